"""megatron-core's local layer spec, with norms that support sequence parallelism.

With ``--sequence-parallel`` each tensor-parallel rank holds a slice of the sequence between
the tensor-parallel blocks, so the layer norms see different tokens on every TP rank and
their weight gradients are partial sums. megatron-core adds them up over the TP group in
``finalize_model_grads`` for every parameter marked ``sequence_parallel`` (Transformer
Engine's and Apex's norms mark theirs). The local spec's norm, ``WrappedTorchNorm``, builds
torch's ``LayerNorm`` / ``RMSNorm``, which mark nothing, and so asserts on sequence
parallelism. The norms here are torch's, marked: a layer norm is per token, so the forward
on a slice of the sequence is the same computation, and only the gradient sum is needed.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["SequenceParallelNorm", "local_layer_spec"]


def _mark(module: torch.nn.Module, sequence_parallel: bool) -> None:
    for param in module.parameters():
        param.sequence_parallel = sequence_parallel


class SequenceParallelNorm:
    """torch's ``LayerNorm`` or ``RMSNorm`` (``config.normalization``) with its weights
    marked ``sequence_parallel`` as ``config`` says; the constructor megatron-core's specs
    call for a norm."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                **_unused) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:  # the trainer's --normalization choices are the two above
            raise ValueError(f"normalization {config.normalization!r}: only LayerNorm and "
                             "RMSNorm are built here")
        _mark(norm, config.sequence_parallel)
        return norm


def local_layer_spec(config: TransformerConfig, normalization: str,
                     vp_stage: int | None = None, *,
                     qk_layernorm: bool = False) -> ModuleSpec | TransformerBlockSubmodules:
    """The local spec for ``GPTModel``; with sequence parallelism, the block of this
    pipeline stage's (and model chunk's) layers with :class:`SequenceParallelNorm` in place
    of every norm, the final one included."""
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    if not config.sequence_parallel:
        return spec
    layer = ModuleSpec(module=spec.module, params=spec.params, submodules=dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelNorm,
        pre_mlp_layernorm=SequenceParallelNorm))
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelNorm)
