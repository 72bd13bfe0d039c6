"""A Llama-3-style Megatron-LM recipe, shrunk to a tiny CPU run, in one launch: SDP4Bit on 4
ranks (2 nodes x 2), a Hugging Face tokenizer made here and the corpus preprocessed with it,
per-token loss, asynchronous saves, the PyTorch profiler, the parameter norm and the memory
log; then the Hugging Face export of its last checkpoint.

Its flags are those of Megatron-LM's ``examples/llama`` scripts (sample-based schedule,
grouped-query attention, untied embeddings, RoPE with Llama 3's base, the overlap flags),
with the sizes cut down, and without ``--cross-entropy-loss-fusion``: megatron-core compiles
that loss with ``torch.compile``, which on a CPU costs each rank 7 s of CPU (more than the
rest of the run); ``tests/distributed/test_integration_loss_fusion.py`` runs it, compiled, in
both test passes. The megatron-core paths it takes are taken in the second test pass
by ``test_dist_checkpoint.py`` (the asynchronous save and its resume),
``tests/distributed/test_integration_loss_fusion.py`` (fused cross entropy, per-token loss)
and ``test_dist_checkpoint.py``'s Llama-style export; the tokenizer is the trainer's own.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.sdp4bit.training.checkpoint import files, integrity
from tests.helpers import launch as _launch
from tests.helpers.trainer import (METHODS, ROOT, build_hf_corpus, torchrun, train_lines,
                                   trainer_env)

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

ITERS, SAVE_INTERVAL = 8, 3
RECIPE = (
    # model: Llama 3's shape, tiny
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 "
    "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 "
    "--max-position-embeddings 32 --position-embedding-type rope --rotary-base 500000 "
    "--rotary-percent 1.0 --swiglu --normalization RMSNorm --norm-epsilon 1e-5 "
    "--untie-embeddings-and-output-weights --disable-bias-linear --init-method-std 0.02 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 "
    # training: sample-based, as the recipe's
    f"--micro-batch-size 2 --global-batch-size 8 --train-samples {8 * ITERS} "
    "--lr-warmup-samples 8 --lr-decay-samples 64 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 "
    "--adam-beta2 0.95 --bf16 --calculate-per-token-loss "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--no-create-attention-mask-in-dataloader --num-workers 1 --split 90,10,0 --seed 7 "
    # checkpoints, logs, profile
    f"--ckpt-format torch_dist --async-save --save-interval {SAVE_INTERVAL} "
    "--log-interval 1 --log-throughput --eval-interval 100 --eval-iters 1 "
    "--log-params-norm --log-memory-to-tensorboard --profile --use-pytorch-profiler "
    "--profile-step-start 2 --profile-step-end 4 --distributed-timeout-minutes 10"
).split()


def test_llama3_recipe_runs_with_sdp4bit_and_exports_its_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    folder, docs, prefix = build_hf_corpus(tmp_path)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]

    save, tb = tmp_path / "ckpt", tmp_path / "tb"
    res = torchrun(RECIPE + METHODS["SDP4Bit"] + tokenizer + [
        "--dp-ranks-per-node", "2", "--data-path", prefix,
        "--data-cache-path", str(tmp_path / "cache"), "--save", str(save),
        "--tensorboard-dir", str(tb)], nproc=4)
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == list(range(1, ITERS + 1))
    losses = [m["lm_loss"] for m in lines]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert all(m["params_norm"] > 0 for m in lines)

    # The asynchronous saves: each scheduled, then published (the last before the run ends);
    # no partial folder is left, the tracker names the last, and its files verify.
    saved = list(range(SAVE_INTERVAL, ITERS + 1, SAVE_INTERVAL)) + [ITERS]
    out = res.stdout
    for it in saved:
        scheduled = out.index(f"scheduled an async checkpoint save at iteration {it:7d} to "
                              f"{save}")
        assert out.index(f"successfully saved checkpoint from iteration {it:7d} to {save}") \
            > scheduled
    assert sorted(os.listdir(save)) == [".lock", *(f"iter_{it:07d}" for it in saved),
                                        files.TRACKER]
    assert files.latest_iteration(str(save)) == ITERS
    for it in saved:
        directory = files.iteration_dir(str(save), it)
        manifest = files.read_manifest(directory)
        assert manifest["iteration"] == it
        assert set(os.listdir(directory)) == {*manifest["files"], files.MANIFEST}
        for name, entry in manifest["files"].items():
            path = os.path.join(directory, name)
            assert integrity.mismatch(path, integrity.file_hash(path), entry) is None

    # Megatron-LM's TensorBoard tags of the parameter norm and of memory (resident memory on
    # the CPU), and the profiler's traces (every rank: --profile-ranks' default).
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"params-norm", "params-norm vs samples", "mem-resident-bytes",
            "mem-max-resident-bytes", "lm loss"} <= tags, tags
    assert [e.step for e in events.Scalars("params-norm")] == list(range(1, ITERS + 1))
    traces = sorted(p.name.split(".")[0] for p in tb.glob("*.pt.trace.json"))
    assert traces == [f"rank-{r}" for r in range(4)], traces

    # The export of the last checkpoint: a Llama with the tokenizer's files and ids.
    hf = tmp_path / "hf"
    res = _launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                         ["--load", str(save), "--output", str(hf)], env=trainer_env(),
                         cwd=ROOT, timeout=300)
    assert (res.returncode, res.stderr) == (0, ""), res.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(hf))
    config = json.loads((hf / "config.json").read_text())
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert (config["architectures"], config["vocab_size"], config["num_key_value_heads"],
            config["tie_word_embeddings"], config["rope_theta"]) == (
        ["LlamaForCausalLM"], len(tok), 2, False, 500000)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == ids
    if (hf / "generation_config.json").exists():
        generation = json.loads((hf / "generation_config.json").read_text())
        assert (generation.get("bos_token_id"), generation.get("eos_token_id"),
                generation.get("pad_token_id")) == ids
    shipped = AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    assert [shipped(d).input_ids for d in docs[:4]] == [tok(d).input_ids for d in docs[:4]]
    assert (shipped.bos_token_id, shipped.eos_token_id, shipped.pad_token_id) == ids
