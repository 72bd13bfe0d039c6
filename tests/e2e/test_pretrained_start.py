"""Starting from a pretrained model: tools/checkpoint/import_hf.py, ``--finetune``,
``--pretrained-checkpoint`` and a torch_dist checkpoint written the way Megatron-LM writes one.

The corpus repeats one document of 8 tokens, a divisor of ``--seq-length`` 32, so every
training sample is the same 33-token window whatever the shuffle: the first logged loss of a
run is then the loss of the loaded weights on that window, which a single rank computes
here with the trainer's own model-building code and loss (see :func:`_first_loss_bound`).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.helpers import launch as _launch
from tests.helpers.corpora import write_gpt2_vocab, write_indexed_dataset
from tests.helpers.spawn import spawn
from tests.helpers.trainer import (METHODS, ROOT, TINY, launch, one_error_line, torchrun,
                                   train_lines, trainer_env)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

DOC = 8  # tokens per document, EOD included: divides SEQ, so every sample starts a document
SEQ = 32
U_FP32 = 2.0 ** -24
MICRO_BATCHES = 16 // 2  # TINY's global batch over its micro-batch


def _flags(**changes: str) -> list[str]:
    args = list(TINY)
    for flag, value in changes.items():
        args[args.index("--" + flag.replace("_", "-")) + 1] = value
    return args + ["--hidden-dropout", "0", "--attention-dropout", "0"]


RUN = _flags(train_iters="3", log_interval="1", eval_interval="100")
WARMUP_SECOND_LR = 3e-3 * 16 / 32  # TINY: --lr 3e-3, 2 warm-up iterations of 16 samples


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(data flags, the 33-token window every sample is, the tokenizer's vocabulary size)."""
    from megatron.sdp4bit.training.tokenizers import GPT2BPETokenizer

    d = tmp_path_factory.mktemp("periodic")
    vocab, merges = write_gpt2_vocab(d)
    tok = GPT2BPETokenizer(vocab, merges)
    gen = torch.Generator().manual_seed(3)
    body = [t for t in torch.randint(0, tok.vocab_size, (64,), generator=gen).tolist()
            if t != tok.eod][:DOC - 1]
    doc = tuple(body) + (tok.eod,)
    prefix = write_indexed_dataset(d, docs=[doc] * 800)
    window = list(doc) * (SEQ // DOC + 1)
    flags = ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges,
             "--data-cache-path", str(d / "cache")]
    return flags, window[:SEQ + 1], tok.vocab_size


def _hf_model(kind: str, vocab: int, out: str) -> None:
    """A random tiny model saved by transformers (initialized wider than its default, so
    that its loss is far from a fresh model's ln(vocab))."""
    import transformers

    torch.manual_seed(11)
    common = dict(vocab_size=vocab, initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":  # GPT2Config's default activation, gelu_new, as OpenAI's GPT-2 has
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, **common))
        assert model.config.activation_function == "gelu_new"
    else:  # untied output layer, 4 query heads in 2 groups, a non-default RoPE base, and
        # Llama 3.1's RoPE scaling ("llama3", factor 8: --use-rope-scaling)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQ, rope_theta=1000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            rms_norm_eps=1e-5, tie_word_embeddings=False, **common))
    model.save_pretrained(out)


def _tool(name: str, args: list[str]):
    return _launch.python(os.path.join(ROOT, "tools", "checkpoint", name), args,
                          env=trainer_env(), cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def imported(corpus, tmp_path_factory):
    """kind -> (HF folder, imported checkpoint folder, the model flags the tool printed)."""
    root = tmp_path_factory.mktemp("imported")
    out = {}
    for kind in ("gpt2", "llama"):
        hf, ckpt = root / f"hf_{kind}", root / f"ckpt_{kind}"
        _hf_model(kind, corpus[2], str(hf))
        extra = []
        if kind == "llama":  # --overwrite replaces what the folder held
            ckpt.mkdir()
            (ckpt / "stale.txt").write_text("old")
            extra = ["--overwrite"]
        res = _tool("import_hf.py", ["--hf", str(hf), "--save", str(ckpt), *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        assert sorted(os.listdir(ckpt)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
        assert sorted(os.listdir(root)) == sorted(  # no temporary folder left beside it
            [f"hf_{k}" for k in out] + [f"ckpt_{k}" for k in out] + [hf.name, ckpt.name])
        out[kind] = (str(hf), str(ckpt), res.stdout.strip().splitlines()[-1].split())
    return out


# ---- one rank: the trainer's model on the imported weights ------------------------------

def _trainer_model(flags: list[str], ckpt_dir: str | None, bf16: bool):
    """The trainer's GPTModel for ``flags`` (built by the trainer's own functions) with the
    checkpoint's weights; fp32, or bf16 inside Float16Module as the trainer runs it."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core.transformer.module import Float16Module

    from megatron.sdp4bit.training.cli.arguments import parse_args
    from megatron.sdp4bit.training.model import build_model, transformer_config_from_args
    from tests.helpers.tiny_gpt import init_parallel

    init_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    args = parse_args(flags + ["--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4",
                               "--mock-data", "--hidden-dropout", "0", "--attention-dropout",
                               "0"] + (["--bf16"] if bf16 else []), world_size=1)
    config = transformer_config_from_args(args)
    padded = 384  # the tests' ~300-token vocabulary padded to a multiple of 128
    model = build_model(args, config, padded)
    if ckpt_dir is not None:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
        model.load_state_dict(loaded["model"], strict=True)
    return (Float16Module(config, model) if bf16 else model), model


def _window_loss(model, window: list[int]) -> float:
    """The trainer's micro-batch loss (training/step.py) on two copies of the window."""
    from megatron.sdp4bit.training.step import _loss_func

    tokens = torch.tensor([window[:-1]] * 2)
    labels = torch.tensor([window[1:]] * 2)
    positions = torch.arange(SEQ).expand(2, -1)
    with torch.no_grad():
        out = model(tokens, positions, None, labels=labels)
    return float(_loss_func(torch.ones_like(labels), False, out)[0])


def _check_import(rank: int, world: int, hf_dir: str, ckpt: str, flags: list[str],
                  window: list[int], out: str) -> None:
    """Child rank: logits of the trainer's fp32 model on the import against the HF model's,
    and the bf16 loss a run starting from the import must log first (written to ``out``)."""
    from transformers import AutoModelForCausalLM

    ours, _ = _trainer_model(flags, os.path.join(ckpt, "iter_0000000"), bf16=False)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine = ours.eval()(tokens, torch.arange(SEQ).expand(2, -1), None).float()
        theirs = hf(tokens).logits
    # Same fp32 weights and function, only the order of fp32 sums differs: the bound of
    # test_dist_checkpoint.py's _check_export (dot products of length <= 256 through two
    # layers: 1e-4 of the largest logit). The padding rows are zeros: their logits are 0.
    bound = 1e-4 * mine.abs().max().item()
    assert (mine[..., :vocab] - theirs).abs().max().item() <= bound
    assert torch.equal(mine[..., vocab:], torch.zeros_like(mine[..., vocab:]))
    wrapped, _ = _trainer_model(flags, os.path.join(ckpt, "iter_0000000"), bf16=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"loss": _window_loss(wrapped, window)}, f)


def _window_loss_of(rank: int, world: int, flags: list[str], folder: str,
                    window: list[int], out: str) -> None:
    """Child rank: the bf16 loss of a checkpoint's weights on the window, into ``out``."""
    wrapped, _ = _trainer_model(flags, folder, bf16=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"loss": _window_loss(wrapped, window)}, f)


def _first_loss_bound(loss: float) -> float:
    """The logged first loss against :func:`_window_loss` of the same weights. Every
    micro-batch of the run holds two copies of the window, so each micro-batch's loss is
    computed by the same operations on the same values as here (one thread per rank in
    both, dropout off): bitwise equal. The logged loss is the fp32 mean of the M = 8
    micro-batch losses (over the DP ranks): summing M equal positive terms is within
    (M - 1) u of exact, relatively, plus 1e-6 for the 7 printed digits."""
    return 2 * (MICRO_BATCHES - 1) * U_FP32 * loss + 1e-6


# The import's name table is the export's, which test_dist_checkpoint.py's exports take in both
# passes; the rest is the tool's own
@pytest.mark.release_independent
def test_import_matches_hugging_face_and_exports_back_bit_for_bit(imported, corpus, tmp_path):
    from safetensors.torch import load_file

    for kind, (hf, ckpt, flags) in imported.items():
        exported = tmp_path / f"export_{kind}"
        res = _tool("export_hf.py", ["--load", ckpt, "--output", str(exported)])
        assert res.returncode == 0, res.stderr[-3000:]
        before, after = (load_file(os.path.join(d, "model.safetensors"))
                         for d in (hf, str(exported)))
        assert sorted(before) == sorted(after), kind
        for name, tensor in before.items():  # same dtype, shape and bytes
            assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
        config = json.loads((exported / "config.json").read_text())
        assert config["vocab_size"] == corpus[2]
        # GPT-2's tanh GeLU comes in as --openai-gelu (the logits below check that the model
        # computes it) and goes out as gelu_new again
        assert ("--openai-gelu" in flags) == (kind == "gpt2")
        assert ("--use-rope-scaling" in flags) == (kind == "llama")
        if kind == "llama":
            assert config["rope_parameters"]["rope_type"] == "llama3"
        assert config.get("activation_function") == ("gelu_new" if kind == "gpt2" else None)
        spawn(_check_import, 1, hf, ckpt, flags, corpus[1], str(tmp_path / f"{kind}.json"))


@pytest.mark.release_independent  # the tool's own files
def test_a_failed_import_leaves_the_folder_as_it_was(imported, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(imported["gpt2"][0], hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "n_inner": 128}))
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "keep.txt").write_text("mine")
    res = _tool("import_hf.py", ["--hf", str(hf), "--save", str(save), "--overwrite"])
    assert res.returncode == 2
    errors = [x for x in res.stderr.splitlines() if x.startswith("import_hf.py: error: ")]
    assert errors == [
        "import_hf.py: error: the weights do not have the shapes config.json gives: "
        "decoder.layers.0.mlp.linear_fc1.weight [256, 64] (the model's is [128, 64]), "
        "decoder.layers.0.mlp.linear_fc1.bias [256] (the model's is [128]), "
        "decoder.layers.0.mlp.linear_fc2.weight [64, 256] (the model's is [64, 128]), "
        "decoder.layers.1.mlp.linear_fc1.weight [256, 64] (the model's is [128, 64])"], res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
    assert os.listdir(save) == ["keep.txt"]


# ---- the runs -----------------------------------------------------------------------------

# --finetune's load: test_parallel_layouts.py's interleaved runs, in both passes; the rest is
# the trainer's own (what the import wrote: the test above)
@pytest.mark.release_independent
def test_training_continues_from_the_import_and_finetune_ignores_a_checkpoints_state(
        imported, corpus, tmp_path):
    """The Llama import (untied, GQA) trained on 4 ranks (2 nodes x 2) with SDP4Bit, every
    replica compared after every iteration; then --finetune from that run's full checkpoint
    (optimizer, schedule and RNG at iteration 3) on one rank starts over at iteration 1."""
    hf, ckpt, flags = imported["llama"]
    spawn(_check_import, 1, hf, ckpt, flags, corpus[1], str(tmp_path / "expected.json"))
    expected = json.loads((tmp_path / "expected.json").read_text())["loss"]
    run = tmp_path / "run"
    res = torchrun(RUN + corpus[0] + flags + METHODS["SDP4Bit"] + [
        "--dp-ranks-per-node", "2", "--check-replicas-interval", "1", "--finetune",
        "--load", ckpt, "--save", str(run), "--save-interval", "3"], nproc=4)
    assert (f"loaded the model weights of {ckpt}/iter_0000000: starting at iteration 0 with a "
            "fresh optimizer, learning-rate schedule and RNG (fine-tuning)") in res.stdout
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    # A fresh model (init std 0.02: logits near 0) starts within a few hundredths of
    # ln(384) = 5.95; the import's loss is far from it, so the check below tells them apart.
    assert abs(expected - 5.95) > 0.3, expected
    assert abs(lines[0]["lm_loss"] - expected) <= _first_loss_bound(expected), (
        lines[0]["lm_loss"], expected)
    # The warm-up starts at --lr-warmup-init 0: megatron-core's scheduler gives the first
    # step the rate of step 0, 0, so it changes nothing, and the fp32 main weights (taken
    # from the loaded ones), and the replicas qWD rebuilds from them, still hold the import
    # at iteration 2, which sees the same window again. (Main weights left at the random
    # initialization gave 5.943 at iteration 2.) The logged rate is the next step's: 3e-3
    # x 16 / 32 samples of warm-up.
    assert lines[0]["learning_rate"] == WARMUP_SECOND_LR
    assert abs(lines[1]["lm_loss"] - lines[0]["lm_loss"]) <= _first_loss_bound(expected)
    assert lines[2]["lm_loss"] < lines[0]["lm_loss"] - 0.1  # and then it learns
    # --finetune from a full checkpoint of this trainer: iteration 1 again, the fresh
    # schedule's first learning rate (warm-up, not iteration 4's), on another layout.
    res = torchrun(RUN + corpus[0] + flags + ["--finetune", "--load", str(run),
                                              "--exit-interval", "1"], nproc=1)
    again = train_lines(res.stdout)
    assert [m["iteration"] for m in again] == [1]
    spawn(_window_loss_of, 1, flags, str(run / "iter_0000003"), corpus[1],
          str(tmp_path / "at3.json"))
    at3 = json.loads((tmp_path / "at3.json").read_text())["loss"]
    assert abs(again[0]["lm_loss"] - at3) <= _first_loss_bound(at3), (again[0]["lm_loss"], at3)
    assert again[0]["learning_rate"] == WARMUP_SECOND_LR  # a schedule at its start again
    assert lines[-1]["learning_rate"] != WARMUP_SECOND_LR  # (the checkpoint's is past it)
    assert f"loaded the model weights of {run}/iter_0000003" in res.stdout


# ---- a checkpoint Megatron-LM wrote ---------------------------------------------------------

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ)]  # TINY's model
MEGATRON_LM_ITERATION = 7


def _write_megatron_lm_checkpoint(rank: int, world: int, root: str, window: list[int],
                                  out: str) -> None:
    """Child rank: a torch_dist checkpoint laid out as Megatron-LM's ``save_checkpoint``
    writes one (megatron/training/checkpointing.py): the tracker holding the bare iteration,
    ``iter_0000007/`` written by megatron-core's ``dist_checkpointing.save`` from a state dict
    whose ``model`` is the GPTModel's (bf16) ``sharded_state_dict()``, beside ``args`` (an
    argparse Namespace), ``iteration``, ``checkpoint_version`` 3.0, the FLOP count and a
    per-rank ``rng_state`` object; no manifest. Also writes the loss a run must log first."""
    from argparse import Namespace

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron.sdp4bit.integration.dist_checkpointing import in_process_writer

    wrapped, model = _trainer_model(MODEL, None, bf16=True)
    with torch.no_grad():  # wider than the initialization, so the loss is not ln(vocab)
        for p in model.parameters():
            p.mul_(8)
    args = Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=SEQ,
                     tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                     world_size=1, data_parallel_size=1, global_batch_size=16,
                     consumed_train_samples=16 * MEGATRON_LM_ITERATION,
                     ckpt_format="torch_dist", bf16=True)
    rng = ShardedObject("rng_state", [{"random_rng_state": None}], (1, 1, 1), (0, 0, 0),
                        replica_id=0)
    state = {"model": model.sharded_state_dict(), "args": args,
             "iteration": MEGATRON_LM_ITERATION, "checkpoint_version": 3.0,
             "num_floating_point_operations_so_far": 0, "rng_state": rng}
    folder = os.path.join(root, f"iter_{MEGATRON_LM_ITERATION:07d}")
    os.makedirs(folder)  # Megatron-LM creates it before the save
    # megatron-core's torch_dist writer, run in-process on CPU (the files are the same)
    with in_process_writer() as strategy:
        dist_checkpointing.save(state, folder, sharded_strategy=strategy, content_metadata={
            "distrib_optim_sharding_type": "dp_reshardable"})
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(MEGATRON_LM_ITERATION))
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"loss": _window_loss(wrapped, window)}, f)


def test_a_megatron_lm_checkpoint_starts_a_finetuning_run(corpus, tmp_path):
    """--pretrained-checkpoint (with nothing in --load yet) takes its weights with --finetune's
    semantics; a model that does not fit it is named tensor by tensor in one line."""
    fixture = tmp_path / "megatron_lm"
    fixture.mkdir()
    spawn(_write_megatron_lm_checkpoint, 1, str(fixture), corpus[1], str(tmp_path / "e.json"))
    expected = json.loads((tmp_path / "e.json").read_text())["loss"]
    assert not (fixture / f"iter_{MEGATRON_LM_ITERATION:07d}" / "manifest.json").exists()
    assert abs(expected - 5.95) > 0.3, expected  # not what a fresh model would log
    run = tmp_path / "run"
    res = torchrun(RUN + corpus[0] + ["--pretrained-checkpoint", str(fixture), "--load",
                                      str(run), "--save", str(run), "--exit-interval", "1"],
                   nproc=1)
    assert (f"loaded the model weights of {fixture}/iter_{MEGATRON_LM_ITERATION:07d}: starting "
            "at iteration 0") in res.stdout
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == [1]
    assert abs(lines[0]["lm_loss"] - expected) <= _first_loss_bound(expected), (
        lines[0]["lm_loss"], expected)
    message = one_error_line(launch(RUN + corpus[0] + ["--finetune", "--load", str(fixture),
                                                       "--ffn-hidden-size", "128"], nproc=1))
    folder = fixture / f"iter_{MEGATRON_LM_ITERATION:07d}"
    assert message == (
        f"checkpoint {folder} does not fit this model: decoder.layers.mlp.linear_fc1.bias is "
        "[2, 256] there, [2, 128] here; decoder.layers.mlp.linear_fc1.weight is [2, 256, 64] "
        "there, [2, 128, 64] here; decoder.layers.mlp.linear_fc2.weight is [2, 64, 256] there, "
        "[2, 64, 128] here: pass the checkpoint's model flags")
