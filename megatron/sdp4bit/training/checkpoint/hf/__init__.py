"""The trainer's model <-> a Hugging Face architecture, one mapping read in both directions
(tools/checkpoint/export_hf.py writes with it, tools/checkpoint/import_hf.py reads with it).

Two architectures; :func:`hf_config` picks the one the settings (the manifest's
``settings["model"]``) map to, or refuses in one line naming, for each, what differs, and
:func:`trainer_flags` reads a ``config.json`` back into the trainer's model flags, refusing
what does not map:

* ``GPT2LMHeadModel``: learned absolute positions, LayerNorm, GeLU, biases, tied embeddings,
  one key/value head per query head, head dim = hidden / heads. The GeLU is the exact (erf)
  one, ``activation_function`` "gelu", or with ``--openai-gelu`` its tanh approximation,
  "gelu_new" (OpenAI's GPT-2 and transformers' default) or a name transformers gives the same
  formula (:data:`TANH_GELUS`);
* ``LlamaForCausalLM``: RoPE over the whole head (megatron-core's non-interleaved rotation is
  transformers' ``rotate_half``), RMSNorm, SwiGLU, no biases; tied or untied embeddings,
  grouped-query attention and any head dim.

Tensors are megatron-core's full (unsharded) ones, one per layer (``decoder.layers.{i}.*``,
as ``GPTModel.state_dict()`` names them; :func:`unstack` splits the stacked tensors of a
torch_dist checkpoint). :data:`RULES` pairs each megatron-core tensor with its Hugging Face
tensors and the two reshapes, one the inverse of the other, so an import followed by an
export gives back the same tensors bit for bit.

The vocabulary: megatron pads the embedding and the output layer to a multiple of
``--make-vocab-size-divisible-by`` x TP rows (:func:`~megatron.sdp4bit.training.tokenizers.
padded_vocab_size`); the import appends zero rows up to that size and the export cuts them
off again, down to the tokenizer's size the manifest records (:func:`pad_vocab`,
:func:`trim_vocab`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


class MappingError(ValueError):
    """What stops an import or an export; one line with the reason."""


ExportError = MappingError


# Settings a manifest written before the Llama export lacks, with the trainer's defaults,
# and those each architecture reads.
# (openai_gelu: the trainer refused --openai-gelu before it recorded it, so False is what such
# a run had, not a guess.)
LATER_DEFAULTS = {"norm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0,
                  "openai_gelu": False}
READS = {"GPT2LMHeadModel": ("norm_epsilon",),
         "LlamaForCausalLM": ("norm_epsilon", "rotary_base", "rotary_percent")}

# transformers' activation_function names for 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
# (--openai-gelu): the same formula, evaluated in slightly different orders (within a float32
# rounding of each other). "gelu_new" is GPT-2's default and what the export writes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate")


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


def _eod(vocab: int) -> int | None:
    # GPT-2's <|endoftext|>, when the vocabulary is GPT-2's
    return 50256 if vocab > 50256 else None


def hf_config(model: dict, vocab_size: int | None = None) -> dict:
    """``config.json`` for the settings (fp32 weights, dropout off); ``vocab_size``: the
    tokenizer's (unpadded) size, default the padded one."""
    name = architecture(model)
    vocab = vocab_size or model["padded_vocab_size"]
    heads, hidden, eod = model["num_attention_heads"], model["hidden_size"], _eod(vocab)
    common = {"architectures": [name], "vocab_size": vocab,
              "torch_dtype": "float32", "bos_token_id": eod, "eos_token_id": eod}
    if name == "GPT2LMHeadModel":
        return {**common, "model_type": "gpt2", "n_positions": model["max_position_embeddings"],
                "n_embd": hidden, "n_layer": model["num_layers"], "n_head": heads,
                "n_inner": model["ffn_hidden_size"],
                # megatron-core's GeLU is the exact (erf) one; --openai-gelu the tanh one
                "activation_function": "gelu_new" if model["openai_gelu"] else "gelu",
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




# ---- the tensors, both directions ------------------------------------------------------

L = "decoder.layers."
WORD, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor <-> its Hugging Face tensor(s). ``{i}`` in the names is the
    layer; ``to_hf(tensor, model)`` gives the HF tensors in ``hf``'s order and
    ``from_hf(tensors, model)`` puts them back together (its exact inverse)."""

    megatron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor, dict], tuple[torch.Tensor, ...]] = lambda t, m: (t,)
    from_hf: Callable[[tuple[torch.Tensor, ...], dict], torch.Tensor] = lambda ts, m: ts[0]
    when: Callable[[dict], bool] = lambda m: True  # the settings that have this tensor


def _gpt2_qkv_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # megatron's fused QKV rows are [q, k, v] per head (a query group of one head); GPT-2's
    # columns are all q, all k, all v. Conv1D stores weights as (in, out): transposed.
    heads, hidden = m["num_attention_heads"], m["hidden_size"]
    if w.dim() == 2:
        return (w.view(heads, 3, hidden // heads, hidden).transpose(0, 1)
                .reshape(3 * hidden, hidden).t(),)
    return (w.view(heads, 3, hidden // heads).transpose(0, 1).reshape(3 * hidden),)


def _gpt2_qkv_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
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


def _llama_qkv_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # megatron-core's fused QKV rows, per query group: its per_group query heads, then its
    # key head, then its value head, each head_dim rows. Query head j of group g is head
    # g * per_group + j, which uses key/value head g, as in transformers' repeat_kv.
    heads, hidden, groups, head_dim = (m["num_attention_heads"], m["hidden_size"],
                                       _kv_heads(m), _head_dim(m))
    per_group = heads // groups
    qkv = w.view(groups, per_group + 2, head_dim, hidden)
    return (qkv[:, :per_group].reshape(heads * head_dim, hidden),
            qkv[:, per_group].reshape(groups * head_dim, hidden),
            qkv[:, per_group + 1].reshape(groups * head_dim, hidden))


def _llama_qkv_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
    q, k, v = ts
    heads, hidden, groups, head_dim = (m["num_attention_heads"], m["hidden_size"],
                                       _kv_heads(m), _head_dim(m))
    per_group = heads // groups
    return torch.cat([q.reshape(groups, per_group, head_dim, hidden),
                      k.reshape(groups, 1, head_dim, hidden),
                      v.reshape(groups, 1, head_dim, hidden)], dim=1).reshape(-1, hidden)


def _swiglu_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # SwiGLU: megatron-core computes silu(first half of fc1) * second half: [gate; up].
    ffn = m["ffn_hidden_size"]
    return w[:ffn], w[ffn:]


H, LL = "transformer.h.{i}.", "model.layers.{i}."
CONV1D = (_conv1d_to_hf, _conv1d_from_hf)
RULES: dict[str, list[Rule]] = {
    "GPT2LMHeadModel": [
        Rule(WORD, ("transformer.wte.weight",)),
        Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
        Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
        Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
        Rule(L + "{i}.self_attention.linear_qkv.weight", (H + "attn.c_attn.weight",),
             _gpt2_qkv_to_hf, _gpt2_qkv_from_hf),
        Rule(L + "{i}.self_attention.linear_qkv.bias", (H + "attn.c_attn.bias",),
             _gpt2_qkv_to_hf, _gpt2_qkv_from_hf),
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
    ],
    "LlamaForCausalLM": [
        Rule(WORD, ("model.embed_tokens.weight",)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
        Rule(OUTPUT, ("lm_head.weight",),
             when=lambda m: m["untie_embeddings_and_output_weights"]),
        Rule(L + "{i}.self_attention.linear_qkv.weight",
             tuple(LL + f"self_attn.{x}_proj.weight" for x in "qkv"),
             _llama_qkv_to_hf, _llama_qkv_from_hf),
        Rule(L + "{i}.self_attention.linear_proj.weight", (LL + "self_attn.o_proj.weight",)),
        Rule(L + "{i}.self_attention.linear_qkv.layer_norm_weight",
             (LL + "input_layernorm.weight",)),
        Rule(L + "{i}.mlp.linear_fc1.layer_norm_weight",
             (LL + "post_attention_layernorm.weight",)),
        Rule(L + "{i}.mlp.linear_fc1.weight", (LL + "mlp.gate_proj.weight",
                                               LL + "mlp.up_proj.weight"),
             _swiglu_to_hf, lambda ts, m: torch.cat(ts)),
        Rule(L + "{i}.mlp.linear_fc2.weight", (LL + "mlp.down_proj.weight",)),
    ],
}


def _expand(name: str, model: dict) -> list[tuple[str, dict]]:
    if "{i}" not in name:
        return [(name, {})]
    return [(name.format(i=i), {"i": i}) for i in range(model["num_layers"])]


def to_hf(name: str, tensors: Tensors, model: dict) -> Tensors:
    """megatron-core tensors (one per layer) -> the architecture's Hugging Face tensors."""
    out: Tensors = {}
    for rule in RULES[name]:
        if not rule.when(model):
            continue
        for key, fmt in _expand(rule.megatron, model):
            parts = rule.to_hf(tensors[key], model)
            out.update({h.format(**fmt): p.contiguous() for h, p in zip(rule.hf, parts)})
    return out


def from_hf(name: str, tensors: Tensors, model: dict) -> Tensors:
    """The architecture's Hugging Face tensors -> megatron-core's (one per layer). Refuses in
    one line naming the tensors that are missing or left over."""
    out: Tensors = {}
    missing, used = [], set()
    for rule in RULES[name]:
        if not rule.when(model):
            continue
        for key, fmt in _expand(rule.megatron, model):
            names = [h.format(**fmt) for h in rule.hf]
            lacking = [n for n in names if n not in tensors]
            used.update(n for n in names if n in tensors)
            if lacking:
                missing += lacking
                continue
            out[key] = rule.from_hf(tuple(tensors[n] for n in names), model).contiguous()
    extra = sorted(set(tensors) - used)
    if missing or extra:
        raise MappingError(f"the {name} weights do not match its config.json: "
                           + "; ".join(part for part in (
                               f"missing {', '.join(missing[:6])}" if missing else "",
                               f"not part of the model {', '.join(extra[:6])}" if extra else "")
                               if part))
    return out


def unstack(stacked: Tensors, model: dict) -> Tensors:
    """A torch_dist checkpoint's tensors (the layers stacked on dim 0) -> one per layer."""
    out: Tensors = {}
    for key, value in stacked.items():
        if key.startswith(L):
            for i in range(model["num_layers"]):
                out[f"{L}{i}.{key[len(L):]}"] = value[i]
        else:
            out[key] = value
    return out


def gpt2_state(stacked: Tensors, model: dict) -> Tensors:
    """A torch_dist checkpoint's tensors -> GPT2LMHeadModel's."""
    return to_hf("GPT2LMHeadModel", unstack(stacked, model), model)


def llama_state(stacked: Tensors, model: dict) -> Tensors:
    """A torch_dist checkpoint's tensors -> LlamaForCausalLM's."""
    return to_hf("LlamaForCausalLM", unstack(stacked, model), model)


STATES = {"GPT2LMHeadModel": gpt2_state, "LlamaForCausalLM": llama_state}


def pad_vocab(tensors: Tensors, padded: int) -> Tensors:
    """Append zero rows to the embedding (and untied output layer) up to ``padded`` rows."""
    out = dict(tensors)
    for key in (WORD, OUTPUT):
        if key in out and out[key].shape[0] < padded:
            w = out[key]
            out[key] = torch.cat([w, w.new_zeros(padded - w.shape[0], *w.shape[1:])])
    return out


def trim_vocab(tensors: Tensors, size: int) -> Tensors:
    """Cut the embedding (and untied output layer) back to the tokenizer's ``size`` rows."""
    return {k: v[:size] if k in (WORD, OUTPUT) else v for k, v in tensors.items()}


# ---- config.json -> the trainer's flags ---------------------------------------------------

def _rope(config) -> tuple[str, float]:
    """(RoPE type, theta) of a transformers config: transformers 5 keeps them in
    ``rope_parameters``, 4 in ``rope_theta`` and ``rope_scaling``."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    return kind, float(theta)


def _need(wrong: list[str], config, field: str, accepted, why: str = "") -> None:
    value = getattr(config, field, accepted[0])
    if value not in accepted:
        wrong.append(f"{field} {value!r} (needs {' or '.join(map(repr, accepted))}{why})")


def trainer_flags(config) -> tuple[str, list[str], int]:
    """A transformers config -> (architecture, ``pretrain_gpt.py`` model flags, the
    vocabulary size). Refuses, naming every setting that does not map."""
    archs = list(getattr(config, "architectures", None) or [])
    name = archs[0] if len(archs) == 1 else None
    if name not in RULES:
        raise MappingError(f"architecture {archs or config.model_type!r} is not imported: "
                           f"only {' and '.join(RULES)}")
    wrong: list[str] = []
    f = lambda *a: [str(x) for x in a]  # noqa: E731
    if name == "GPT2LMHeadModel":
        hidden, heads = config.n_embd, config.n_head
        # transformers' GPT2Config defaults to the tanh approximation
        act = getattr(config, "activation_function", "gelu_new")
        if act not in ("gelu",) + TANH_GELUS:
            wrong.append(f"activation_function {act!r} (needs 'gelu', the exact GeLU, or the "
                         f"tanh approximation {', '.join(map(repr, TANH_GELUS))}, "
                         "--openai-gelu)")
        _need(wrong, config, "tie_word_embeddings", [True])
        _need(wrong, config, "scale_attn_weights", [True])
        _need(wrong, config, "scale_attn_by_inverse_layer_idx", [False])
        _need(wrong, config, "add_cross_attention", [False])
        flags = f("--num-layers", config.n_layer, "--hidden-size", hidden,
                  "--ffn-hidden-size", config.n_inner or 4 * hidden,
                  "--num-attention-heads", heads, "--seq-length", config.n_positions,
                  "--max-position-embeddings", config.n_positions,
                  "--position-embedding-type", "learned_absolute", "--normalization",
                  "LayerNorm", "--norm-epsilon", repr(float(config.layer_norm_epsilon)))
        if act in TANH_GELUS:
            flags.append("--openai-gelu")
    else:
        hidden, heads = config.hidden_size, config.num_attention_heads
        groups = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kind, theta = _rope(config)
        if kind != "default":
            wrong.append(f"rope type {kind!r} (needs 'default': megatron-core's RoPE here has "
                         "no scaling)")
        partial = getattr(config, "partial_rotary_factor", 1.0)
        if partial != 1.0:
            wrong.append(f"partial_rotary_factor {partial!r} (needs 1.0)")
        _need(wrong, config, "hidden_act", ["silu"])
        _need(wrong, config, "attention_bias", [False])
        _need(wrong, config, "mlp_bias", [False])
        _need(wrong, config, "pretraining_tp", [1])
        flags = f("--num-layers", config.num_hidden_layers, "--hidden-size", hidden,
                  "--ffn-hidden-size", config.intermediate_size,
                  "--num-attention-heads", heads)
        if head_dim != hidden // heads:
            flags += f("--kv-channels", head_dim)
        if groups != heads:
            flags += f("--group-query-attention", "--num-query-groups", groups)
        if theta != int(theta):
            wrong.append(f"rope_theta {theta!r} (needs an integer: --rotary-base takes one)")
        flags += f("--seq-length", config.max_position_embeddings,
                   "--max-position-embeddings", config.max_position_embeddings,
                   "--position-embedding-type", "rope", "--rotary-base", int(theta),
                   "--normalization", "RMSNorm", "--norm-epsilon",
                   repr(float(config.rms_norm_eps)), "--swiglu", "--disable-bias-linear")
        if not config.tie_word_embeddings:
            flags.append("--untie-embeddings-and-output-weights")
    if wrong:
        raise MappingError(f"the {name} in config.json does not map to this trainer's model: "
                           + ", ".join(wrong))
    return name, flags, int(config.vocab_size)
