"""``GPT2LMHeadModel``: learned absolute positions, LayerNorm, GeLU, biases, tied embeddings,
one key/value head per query head, head dim = hidden / heads.

The GeLU is the exact (erf) one, ``activation_function`` "gelu", or with ``--openai-gelu``
its tanh approximation, "gelu_new" (OpenAI's GPT-2 and transformers' default) or a name
transformers gives the same formula (:data:`TANH_GELUS`).
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.training.checkpoint.hf.common import (
    as_flags, differences, head_dim, kv_heads, need)
from megatron.sdp4bit.training.checkpoint.hf.tensors import L, WORD, Rule, Tensors

NAME = "GPT2LMHeadModel"

# transformers' activation_function names for 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
# (--openai-gelu): the same formula, evaluated in slightly different orders (within a float32
# rounding of each other). "gelu_new" is GPT-2's default and what the export writes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate")

# Settings an older manifest may lack that this architecture's config reads.
READS = ("norm_epsilon",)

BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal masks saved by old transformers


def mismatches(model: dict) -> list[str]:
    """What keeps the settings from being a GPT2LMHeadModel (empty: nothing)."""
    wrong = differences(model, {
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
        "swiglu": False, "add_bias_linear": True, "untie_embeddings_and_output_weights": False,
        "qk_layernorm": False, "apply_layernorm_1p": False, "num_experts": None})
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    if kv_heads(model) != heads:
        wrong.append(f"num_query_groups is {model['num_query_groups']} (needs one per head, "
                     f"{heads})")
    if head_dim(model) != hidden // heads:
        wrong.append(f"kv_channels is {model['kv_channels']} (needs hidden_size / "
                     f"num_attention_heads, {hidden // heads})")
    return wrong


def hf_config(model: dict) -> dict:
    """The GPT-2 fields of ``config.json`` (fp32 weights, dropout off)."""
    return {"model_type": "gpt2", "n_positions": model["max_position_embeddings"],
            "n_embd": model["hidden_size"], "n_layer": model["num_layers"],
            "n_head": model["num_attention_heads"], "n_inner": model["ffn_hidden_size"],
            # megatron-core's GeLU is the exact (erf) one; --openai-gelu the tanh one
            "activation_function": "gelu_new" if model["openai_gelu"] else "gelu",
            "layer_norm_epsilon": model["norm_epsilon"], "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}


def trainer_flags(config) -> tuple[list[str], list[str]]:
    """A transformers GPT2Config -> (the trainer's model flags, what does not map)."""
    wrong: list[str] = []
    hidden, heads = config.n_embd, config.n_head
    # transformers' GPT2Config defaults to the tanh approximation
    act = getattr(config, "activation_function", "gelu_new")
    if act not in ("gelu",) + TANH_GELUS:
        wrong.append(f"activation_function {act!r} (needs 'gelu', the exact GeLU, or the "
                     f"tanh approximation {', '.join(map(repr, TANH_GELUS))}, "
                     "--openai-gelu)")
    need(wrong, config, "tie_word_embeddings", [True])
    need(wrong, config, "scale_attn_weights", [True])
    need(wrong, config, "scale_attn_by_inverse_layer_idx", [False])
    need(wrong, config, "add_cross_attention", [False])
    flags = as_flags("--num-layers", config.n_layer, "--hidden-size", hidden,
                     "--ffn-hidden-size", config.n_inner or 4 * hidden,
                     "--num-attention-heads", heads, "--seq-length", config.n_positions,
                     "--max-position-embeddings", config.n_positions,
                     "--position-embedding-type", "learned_absolute", "--normalization",
                     "LayerNorm", "--norm-epsilon", repr(float(config.layer_norm_epsilon)))
    if act in TANH_GELUS:
        flags.append("--openai-gelu")
    return flags, wrong


def normalize(tensors: Tensors) -> Tensors:
    """GPT-2's weight names as ``save_pretrained`` writes them: the ``transformer.`` prefix
    (missing in some older files), no saved causal masks."""
    out = dict(tensors)
    if not any(k.startswith("transformer.") for k in out):
        out = {(k if k.startswith("lm_head.") else "transformer." + k): v
               for k, v in out.items()}
    return {k: v for k, v in out.items() if not k.endswith(BUFFERS)}


def _qkv_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # megatron's fused QKV rows are [q, k, v] per head (a query group of one head); GPT-2's
    # columns are all q, all k, all v. Conv1D stores weights as (in, out): transposed.
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    if w.dim() == 2:
        return (w.view(heads, 3, hidden // heads, hidden).transpose(0, 1)
                .reshape(3 * hidden, hidden).t(),)
    return (w.view(heads, 3, hidden // heads).transpose(0, 1).reshape(3 * hidden),)


def _qkv_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    (w,) = ts
    if w.dim() == 2:
        return (w.t().reshape(3, heads, hidden // heads, hidden).transpose(0, 1)
                .reshape(3 * hidden, hidden))
    return w.view(3, heads, hidden // heads).transpose(0, 1).reshape(3 * hidden)


def _conv1d_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    return (w.t(),)  # GPT-2's Conv1D stores (in, out), nn.Linear (out, in)


def _conv1d_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
    return ts[0].t()


H = "transformer.h.{i}."
CONV1D = (_conv1d_to_hf, _conv1d_from_hf)
RULES = (
    Rule(WORD, ("transformer.wte.weight",)),
    Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
    Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
    Rule(L + "{i}.self_attention.linear_qkv.weight", (H + "attn.c_attn.weight",),
         _qkv_to_hf, _qkv_from_hf),
    Rule(L + "{i}.self_attention.linear_qkv.bias", (H + "attn.c_attn.bias",),
         _qkv_to_hf, _qkv_from_hf),
    Rule(L + "{i}.self_attention.linear_proj.weight", (H + "attn.c_proj.weight",), *CONV1D),
    Rule(L + "{i}.self_attention.linear_proj.bias", (H + "attn.c_proj.bias",)),
    Rule(L + "{i}.self_attention.linear_qkv.layer_norm_weight", (H + "ln_1.weight",)),
    Rule(L + "{i}.self_attention.linear_qkv.layer_norm_bias", (H + "ln_1.bias",)),
    Rule(L + "{i}.mlp.linear_fc1.layer_norm_weight", (H + "ln_2.weight",)),
    Rule(L + "{i}.mlp.linear_fc1.layer_norm_bias", (H + "ln_2.bias",)),
    Rule(L + "{i}.mlp.linear_fc1.weight", (H + "mlp.c_fc.weight",), *CONV1D),
    Rule(L + "{i}.mlp.linear_fc1.bias", (H + "mlp.c_fc.bias",)),
    Rule(L + "{i}.mlp.linear_fc2.weight", (H + "mlp.c_proj.weight",), *CONV1D),
    Rule(L + "{i}.mlp.linear_fc2.bias", (H + "mlp.c_proj.bias",)),
)
