"""The Hugging Face architectures the trainer's model maps to: one :class:`Architecture`
(an adapter: the config check, the config translation both ways, the tensor rules) per
architecture, each built from its own module beside this one.

:func:`architecture` picks the one the settings (the manifest's ``settings["model"]``) map
to, or refuses in one line naming, for each, what differs; :func:`hf_config` writes its
``config.json``; :func:`trainer_flags` reads a ``config.json`` back into the trainer's model
flags, refusing what does not map; :func:`to_hf` and :func:`from_hf` move the tensors.
``tools/checkpoint/export_hf.py`` and ``import_hf.py`` use nothing else. Adding an
architecture is one entry here plus its module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from megatron.sdp4bit.training.checkpoint import settings as settings_contract
from megatron.sdp4bit.training.checkpoint.hf import gpt2, llama, mixtral, tensors
from megatron.sdp4bit.training.checkpoint.hf.common import ExportError, MappingError
from megatron.sdp4bit.training.checkpoint.hf.tensors import WORD, Rule, Tensors


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture (``name``: its ``config.json`` ``architectures[0]``).

    ``mismatches(model)``: what keeps the trainer's model settings from being it (empty:
    nothing); ``config(model)``: its own ``config.json`` fields; ``flags(config)``: a
    transformers config -> (the trainer's model flags, what does not map); ``rules``: its
    tensors (:class:`~.tensors.Rule`); ``normalize(tensors)``: its weight files' names as
    ``save_pretrained`` writes them; ``reads``: the settings an older manifest may lack that
    its config reads."""

    name: str
    mismatches: Callable[[dict], list[str]]
    config: Callable[[dict], dict]
    flags: Callable[[object], tuple[list[str], list[str]]]
    rules: tuple[Rule, ...]
    normalize: Callable[[Tensors], Tensors]
    reads: tuple[str, ...]

    @property
    def embedding(self) -> str:
        """The Hugging Face name of the word embedding."""
        return next(r.hf[0] for r in self.rules if r.megatron == WORD)


def _entry(module) -> Architecture:
    return Architecture(module.NAME, module.mismatches, module.hf_config, module.trainer_flags,
                        module.RULES, module.normalize, module.READS)


REGISTRY: Mapping[str, Architecture] = MappingProxyType(
    {a.name: a for a in (_entry(gpt2), _entry(llama), _entry(mixtral))})
# What tools/checkpoint/import_hf.py reads (the rest are exported only).
IMPORTED = ("GPT2LMHeadModel", "LlamaForCausalLM")

# What a manifest written before a model setting was recorded is read as (the trainer's
# defaults then): the export writes a config from these.
LATER_DEFAULTS = {**settings_contract.LATER_MODEL_SETTINGS,
                  **settings_contract.LATER_MODEL_DEFAULTS}
READS = {name: a.reads for name, a in REGISTRY.items()}


def with_defaults(model: dict) -> tuple[dict, list[str]]:
    """(settings with the trainer's defaults for what an older manifest lacks, those keys)."""
    missing = [k for k in LATER_DEFAULTS if k not in model]
    return {**{k: LATER_DEFAULTS[k] for k in missing}, **model}, missing


def architecture(model: dict) -> str:
    """The architecture the settings map to; refuses naming every difference of each."""
    found = {name: a.mismatches(model) for name, a in REGISTRY.items()}
    for name, wrong in found.items():
        if not wrong:
            return name
    raise ExportError("the model does not map to a Hugging Face architecture this tool "
                      "writes: " + "; ".join(f"for {name}, " + ", ".join(wrong)
                                             for name, wrong in found.items()))


def hf_config(model: dict, vocab_size: int | None = None,
              special_ids: dict[str, int | None] | None = None) -> dict:
    """``config.json`` for the settings (fp32 weights, dropout off); ``vocab_size``: the
    tokenizer's (unpadded) size, default the padded one; ``special_ids``: its
    ``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` (default: none)."""
    name = architecture(model)
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
           **(special_ids or {})}
    return {"architectures": [name], "vocab_size": vocab_size or model["padded_vocab_size"],
            "torch_dtype": "float32", **ids, **REGISTRY[name].config(model)}


def trainer_flags(config) -> tuple[str, list[str], int]:
    """A transformers config -> (architecture, ``pretrain_gpt.py`` model flags, the
    vocabulary size). Refuses, naming every setting that does not map."""
    archs = list(getattr(config, "architectures", None) or [])
    name = archs[0] if len(archs) == 1 else None
    if name not in IMPORTED:
        raise MappingError(f"architecture {archs or config.model_type!r} is not imported: "
                           f"only {' and '.join(IMPORTED)}")
    flags, wrong = REGISTRY[name].flags(config)
    if wrong:
        raise MappingError(f"the {name} in config.json does not map to this trainer's model: "
                           + ", ".join(wrong))
    return name, flags, int(config.vocab_size)


def to_hf(name: str, state: Tensors, model: dict) -> Tensors:
    """megatron-core tensors (one per layer) -> the architecture's Hugging Face tensors."""
    return tensors.to_hf(REGISTRY[name].rules, state, model)


def from_hf(name: str, state: Tensors, model: dict) -> Tensors:
    """The architecture's Hugging Face tensors -> megatron-core's (one per layer). Refuses in
    one line naming the tensors that are missing or left over."""
    return tensors.from_hf(name, REGISTRY[name].rules, state, model)
