"""``LlamaForCausalLM``: RoPE over the whole head (megatron-core's non-interleaved rotation
is transformers' ``rotate_half``), RMSNorm, SwiGLU, no biases; tied or untied embeddings,
grouped-query attention and any head dim."""

from __future__ import annotations

import torch

from megatron.sdp4bit.training.checkpoint.hf.common import (
    as_flags, differences, head_dim, kv_heads, need)
from megatron.sdp4bit.training.checkpoint.hf.tensors import L, OUTPUT, WORD, Rule, Tensors

NAME = "LlamaForCausalLM"

# Settings an older manifest may lack that this architecture's config reads.
READS = ("norm_epsilon", "rotary_base", "rotary_percent")


def mismatches(model: dict) -> list[str]:
    """What keeps the settings from being a LlamaForCausalLM (empty: nothing)."""
    wrong = differences(model, {"position_embedding_type": "rope", "normalization": "RMSNorm",
                                "swiglu": True, "add_bias_linear": False,
                                "qk_layernorm": False, "apply_layernorm_1p": False,
                                "num_experts": None})
    # The rotary percent only acts with RoPE; transformers' Llama rotates the whole head.
    if model.get("position_embedding_type") == "rope" and model["rotary_percent"] != 1.0:
        wrong.append(f"rotary_percent is {model['rotary_percent']!r} (needs 1.0)")
    return wrong


# Llama 3.x's RoPE scaling ("llama3") as megatron-core's rope_scaling computes it: only the
# factor is a setting (--rope-scaling-factor); these three are fixed there.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _rope_parameters(model: dict) -> dict:
    theta = model["rotary_base"]
    if not model.get("use_rope_scaling"):
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "llama3", "rope_theta": theta,
            "factor": float(model["rope_scaling_factor"]), **LLAMA3_FIXED}


def hf_config(model: dict) -> dict:
    """The Llama fields of ``config.json`` (fp32 weights, dropout off)."""
    theta, rope = model["rotary_base"], _rope_parameters(model)
    # transformers < 5 reads rope_scaling for a scaled RoPE, 5 reads rope_parameters.
    scaling = {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} \
        if rope["rope_type"] != "default" else {}
    return {"model_type": "llama", "hidden_size": model["hidden_size"],
            "intermediate_size": model["ffn_hidden_size"], "num_hidden_layers":
            model["num_layers"], "num_attention_heads": model["num_attention_heads"],
            "num_key_value_heads": kv_heads(model), "head_dim": head_dim(model),
            "hidden_act": "silu", "max_position_embeddings": model["max_position_embeddings"],
            "rms_norm_eps": model["norm_epsilon"],
            # transformers < 5 reads rope_theta, 5 reads rope_parameters (and converts the
            # former when the latter is absent): both, equal.
            "rope_theta": theta, "rope_parameters": rope, **scaling,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": not model["untie_embeddings_and_output_weights"]}


def _rope(config) -> tuple[str, float, dict]:
    """(RoPE type, theta, scaling parameters) of a transformers config: transformers 5 keeps
    them in ``rope_parameters``, 4 in ``rope_theta`` and ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return kind, float(theta), {**scaling, **params}


def _rope_scaling_flags(kind: str, params: dict, wrong: list[str]) -> list[str]:
    """--use-rope-scaling for a "llama3" RoPE with megatron-core's fixed parameters."""
    if kind == "default":
        return []
    if kind != "llama3":
        wrong.append(f"rope type {kind!r} (needs 'default' or 'llama3': megatron-core's RoPE "
                     "scaling here is Llama 3.x's)")
        return []
    for key, value in LLAMA3_FIXED.items():
        if params.get(key) != value:
            wrong.append(f"llama3 rope {key} {params.get(key)!r} (needs {value:g}: "
                         "megatron-core's rope_scaling fixes it)")
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or not factor >= 1:
        wrong.append(f"llama3 rope factor {factor!r} (needs a number >= 1)")
        return []
    return as_flags("--use-rope-scaling", "--rope-scaling-factor", repr(float(factor)))


def trainer_flags(config) -> tuple[list[str], list[str]]:
    """A transformers LlamaConfig -> (the trainer's model flags, what does not map)."""
    wrong: list[str] = []
    hidden, heads = config.hidden_size, config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head = getattr(config, "head_dim", None) or hidden // heads
    kind, theta, rope_params = _rope(config)
    scaling_flags = _rope_scaling_flags(kind, rope_params, wrong)
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial != 1.0:
        wrong.append(f"partial_rotary_factor {partial!r} (needs 1.0)")
    need(wrong, config, "hidden_act", ["silu"])
    need(wrong, config, "attention_bias", [False])
    need(wrong, config, "mlp_bias", [False])
    need(wrong, config, "pretraining_tp", [1])
    flags = as_flags("--num-layers", config.num_hidden_layers, "--hidden-size", hidden,
                     "--ffn-hidden-size", config.intermediate_size,
                     "--num-attention-heads", heads)
    if head != hidden // heads:
        flags += as_flags("--kv-channels", head)
    if groups != heads:
        flags += as_flags("--group-query-attention", "--num-query-groups", groups)
    if theta != int(theta):
        wrong.append(f"rope_theta {theta!r} (needs an integer: --rotary-base takes one)")
    flags += as_flags("--seq-length", config.max_position_embeddings,
                      "--max-position-embeddings", config.max_position_embeddings,
                      "--position-embedding-type", "rope", "--rotary-base", int(theta),
                      "--normalization", "RMSNorm", "--norm-epsilon",
                      repr(float(config.rms_norm_eps)), "--swiglu", "--disable-bias-linear")
    if not config.tie_word_embeddings:
        flags.append("--untie-embeddings-and-output-weights")
    return flags + scaling_flags, wrong


def normalize(tensors: Tensors) -> Tensors:
    return tensors


def _qkv_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # megatron-core's fused QKV rows, per query group: its per_group query heads, then its
    # key head, then its value head, each head_dim rows. Query head j of group g is head
    # g * per_group + j, which uses key/value head g, as in transformers' repeat_kv.
    heads, hidden, groups, dim = (m["num_attention_heads"], m["hidden_size"], kv_heads(m),
                                  head_dim(m))
    per_group = heads // groups
    qkv = w.view(groups, per_group + 2, dim, hidden)
    return (qkv[:, :per_group].reshape(heads * dim, hidden),
            qkv[:, per_group].reshape(groups * dim, hidden),
            qkv[:, per_group + 1].reshape(groups * dim, hidden))


def _qkv_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
    q, k, v = ts
    heads, hidden, groups, dim = (m["num_attention_heads"], m["hidden_size"], kv_heads(m),
                                  head_dim(m))
    per_group = heads // groups
    return torch.cat([q.reshape(groups, per_group, dim, hidden),
                      k.reshape(groups, 1, dim, hidden),
                      v.reshape(groups, 1, dim, hidden)], dim=1).reshape(-1, hidden)


def _swiglu_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # SwiGLU: megatron-core computes silu(first half of fc1) * second half: [gate; up].
    ffn = m["ffn_hidden_size"]
    return w[:ffn], w[ffn:]


LL = "model.layers.{i}."
RULES = (
    Rule(WORD, ("model.embed_tokens.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule(OUTPUT, ("lm_head.weight",), when=lambda m: m["untie_embeddings_and_output_weights"]),
    Rule(L + "{i}.self_attention.linear_qkv.weight",
         tuple(LL + f"self_attn.{x}_proj.weight" for x in "qkv"), _qkv_to_hf, _qkv_from_hf),
    Rule(L + "{i}.self_attention.linear_proj.weight", (LL + "self_attn.o_proj.weight",)),
    Rule(L + "{i}.self_attention.linear_qkv.layer_norm_weight",
         (LL + "input_layernorm.weight",)),
    Rule(L + "{i}.mlp.linear_fc1.layer_norm_weight", (LL + "post_attention_layernorm.weight",)),
    Rule(L + "{i}.mlp.linear_fc1.weight", (LL + "mlp.gate_proj.weight", LL + "mlp.up_proj.weight"),
         _swiglu_to_hf, lambda ts, m: torch.cat(ts)),
    Rule(L + "{i}.mlp.linear_fc2.weight", (LL + "mlp.down_proj.weight",)),
)
