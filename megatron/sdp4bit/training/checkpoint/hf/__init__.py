"""The trainer's model <-> Hugging Face architectures, one mapping read in both directions
(tools/checkpoint/export_hf.py writes with it, tools/checkpoint/import_hf.py reads with it).

:mod:`.registry` names the architectures (one adapter each: config check, config
translation both ways, tensor rules), :mod:`.gpt2` and :mod:`.llama` are their modules, and
:mod:`.tensors` applies the rules and pads or trims the vocabulary.
"""

from __future__ import annotations

from megatron.sdp4bit.training.checkpoint.hf.common import ExportError, MappingError
from megatron.sdp4bit.training.checkpoint.hf.gpt2 import TANH_GELUS
from megatron.sdp4bit.training.checkpoint.hf.registry import (
    READS, REGISTRY, Architecture, architecture, from_hf, hf_config, to_hf, trainer_flags,
    with_defaults)
from megatron.sdp4bit.training.checkpoint.hf.tensors import pad_vocab, trim_vocab, unstack

__all__ = ["READS", "REGISTRY", "TANH_GELUS", "Architecture", "ExportError", "MappingError",
           "architecture", "from_hf", "hf_config", "pad_vocab", "to_hf", "trainer_flags",
           "trim_vocab", "unstack", "with_defaults"]
