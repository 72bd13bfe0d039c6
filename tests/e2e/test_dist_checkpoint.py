"""``--ckpt-format torch_dist`` under ``torchrun``: resume on the same and on other layouts.

One SDP4Bit run on 4 ranks (2 "nodes" x 2) saves at iteration 4 and goes on to 8; it is the
uninterrupted reference of the same-layout and data-parallel cases. A second one on 8 ranks
(TP 2 x PP 2 x DP 2, saved with --dist-ckpt-optim-fully-reshardable) is the reference of the
TP and PP change. Dropout is off, so that a resume's first iteration sees the same weights
and samples as the reference, whatever the layout. A third, shorter 4-rank run with
--gradient-error-feedback is resumed in both formats (its per-rank error state).

The Hugging Face export (tools/checkpoint/export_hf.py) is checked against the trainer's own
model: the reference's checkpoint as a GPT2LMHeadModel, and a short 2-rank run of a
Llama-style model as a LlamaForCausalLM.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from benchmarks.noise_spread import BASE, LAYOUTS, noise_bound
from megatron.sdp4bit.integration.dist_checkpointing import (MEGATRON_INTEGRITY,
                                                             megatron_integrity_check)
from tests.helpers import crafted
from tests.helpers.hf_checkpoint import check_export, export_hf, init_one_rank
from tests.helpers.spawn import spawn
from tests.helpers.trainer import launch, one_error_line
from tests.helpers.tiny_gpt import transformer_config
from tests.helpers.trainer import METHODS, TINY, torchrun, train_lines

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SAVED_AT = 4
# Bounds on the loss of a resharded resume against its uninterrupted reference.
#
# (1) The first iteration after a resume that keeps TP (a DP change; a PP change too, but
#     this module changes PP together with TP, under (2)) sees the checkpoint's weights and
#     the same 16 samples in the same micro-batches of 2 (consecutive pairs of the global
#     batch, whatever the DP size), dropout off: every micro-batch's loss is computed by the
#     same operations on the same values, bitwise the reference's (a PP stage boundary
#     passes the bf16 activations unchanged). Only the logged mean of the M = 16 / 2 = 8
#     fp32 micro-batch losses is summed in another order (a mean over the rank's
#     micro-batches, then an all-reduce over DP; the divisions are by powers of 2, exact).
#     Any order of summing M positive fp32 terms is within (M - 1) u S of the exact sum S
#     (u = 2**-24), so the two logged means differ by at most 2 (M - 1) u L, plus 1e-6 from
#     printing both with 7 significant digits (x.xxxxxxE+00). For L = 5.4: 5.5e-6.
# (2) From the second iteration on, SDP4Bit's rounding noise: noise_bound(), measured on
#     these runs by benchmarks/noise_spread.py ([Note: the noise bound of a resharded
#     resume] there).
U_FP32 = 2.0 ** -24
MICRO_BATCHES = 16 // 2
PRINTED = 1e-6


def same_forward_bound(loss: float) -> float:
    """Absolute bound of (1) on the first iteration's loss."""
    return 2 * (MICRO_BATCHES - 1) * U_FP32 * loss + PRINTED


def _reference(data_prefix, root, layout: str, extra: list[str]):
    """Launch the uninterrupted run on ``layout``, saving at SAVED_AT; returns (its log lines,
    a folder holding only its iteration-4 checkpoint)."""
    nproc, flags = LAYOUTS[layout]
    full = root / "full"
    res = torchrun(BASE + data_prefix + flags + ["--save", str(full), "--save-interval",
                                                 str(SAVED_AT), *extra], nproc=nproc)
    # megatron-core's warning when its fully reshardable save cuts the optimizer state at the
    # wrong offsets (integration/dist_checkpointing.py corrects them first)
    assert "data corruption" not in res.stdout + res.stderr
    at4 = root / "at4"
    at4.mkdir()
    shutil.copytree(full / f"iter_{SAVED_AT:07d}", at4 / f"iter_{SAVED_AT:07d}")
    (at4 / "latest_checkpointed_iteration.txt").write_text(f"{SAVED_AT}\n")
    return train_lines(res.stdout), at4


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):
    """(log lines of the uninterrupted 4-rank run, folder holding only its iteration-4
    checkpoint)."""
    return _reference(data_prefix, tmp_path_factory.mktemp("ckpt"), "dp4", [])


@pytest.fixture(scope="module")
def model_parallel_reference(data_prefix, tmp_path_factory):
    """The same for TP 2 x PP 2 x DP 2 on 8 ranks, fully reshardable."""
    return _reference(data_prefix, tmp_path_factory.mktemp("ckpt_mp"), "tp2pp2dp2",
                      ["--dist-ckpt-optim-fully-reshardable"])


def _resume(reference, tmp_path, data_prefix, nproc: int, extra: list[str]) -> list[dict]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    res = torchrun(BASE + data_prefix + ["--load", str(ckpt), "--check-replicas-interval", "1",
                                         *extra], nproc=nproc)
    assert f"loaded checkpoint from {ckpt} at iteration {SAVED_AT}" in res.stdout
    return train_lines(res.stdout)


def _check_continuous(ref: list[dict], resumed: list[dict], first_bound: float) -> None:
    # --check-replicas-interval 1 stopped the run had any DP replica differed after the load.
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    print("relative loss differences at iterations 5-8:", " ".join(  # shown with pytest -s
        f"{abs(a['lm_loss'] - b['lm_loss']) / a['lm_loss']:.1e}" for a, b in zip(ref, resumed)))
    assert abs(resumed[0]["lm_loss"] - ref[0]["lm_loss"]) <= first_bound, (ref[0], resumed[0])
    bound = noise_bound()
    for a, b in zip(ref, resumed):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= bound * a["lm_loss"], (a, b)
        assert a["consumed_samples"] == b["consumed_samples"]
        assert a["learning_rate"] == b["learning_rate"]
    assert resumed[-1]["lm_loss"] < resumed[0]["lm_loss"]


# The second pass resumes at DP 4 only: megatron-core's TP and PP sharding of the checkpoint
# are in its TP 2 x PP 2 -> TP 1 case below.
@pytest.mark.parametrize("layout,fixture", [
    ("dp4", "reference"),
    pytest.param("tp2pp2dp2", "model_parallel_reference",
                 marks=pytest.mark.release_independent)])
def test_same_layout_resume_is_bit_exact(request, tmp_path, data_prefix, layout, fixture):
    """Also with TP 2: the checkpoint holds one copy of the weights TP does not split (layer
    norms, row-parallel biases, position embeddings), and the TP ranks' copies must have
    stayed bitwise equal under SDP4Bit for the resume to continue exactly."""
    run = request.getfixturevalue(fixture)
    full, _ = run
    resumed = _resume(run, tmp_path, data_prefix, *LAYOUTS[layout])
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(full[SAVED_AT:], resumed):
        for key in ("lm_loss", "grad_norm", "learning_rate", "consumed_samples",
                    "comm_bytes_params", "comm_bytes_grads_inter"):
            assert a[key] == b[key], (key, a, b)


def test_error_feedback_resume_is_bit_exact_in_both_formats(tmp_path, data_prefix):
    """--gradient-error-feedback (int8 state, reset every 4 calls: the saved call count
    matters) on 2 x 2 ranks: each rank's error state is in the checkpoint, so a resume
    continues bit for bit. An uninterrupted 6-iteration run saves --ckpt-format torch at 3;
    a resume from it converts to torch_dist, saving at 4, 5 and 6 with --async-save (each
    save written in the background while the next iteration runs, published before the next
    save: what a save holds is taken when it is scheduled); a resume from that torch_dist
    iteration 4 runs 5 and 6. Both must repeat the uninterrupted run exactly (a state
    restored as zero changes the inter-node messages, hence the gradient norm)."""
    nproc, flags = LAYOUTS["dp4"]
    ef = ["--gradient-error-feedback", "--gradient-error-feedback-reset-interval", "4"]
    base = [*BASE, *data_prefix, *flags, *ef]
    base[base.index("--train-iters") + 1] = "6"
    full, torch_ckpt, dist_ckpt = tmp_path / "full", tmp_path / "torch", tmp_path / "dist"
    ref = train_lines(torchrun(base + ["--save", str(full), "--save-interval", "3",
                                       "--ckpt-format", "torch"], nproc=nproc).stdout)
    assert [m["iteration"] for m in ref] == [1, 2, 3, 4, 5, 6]
    shutil.copytree(full / "iter_0000003", torch_ckpt / "iter_0000003")
    (torch_ckpt / "latest_checkpointed_iteration.txt").write_text("3\n")
    runs = {}
    res = torchrun(base + ["--load", str(torch_ckpt), "--auto-detect-ckpt-format",
                           "--save", str(dist_ckpt), "--save-interval", "1", "--async-save"],
                   nproc=nproc)
    runs["torch"] = train_lines(res.stdout)
    for it in (4, 5, 6):  # scheduled, then published (the last one before the run ended)
        assert res.stdout.index(f"successfully saved checkpoint from iteration {it:7d}") > \
            res.stdout.index(f"scheduled an async checkpoint save at iteration {it:7d}")
    assert sorted(os.listdir(dist_ckpt)) == [".lock", "iter_0000004", "iter_0000005",
                                             "iter_0000006", "latest_checkpointed_iteration.txt"]
    (dist_ckpt / "latest_checkpointed_iteration.txt").write_text("4\n")
    res = torchrun(base + ["--load", str(dist_ckpt)], nproc=nproc)
    runs["torch_dist"] = train_lines(res.stdout)
    assert "starts from zero error" not in res.stdout
    for fmt, resumed, start in (("torch", runs["torch"], 3), ("torch_dist", runs["torch_dist"], 4)):
        assert [m["iteration"] for m in resumed] == list(range(start + 1, 7)), fmt
        for a, b in zip(ref[start:], resumed):
            for key in ("lm_loss", "grad_norm", "comm_bytes_grads_inter"):
                assert a[key] == b[key], (fmt, key, a, b)


# 4 -> 8 takes megatron-core's path of 4 -> 2: the second pass runs 4 -> 2 only
@pytest.mark.parametrize("layout", [
    pytest.param("dp2", id="4to2"),
    pytest.param("dp8", id="4to8", marks=pytest.mark.release_independent)])
def test_data_parallel_resharded_resume(reference, tmp_path, data_prefix, layout):
    full, _ = reference
    resumed = _resume(reference, tmp_path, data_prefix, *LAYOUTS[layout])
    ref = full[SAVED_AT:]
    _check_continuous(ref, resumed, same_forward_bound(ref[0]["lm_loss"]))


def test_tensor_and_pipeline_parallel_resharded_resume(model_parallel_reference, tmp_path,
                                                       data_prefix):
    """TP 2 x PP 2 x DP 2 (8 ranks) -> TP 1 x PP 1 x DP 4 (4 ranks), in buckets of 40,000
    elements (the save had one bucket per stage and one for the tied embedding). The padded
    vocabulary must stay 512: the default 128 x TP 2 gave it, TP 1 needs 256."""
    full, _ = model_parallel_reference
    nproc, flags = LAYOUTS["dp4"]
    resumed = _resume(model_parallel_reference, tmp_path, data_prefix, nproc,
                      flags + ["--make-vocab-size-divisible-by", "256",
                               "--overlap-grad-reduce", "--ddp-bucket-size", "40000"])
    ref = full[SAVED_AT:]
    _check_continuous(ref, resumed, noise_bound() * ref[0]["lm_loss"])


def test_changed_checkpoint_file_is_refused_in_one_line(reference, tmp_path, data_prefix):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    target = ckpt / f"iter_{SAVED_AT:07d}" / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    message = one_error_line(launch(BASE + data_prefix + ["--load", str(ckpt)]))
    assert message == (f"checkpoint file {target} does not match its SHA-256 in the manifest: "
                       "it changed after it was written (disk or copy error); load an earlier "
                       f"checkpoint (no other complete checkpoint is in {ckpt})")
    message = one_error_line(launch(BASE + data_prefix + ["--load", str(reference[1]),
                                                         "--ckpt-format", "torch"]))
    assert message == (f"the checkpoint in {reference[1]} is in format torch_dist, this run's "
                       "--ckpt-format is torch: pass --ckpt-format torch_dist, or "
                       "--auto-detect-ckpt-format to load it and save in torch (which converts "
                       "it)")
    # megatron-core 0.19's own SHA-256 manifest, checked on top of ours where it exists: a
    # change that our manifest is made to agree with is still refused.
    folder = target.parent
    assert (folder / MEGATRON_INTEGRITY).is_file() == megatron_integrity_check()
    if megatron_integrity_check():
        crafted.reseal(folder)  # as the checkpoint's author would
        message = one_error_line(launch(BASE + data_prefix + ["--load", str(ckpt)]))
        assert message.startswith(f"checkpoint {folder} fails megatron-core's integrity check "
                                  f"({MEGATRON_INTEGRITY}): "), message
        assert message.endswith(f"; load an earlier checkpoint (no other complete checkpoint "
                                f"is in {ckpt})"), message


def _compare_logits(rank: int, world: int, ckpt_dir: str, hf_dir: str) -> None:
    """Child rank: the trainer's GPTModel (fp32, weights from the checkpoint) and the exported
    GPT2LMHeadModel on the same tokens."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.sdp4bit.training.checkpoint import files

    init_one_rank()
    m = files.read_manifest(ckpt_dir)["settings"]["model"]
    config = transformer_config(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                     num_attention_heads=m["num_attention_heads"],
                     ffn_hidden_size=m["ffn_hidden_size"], layernorm_epsilon=1e-5)
    model = GPTModel(config, get_gpt_layer_local_spec(), m["padded_vocab_size"],
                     m["max_position_embeddings"], position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    check_export(model, ckpt_dir, hf_dir, "GPT2LMHeadModel")


def test_export_to_hugging_face_matches_the_trainers_logits(reference, tmp_path):
    hf = tmp_path / "hf"
    export_hf(reference[1], hf, "GPT2LMHeadModel")
    # the run's GPT-2 BPE files ship beside the model, <|endoftext|> its bos and eos
    assert sorted(os.listdir(hf)) == ["config.json", "merges.txt", "model.safetensors",
                                      "tokenizer_config.json", "vocab.json"]
    vocab = json.loads((hf / "vocab.json").read_text(encoding="utf-8"))
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        vocab["<|endoftext|>"], vocab["<|endoftext|>"], None)
    spawn(_compare_logits, 1, str(reference[1] / f"iter_{SAVED_AT:07d}"), str(hf))


# A Llama-style model: RoPE (base 1000, not megatron's or transformers' default, so that a
# dropped or defaulted rope_theta shows), RMSNorm (eps 1e-5, the trainer's default and not
# transformers' 1e-6), SwiGLU, no biases, untied output layer, and 4 query heads in 2 groups,
# so that the fused QKV split per group and lm_head are exercised.
_tiny = lambda flag: int(TINY[TINY.index(flag) + 1])  # noqa: E731
LLAMA = dict(layers=_tiny("--num-layers"), hidden=_tiny("--hidden-size"),
             heads=_tiny("--num-attention-heads"), groups=2, seq=_tiny("--seq-length"),
             rotary_base=1000, norm_epsilon=1e-5)
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--group-query-attention", "--num-query-groups", str(LLAMA["groups"]),
               "--rotary-base", str(LLAMA["rotary_base"]),
               "--norm-epsilon", str(LLAMA["norm_epsilon"])]


def _compare_llama_logits(rank: int, world: int, ckpt_dir: str, hf_dir: str) -> None:
    """Child rank: the trainer's Llama-style GPTModel, built from the test's own settings (not
    the manifest's, which the export reads), against the exported LlamaForCausalLM."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoConfig

    from megatron.sdp4bit.training.checkpoint import files

    init_one_rank()
    m = files.read_manifest(ckpt_dir)["settings"]["model"]
    config = transformer_config(num_layers=LLAMA["layers"], hidden_size=LLAMA["hidden"],
                     num_attention_heads=LLAMA["heads"], num_query_groups=LLAMA["groups"],
                     ffn_hidden_size=4 * LLAMA["hidden"], normalization="RMSNorm",
                     layernorm_epsilon=LLAMA["norm_epsilon"], gated_linear_unit=True,
                     activation_func=F.silu, add_bias_linear=False)
    model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                     m["padded_vocab_size"], LLAMA["seq"], position_embedding_type="rope",
                     rotary_base=LLAMA["rotary_base"], rotary_percent=1.0,
                     share_embeddings_and_output_weights=False)
    hf_config = AutoConfig.from_pretrained(hf_dir)
    assert (hf_config.num_attention_heads, hf_config.num_key_value_heads,
            hf_config.tie_word_embeddings) == (LLAMA["heads"], LLAMA["groups"], False)
    check_export(model, ckpt_dir, hf_dir, "LlamaForCausalLM")


def test_llama_style_export_matches_the_trainers_logits(data_prefix, tmp_path):
    # The bound of check_export is about 7e-5 here. Mutations of the mapping tried by hand
    # made the largest difference: 0.58 (k and v swapped in each group), 0.39 (QKV rows read
    # as [all q; all k; all v]), 0.022 (gate and up swapped), 0.0024 (rope_theta 10000).
    args = list(TINY)
    for flag, value in (("--train-iters", "2"), ("--lr-warmup-iters", "1"),
                        ("--log-interval", "1"), ("--eval-interval", "100")):
        args[args.index(flag) + 1] = value
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    torchrun(args + data_prefix + LLAMA_FLAGS + METHODS["SDP4Bit"] + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--save", str(ckpt)], nproc=2)
    export_hf(ckpt, hf, "LlamaForCausalLM")
    spawn(_compare_llama_logits, 1, str(ckpt / "iter_0000002"), str(hf))
