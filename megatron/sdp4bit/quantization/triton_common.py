"""Building blocks shared by the fused Triton kernels (:mod:`.triton_qwd`, :mod:`.triton_tlq`).

Every kernel works on a tile of ``[R, GP]`` values: ``R`` quantization groups, one per row,
each padded to ``GP = next_power_of_2(G)`` lanes (lanes ``>= G`` are masked out and read as
zeros). The numerics copy :mod:`.reference` operation by operation so that, with
round-to-nearest and no Hadamard transform, the kernels produce the reference's bytes:

* divisions are IEEE round-to-nearest (``div_rn``), never the approximate GPU division;
* kernels are launched with ``enable_fp_fusion=False`` so that ``acc + q * s`` is a multiply
  then an add, as in torch, and not a fused multiply-add (one rounding instead of two);
* the stochastic-rounding noise is the counter hash of :mod:`.rng` evaluated in ``uint32``
  lanes (multiplication wraps mod 2**32 exactly as the reference's int64 emulation), so the
  kernels draw the very same numbers as the reference.

* the Hadamard transform runs the butterflies of :mod:`..hadamard` in the same order
  ([Note: butterfly order] there), so it too is bit-exact.

[Note: 64-bit offsets]
A production wire buffer exceeds 2**31 bytes (a 2.7B-parameter bucket at TP 1, in messages
for 8 ranks), and Triton computes in int32 whatever it types int32: scalar kernel arguments
below 2**31, loop counters, ``tl.arange``, ``tl.program_id``. So every offset that involves a
size argument, a program id or a loop counter is formed in int64 *before* it is multiplied
or added: row indices start from ``tl.program_id(0).to(tl.int64)``, message indices are cast
with ``tl.cast(k, tl.int64)``, group counts times 4 likewise. ``tests/helpers/triton_ir.py``
checks the compiled IR of every kernel for this.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Elements per program: enough work per program to hide memory latency on a GPU, small enough
# to stay in registers (2 groups of 2048, or 32 groups of 128).
TILE_ELEMENTS = 4096
# Launch options every kernel uses (see the module docstring for why no fp fusion).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (see :func:`..rng.mix32_`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def uniform_tile(idx, k0, k1):
    """fp32 uniforms in [0, 1) of the counter stream (k0, k1) at int64 indices ``idx``."""
    h = _mix32(_mix32(idx.to(tl.uint32) ^ k0.to(tl.uint32)) ^ k1.to(tl.uint32))
    return (h >> 8).to(tl.float32) * (2.0 ** -24)


@triton.jit
def quantize_tile(x, idx, k0, k1, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Quantize the rows of ``x`` (fp32 [R, GP], padding lanes 0) as groups.

    Returns ``(codes uint8 [R, GP], scales fp32 [R])`` by the rules of
    :func:`..reference.quantize_groups`; ``idx`` [R, GP] are the random-stream indices.
    """
    ax = tl.abs(x)
    # tl.max does not promise to propagate NaN on a GPU: detect non-finite values apart.
    nonfinite = (ax != ax) | (ax == float("inf"))
    bad = tl.max(nonfinite.to(tl.int32), axis=1) > 0
    absmax = tl.max(tl.where(nonfinite, 0.0, ax), axis=1)
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, QMAX, tl.float32))
    scale = tl.where(bad, float("nan"), scale)
    usable = (scale > 0) & (~bad)
    safe = tl.where(usable, scale, 1.0)
    if STOCHASTIC:
        u = uniform_tile(idx, k0, k1)
    else:
        u = 0.5
    q = tl.floor(tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape)) + u)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    q = tl.where(usable[:, None], q, 0.0)
    codes = (q + (QMAX + 1)).to(tl.uint8)
    return codes, scale


@triton.jit
def dequantize_tile(codes, scale, QMAX: tl.constexpr):
    """``(code - offset) * scale`` in fp32; ``scale`` broadcasts against ``codes``."""
    return (codes.to(tl.float32) - (QMAX + 1)) * scale


@triton.jit
def store_groups(out_ptr, msg, gl, row_valid, codes, scale, msg_nbytes, groups_per_msg,
                 G: tl.constexpr, GP: tl.constexpr, BITS: tl.constexpr):
    """Write group ``gl[r]`` of message ``msg[r]`` (scale and packed codes) for every row.

    ``out_ptr`` is the wire buffer (uint8, 4-byte aligned); ``msg``/``gl``/``row_valid`` [R],
    int64 (see [Note: 64-bit offsets]).
    """
    base = msg * msg_nbytes
    scale_ptr = out_ptr.to(tl.pointer_type(tl.float32))
    tl.store(scale_ptr + base // 4 + gl, scale, mask=row_valid)
    payload = base + 4 * tl.cast(groups_per_msg, tl.int64) + gl * (G * BITS // 8)
    if BITS == 2:
        # [R, GP/4, 2, 2]: element 4i + 2a + b at [i, a, b]; split b, then a
        even, odd = tl.split(tl.reshape(codes, [codes.shape[0], GP // 4, 2, 2]))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        t = tl.arange(0, GP // 4)
        tl.store(out_ptr + payload[:, None] + t[None, :],
                 c0 | (c1 << 2) | (c2 << 4) | (c3 << 6),
                 mask=row_valid[:, None] & (t < G // 4)[None, :])
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, [codes.shape[0], GP // 2, 2]))
        t = tl.arange(0, GP // 2)
        tl.store(out_ptr + payload[:, None] + t[None, :], lo | (hi << 4),
                 mask=row_valid[:, None] & (t < G // 2)[None, :])
    else:
        t = tl.arange(0, GP)
        tl.store(out_ptr + payload[:, None] + t[None, :], codes,
                 mask=row_valid[:, None] & (t < G)[None, :])


@triton.jit
def load_codes(wire_ptr, payload, start, row_valid, G: tl.constexpr, GP: tl.constexpr,
               BITS: tl.constexpr):
    """uint8 codes [R, GP] of elements ``start[r] .. start[r] + G - 1`` of the payload that
    begins at byte ``payload[r]`` (``start`` on a byte: even at 4 bits, a multiple of 4 at 2);
    lanes ``>= G`` and invalid rows give 0."""
    if BITS == 2:
        t = tl.arange(0, GP // 4)
        mask = row_valid[:, None] & (t < G // 4)[None, :]
        packed = tl.load(wire_ptr + (payload + start // 4)[:, None] + t[None, :], mask=mask,
                         other=0)
        # [R, GP/4, 2 (a), 2 (b)] holding element 4i + 2a + b: the inverse of store_groups
        even = tl.join(packed & 0x03, (packed >> 4) & 0x03)
        odd = tl.join((packed >> 2) & 0x03, packed >> 6)
        codes = tl.reshape(tl.join(even, odd), [packed.shape[0], GP])
    elif BITS == 4:
        t = tl.arange(0, GP // 2)
        mask = row_valid[:, None] & (t < G // 2)[None, :]
        packed = tl.load(wire_ptr + (payload + start // 2)[:, None] + t[None, :], mask=mask,
                         other=0)
        codes = tl.reshape(tl.join(packed & 0x0F, packed >> 4), [packed.shape[0], GP])
    else:
        t = tl.arange(0, GP)
        mask = row_valid[:, None] & (t < G)[None, :]
        codes = tl.load(wire_ptr + (payload + start)[:, None] + t[None, :], mask=mask, other=0)
    return codes


@triton.jit
def hadamard_tile(x, h_scale, HB: tl.constexpr, LOG2_HB: tl.constexpr):
    """Transform every contiguous block of ``HB`` values of each row of ``x`` [R, GP] (``GP``
    a multiple of HB) as :mod:`..hadamard` does, bit for bit: butterflies of half-width
    1, 2, .., HB/2 in fp32, then a multiplication by ``h_scale`` (fp32 ``1/sqrt(HB)``)."""
    R: tl.constexpr = x.shape[0]
    GP: tl.constexpr = x.shape[1]
    NB: tl.constexpr = R * GP // HB
    y = tl.reshape(x, [NB, HB])
    for s in tl.static_range(LOG2_HB):
        # pairs (j, j + h) of every 2h-run: put the pair's two members in a last axis of 2
        pairs = tl.permute(tl.reshape(y, [NB, HB // (2 << s), 2, 1 << s]), [0, 1, 3, 2])
        a, c = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(a + c, a - c), [0, 1, 3, 2]), [NB, HB])
    return tl.reshape(y * h_scale, [R, GP])


@triton.jit
def cast_for_store(x, ptr):
    """fp32 ``x`` rounded to the element type of ``ptr`` as torch rounds it (to nearest even).

    bf16 is rounded by hand: the interpreter truncates fp32 -> bf16, and the hand rounding is
    what ``cvt.rn.bf16.f32`` does on a GPU anyway (NaN becomes torch's 0x7FC0).
    """
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, 0x7FC00000, bits)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(ptr.dtype.element_ty)


# ---------------------------------------------------------------------------- host helpers


def tile_rows(group_size: int) -> tuple[int, int]:
    """``(R, GP)``: groups per program and padded group width for a group size."""
    gp = triton.next_power_of_2(group_size)
    return max(1, TILE_ELEMENTS // gp), gp


def num_warps(rows: int, gp: int) -> int:
    return 8 if rows * gp >= 4096 else 4


def seed_words(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32
