"""``--ckpt-format torch_dist`` under ``torchrun``: resume on the same and on other layouts.

One SDP4Bit run on 4 ranks (2 "nodes" x 2) saves at iteration 4 and goes on to 8; it is the
uninterrupted reference of every case. Dropout is off, so that a resume's first iteration
sees the same weights and samples as the reference, whatever the layout.

The Hugging Face export (tools/checkpoint/export_hf.py) is checked against the trainer's own
model: the reference's checkpoint as a GPT2LMHeadModel, and a short 2-rank run of a
Llama-style model as a LlamaForCausalLM.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.distributed._spawn import spawn
from tests.e2e import _launch
from tests.e2e.test_faults import launch, one_error_line
from tests.e2e.test_pretrain_gpt import METHODS, ROOT, TINY, _env, torchrun, train_lines

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = list(TINY)
for flag, value in (("--train-iters", "8"), ("--log-interval", "1"), ("--eval-interval", "100")):
    BASE[BASE.index(flag) + 1] = value
BASE += ["--hidden-dropout", "0", "--attention-dropout", "0", *METHODS["SDP4Bit"]]
SAVED_AT = 4


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):
    """(log lines of the uninterrupted run, folder holding only its iteration-4 checkpoint)."""
    root = tmp_path_factory.mktemp("ckpt")
    full = root / "full"
    res = torchrun(BASE + data_prefix + ["--dp-ranks-per-node", "2", "--save", str(full),
                                         "--save-interval", str(SAVED_AT)])
    at4 = root / "at4"
    at4.mkdir()
    shutil.copytree(full / f"iter_{SAVED_AT:07d}", at4 / f"iter_{SAVED_AT:07d}")
    (at4 / "latest_checkpointed_iteration.txt").write_text(f"{SAVED_AT}\n")
    return train_lines(res.stdout), at4


def _resume(reference, tmp_path, data_prefix, nproc: int, extra: list[str]) -> list[dict]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    res = torchrun(BASE + data_prefix + ["--load", str(ckpt), "--check-replicas-interval", "1",
                                         *extra], nproc=nproc)
    assert f"loaded checkpoint from {ckpt} at iteration {SAVED_AT}" in res.stdout
    return train_lines(res.stdout)


def test_same_layout_resume_is_bit_exact(reference, tmp_path, data_prefix):
    full, _ = reference
    resumed = _resume(reference, tmp_path, data_prefix, 4, ["--dp-ranks-per-node", "2"])
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(full[SAVED_AT:], resumed):
        for key in ("lm_loss", "grad_norm", "learning_rate", "consumed_samples",
                    "comm_bytes_params", "comm_bytes_grads_inter"):
            assert a[key] == b[key], (key, a, b)


# Resharded resumes. Bounds:
# * iteration 5 sees the checkpoint's weights and the same 16 samples in the same micro-batches
#   of 2 (only their split over ranks changes) with dropout off, so every micro-batch's loss is
#   bitwise the reference's; only the fp32 mean over 8 micro-batches is summed in another
#   order: a relative difference of at most 8 * 2**-24 < 1e-6 (1e-5 allowed);
# * later iterations differ by the update of step 5 onwards: other quantization groups and
#   noise draws (TLq-HS on another topology, qWD on other shards) and another summation order.
#   That is the method's own rounding noise, a small fraction of one step's loss change (here
#   3% per iteration): 1% relative is allowed, and the resumed run must keep descending.
@pytest.mark.parametrize("nproc,per_node", [(2, 1), (8, 4)], ids=["4to2", "4to8"])
def test_data_parallel_resharded_resume(reference, tmp_path, data_prefix, nproc, per_node):
    full, _ = reference
    resumed = _resume(reference, tmp_path, data_prefix, nproc,
                      ["--dp-ranks-per-node", str(per_node)])
    # --check-replicas-interval 1 stopped the run had any DP replica differed after the load.
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    ref = full[SAVED_AT:]
    assert abs(resumed[0]["lm_loss"] - ref[0]["lm_loss"]) <= 1e-5 * ref[0]["lm_loss"]
    for a, b in zip(ref[1:], resumed[1:]):
        assert abs(a["lm_loss"] - b["lm_loss"]) <= 0.01 * a["lm_loss"], (a, b)
        assert a["consumed_samples"] == b["consumed_samples"]
        assert a["learning_rate"] == b["learning_rate"]
    assert resumed[-1]["lm_loss"] < resumed[0]["lm_loss"]


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
                       "checkpoint")
    message = one_error_line(launch(BASE + data_prefix + ["--load", str(reference[1]),
                                                         "--ckpt-format", "torch"]))
    assert message == (f"the checkpoint in {reference[1]} is in format torch_dist, this run's "
                       "--ckpt-format is torch: pass --ckpt-format torch_dist, or "
                       "--auto-detect-ckpt-format to load it and save in torch (which converts "
                       "it)")


def _check_export(model, ckpt_dir: str, hf_dir: str, architecture: str) -> None:
    """The trainer's GPTModel ``model`` (fp32) gets the checkpoint's weights; its logits and
    the exported model's on the same tokens must agree, and ``generate()`` must run."""
    import torch
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    model = model.eval()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
    model.load_state_dict(loaded["model"], strict=False)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (2, model.max_sequence_length), generator=gen)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens, positions, None).float()
        theirs = hf(tokens).logits
    # Same fp32 weights and function; only the order of the fp32 sums differs. A dot product
    # of length K has a relative error of at most K * 2**-24 of the sum of |terms| (K <= 256
    # here: 1.5e-5); through 2 layers the logits (|logit| <= ~10) stay within 1e-4 * max|logit|.
    # With RoPE both sides rotate by cos/sin of the same fp32 angles (position x inv_freq,
    # inv_freq = base ** (-2i / head_dim) computed alike), and RMSNorm's mean of squares is one
    # more dot product (K = 64): the same bound holds.
    bound = 1e-4 * ours.abs().max().item()
    assert (ours - theirs).abs().max().item() <= bound, ((ours - theirs).abs().max(), bound)
    out = hf.generate(tokens[:1, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def _config(**kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, **kwargs)


def _init_one_rank() -> None:
    from megatron.core import tensor_parallel

    from tests.distributed._tiny_gpt import init_parallel

    init_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # the attention's RNG tracker


def _compare_logits(rank: int, world: int, ckpt_dir: str, hf_dir: str) -> None:
    """Child rank: the trainer's GPTModel (fp32, weights from the checkpoint) and the exported
    GPT2LMHeadModel on the same tokens."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron.sdp4bit.training.checkpoint import files

    _init_one_rank()
    m = files.read_manifest(ckpt_dir)["settings"]["model"]
    config = _config(num_layers=m["num_layers"], hidden_size=m["hidden_size"],
                     num_attention_heads=m["num_attention_heads"],
                     ffn_hidden_size=m["ffn_hidden_size"], layernorm_epsilon=1e-5)
    model = GPTModel(config, get_gpt_layer_local_spec(), m["padded_vocab_size"],
                     m["max_position_embeddings"], position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=True)
    _check_export(model, ckpt_dir, hf_dir, "GPT2LMHeadModel")


def test_export_to_hugging_face_matches_the_trainers_logits(reference, tmp_path):
    hf = tmp_path / "hf"
    _export(reference[1], hf, "GPT2LMHeadModel")
    assert sorted(os.listdir(hf)) == ["config.json", "model.safetensors"]
    spawn(_compare_logits, 1, str(reference[1] / f"iter_{SAVED_AT:07d}"), str(hf))


def _export(load, hf, architecture: str) -> None:
    res = _launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                         ["--load", str(load), "--output", str(hf)], env=_env(), cwd=ROOT,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith(f"wrote {hf} ({architecture}): "), res.stdout


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

    _init_one_rank()
    m = files.read_manifest(ckpt_dir)["settings"]["model"]
    config = _config(num_layers=LLAMA["layers"], hidden_size=LLAMA["hidden"],
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
    _check_export(model, ckpt_dir, hf_dir, "LlamaForCausalLM")


def test_llama_style_export_matches_the_trainers_logits(data_prefix, tmp_path):
    # The bound of _check_export is about 7e-5 here. Mutations of the mapping tried by hand
    # made the largest difference: 0.58 (k and v swapped in each group), 0.39 (QKV rows read
    # as [all q; all k; all v]), 0.022 (gate and up swapped), 0.0024 (rope_theta 10000).
    args = list(TINY)
    for flag, value in (("--train-iters", "2"), ("--lr-warmup-iters", "1"),
                        ("--log-interval", "1"), ("--eval-interval", "100")):
        args[args.index(flag) + 1] = value
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    torchrun(args + data_prefix + LLAMA_FLAGS + METHODS["SDP4Bit"] + [
        "--hidden-dropout", "0", "--attention-dropout", "0", "--save", str(ckpt)], nproc=2)
    _export(ckpt, hf, "LlamaForCausalLM")
    spawn(_compare_llama_logits, 1, str(ckpt / "iter_0000002"), str(hf))
