"""megatron-core's tensors <-> a Hugging Face architecture's, by a table of :class:`Rule`.

Tensors are megatron-core's full (unsharded) ones, one per layer (``decoder.layers.{i}.*``,
as ``GPTModel.state_dict()`` names them; :func:`unstack` splits the stacked tensors of a
torch_dist checkpoint). Each rule pairs a megatron-core tensor with its Hugging Face
tensors and the two reshapes, one the inverse of the other, so an import followed by an
export gives back the same tensors bit for bit.

The vocabulary: megatron pads the embedding and the output layer to a multiple of
``--make-vocab-size-divisible-by`` x TP rows (:func:`~megatron.sdp4bit.training.tokenizers.
padded_vocab_size`); the import appends zero rows up to that size and the export cuts them
off again, down to the tokenizer's size the manifest records (:func:`pad_vocab`,
:func:`trim_vocab`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron.sdp4bit.training.checkpoint.hf.common import MappingError

L = "decoder.layers."
WORD, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """One megatron-core tensor <-> its Hugging Face tensor(s). ``{i}`` in the names is the
    layer; ``{e}`` in a Hugging Face name makes one name per expert (``num_experts`` of the
    settings). ``to_hf(tensor, model)`` gives the HF tensors in the order of their names
    (:func:`hf_names`) and ``from_hf(tensors, model)`` puts them back together (its exact
    inverse)."""

    megatron: str
    hf: tuple[str, ...]
    to_hf: Callable[[torch.Tensor, dict], tuple[torch.Tensor, ...]] = lambda t, m: (t,)
    from_hf: Callable[[tuple[torch.Tensor, ...], dict], torch.Tensor] = lambda ts, m: ts[0]
    when: Callable[[dict], bool] = lambda m: True  # the settings that have this tensor


def _expand(name: str, model: dict) -> list[tuple[str, dict]]:
    if "{i}" not in name:
        return [(name, {})]
    return [(name.format(i=i), {"i": i}) for i in range(model["num_layers"])]


def hf_names(rule: Rule, fmt: dict, model: dict) -> list[str]:
    """The Hugging Face names of ``rule`` for one layer (``fmt``), each ``{e}`` name once per
    expert, in ``rule.hf``'s order."""
    names = []
    for h in rule.hf:
        experts = range(model["num_experts"]) if "{e}" in h else [None]
        names += [h.format(**fmt, **({} if e is None else {"e": e})) for e in experts]
    return names


def to_hf(rules: Sequence[Rule], tensors: Tensors, model: dict) -> Tensors:
    """megatron-core tensors (one per layer) -> the architecture's Hugging Face tensors.
    Refuses in one line a tensor the settings need that the checkpoint lacks (its manifest
    does not describe its model: an older trainer's MoE checkpoint records no experts)."""
    out: Tensors = {}
    for rule in rules:
        if not rule.when(model):
            continue
        for key, fmt in _expand(rule.megatron, model):
            if key not in tensors:
                module = key.rsplit(".", 2)[0] + "."  # e.g. decoder.layers.0.mlp.
                near = sorted(k for k in tensors if k.startswith(module))[:3]
                raise MappingError(f"the checkpoint holds no {key}, which its recorded model "
                                   f"settings need (it holds {', '.join(near) or 'none like it'})"
                                   ": its manifest does not describe its tensors")
            names = hf_names(rule, fmt, model)
            parts = rule.to_hf(tensors[key], model)
            assert len(parts) == len(names), (key, len(parts), len(names))
            out.update({h: p.contiguous() for h, p in zip(names, parts)})
    return out


def from_hf(name: str, rules: Sequence[Rule], tensors: Tensors, model: dict) -> Tensors:
    """The architecture's Hugging Face tensors -> megatron-core's (one per layer). Refuses in
    one line naming the tensors that are missing or left over."""
    out: Tensors = {}
    missing, used = [], set()
    for rule in rules:
        if not rule.when(model):
            continue
        for key, fmt in _expand(rule.megatron, model):
            names = hf_names(rule, fmt, model)
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
