"""tools/checkpoint/export_hf.py without a checkpoint: the architecture mapping, the refusals
and the GPT-2, Llama and Mixtral tensor layouts (the logits tests are in
tests/e2e/test_dist_checkpoint.py and, for Mixtral, tests/e2e/test_moe_trainer.py)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron.sdp4bit.training.checkpoint import hf as hf_arch
from megatron.sdp4bit.training.checkpoint.settings import MOE_KEYS

from tests.helpers.full_disk import full_disk
from tests.helpers.hf_checkpoint import write_gpt2_checkpoint
from tests.helpers.scripts import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
export_hf = load_tool("tools/checkpoint/export_hf.py")

DEFAULT = {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 32, "num_attention_heads": 2,
           "kv_channels": None, "group_query_attention": False, "num_query_groups": 1,
           "max_position_embeddings": 16, "position_embedding_type": "learned_absolute",
           "rotary_base": 10000, "rotary_percent": 1.0,
           "untie_embeddings_and_output_weights": False, "swiglu": False, "openai_gelu": False,
           "normalization": "LayerNorm", "norm_epsilon": 1e-5, "add_bias_linear": True,
           "params_dtype": "bf16", "padded_vocab_size": 128, "qk_layernorm": False,
           "use_rope_scaling": False, "rope_scaling_factor": 8.0, "apply_layernorm_1p": False,
           **dict.fromkeys(MOE_KEYS)}
LLAMA = {**DEFAULT, "position_embedding_type": "rope", "normalization": "RMSNorm",
         "swiglu": True, "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
         "num_attention_heads": 4, "group_query_attention": True, "num_query_groups": 2,
         "kv_channels": 4, "rotary_base": 500000, "norm_epsilon": 1e-6}


def test_default_architecture_maps_to_gpt2():
    config = export_hf.hf_config(DEFAULT)
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"],
            config["vocab_size"], config["n_positions"], config["layer_norm_epsilon"]) == (
        8, 2, 2, 32, 128, 16, 1e-5)


def test_the_gelu_flavour_maps_to_gpt2s_activation_function():
    assert export_hf.hf_config(DEFAULT)["activation_function"] == "gelu"
    config = export_hf.hf_config({**DEFAULT, "openai_gelu": True})
    assert config["activation_function"] == "gelu_new"
    # read back, the config gives the flag again
    from transformers import GPT2Config

    assert "--openai-gelu" in hf_arch.trainer_flags(GPT2Config(**config))[1]
    assert "--openai-gelu" not in hf_arch.trainer_flags(
        GPT2Config(**export_hf.hf_config(DEFAULT)))[1]
    # a manifest written before --openai-gelu existed was a plain-GeLU run
    old = {k: v for k, v in DEFAULT.items() if k != "openai_gelu"}
    model, missing = hf_arch.with_defaults(old)
    assert missing == ["openai_gelu"] and model["openai_gelu"] is False
    assert export_hf.hf_config(model)["activation_function"] == "gelu"


def test_llama_style_settings_map_to_llama():
    config = export_hf.hf_config(LLAMA)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert {k: config[k] for k in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "rope_theta",
        "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")} == {
        "hidden_size": 8, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 500000,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000},
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    tied = {**LLAMA, "untie_embeddings_and_output_weights": False, "group_query_attention": False,
            "kv_channels": None}
    config = export_hf.hf_config(tied)
    assert (config["tie_word_embeddings"], config["num_key_value_heads"], config["head_dim"]) == (
        True, 4, 2)


def test_llama3_rope_scaling_round_trips_with_transformers_frequencies():
    """--use-rope-scaling exports as transformers' "llama3" RoPE whose inverse frequencies
    are megatron-core's, and that config imports back to the same flags."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model = {**LLAMA, "use_rope_scaling": True, "rope_scaling_factor": 32.0, "kv_channels": 64,
             "hidden_size": 256, "max_position_embeddings": 16384}
    config = LlamaConfig(**export_hf.hf_config(model))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000,
                           rope_scaling=True, rope_scaling_factor=32.0,
                           use_cpu_initialization=True).inv_freq
    unscaled = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_base=500000,
                               use_cpu_initialization=True).inv_freq
    assert not torch.allclose(ours, unscaled)  # the factor changed the low frequencies
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    name, flags, _ = hf_arch.trainer_flags(config)
    assert name == "LlamaForCausalLM"
    assert flags[-3:] == ["--use-rope-scaling", "--rope-scaling-factor", "32.0"]


def test_zero_centred_norms_are_refused_by_both_architectures():
    """--apply-layernorm-1p's norms scale by 1 + weight; both architectures' by the weight."""
    assert _refusal({**LLAMA, "apply_layernorm_1p": True}).endswith(
        "for LlamaForCausalLM, apply_layernorm_1p is True (needs False); for "
        "MixtralForCausalLM, apply_layernorm_1p is True (needs False), num_experts is None "
        "(needs a mixture of experts, --num-experts)")
    assert "for GPT2LMHeadModel, apply_layernorm_1p is True (needs False); " in _refusal(
        {**DEFAULT, "apply_layernorm_1p": True})


def test_qk_layernorm_is_refused_by_both_architectures():
    assert _refusal({**LLAMA, "qk_layernorm": True}).endswith(
        "for LlamaForCausalLM, qk_layernorm is True (needs False); for MixtralForCausalLM, "
        "qk_layernorm is True (needs False), num_experts is None (needs a mixture of experts, "
        "--num-experts)")
    assert "for GPT2LMHeadModel, qk_layernorm is True (needs False); " in _refusal(
        {**DEFAULT, "qk_layernorm": True})


def _refusal(model: dict) -> str:
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.hf_config(model)
    return str(err.value)


PREFIX = "the model does not map to a Hugging Face architecture this tool writes: "
NO_EXPERTS = "num_experts is None (needs a mixture of experts, --num-experts)"


def test_llama_with_biases_is_refused_naming_what_differs_for_each_architecture():
    assert _refusal({**LLAMA, "add_bias_linear": True}) == PREFIX + (
        "for GPT2LMHeadModel, position_embedding_type is 'rope' (needs 'learned_absolute'), "
        "normalization is 'RMSNorm' (needs 'LayerNorm'), swiglu is True (needs False), "
        "untie_embeddings_and_output_weights is True (needs False), num_query_groups is 2 "
        "(needs one per head, 4), kv_channels is 4 (needs hidden_size / num_attention_heads, 2); "
        "for LlamaForCausalLM, add_bias_linear is True (needs False); "
        "for MixtralForCausalLM, add_bias_linear is True (needs False), " + NO_EXPERTS)


def test_mixed_architectures_are_refused():
    # RoPE with LayerNorm and a partial rotary: only the position type is GPT-2's problem.
    assert _refusal({**DEFAULT, "position_embedding_type": "rope", "rotary_percent": 0.5}) == (
        PREFIX + "for GPT2LMHeadModel, position_embedding_type is 'rope' (needs "
        "'learned_absolute'); for LlamaForCausalLM, normalization is 'LayerNorm' (needs "
        "'RMSNorm'), swiglu is False (needs True), add_bias_linear is True (needs False), "
        "rotary_percent is 0.5 (needs 1.0); for MixtralForCausalLM, normalization is "
        "'LayerNorm' (needs 'RMSNorm'), swiglu is False (needs True), add_bias_linear is True "
        "(needs False), rotary_percent is 0.5 (needs 1.0), " + NO_EXPERTS)
    # SwiGLU with learned positions; the rotary percent of a model without RoPE is not named.
    assert _refusal({**LLAMA, "position_embedding_type": "learned_absolute",
                     "rotary_percent": 0.5, "untie_embeddings_and_output_weights": False,
                     "group_query_attention": False, "kv_channels": None}) == PREFIX + (
        "for GPT2LMHeadModel, normalization is 'RMSNorm' (needs 'LayerNorm'), swiglu is True "
        "(needs False), add_bias_linear is False (needs True); for LlamaForCausalLM, "
        "position_embedding_type is 'learned_absolute' (needs 'rope'); for MixtralForCausalLM, "
        "position_embedding_type is 'learned_absolute' (needs 'rope'), " + NO_EXPERTS)
    # --no-position-embedding maps to neither.
    assert _refusal({**DEFAULT, "position_embedding_type": "none"}) == PREFIX + (
        "for GPT2LMHeadModel, position_embedding_type is 'none' (needs 'learned_absolute'); "
        "for LlamaForCausalLM, position_embedding_type is 'none' (needs 'rope'), normalization "
        "is 'LayerNorm' (needs 'RMSNorm'), swiglu is False (needs True), add_bias_linear is "
        "True (needs False); for MixtralForCausalLM, position_embedding_type is 'none' (needs "
        "'rope'), normalization is 'LayerNorm' (needs 'RMSNorm'), swiglu is False (needs True), "
        "add_bias_linear is True (needs False), " + NO_EXPERTS)


def test_an_older_manifest_gets_the_trainers_defaults():
    old = {k: v for k, v in LLAMA.items()
           if k not in ("norm_epsilon", "rotary_base", "rotary_percent")}
    model, missing = hf_arch.with_defaults(old)
    assert missing == ["norm_epsilon", "rotary_base", "rotary_percent"]
    assert (model["norm_epsilon"], model["rotary_base"], model["rotary_percent"]) == (
        1e-5, 10000, 1.0)
    assert hf_arch.with_defaults(LLAMA) == (LLAMA, [])


def test_fused_qkv_rows_become_gpt2_q_k_v_columns():
    heads, hidden, head_dim = 2, 8, 4
    t = {"embedding.word_embeddings.weight": torch.zeros(128, hidden),
         "embedding.position_embeddings.weight": torch.zeros(16, hidden),
         "decoder.final_layernorm.weight": torch.ones(hidden),
         "decoder.final_layernorm.bias": torch.zeros(hidden)}
    L = "decoder.layers."
    # Row r of megatron's fused weight belongs to head r // 12, part (r // 4) % 3 (q, k, v).
    rows = torch.arange(3 * hidden, dtype=torch.float32)
    t[L + "self_attention.linear_qkv.weight"] = rows.view(1, -1, 1).expand(2, -1, hidden)
    t[L + "self_attention.linear_qkv.bias"] = rows.view(1, -1).expand(2, -1)
    for name, shape in (("self_attention.linear_proj.weight", (hidden, hidden)),
                        ("self_attention.linear_proj.bias", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_weight", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.weight", (32, hidden)), ("mlp.linear_fc1.bias", (32,)),
                        ("mlp.linear_fc2.weight", (hidden, 32)), ("mlp.linear_fc2.bias", (hidden,))):
        t[L + name] = torch.zeros(2, *shape)
    out = hf_arch.to_hf("GPT2LMHeadModel", hf_arch.unstack(t, DEFAULT), DEFAULT)
    bias = out["transformer.h.0.attn.c_attn.bias"]
    # GPT-2 column c: part c // 8, head (c % 8) // 4, element c % 4.
    expect = [h * 3 * head_dim + part * head_dim + e
              for part in range(3) for h in range(heads) for e in range(head_dim)]
    assert bias.tolist() == expect
    assert out["transformer.h.0.attn.c_attn.weight"].shape == (hidden, 3 * hidden)
    assert out["transformer.h.0.attn.c_attn.weight"][0].tolist() == expect
    assert out["transformer.h.0.mlp.c_fc.weight"].shape == (hidden, 32)


def test_fused_qkv_rows_split_per_query_group_and_fc1_into_gate_then_up():
    heads, groups, head_dim, hidden, ffn = 4, 2, 4, 8, 32
    rows = (heads + 2 * groups) * head_dim
    t = {"embedding.word_embeddings.weight": torch.zeros(128, hidden),
         "decoder.final_layernorm.weight": torch.ones(hidden),
         "output_layer.weight": torch.ones(128, hidden)}
    L = "decoder.layers."
    # Row r of megatron's fused weight: group r // 16, in it part (r % 16) // 4 = q of the
    # group's first head, q of its second head, k, v.
    t[L + "self_attention.linear_qkv.weight"] = torch.arange(
        rows, dtype=torch.float32).view(1, -1, 1).expand(2, -1, hidden)
    t[L + "mlp.linear_fc1.weight"] = torch.arange(
        2 * ffn, dtype=torch.float32).view(1, -1, 1).expand(2, -1, hidden)
    for name, shape in (("self_attention.linear_proj.weight", (hidden, heads * head_dim)),
                        ("self_attention.linear_qkv.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc2.weight", (hidden, ffn))):
        t[L + name] = torch.zeros(2, *shape)
    out = hf_arch.to_hf("LlamaForCausalLM", hf_arch.unstack(t, LLAMA), LLAMA)
    first = {k: v[:, 0].tolist() for k, v in out.items() if k.startswith("model.layers.1.")
             and k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight",
                             "gate_proj.weight", "up_proj.weight"))}
    span = lambda start: list(range(start, start + head_dim))  # noqa: E731
    assert first == {
        "model.layers.1.self_attn.q_proj.weight": span(0) + span(4) + span(16) + span(20),
        "model.layers.1.self_attn.k_proj.weight": span(8) + span(24),
        "model.layers.1.self_attn.v_proj.weight": span(12) + span(28),
        "model.layers.1.mlp.gate_proj.weight": list(range(ffn)),
        "model.layers.1.mlp.up_proj.weight": list(range(ffn, 2 * ffn))}
    assert out["lm_head.weight"].shape == (128, hidden)
    tied_model = {**LLAMA, "untie_embeddings_and_output_weights": False}
    tied = hf_arch.to_hf("LlamaForCausalLM", hf_arch.unstack(t, tied_model), tied_model)
    assert "lm_head.weight" not in tied


MIXTRAL = {**LLAMA, "num_experts": 3, "moe_ffn_hidden_size": 16, "moe_layer_freq": [1, 1],
           "moe_router_topk": 2, "moe_router_score_function": "softmax",
           "moe_router_pre_softmax": False, "moe_router_load_balancing_type": "aux_loss",
           "moe_grouped_gemm": False}


def test_moe_settings_map_to_mixtral_and_what_does_not_is_named():
    config = export_hf.hf_config(MIXTRAL)
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert {k: config[k] for k in ("model_type", "intermediate_size", "num_local_experts",
                                   "num_experts_per_tok", "router_jitter_noise",
                                   "num_key_value_heads", "rope_theta")} == {
        "model_type": "mixtral", "intermediate_size": 16, "num_local_experts": 3,
        "num_experts_per_tok": 2, "router_jitter_noise": 0.0, "num_key_value_heads": 2,
        "rope_theta": 500000}
    # the test's old MoE model (GPT-2 style): each architecture's differences, one line
    gpt2_moe = {**DEFAULT, **{k: v for k, v in MIXTRAL.items() if k in MOE_KEYS}}
    assert _refusal(gpt2_moe) == PREFIX + (
        "for GPT2LMHeadModel, num_experts is 3 (needs None); for LlamaForCausalLM, "
        "position_embedding_type is 'learned_absolute' (needs 'rope'), normalization is "
        "'LayerNorm' (needs 'RMSNorm'), swiglu is False (needs True), add_bias_linear is True "
        "(needs False), num_experts is 3 (needs None); for MixtralForCausalLM, "
        "position_embedding_type is 'learned_absolute' (needs 'rope'), normalization is "
        "'LayerNorm' (needs 'RMSNorm'), swiglu is False (needs True), add_bias_linear is True "
        "(needs False)")
    for change, named in (
            ({"moe_layer_freq": [1, 0]}, "moe_layer_freq is [1, 0] (needs every layer a MoE "
                                         "layer)"),
            ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax is True (needs False)"),
            ({"moe_shared_expert_intermediate_size": 16},
             "moe_shared_expert_intermediate_size is 16 (needs None)"),
            ({"moe_router_load_balancing_type": "sinkhorn"},
             "moe_router_load_balancing_type is 'sinkhorn' (needs another")):
        assert _refusal({**MIXTRAL, **change}).split("for MixtralForCausalLM, ")[1].startswith(
            named), change
    # exported only: the import names what it reads
    from transformers import MixtralConfig

    with pytest.raises(hf_arch.MappingError, match=r"^architecture \['MixtralForCausalLM'\] is "
                       r"not imported: only GPT2LMHeadModel and LlamaForCausalLM$"):
        hf_arch.trainer_flags(MixtralConfig(**config))


def test_expert_weights_become_mixtrals_w1_w3_w2_and_back():
    """Each expert's fc1 rows [gate; up] are w1 then w3, fc2 is w2, the router Mixtral's
    gate; the mapping read backwards gives every tensor back bit for bit. An older trainer's
    MoE manifest (no experts recorded: read as a Llama) meets tensors it does not name: one
    line, no KeyError."""
    experts, ffn, hidden = 3, 16, 8
    t = {"embedding.word_embeddings.weight": torch.randn(128, hidden),
         "decoder.final_layernorm.weight": torch.randn(hidden),
         "output_layer.weight": torch.randn(128, hidden)}
    L = "decoder.layers."
    for name, shape in (("self_attention.linear_qkv.weight", (32, hidden)),
                        ("self_attention.linear_proj.weight", (hidden, 16)),
                        ("self_attention.linear_qkv.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_weight", (hidden,)),
                        ("mlp.router.weight", (experts, hidden)),
                        ("mlp.experts.experts.linear_fc2.weight", (experts, hidden, ffn))):
        t[L + name] = torch.randn(2, *shape)
    # fc1 row r of expert e holds 100 e + r
    t[L + "mlp.experts.experts.linear_fc1.weight"] = (
        100 * torch.arange(experts).view(1, -1, 1, 1) + torch.arange(2 * ffn).view(1, 1, -1, 1)
    ).float().expand(2, -1, -1, hidden)
    ours = hf_arch.unstack(t, MIXTRAL)
    out = hf_arch.to_hf("MixtralForCausalLM", ours, MIXTRAL)
    moe = "model.layers.1.block_sparse_moe."
    assert out[moe + "experts.2.w1.weight"][:, 0].tolist() == [200 + r for r in range(ffn)]
    assert out[moe + "experts.2.w3.weight"][:, 0].tolist() == [200 + r for r in range(ffn, 32)]
    assert torch.equal(out[moe + "experts.1.w2.weight"],
                       t[L + "mlp.experts.experts.linear_fc2.weight"][1, 1])
    assert torch.equal(out[moe + "gate.weight"], t[L + "mlp.router.weight"][1])
    assert len([k for k in out if ".experts." in k]) == 2 * experts * 3
    back = hf_arch.from_hf("MixtralForCausalLM", out, MIXTRAL)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    with pytest.raises(hf_arch.MappingError, match=(
            r"^the checkpoint holds no decoder\.layers\.0\.mlp\.linear_fc1\.weight, which its "
            r"recorded model settings need \(it holds decoder\.layers\.0\.mlp\.experts\.experts"
            r"\.linear_fc1\.weight, .*\): its manifest does not describe its tensors$")):
        hf_arch.to_hf("LlamaForCausalLM", ours, LLAMA)


# ------------------------------------------------ the output folder, damage, a full disk


# 0.4 MB of weights: more than the 64 KiB disk below holds
BIGGER = {**DEFAULT, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
          "padded_vocab_size": 256, "max_position_embeddings": 32}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return write_gpt2_checkpoint(tmp_path_factory.mktemp("ckpt"), BIGGER)


def _run(*args: str):
    """``python tools/checkpoint/export_hf.py args``, forked from the session's fork server."""
    from tests.helpers import launch

    return launch.python(os.path.join(ROOT, "tools/checkpoint/export_hf.py"), list(args),
                         env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, timeout=300)


def test_an_output_folder_is_replaced_whole_or_not_at_all(checkpoint, tmp_path):
    """An export into a folder holding an earlier export's files replaced two of them and
    left its tokenizer.json beside them."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.export(checkpoint, str(out))
    assert str(err.value) == (f"--output {out} is not empty (it holds tokenizer.json): pass "
                              "--overwrite to replace the whole folder, or choose another "
                              "--output")
    assert os.listdir(out) == ["tokenizer.json"]
    assert export_hf.export(checkpoint, str(out), overwrite=True) == "GPT2LMHeadModel"
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]  # nothing mixed
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temporary folder left


def test_a_missing_file_and_a_full_disk_are_one_line_and_leave_nothing(checkpoint, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint, damaged)
    missing = damaged / "iter_0000002" / "__0_0.distcp"
    missing.unlink()
    res = _run("--load", str(damaged), "--output", str(tmp_path / "hf"))
    assert (res.returncode, res.stdout, res.stderr) == (2, "", (
        f"export_hf.py: error: checkpoint file {missing} is missing: the checkpoint is "
        "incomplete; export an earlier checkpoint\n"))
    with full_disk(tmp_path, kib=64) as disk:
        res = _run("--load", checkpoint, "--output", str(disk / "hf"))
        assert (res.returncode, res.stderr) == (2, (
            f"export_hf.py: error: cannot write {disk / 'hf'} (No space left on device): free "
            "space or fix the folder; nothing was written\n"))
        assert os.listdir(disk) == []


# ------------------------------------------------ a crafted .metadata


DAMAGED = "the checkpoint is damaged or was crafted: refusing it"


def _crafted(checkpoint: str, tmp_path, name: str, change) -> str:
    """A copy of the checkpoint whose ``.metadata`` ``change`` rewrote, the manifest sealed
    again as its author would; returns its iteration folder."""
    import shutil

    from tests.helpers import crafted

    root = tmp_path / name
    shutil.copytree(checkpoint, root)
    folder = root / "iter_0000002"
    crafted.rewrite_metadata(folder, lambda m: change(folder, m))
    return str(folder)


def _refused_export(root: str, out) -> str:
    from megatron.sdp4bit.training.checkpoint.safe_load import UnsafePickle

    with pytest.raises(UnsafePickle) as err:
        export_hf.export(root, str(out))
    assert not os.path.exists(out)
    return str(err.value)


def test_tensor_entries_outside_the_folder_are_refused_before_they_are_read(checkpoint,
                                                                            tmp_path):
    """The export read the model's weights from a file outside the checkpoint the
    .metadata's tensor entries named (only object entries were checked)."""
    import shutil

    from tests.helpers import crafted

    outside = tmp_path / "outside.distcp"
    shutil.copy(os.path.join(checkpoint, "iter_0000002", "__0_0.distcp"), outside)
    folder = _crafted(checkpoint, tmp_path, "outside",
                      lambda _, m: crafted.point_at(m, "../../outside.distcp"))
    expected = (f"checkpoint file {folder}/.metadata names data file '../../outside.distcp' for "
                f"tensor embedding.word_embeddings.weight chunk at [0, 0] outside its folder: "
                f"{DAMAGED}")
    res = _run("--load", os.path.dirname(folder), "--output", str(tmp_path / "hf"))
    assert (res.returncode, res.stdout, res.stderr) == (2, "", f"export_hf.py: error: {expected}\n")
    assert not (tmp_path / "hf").exists()
    outside.unlink()  # never read: the same line without it
    assert _refused_export(os.path.dirname(folder), tmp_path / "hf") == expected


def _grow(folder, metadata, key: str, rows: int, chunk: bool) -> None:
    entry = metadata.state_dict_metadata[key]
    entry.size = torch.Size([entry.size[0] * rows, *entry.size[1:]])
    if chunk:
        entry.chunks[0].sizes = entry.size


def test_sizes_and_shapes_the_metadata_gives_are_checked_before_anything_is_allocated(
        checkpoint, tmp_path):
    """An embedding grown 2**24 times asked torch.empty for 1 TiB here (824 GB in the probe);
    a shape that lies ended in torch's AssertionError; one that agrees with its data but not
    with the model was exported as it was."""
    key = "embedding.word_embeddings.weight"
    folder = _crafted(checkpoint, tmp_path, "grown", lambda f, m: _grow(f, m, key, 2**24, False))
    assert _refused_export(os.path.dirname(folder), tmp_path / "hf") == (
        f"checkpoint file {folder}/.metadata gives tensor {key} the shape [4294967296, 64] "
        f"(274877906944 elements), but its chunks hold 16384 elements: {DAMAGED}")
    folder = _crafted(checkpoint, tmp_path, "lying", lambda f, m: _grow(f, m, key, 2, True))
    message = _refused_export(os.path.dirname(folder), tmp_path / "hf")
    assert message.startswith(f"checkpoint file {folder}/__0_0.distcp holds a float32 tensor of "
                              f"shape [256, 64], the entry says float32 [512, 64] for tensor "
                              f"{key} chunk at [0, 0] (bytes "), message
    assert message.endswith(f"): {DAMAGED}"), message

    # shape, chunk and data agree with each other, not with the manifest's model: the export
    # wrote a model transformers cannot load
    from tests.helpers import crafted

    norm = "decoder.final_layernorm.weight"
    folder = _crafted(checkpoint, tmp_path, "consistent", lambda f, m: crafted.append_tensor(
        f, m, norm, torch.ones(80)))
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.export(os.path.dirname(folder), str(tmp_path / "hf"))
    assert str(err.value) == (
        f"checkpoint {folder}'s tensors do not have the shapes its manifest's model settings "
        "give (transformer.ln_f.weight is [80], not [64]): the checkpoint is damaged or was "
        "crafted; export an earlier one")
    assert not (tmp_path / "hf").exists()


def test_a_fifo_in_the_checkpoint_is_refused_without_being_opened(checkpoint, tmp_path):
    import shutil

    root = tmp_path / "fifo"
    shutil.copytree(checkpoint, root)
    metadata = root / "iter_0000002" / ".metadata"
    metadata.unlink()
    os.mkfifo(metadata)
    res = _run("--load", str(root), "--output", str(tmp_path / "hf"))  # 300 s bound
    assert (res.returncode, res.stderr) == (2, (
        f"export_hf.py: error: a file of checkpoint {metadata} is a FIFO, not a regular file: "
        "refused without opening it; remove it\n"))
