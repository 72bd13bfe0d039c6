"""megatron-core's local layer spec, with norms that support sequence parallelism and
zero-centred weights.

With ``--sequence-parallel`` each tensor-parallel rank holds a slice of the sequence between
the tensor-parallel blocks, so the layer norms see different tokens on every TP rank and
their weight gradients are partial sums. megatron-core adds them up over the TP group in
``finalize_model_grads`` for every parameter marked ``sequence_parallel`` (Transformer
Engine's and Apex's norms mark theirs). The local spec's norm, ``WrappedTorchNorm``, builds
torch's ``LayerNorm`` / ``RMSNorm``, which mark nothing, and so asserts on sequence
parallelism. It also asserts on ``layernorm_zero_centered_gamma`` (``--apply-layernorm-1p``),
which only Transformer Engine's and Apex's norms implement. The norms here
(:class:`LocalNorm`) are torch's, marked, and zero-centred on request: a layer norm is per
token, so the forward on a slice of the sequence is the same computation, and only the
gradient sum is needed.

[Note: zero-centred norms]
With ``layernorm_zero_centered_gamma`` a norm's weight ``g`` starts at 0 and the norm scales by
``1 + g`` (Transformer Engine's ``zero_centered_gamma``): weight decay then pulls the scale
towards 1 instead of 0. ``1 + g`` is formed in fp32 and the norm computed in fp32 (as
Transformer Engine computes it), then rounded once to the input's dtype: a bf16 ``1 + g``
would keep only 8 bits of ``g`` next to the 1.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["LocalNorm", "ZeroCenteredNorm", "local_layer_spec", "with_local_norms"]


def _megatron_norms() -> tuple[type, ...]:
    """The norm classes megatron-core's local specs use (Apex's only where it imports)."""
    norms: tuple[type, ...] = (WrappedTorchNorm,)
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    except ImportError:
        return norms
    return norms + (FusedLayerNorm,)


def _mark(module: torch.nn.Module, sequence_parallel: bool) -> None:
    for param in module.parameters():
        param.sequence_parallel = sequence_parallel


class ZeroCenteredNorm(torch.nn.Module):
    """``LayerNorm`` or ``RMSNorm`` scaling by ``1 + weight``, the weight starting at 0
    ([Note: zero-centred norms]); a ``LayerNorm``'s bias as torch's."""

    def __init__(self, normalization: str, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.rms = normalization == "RMSNorm"
        self.shape, self.eps = (hidden_size,), eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.bias = None if self.rms else torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight.float() + 1.0
        if self.rms:
            out = F.rms_norm(x.float(), self.shape, scale, self.eps)
        else:
            out = F.layer_norm(x.float(), self.shape, scale, self.bias.float(), self.eps)
        return out.to(x.dtype)


class LocalNorm:
    """torch's ``LayerNorm`` or ``RMSNorm`` (``config.normalization``), zero-centred with
    ``config.layernorm_zero_centered_gamma``, its weights marked ``sequence_parallel`` as
    ``config`` says; the constructor megatron-core's specs call for a norm."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                **_unused) -> torch.nn.Module:
        if config.normalization not in ("LayerNorm", "RMSNorm"):  # the trainer's choices
            raise ValueError(f"normalization {config.normalization!r}: only LayerNorm and "
                             "RMSNorm are built here")
        if config.layernorm_zero_centered_gamma:
            norm: torch.nn.Module = ZeroCenteredNorm(config.normalization, hidden_size, eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        _mark(norm, config.sequence_parallel)
        return norm


def with_local_norms(spec):
    """``spec`` (a ``ModuleSpec``, a block's submodules, or anything they hold) with every
    norm class of megatron-core's local specs replaced by :class:`LocalNorm`, at any depth
    (a layer's input and pre-MLP norms, the attention's q/k norms, a block's final norm)."""
    if isinstance(spec, type):
        return LocalNorm if issubclass(spec, _megatron_norms()) else spec
    if isinstance(spec, list):
        return [with_local_norms(item) for item in spec]
    if dataclasses.is_dataclass(spec):
        return dataclasses.replace(spec, **{
            f.name: with_local_norms(getattr(spec, f.name))
            for f in dataclasses.fields(spec) if f.init})
    return spec


def local_layer_spec(config: TransformerConfig, normalization: str,
                     vp_stage: int | None = None, *,
                     qk_layernorm: bool = False) -> ModuleSpec | TransformerBlockSubmodules:
    """The local spec for ``GPTModel``; with sequence parallelism or zero-centred norms, the
    block of this pipeline stage's (and model chunk's) layers with :class:`LocalNorm` in
    place of every norm, the final one included."""
    spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    if not (config.sequence_parallel or config.layernorm_zero_centered_gamma):
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[with_local_norms(spec)] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=LocalNorm)
