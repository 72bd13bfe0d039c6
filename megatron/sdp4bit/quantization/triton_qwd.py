"""Fused Triton kernels of the qWD weight-difference all-gather (see :mod:`.reference`).

``qwd_sender``: one pass reads the fp32 main shard and the bf16 replica shard, forms the
difference, and writes the message (scales and packed codes). ``qwd_receiver``: one pass reads
the gathered messages and the replica and writes ``replica + D(message)`` for every shard.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from megatron.sdp4bit.quantization import checks
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import triton_common as tc


@triton.jit(do_not_specialize=["k0", "k1"])
def _qwd_sender_kernel(main_ptr, replica_ptr, out_ptr, ngroups, k0, k1,
                       G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                       BITS: tl.constexpr, QMAX: tl.constexpr, HAS_REPLICA: tl.constexpr,
                       STOCHASTIC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64) * R + tl.arange(0, R)  # group index [R]
    t = tl.arange(0, GP)
    row_valid = g < ngroups
    idx = tc.row_offsets(g * G, GP, tc.VEC)  # element index = random-stream index
    mask = row_valid[:, None] & (t < G)[None, :]
    x = tl.load(main_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if HAS_REPLICA:
        x = x - tl.load(replica_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    codes, scale = tc.quantize_tile(x, g * G, k0, k1, QMAX, STOCHASTIC)
    tc.store_groups(out_ptr, g, 4 * tl.cast(ngroups, tl.int64) + g * (G * BITS // 8),
                    row_valid, codes, scale, G, GP, BITS)


@triton.jit
def _qwd_receiver_kernel(wire_ptr, replica_ptr, groups_per_shard, msg_nbytes, tiles_per_shard,
                         G: tl.constexpr, GP: tl.constexpr, R: tl.constexpr,
                         BITS: tl.constexpr, QMAX: tl.constexpr, ACCUMULATE: tl.constexpr):
    # One program = R groups of one shard (scalar int32 division per program).
    pid = tl.program_id(0)
    shard = tl.cast(pid // tiles_per_shard, tl.int64)
    gl = tl.cast(pid % tiles_per_shard, tl.int64) * R + tl.arange(0, R)  # group in the shard
    t = tl.arange(0, GP)
    row_valid = gl < groups_per_shard
    base = shard * msg_nbytes
    scale = tl.load(wire_ptr.to(tl.pointer_type(tl.float32)) + base // 4 + gl, mask=row_valid,
                    other=0.0)
    codes = tc.load_codes(wire_ptr, base + 4 * tl.cast(groups_per_shard, tl.int64), gl * G,
                          row_valid, G, GP, BITS)
    value = tc.dequantize_tile(codes, scale[:, None], QMAX)
    idx = tc.row_offsets((shard * groups_per_shard + gl) * G, GP, tc.VEC)
    mask = row_valid[:, None] & (t < G)[None, :]
    if ACCUMULATE:
        value = tl.load(replica_ptr + idx, mask=mask, other=0.0).to(tl.float32) + value
    tl.store(replica_ptr + idx, tc.cast_for_store(value, replica_ptr), mask=mask)


def qwd_sender(main_shard: torch.Tensor, replica_shard: torch.Tensor | None, out: torch.Tensor,
               *, bits: int, group_size: int, stochastic: bool, seed: int) -> None:
    """Triton version of :func:`..reference.qwd_sender` (same arguments and bytes)."""
    numel = checks.qwd_sender_sizes(main_shard, replica_shard, out, bits=bits,
                                    group_size=group_size, stochastic=stochastic)
    ngroups = numel // group_size
    if ngroups == 0:
        return
    main = main_shard.reshape(-1).contiguous()
    replica = main if replica_shard is None else replica_shard.reshape(-1).contiguous()
    rows, gp, warps = tc.tile_rows("qwd_sender", group_size)
    k0, k1 = tc.seed_words(seed)
    _qwd_sender_kernel[(triton.cdiv(ngroups, rows),)](
        main, replica, out, ngroups, k0, k1, G=group_size, GP=gp, R=rows, BITS=bits,
        QMAX=fmt.qmax(bits), HAS_REPLICA=replica_shard is not None, STOCHASTIC=stochastic,
        num_warps=warps, **tc.LAUNCH_OPTIONS)


def qwd_receiver(wire: torch.Tensor, replica: torch.Tensor, *, world: int, bits: int,
                 group_size: int, accumulate: bool = True) -> None:
    """Triton version of :func:`..reference.qwd_receiver` (same arguments and bytes)."""
    shard = checks.qwd_receiver_sizes(wire, replica, world=world, bits=bits,
                                      group_size=group_size)
    ngroups = replica.numel() // group_size
    if ngroups == 0:
        return
    rows, gp, warps = tc.tile_rows("qwd_receiver", group_size)
    tiles_per_shard = triton.cdiv(shard // group_size, rows)
    _qwd_receiver_kernel[(tiles_per_shard * world,)](
        wire, replica, shard // group_size, fmt.message_nbytes(shard, bits, group_size),
        tiles_per_shard, G=group_size, GP=gp, R=rows, BITS=bits,
        QMAX=fmt.qmax(bits), ACCUMULATE=accumulate, num_warps=warps, **tc.LAUNCH_OPTIONS)
