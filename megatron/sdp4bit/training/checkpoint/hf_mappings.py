"""The trainer's model settings and tensors -> a Hugging Face architecture (used by export_hf.py).

Two architectures are written; :func:`hf_config` picks the one the settings (the manifest's
``settings["model"]``) map to, or refuses in one line naming, for each, what differs:

* ``GPT2LMHeadModel``: learned absolute positions, LayerNorm, GeLU, biases, tied embeddings,
  one key/value head per query head, head dim = hidden / heads;
* ``LlamaForCausalLM``: RoPE over the whole head (megatron-core's non-interleaved rotation is
  transformers' ``rotate_half``), RMSNorm, SwiGLU, no biases; tied or untied embeddings,
  grouped-query attention and any head dim.

Tensors are megatron-core's full (unsharded) ones with the layers stacked on dim 0, as the
torch_dist checkpoint holds them.
"""

from __future__ import annotations

import torch


class ExportError(ValueError):
    """What stops the export; one line with the reason."""


# Settings a manifest written before the Llama export lacks, with the trainer's defaults,
# and those each architecture reads.
LATER_DEFAULTS = {"norm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0}
READS = {"GPT2LMHeadModel": ("norm_epsilon",), "LlamaForCausalLM": tuple(LATER_DEFAULTS)}


def with_defaults(model: dict) -> tuple[dict, list[str]]:
    """(settings with the trainer's defaults for what an older manifest lacks, those keys)."""
    missing = [k for k in LATER_DEFAULTS if k not in model]
    return {**{k: LATER_DEFAULTS[k] for k in missing}, **model}, missing


def _head_dim(model: dict) -> int:
    return model.get("kv_channels") or model["hidden_size"] // model["num_attention_heads"]


def _kv_heads(model: dict) -> int:
    if model.get("group_query_attention"):
        return model["num_query_groups"]
    return model["num_attention_heads"]


def _differences(model: dict, needs: dict) -> list[str]:
    return [f"{k} is {model.get(k)!r} (needs {v!r})" for k, v in needs.items()
            if model.get(k) != v]


def gpt2_mismatches(model: dict) -> list[str]:
    """What keeps the settings from being a GPT2LMHeadModel (empty: nothing)."""
    wrong = _differences(model, {
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
        "swiglu": False, "add_bias_linear": True, "untie_embeddings_and_output_weights": False})
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    if _kv_heads(model) != heads:
        wrong.append(f"num_query_groups is {model['num_query_groups']} (needs one per head, "
                     f"{heads})")
    if _head_dim(model) != hidden // heads:
        wrong.append(f"kv_channels is {model['kv_channels']} (needs hidden_size / "
                     f"num_attention_heads, {hidden // heads})")
    return wrong


def llama_mismatches(model: dict) -> list[str]:
    """What keeps the settings from being a LlamaForCausalLM (empty: nothing)."""
    wrong = _differences(model, {"position_embedding_type": "rope", "normalization": "RMSNorm",
                                 "swiglu": True, "add_bias_linear": False})
    # The rotary percent only acts with RoPE; transformers' Llama rotates the whole head.
    if model.get("position_embedding_type") == "rope" and model["rotary_percent"] != 1.0:
        wrong.append(f"rotary_percent is {model['rotary_percent']!r} (needs 1.0)")
    return wrong


ARCHITECTURES = {"GPT2LMHeadModel": gpt2_mismatches, "LlamaForCausalLM": llama_mismatches}


def architecture(model: dict) -> str:
    """The architecture the settings map to; refuses naming every difference of each."""
    found = {name: check(model) for name, check in ARCHITECTURES.items()}
    for name, wrong in found.items():
        if not wrong:
            return name
    raise ExportError("the model does not map to a Hugging Face architecture this tool "
                      "writes: " + "; ".join(f"for {name}, " + ", ".join(wrong)
                                             for name, wrong in found.items()))


def _eod(model: dict) -> int | None:
    # GPT-2's <|endoftext|>, when the vocabulary is GPT-2's
    return 50256 if model["padded_vocab_size"] > 50256 else None


def hf_config(model: dict) -> dict:
    """``config.json`` for the settings (fp32 weights, dropout off)."""
    name = architecture(model)
    heads, hidden, eod = model["num_attention_heads"], model["hidden_size"], _eod(model)
    common = {"architectures": [name], "vocab_size": model["padded_vocab_size"],
              "torch_dtype": "float32", "bos_token_id": eod, "eos_token_id": eod}
    if name == "GPT2LMHeadModel":
        return {**common, "model_type": "gpt2", "n_positions": model["max_position_embeddings"],
                "n_embd": hidden, "n_layer": model["num_layers"], "n_head": heads,
                "n_inner": model["ffn_hidden_size"],
                "activation_function": "gelu",  # megatron-core's GeLU is the exact (erf) one
                "layer_norm_epsilon": model["norm_epsilon"], "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}
    theta = model["rotary_base"]
    return {**common, "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": model["ffn_hidden_size"], "num_hidden_layers":
            model["num_layers"], "num_attention_heads": heads,
            "num_key_value_heads": _kv_heads(model), "head_dim": _head_dim(model),
            "hidden_act": "silu", "max_position_embeddings": model["max_position_embeddings"],
            "rms_norm_eps": model["norm_epsilon"],
            # transformers < 5 reads rope_theta, 5 reads rope_parameters (and converts the
            # former when the latter is absent): both, equal.
            "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "tie_word_embeddings": not model["untie_embeddings_and_output_weights"]}


L = "decoder.layers."


def gpt2_state(t: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """megatron-core GPT tensors -> GPT2LMHeadModel's names."""
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    head_dim = hidden // heads
    out = {"transformer.wte.weight": t["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": t["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": t["decoder.final_layernorm.bias"]}
    for i in range(model["num_layers"]):
        h = f"transformer.h.{i}."
        # megatron's fused QKV rows are [q, k, v] per head (a query group of one head); GPT-2's
        # columns are all q, all k, all v. Conv1D stores weights as (in, out): transposed.
        qkv_w = t[L + "self_attention.linear_qkv.weight"][i].view(heads, 3, head_dim, hidden)
        qkv_b = t[L + "self_attention.linear_qkv.bias"][i].view(heads, 3, head_dim)
        out[h + "attn.c_attn.weight"] = qkv_w.transpose(0, 1).reshape(3 * hidden, hidden).t()
        out[h + "attn.c_attn.bias"] = qkv_b.transpose(0, 1).reshape(3 * hidden)
        out[h + "attn.c_proj.weight"] = t[L + "self_attention.linear_proj.weight"][i].t()
        out[h + "attn.c_proj.bias"] = t[L + "self_attention.linear_proj.bias"][i]
        out[h + "ln_1.weight"] = t[L + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[h + "ln_1.bias"] = t[L + "self_attention.linear_qkv.layer_norm_bias"][i]
        out[h + "ln_2.weight"] = t[L + "mlp.linear_fc1.layer_norm_weight"][i]
        out[h + "ln_2.bias"] = t[L + "mlp.linear_fc1.layer_norm_bias"][i]
        out[h + "mlp.c_fc.weight"] = t[L + "mlp.linear_fc1.weight"][i].t()
        out[h + "mlp.c_fc.bias"] = t[L + "mlp.linear_fc1.bias"][i]
        out[h + "mlp.c_proj.weight"] = t[L + "mlp.linear_fc2.weight"][i].t()
        out[h + "mlp.c_proj.bias"] = t[L + "mlp.linear_fc2.bias"][i]
    return {k: v.contiguous() for k, v in out.items()}


def llama_state(t: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """megatron-core GPT tensors -> LlamaForCausalLM's names (nn.Linear: (out, in) both)."""
    heads, hidden, groups = model["num_attention_heads"], model["hidden_size"], _kv_heads(model)
    ffn, head_dim = model["ffn_hidden_size"], _head_dim(model)
    per_group = heads // groups
    out = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"],
           "model.norm.weight": t["decoder.final_layernorm.weight"]}
    if model["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = t["output_layer.weight"]
    for i in range(model["num_layers"]):
        h = f"model.layers.{i}."
        # megatron-core's fused QKV rows, per query group: its per_group query heads, then
        # its key head, then its value head, each head_dim rows. Query head j of group g is
        # head g * per_group + j, which uses key/value head g, as in transformers' repeat_kv.
        qkv = t[L + "self_attention.linear_qkv.weight"][i].view(
            groups, per_group + 2, head_dim, hidden)
        out[h + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(heads * head_dim, hidden)
        out[h + "self_attn.k_proj.weight"] = qkv[:, per_group].reshape(groups * head_dim, hidden)
        out[h + "self_attn.v_proj.weight"] = qkv[:, per_group + 1].reshape(
            groups * head_dim, hidden)
        out[h + "self_attn.o_proj.weight"] = t[L + "self_attention.linear_proj.weight"][i]
        out[h + "input_layernorm.weight"] = t[L + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[h + "post_attention_layernorm.weight"] = t[L + "mlp.linear_fc1.layer_norm_weight"][i]
        # SwiGLU: megatron-core computes silu(first half of fc1) * second half: [gate; up].
        fc1 = t[L + "mlp.linear_fc1.weight"][i]
        out[h + "mlp.gate_proj.weight"] = fc1[:ffn]
        out[h + "mlp.up_proj.weight"] = fc1[ffn:]
        out[h + "mlp.down_proj.weight"] = t[L + "mlp.linear_fc2.weight"][i]
    return {k: v.contiguous() for k, v in out.items()}


STATES = {"GPT2LMHeadModel": gpt2_state, "LlamaForCausalLM": llama_state}
