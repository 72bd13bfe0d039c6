"""Argument checks of the compiled backends (Triton kernels and CPU kernels), in one place.

The compiled operations read and write raw memory, so they check more than the torch
references do: contiguity, 4-byte alignment of wire buffers (they hold fp32 scales), one
device, whole groups per message, Hadamard blocks inside groups and chunks. Each
``*_sizes`` function checks the arguments of one operation of :mod:`.reference` and returns
the sizes the kernels need; a bad argument raises ``ValueError`` naming the fix, whichever
backend runs.
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization.hadamard import check_hadamard_block

STREAM_LIMIT = 1 << 32


def check_stream(stochastic: bool, numel: int) -> None:
    if stochastic and numel > STREAM_LIMIT:
        raise ValueError(f"random-stream indices [0, {numel}) exceed 2**32")


def check_wire(wire: torch.Tensor, name: str, count: int, numel: int, bits: int,
               group_size: int) -> None:
    """``wire`` must hold ``count`` messages (as :func:`.format.split_messages` checks) and be
    4-byte aligned and contiguous: the kernels store fp32 scales through its uint8 pointer."""
    if wire.dtype != torch.uint8 or wire.dim() != 1 or not wire.is_contiguous():
        raise ValueError(f"{name} must be a contiguous 1D uint8 buffer, got "
                         f"{tuple(wire.shape)} {wire.dtype}")
    if wire.data_ptr() % 4:
        raise ValueError(f"{name} must start at a 4-byte aligned address (it holds fp32 "
                         "scales): allocate it whole or slice it at a multiple of 4 bytes")
    if numel:
        fmt.split_messages(wire, count, numel, bits, group_size)


def check_output(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous: the kernels write it in place")


def check_same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors on different devices: {sorted(map(str, devices))}")


def check_hadamard(hadamard_block: int, group_size: int, chunk: int | None = None) -> None:
    """The kernels transform blocks inside one group: ``group_size`` must be a multiple of
    the block, and so must a tlq_sender chunk (blocks are contiguous input)."""
    check_hadamard_block(hadamard_block)
    if group_size % hadamard_block:
        raise ValueError(f"group_size={group_size} is not a multiple of "
                         f"hadamard_block={hadamard_block}")
    if chunk is not None and chunk % hadamard_block:
        raise ValueError(f"each destination chunk holds {chunk} elements, not a multiple of "
                         f"hadamard_block={hadamard_block}: pad the buffer")


def check_group_nesting(group_size_in: int, group_size_out: int) -> None:
    """Between the hops one group size must divide the other, so that an output group reads
    either one input scale or whole input groups (the same rule on every backend)."""
    if group_size_in % group_size_out and group_size_out % group_size_in:
        raise ValueError(f"group_size_in={group_size_in} and group_size_out={group_size_out} "
                         "must divide one another")


def qwd_sender_sizes(main_shard: torch.Tensor, replica_shard: torch.Tensor | None,
                     out: torch.Tensor, *, bits: int, group_size: int,
                     stochastic: bool) -> int:
    """Checks of :func:`.reference.qwd_sender`; returns ``numel``."""
    numel = main_shard.numel()
    fmt.check_message_shape(numel, bits, group_size)
    check_wire(out, "out", 1, numel, bits, group_size)
    if replica_shard is not None:
        if replica_shard.numel() != numel:
            raise ValueError(f"replica_shard has {replica_shard.numel()} elements, "
                             f"main_shard {numel}: they must be the same shard")
        check_same_device(main_shard, replica_shard, out)
    else:
        check_same_device(main_shard, out)
    check_stream(stochastic, numel)
    return numel


def qwd_receiver_sizes(wire: torch.Tensor, replica: torch.Tensor, *, world: int, bits: int,
                       group_size: int) -> int:
    """Checks of :func:`.reference.qwd_receiver`; returns the shard size."""
    if world < 1 or replica.numel() % world:
        raise ValueError(f"replica of {replica.numel()} elements does not split into "
                         f"world={world} equal shards")
    shard = replica.numel() // world
    fmt.check_message_shape(shard, bits, group_size)
    check_wire(wire, "wire", world, shard, bits, group_size)
    check_output(replica, "replica")
    check_same_device(wire, replica)
    return shard


def tlq_sender_sizes(inp: torch.Tensor, out: torch.Tensor, *, num_dests: int,
                     blocks_per_dest: int, slices: int, bits: int, group_size: int,
                     hadamard_block: int, stochastic: bool) -> tuple[int, int]:
    """Checks of :func:`.reference.tlq_sender`; returns ``(chunk, message numel)``."""
    count = num_dests * blocks_per_dest * slices
    if min(num_dests, blocks_per_dest, slices) < 1 or inp.numel() % count:
        raise ValueError(f"input of {inp.numel()} elements does not split into "
                         f"blocks_per_dest={blocks_per_dest} x num_dests={num_dests} x "
                         f"slices={slices} equal chunks")
    chunk = inp.numel() // count
    msg_numel = blocks_per_dest * chunk
    fmt.check_message_shape(msg_numel, bits, group_size)
    check_wire(out, "out", slices * num_dests, msg_numel, bits, group_size)
    check_same_device(inp, out)
    if hadamard_block:
        check_hadamard(hadamard_block, group_size, chunk)
    check_stream(stochastic, inp.numel())
    return chunk, msg_numel


def tlq_middle_sizes(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, numel: int,
                     bits_in: int, group_size_in: int, n_out: int, bits_out: int,
                     group_size_out: int, stochastic: bool) -> int:
    """Checks of :func:`.reference.tlq_middle`; returns the numel of an output message."""
    if n_in < 1 or n_out < 1 or numel % n_out:
        raise ValueError(f"numel={numel} must split into n_out={n_out} equal messages and "
                         f"n_in={n_in} must be positive")
    out_numel = numel // n_out
    fmt.check_message_shape(numel, bits_in, group_size_in)
    fmt.check_message_shape(out_numel, bits_out, group_size_out)
    check_wire(wire_in, "wire_in", n_in, numel, bits_in, group_size_in)
    check_wire(out, "out", n_out, out_numel, bits_out, group_size_out)
    check_same_device(wire_in, out)
    check_group_nesting(group_size_in, group_size_out)
    check_stream(stochastic, numel)
    return out_numel


def tlq_receiver_sizes(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                       group_size: int, hadamard_block: int) -> int:
    """Checks of :func:`.reference.tlq_receiver`; returns ``out.numel()``."""
    numel = out.numel()
    if n_in < 1:
        raise ValueError(f"n_in={n_in} must be positive")
    fmt.check_message_shape(numel, bits, group_size)
    check_wire(wire_in, "wire_in", n_in, numel, bits, group_size)
    check_output(out, "out")
    check_same_device(wire_in, out)
    if hadamard_block:
        check_hadamard(hadamard_block, group_size)
    return numel
