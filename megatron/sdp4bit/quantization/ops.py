"""The fused operations the collectives call, dispatched to Triton or the torch reference.

Each function has the signature of its reference in :mod:`.reference` (read there for the
exact semantics) plus ``backend``; see :class:`.backend.KernelBackend` for how it resolves.
The Triton versions live in :mod:`.triton_kernels`, the CPU ones in :mod:`.cpu_kernels`;
both are imported only when used.
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.quantization import reference
from megatron.sdp4bit.quantization.backend import KernelBackend, resolve_backend


def _impl(name: str, backend: KernelBackend | str, tensor: torch.Tensor):
    resolved = resolve_backend(backend, tensor)
    if resolved is KernelBackend.TRITON:
        from megatron.sdp4bit.quantization import triton_kernels

        return getattr(triton_kernels, name)
    if resolved is KernelBackend.CPU:
        from megatron.sdp4bit.quantization import cpu_kernels

        return getattr(cpu_kernels, name)
    return getattr(reference, name)


def qwd_sender(main_shard: torch.Tensor, replica_shard: torch.Tensor | None, out: torch.Tensor,
               *, bits: int, group_size: int, stochastic: bool, seed: int,
               backend: KernelBackend | str = KernelBackend.AUTO) -> None:
    _impl("qwd_sender", backend, main_shard)(
        main_shard, replica_shard, out, bits=bits, group_size=group_size,
        stochastic=stochastic, seed=seed)


def qwd_receiver(wire: torch.Tensor, replica: torch.Tensor, *, world: int, bits: int,
                 group_size: int, accumulate: bool = True,
                 backend: KernelBackend | str = KernelBackend.AUTO) -> None:
    _impl("qwd_receiver", backend, replica)(
        wire, replica, world=world, bits=bits, group_size=group_size, accumulate=accumulate)


def tlq_sender(inp: torch.Tensor, out: torch.Tensor, *, num_dests: int, blocks_per_dest: int,
               slices: int, bits: int, group_size: int, hadamard_block: int, stochastic: bool,
               seed: int, backend: KernelBackend | str = KernelBackend.AUTO) -> None:
    _impl("tlq_sender", backend, inp)(
        inp, out, num_dests=num_dests, blocks_per_dest=blocks_per_dest, slices=slices,
        bits=bits, group_size=group_size, hadamard_block=hadamard_block,
        stochastic=stochastic, seed=seed)


def tlq_middle(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, numel: int,
               bits_in: int, group_size_in: int, n_out: int, bits_out: int,
               group_size_out: int, stochastic: bool, seed: int,
               backend: KernelBackend | str = KernelBackend.AUTO) -> None:
    _impl("tlq_middle", backend, wire_in)(
        wire_in, out, n_in=n_in, numel=numel, bits_in=bits_in, group_size_in=group_size_in,
        n_out=n_out, bits_out=bits_out, group_size_out=group_size_out,
        stochastic=stochastic, seed=seed)


def tlq_receiver(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                 group_size: int, hadamard_block: int, scale: float = 1.0,
                 accumulate: bool = False,
                 backend: KernelBackend | str = KernelBackend.AUTO) -> None:
    _impl("tlq_receiver", backend, out)(
        wire_in, out, n_in=n_in, bits=bits, group_size=group_size,
        hadamard_block=hadamard_block, scale=scale, accumulate=accumulate)
