"""Public tensor-level API: ``quantize`` / ``dequantize`` and :class:`QuantizedTensor`.

Inputs of any shape and size are accepted: the flattened values are padded with zeros up to a
multiple of ``lcm(group_size, 32 / bits)`` (whole groups, and a payload that keeps the
4-byte alignment of the wire format); ``dequantize`` drops the padding and restores the shape. Both
go through the same fused operations as the collectives, so they run the Triton kernels on
CUDA tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.sdp4bit.config import check_bits
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.backend import KernelBackend
from megatron.sdp4bit.quantization.hadamard import check_hadamard_block


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized tensor as it travels: one uint8 buffer holding scales then payload."""

    data: torch.Tensor  # 1D uint8: [scales fp32 x ngroups][payload]
    numel: int  # elements of the original tensor (before padding)
    shape: torch.Size
    bits: int
    group_size: int
    hadamard_block: int  # 0 = no Hadamard transform

    @property
    def padded_numel(self) -> int:
        return _padded_numel(self.numel, self.group_size, self.bits)

    @property
    def scales(self) -> torch.Tensor:
        """1D fp32, one scale per group (NaN for a group that held NaN/Inf)."""
        return fmt.split_message(self.data, self.padded_numel, self.bits, self.group_size)[0]

    @property
    def payload(self) -> torch.Tensor:
        """1D uint8 packed codes (offset binary; the packing order of :mod:`.format`)."""
        return fmt.split_message(self.data, self.padded_numel, self.bits, self.group_size)[1]

    @property
    def wire_bytes(self) -> int:
        """Bytes that go on the wire: payload plus scales."""
        return self.data.numel()


def _padded_numel(numel: int, group_size: int, bits: int) -> int:
    unit = math.lcm(group_size, 32 // bits)
    return -(-numel // unit) * unit


def _check(bits: int, group_size: int, hadamard_block: int) -> None:
    check_bits("bits", bits)
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size={group_size} must be a positive even integer")
    if group_size * bits % 8:
        raise ValueError(f"group_size={group_size} must be a multiple of 4 at {bits} bits "
                         "(a group fills whole bytes: four codes per byte)")
    if hadamard_block:
        check_hadamard_block(hadamard_block)
        if group_size % hadamard_block:
            raise ValueError(f"group_size={group_size} is not a multiple of "
                             f"hadamard_block={hadamard_block}")


def quantize(x: torch.Tensor, bits: int, group_size: int, *, hadamard_block: int = 0,
             stochastic: bool = True, seed: int | None = None,
             backend: KernelBackend | str = KernelBackend.AUTO) -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (fp32, bf16 or fp16); see ``reference``.

    ``seed`` selects the stochastic-rounding stream (same seed, same bytes); ``None`` draws
    one from torch's default generator. ``hadamard_block`` > 0 transforms each block first.
    """
    _check(bits, group_size, hadamard_block)
    if not x.is_floating_point():
        raise ValueError(f"quantize expects a floating-point tensor, got {x.dtype}")
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    numel = x.numel()
    padded = _padded_numel(numel, group_size, bits)
    flat = x.reshape(-1)
    if padded != numel:
        flat = torch.cat([flat, flat.new_zeros(padded - numel)])
    data = torch.empty(fmt.message_nbytes(padded, bits, group_size), dtype=torch.uint8,
                       device=x.device)
    if padded:
        ops.tlq_sender(flat, data, num_dests=1, blocks_per_dest=1, slices=1, bits=bits,
                       group_size=group_size, hadamard_block=hadamard_block,
                       stochastic=stochastic, seed=seed, backend=backend)
    return QuantizedTensor(data, numel, x.shape, bits, group_size, hadamard_block)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32,
               backend: KernelBackend | str = KernelBackend.AUTO) -> torch.Tensor:
    """Values of ``q`` (inverse Hadamard applied) with the original shape, in ``dtype``."""
    out = torch.empty(q.padded_numel, dtype=torch.float32, device=q.data.device)
    if q.padded_numel:
        ops.tlq_receiver(q.data, out, n_in=1, bits=q.bits, group_size=q.group_size,
                         hadamard_block=q.hadamard_block, backend=backend)
    return out[: q.numel].view(q.shape).to(dtype)
