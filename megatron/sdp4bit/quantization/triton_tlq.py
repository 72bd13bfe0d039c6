"""Fused Triton kernels of the two-level gradient reduce-scatter (see :mod:`.reference`).

Each program owns ``R`` output groups. ``tlq_sender`` gathers them from the input in
destination order, applies the Hadamard transform in registers and writes the messages;
``tlq_middle`` and ``tlq_receiver`` decode the same group of every incoming message, sum in
fp32 in message order (as ``torch.sum`` over a handful of rows does), then requantize or
transform back and write the shard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.sdp4bit.quantization import checks
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import triton_common as tc
from megatron.sdp4bit.quantization.hadamard import block_scale


@triton.jit
def _source_index(o, msg_numel, chunk, num_dests, slices):
    """Input index of output element ``o``: output message ``p * D + d`` holds the chunks
    ``inp[b, d, p, :]`` for b = 0..B-1 (input viewed as [B, D, P, chunk])."""
    msg = o // msg_numel
    r = o - msg * msg_numel
    b = r // chunk
    j = r - b * chunk
    p = msg // num_dests
    d = msg - p * num_dests
    return ((b * num_dests + d) * slices + p) * chunk + j


@triton.jit(do_not_specialize=["k0", "k1"])
def _tlq_sender_kernel(inp_ptr, out_ptr, h_scale, ngroups, msg_numel, chunk, num_dests, slices,
                       msg_nbytes, k0, k1,
                       G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                       BITS: tl.constexpr, QMAX: tl.constexpr, HB: tl.constexpr, LOG2_HB: tl.constexpr,
                       CHUNK_ALIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # output group [R]
    t = tl.arange(0, GP)
    row_valid = g < ngroups
    start = g * G
    o = start[:, None] + t[None, :]  # output index = random-stream index
    mask = row_valid[:, None] & (t < G)[None, :]
    if CHUNK_ALIGNED:
        # Chunks hold whole groups: one index computation per row, contiguous loads.
        src = _source_index(start, msg_numel, chunk, num_dests, slices)[:, None] + t[None, :]
    else:
        src = _source_index(o, msg_numel, chunk, num_dests, slices)
    x = tl.load(inp_ptr + src, mask=mask, other=0.0).to(tl.float32)
    if HB > 0:
        x = tc.hadamard_tile(x, h_scale, HB, LOG2_HB)
    codes, scale = tc.quantize_tile(x, o, k0, k1, QMAX, STOCHASTIC)
    msg = start // msg_numel
    groups_per_msg = msg_numel // G
    gl = (start - msg * msg_numel) // G
    tc.store_groups(out_ptr, msg, gl, row_valid, codes, scale, msg_nbytes, groups_per_msg,
                    G, GP, BITS)


@triton.jit
def _dequantize_message(wire_ptr, k, msg_nbytes, groups_per_msg, start, row_valid,
                        G_MSG: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                        TILE_G: tl.constexpr, TILE_GP: tl.constexpr):
    """fp32 values ``start[r] + 0..TILE_G-1`` of message ``k`` (groups of ``G_MSG``).

    ``k`` is a loop counter (int32): the message's byte offset is formed in int64
    (triton_common's [Note: 64-bit offsets])."""
    base = tl.cast(k, tl.int64) * msg_nbytes
    scale_ptr = wire_ptr.to(tl.pointer_type(tl.float32)) + base // 4
    if TILE_G <= G_MSG:
        # G_MSG is a multiple of TILE_G: a row lies inside one message group.
        scale = tl.load(scale_ptr + start // G_MSG, mask=row_valid, other=0.0)[:, None]
    else:
        t = tl.arange(0, TILE_GP)
        mask = row_valid[:, None] & (t < TILE_G)[None, :]
        scale = tl.load(scale_ptr + (start[:, None] + t[None, :]) // G_MSG, mask=mask,
                        other=0.0)
    codes = tc.load_codes(wire_ptr, base + 4 * tl.cast(groups_per_msg, tl.int64), start,
                          row_valid, TILE_G, TILE_GP, BITS)
    return tc.dequantize_tile(codes, scale, QMAX)


@triton.jit
def _dequantize_sum(wire_ptr, n_in, msg_nbytes, groups_per_msg, start, row_valid,
                    G_MSG: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                    TILE_G: tl.constexpr, TILE_GP: tl.constexpr):
    """fp32 sum over the ``n_in`` messages, in message order, of the tile's elements.

    Starts from +0 as torch.sum does (so that -0 + +0 = +0 matches bit for bit)."""
    acc = 0.0 + _dequantize_message(wire_ptr, 0, msg_nbytes, groups_per_msg, start, row_valid,
                              G_MSG, BITS, QMAX, TILE_G, TILE_GP)
    for k in range(1, n_in):
        acc = acc + _dequantize_message(wire_ptr, k, msg_nbytes, groups_per_msg, start,
                                        row_valid, G_MSG, BITS, QMAX, TILE_G, TILE_GP)
    return acc


@triton.jit(do_not_specialize=["k0", "k1"])
def _tlq_middle_kernel(wire_ptr, out_ptr, n_in, in_nbytes, in_groups, ngroups, out_numel,
                       out_nbytes, k0, k1,
                       G_IN: tl.constexpr, BITS_IN: tl.constexpr, QMAX_IN: tl.constexpr,
                       G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                       BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # output group [R]
    t = tl.arange(0, GP)
    row_valid = g < ngroups
    start = g * G  # index in the summed vector = output index = random-stream index
    total = _dequantize_sum(wire_ptr, n_in, in_nbytes, in_groups, start, row_valid,
                            G_IN, BITS_IN, QMAX_IN, G, GP)
    if GP != G:
        # A group that is not a power of two: the padding lanes decoded code 0 as -(QMAX+1)
        # x scale; zero them, or they would enter the group's absmax.
        total = tl.where((t < G)[None, :], total, 0.0)
    codes, scale = tc.quantize_tile(total, start[:, None] + t[None, :], k0, k1, QMAX,
                                    STOCHASTIC)
    msg = start // out_numel
    gl = (start - msg * out_numel) // G
    tc.store_groups(out_ptr, msg, gl, row_valid, codes, scale, out_nbytes, out_numel // G,
                    G, GP, BITS)


@triton.jit
def _tlq_receiver_kernel(wire_ptr, out_ptr, h_scale, n_in, msg_nbytes, ngroups, scale_by,
                         G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                         BITS: tl.constexpr, QMAX: tl.constexpr, HB: tl.constexpr, LOG2_HB: tl.constexpr,
                         APPLY_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    t = tl.arange(0, GP)
    row_valid = g < ngroups
    start = g * G
    total = _dequantize_sum(wire_ptr, n_in, msg_nbytes, ngroups, start, row_valid,
                            G, BITS, QMAX, G, GP)
    if HB > 0:
        total = tc.hadamard_tile(total, h_scale, HB, LOG2_HB)
    if APPLY_SCALE:
        total = total * scale_by
    idx = start[:, None] + t[None, :]
    mask = row_valid[:, None] & (t < G)[None, :]
    if ACCUMULATE:
        total = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) + total
    tl.store(out_ptr + idx, tc.cast_for_store(total, out_ptr), mask=mask)


def _hadamard_args(hadamard_block: int) -> dict:
    """The kernel arguments of the transform (HB == 0 compiles it out)."""
    return dict(h_scale=block_scale(hadamard_block) if hadamard_block else 1.0,
                HB=hadamard_block, LOG2_HB=max(hadamard_block, 1).bit_length() - 1)


def tlq_sender(inp: torch.Tensor, out: torch.Tensor, *, num_dests: int, blocks_per_dest: int,
               slices: int, bits: int, group_size: int, hadamard_block: int,
               stochastic: bool, seed: int) -> None:
    """Triton version of :func:`..reference.tlq_sender` (same arguments and bytes)."""
    chunk, msg_numel = checks.tlq_sender_sizes(
        inp, out, num_dests=num_dests, blocks_per_dest=blocks_per_dest, slices=slices,
        bits=bits, group_size=group_size, hadamard_block=hadamard_block, stochastic=stochastic)
    ngroups = inp.numel() // group_size
    if ngroups == 0:
        return
    flat = inp.reshape(-1).contiguous()
    rows, gp = tc.tile_rows(group_size)
    k0, k1 = tc.seed_words(seed)
    _tlq_sender_kernel[(triton.cdiv(ngroups, rows),)](
        flat, out, ngroups=ngroups, msg_numel=msg_numel, chunk=chunk, num_dests=num_dests,
        slices=slices, msg_nbytes=fmt.message_nbytes(msg_numel, bits, group_size), k0=k0, k1=k1,
        G=group_size, GP=gp, R=rows, BITS=bits, QMAX=fmt.qmax(bits),
        **_hadamard_args(hadamard_block),
        CHUNK_ALIGNED=chunk % group_size == 0, STOCHASTIC=stochastic,
        num_warps=tc.num_warps(rows, gp), **tc.LAUNCH_OPTIONS)


def tlq_middle(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, numel: int,
               bits_in: int, group_size_in: int, n_out: int, bits_out: int,
               group_size_out: int, stochastic: bool, seed: int) -> None:
    """Triton version of :func:`..reference.tlq_middle` (same arguments and bytes)."""
    out_numel = checks.tlq_middle_sizes(
        wire_in, out, n_in=n_in, numel=numel, bits_in=bits_in, group_size_in=group_size_in,
        n_out=n_out, bits_out=bits_out, group_size_out=group_size_out, stochastic=stochastic)
    ngroups = numel // group_size_out
    if ngroups == 0:
        return
    rows, gp = tc.tile_rows(group_size_out)
    k0, k1 = tc.seed_words(seed)
    _tlq_middle_kernel[(triton.cdiv(ngroups, rows),)](
        wire_in, out, n_in, fmt.message_nbytes(numel, bits_in, group_size_in),
        numel // group_size_in, ngroups, out_numel,
        fmt.message_nbytes(out_numel, bits_out, group_size_out), k0, k1,
        G_IN=group_size_in, BITS_IN=bits_in, QMAX_IN=fmt.qmax(bits_in),
        G=group_size_out, GP=gp, R=rows, BITS=bits_out, QMAX=fmt.qmax(bits_out),
        STOCHASTIC=stochastic, num_warps=tc.num_warps(rows, gp), **tc.LAUNCH_OPTIONS)


def tlq_receiver(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                 group_size: int, hadamard_block: int, scale: float = 1.0,
                 accumulate: bool = False) -> None:
    """Triton version of :func:`..reference.tlq_receiver` (same arguments and bytes)."""
    numel = checks.tlq_receiver_sizes(wire_in, out, n_in=n_in, bits=bits,
                                      group_size=group_size, hadamard_block=hadamard_block)
    ngroups = numel // group_size
    if ngroups == 0:
        return
    rows, gp = tc.tile_rows(group_size)
    _tlq_receiver_kernel[(triton.cdiv(ngroups, rows),)](
        wire_in, out, n_in=n_in, msg_nbytes=fmt.message_nbytes(numel, bits, group_size),
        ngroups=ngroups, scale_by=float(scale), G=group_size, GP=gp, R=rows, BITS=bits,
        QMAX=fmt.qmax(bits), **_hadamard_args(hadamard_block),
        APPLY_SCALE=scale != 1.0, ACCUMULATE=accumulate, num_warps=tc.num_warps(rows, gp),
        **tc.LAUNCH_OPTIONS)
