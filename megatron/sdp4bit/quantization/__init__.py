"""Quantization core: group-wise 4/8-bit quantization, Hadamard smoothing, fused wire ops.

Public API (stable)::

    quantize(x, bits, group_size, *, hadamard_block=0, stochastic=True, seed=None)
    dequantize(q, dtype=torch.float32)
    QuantizedTensor      # .payload .scales .numel .bits .group_size .hadamard_block .wire_bytes
    hadamard_transform(x, block), inverse_hadamard_transform(x, block)
    KernelBackend        # AUTO / TORCH / TRITON

The fused operations used by the collectives are in :mod:`.ops`; the wire format in
:mod:`.format`; the torch references in :mod:`.reference`; the Triton kernels in
:mod:`.triton_kernels`.
"""

from megatron.sdp4bit.quantization.api import QuantizedTensor, dequantize, quantize
from megatron.sdp4bit.quantization.backend import KernelBackend
from megatron.sdp4bit.quantization.format import message_nbytes
from megatron.sdp4bit.quantization.hadamard import hadamard_transform, inverse_hadamard_transform
from megatron.sdp4bit.quantization.rng import derive_seed

__all__ = [
    "KernelBackend",
    "QuantizedTensor",
    "dequantize",
    "derive_seed",
    "hadamard_transform",
    "inverse_hadamard_transform",
    "message_nbytes",
    "quantize",
]
