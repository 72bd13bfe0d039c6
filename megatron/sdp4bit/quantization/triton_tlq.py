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

# Messages _dequantize_sum decodes per iteration of its loop (the PTX budget test divides
# the loop's static counts by this, plus one for the remainder loop).
MESSAGES_PER_PASS = 4


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
                       msg_nbytes, tiles_per_chunk, k0, k1,
                       G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                       BITS: tl.constexpr, QMAX: tl.constexpr, LOG2_HB: tl.constexpr,
                       CHUNK_ALIGNED: tl.constexpr, STOCHASTIC: tl.constexpr):
    t = tl.arange(0, GP)
    r = tl.arange(0, R)
    if CHUNK_ALIGNED:
        # One program = R groups of one input chunk: where the chunk goes (message, block) is
        # resolved once per program with scalar arithmetic, and the tile is one contiguous run
        # of the input and of a message. Per-row values are a scalar plus r times a constant.
        pid = tl.program_id(0)
        c = pid // tiles_per_chunk  # input chunk, in [B, D, P] order
        p = c % slices
        d = (c // slices) % num_dests
        b = c // slices // num_dests
        tile = tl.cast(pid % tiles_per_chunk, tl.int64) * (R * G)  # offset in the chunk
        msg = tl.cast(p, tl.int64) * num_dests + d
        msg_offset = tl.cast(b, tl.int64) * chunk + tile  # first row inside the message
        row_valid = tile + r * G < chunk
        mask = row_valid[:, None] & (t < G)[None, :]
        src = tl.cast(c, tl.int64) * chunk + tile
        x = tl.load(inp_ptr + tc.row_offsets(src + r * G, GP, tc.VEC), mask=mask, other=0.0)
        start = msg * msg_numel + msg_offset + r * G  # output index = random-stream index
        gl = msg_offset // G + r  # group inside the message
    else:
        # Groups that span chunks (a chunk is not a whole number of groups): each element
        # finds its source on its own. Not the production layout (comm pads chunks to whole
        # groups), so its per-element 64-bit divisions are tolerated.
        g = tl.program_id(0).to(tl.int64) * R + r  # output group [R]
        row_valid = g < ngroups
        start = g * G
        msg = start // msg_numel
        mask = row_valid[:, None] & (t < G)[None, :]
        src = _source_index(start[:, None] + t[None, :], msg_numel, chunk, num_dests, slices)
        x = tl.load(inp_ptr + src, mask=mask, other=0.0)
        gl = (start - msg * msg_numel) // G
    x = x.to(tl.float32)
    if LOG2_HB > 0:
        x = tc.hadamard_tile(x, h_scale, LOG2_HB)
    codes, scale = tc.quantize_tile(x, start, k0, k1, QMAX, STOCHASTIC)
    base = msg * msg_nbytes
    payload = base + 4 * tl.cast(msg_numel // G, tl.int64)
    tc.store_groups(out_ptr, base // 4 + gl, payload + gl * (G * BITS // 8), row_valid, codes,
                    scale, G, GP, BITS)


@triton.jit
def _dequantize_message(wire_ptr, base, payload_offset, start, row_valid,
                        G_MSG: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                        TILE_G: tl.constexpr, TILE_GP: tl.constexpr):
    """fp32 values ``start[r] + 0..TILE_G-1`` of the message at byte ``base`` (int64) whose
    payload starts ``payload_offset`` bytes in (groups of ``G_MSG``)."""
    scale_ptr = wire_ptr.to(tl.pointer_type(tl.float32)) + base // 4
    if TILE_G <= G_MSG:
        # G_MSG is a multiple of TILE_G: a row lies inside one message group.
        scale = tl.load(scale_ptr + start // G_MSG, mask=row_valid, other=0.0)[:, None]
    else:
        t = tl.arange(0, TILE_GP)
        mask = row_valid[:, None] & (t < TILE_G)[None, :]
        scale = tl.load(scale_ptr + (start[:, None] + t[None, :]) // G_MSG, mask=mask,
                        other=0.0)
    codes = tc.load_codes(wire_ptr, base + payload_offset, start, row_valid, TILE_G, TILE_GP,
                          BITS)
    return tc.dequantize_tile(codes, scale, QMAX)


@triton.jit
def _dequantize_sum(wire_ptr, n_in, msg_nbytes, groups_per_msg, start, row_valid,
                    G_MSG: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                    TILE_G: tl.constexpr, TILE_GP: tl.constexpr):
    """fp32 sum over the ``n_in`` messages, in message order, of the values
    ``start[r] + 0..TILE_G-1`` (messages of groups of ``G_MSG``).

    Starts from +0 as torch.sum does (so that -0 + +0 = +0 matches bit for bit). Four
    messages per iteration (``MESSAGES_PER_PASS``), so that each thread has four messages'
    loads in flight; the additions stay in message order. ``k`` is a loop counter (int32): byte offsets are formed in int64
    (triton_common's [Note: 64-bit offsets])."""
    acc = tl.zeros([start.shape[0], TILE_GP], tl.float32)
    payload = 4 * tl.cast(groups_per_msg, tl.int64)
    step = tl.cast(msg_nbytes, tl.int64)
    n_main = n_in - n_in % 4
    for k in range(0, n_main, 4):
        base = tl.cast(k, tl.int64) * msg_nbytes
        v0 = _dequantize_message(wire_ptr, base, payload, start, row_valid,
                                 G_MSG, BITS, QMAX, TILE_G, TILE_GP)
        v1 = _dequantize_message(wire_ptr, base + step, payload, start, row_valid,
                                 G_MSG, BITS, QMAX, TILE_G, TILE_GP)
        v2 = _dequantize_message(wire_ptr, base + 2 * step, payload, start, row_valid,
                                 G_MSG, BITS, QMAX, TILE_G, TILE_GP)
        v3 = _dequantize_message(wire_ptr, base + 3 * step, payload, start, row_valid,
                                 G_MSG, BITS, QMAX, TILE_G, TILE_GP)
        acc = (((acc + v0) + v1) + v2) + v3
    for k in range(n_main, n_in):
        acc = acc + _dequantize_message(wire_ptr, tl.cast(k, tl.int64) * msg_nbytes, payload,
                                        start, row_valid, G_MSG, BITS, QMAX, TILE_G, TILE_GP)
    return acc


@triton.jit(do_not_specialize=["k0", "k1"])
def _tlq_middle_kernel(wire_ptr, out_ptr, n_in, in_nbytes, in_groups, out_numel,
                       out_nbytes, tiles_per_msg, k0, k1,
                       G_IN: tl.constexpr, BITS_IN: tl.constexpr, QMAX_IN: tl.constexpr,
                       G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                       BITS: tl.constexpr, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    # One program = R groups of one output message (scalar int32 division per program).
    pid = tl.program_id(0)
    msg = tl.cast(pid // tiles_per_msg, tl.int64)
    tile = tl.cast(pid % tiles_per_msg, tl.int64) * (R * G)  # offset in the message
    r = tl.arange(0, R)
    t = tl.arange(0, GP)
    row_valid = tile + r * G < out_numel
    start = msg * out_numel + tile + r * G  # index in the summed vector = stream index
    total = _dequantize_sum(wire_ptr, n_in, in_nbytes, in_groups, start, row_valid,
                            G_IN, BITS_IN, QMAX_IN, G, GP)
    if GP != G:
        # A group that is not a power of two: the padding lanes decoded code 0 as -(QMAX+1)
        # x scale; zero them, or they would enter the group's absmax.
        total = tl.where((t < G)[None, :], total, 0.0)
    codes, scale = tc.quantize_tile(total, start, k0, k1, QMAX, STOCHASTIC)
    gl = tile // G + r
    base = msg * out_nbytes
    payload = base + 4 * tl.cast(out_numel // G, tl.int64)
    tc.store_groups(out_ptr, base // 4 + gl, payload + gl * (G * BITS // 8), row_valid, codes,
                    scale, G, GP, BITS)


@triton.jit
def _tlq_receiver_kernel(wire_ptr, out_ptr, h_scale, n_in, msg_nbytes, ngroups, scale_by,
                         G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                         BITS: tl.constexpr, QMAX: tl.constexpr, LOG2_HB: tl.constexpr,
                         APPLY_SCALE: tl.constexpr, ACCUMULATE: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)
    t = tl.arange(0, GP)
    row_valid = g < ngroups
    start = g * G
    total = _dequantize_sum(wire_ptr, n_in, msg_nbytes, ngroups, start, row_valid,
                            G, BITS, QMAX, G, GP)
    if LOG2_HB > 0:
        total = tc.hadamard_tile(total, h_scale, LOG2_HB)
    if APPLY_SCALE:
        total = total * scale_by
    idx = tc.row_offsets(start, GP, tc.VEC)
    mask = row_valid[:, None] & (t < G)[None, :]
    if ACCUMULATE:
        total = tl.load(out_ptr + idx, mask=mask, other=0.0).to(tl.float32) + total
    tl.store(out_ptr + idx, tc.cast_for_store(total, out_ptr), mask=mask)


def _hadamard_args(hadamard_block: int) -> dict:
    """The kernel arguments of the transform (HB == 0 compiles it out)."""
    return dict(h_scale=block_scale(hadamard_block) if hadamard_block else 1.0,
                LOG2_HB=max(hadamard_block, 1).bit_length() - 1)


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
    rows, gp, warps = tc.tile_rows("tlq_sender", group_size)
    k0, k1 = tc.seed_words(seed)
    aligned = chunk % group_size == 0
    tiles_per_chunk = triton.cdiv(chunk, rows * group_size)
    grid = (tiles_per_chunk * blocks_per_dest * num_dests * slices if aligned
            else triton.cdiv(ngroups, rows),)
    _tlq_sender_kernel[grid](
        flat, out, ngroups=ngroups, msg_numel=msg_numel, chunk=chunk, num_dests=num_dests,
        slices=slices, msg_nbytes=fmt.message_nbytes(msg_numel, bits, group_size),
        tiles_per_chunk=tiles_per_chunk, k0=k0, k1=k1,
        G=group_size, GP=gp, R=rows, BITS=bits, QMAX=fmt.qmax(bits),
        **_hadamard_args(hadamard_block), CHUNK_ALIGNED=aligned, STOCHASTIC=stochastic,
        num_warps=warps, **tc.LAUNCH_OPTIONS)


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
    rows, gp, warps = tc.tile_rows("tlq_middle", group_size_out)
    k0, k1 = tc.seed_words(seed)
    tiles_per_msg = triton.cdiv(out_numel // group_size_out, rows)
    _tlq_middle_kernel[(tiles_per_msg * n_out,)](
        wire_in, out, n_in, fmt.message_nbytes(numel, bits_in, group_size_in),
        numel // group_size_in, out_numel,
        fmt.message_nbytes(out_numel, bits_out, group_size_out), tiles_per_msg, k0, k1,
        G_IN=group_size_in, BITS_IN=bits_in, QMAX_IN=fmt.qmax(bits_in),
        G=group_size_out, GP=gp, R=rows, BITS=bits_out, QMAX=fmt.qmax(bits_out),
        STOCHASTIC=stochastic, num_warps=warps, **tc.LAUNCH_OPTIONS)


def tlq_receiver(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                 group_size: int, hadamard_block: int, scale: float = 1.0,
                 accumulate: bool = False) -> None:
    """Triton version of :func:`..reference.tlq_receiver` (same arguments and bytes)."""
    numel = checks.tlq_receiver_sizes(wire_in, out, n_in=n_in, bits=bits,
                                      group_size=group_size, hadamard_block=hadamard_block)
    ngroups = numel // group_size
    if ngroups == 0:
        return
    rows, gp, warps = tc.tile_rows("tlq_receiver", group_size)
    _tlq_receiver_kernel[(triton.cdiv(ngroups, rows),)](
        wire_in, out, n_in=n_in, msg_nbytes=fmt.message_nbytes(numel, bits, group_size),
        ngroups=ngroups, scale_by=float(scale), G=group_size, GP=gp, R=rows, BITS=bits,
        QMAX=fmt.qmax(bits), **_hadamard_args(hadamard_block),
        APPLY_SCALE=scale != 1.0, ACCUMULATE=accumulate, num_warps=warps, **tc.LAUNCH_OPTIONS)
