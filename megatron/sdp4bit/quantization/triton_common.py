"""Building blocks shared by the fused Triton kernels (:mod:`.triton_qwd`, :mod:`.triton_tlq`).

Every kernel works on a tile of ``[R, GP]`` values: ``R`` quantization groups, one per row,
each padded to ``GP = next_power_of_2(G)`` lanes (lanes ``>= G`` are masked out and read as
zeros). The numerics are those of :mod:`.reference`, operation by operation, so that the
kernels produce the reference's bytes bit for bit:

* divisions are IEEE round-to-nearest (``div_rn``), never the approximate GPU division; there
  are two per group (the scale and its reciprocal) and none per element;
* kernels are launched with ``enable_fp_fusion=False`` so that ``acc + q * s`` is a multiply
  then an add, as in torch, and not a fused multiply-add (one rounding instead of two);
* the stochastic-rounding noise is the counter hash of :mod:`.rng` evaluated in ``uint32``
  lanes, one hash per pair of elements, so the kernels draw the very same numbers as the
  reference;
* the Hadamard transform runs the butterflies of :mod:`..hadamard` in the same order
  ([Note: butterfly order] there), so it too is bit-exact.

[Note: kernel structure]
What makes these kernels run at the memory bound on a GPU, and what the PTX budget test
(``tests/unit/test_triton_compile.py``) checks of it:

* Each byte is read once and written once: a program loads its tile with contiguous,
  16-byte aligned accesses (128-bit vector loads of fp32), keeps it in registers through the
  transform, the group reduction and the quantization, and stores codes and scales.
* No layout conversion of the tile through shared memory. The tile's layout is the one
  Triton gives its global loads, VEC contiguous values of a row per thread (``row_offsets``
  declares every load and store contiguous in runs of VEC values, so that all of them,
  packed codes included, get that same layout), and every later step keeps it: the Hadamard
  butterflies find their partners with a two-element reduction (in a thread's registers, or
  one warp shuffle), the pairs of the random stream are joined along the last axis, the
  4-bit and 2-bit packing splits an axis a thread already holds. What still goes through
  shared memory: the R scales of a program on their way to the store (a vector of R floats,
  one barrier), and the absmax of a group that spans warps (groups of 2048).
* Per element: no division (a reciprocal per group), no 64-bit index arithmetic (the
  tlq_sender's destination order is resolved once per program), and half a hash (16 random
  bits per element, [Note: counter-based rounding noise] in :mod:`.rng`).

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

import triton
import triton.language as tl


# [Note: launch shapes]
# Elements per program and warps per program, per kernel. Not measured on a GPU yet: chosen
# for H100/H200 by the rules below and kept in one table, so that a GPU run can sweep them
# (a benchmark may rebind an entry before a launch).
# * 16 elements per thread (4096 per program of 8 warps): four 128-bit fp32 loads in flight
#   per thread. With the register counts the PTX budget test reports (about 40 per thread,
#   100 for tlq_middle's four messages in flight), 2-8 programs of 256 threads are resident
#   per SM: 32-128 KiB of loads in flight per SM, against the ~15-30 KiB that HBM3 needs
#   (latency x bandwidth / SMs), and no spills.
# * 8 warps: a group of 2048 is then 4 warps and a tile two groups, so a group's absmax needs
#   one cross-warp step; a group of 128 is one warp (no barrier: a warp reduction).
# * The receivers and tlq_middle decode four messages per loop iteration: with 16 elements
#   per thread, 16-64 bytes of codes in flight per thread.
# The first GPU run (the earlier kernels, H200) found 16 elements per thread the best among
# tiles of 1024-16384 and 2-16 warps; the structure, not the launch shape, limited those.
LAUNCH = {
    "qwd_sender": (4096, 8),
    "qwd_receiver": (4096, 8),
    "tlq_sender": (4096, 8),
    "tlq_middle": (4096, 8),
    "tlq_receiver": (4096, 8),
}
# Launch options every kernel uses (see the module docstring for why no fp fusion).
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


# ----------------------------------------------------------------------------- jit helpers


# Values per contiguous run of one thread: every global access of a tile is hinted to be
# contiguous in runs of VEC values ([Note: kernel structure]), so that Triton gives every
# load and store of a kernel the same layout (VEC values of a row per thread, 128-bit fp32
# accesses) and needs no conversion through shared memory between them.
VEC = tl.constexpr(4)


@triton.jit
def row_offsets(start, N: tl.constexpr, RUN: tl.constexpr):
    """``start[r] + j`` for j < N ([R, N] int64), declared contiguous in runs of ``RUN``
    elements: the layout hint of the module docstring (true of any contiguous row)."""
    return tl.max_contiguous(start[:, None] + tl.arange(0, N)[None, :], [1, RUN])


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 lanes (see :func:`..rng.mix32_`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def uniform_tile(start, k0, k1, GP: tl.constexpr):
    """fp32 uniforms [R, GP] of the counter stream (k0, k1) at indices ``start[r] + j``.

    ``start`` [R] int64, even: element pairs (2i, 2i+1) share the hash of pair i, the even
    element its low 16 bits, the odd one its high 16 bits; ``u = (2 * half + 1) * 2**-17``
    is formed exactly as ``(1 + half * 2**-16) - (1 - 2**-17)`` (see :mod:`..rng`).
    """
    R: tl.constexpr = start.shape[0]
    pair = ((start >> 1)[:, None] + tl.arange(0, GP // 2)[None, :]).to(tl.uint32)
    h = _mix32(_mix32(pair ^ k0.to(tl.uint32)) ^ k1.to(tl.uint32))
    lo = ((h & 0xFFFF) << 7) | 0x3F800000
    hi = ((h >> 9) & 0x7FFF80) | 0x3F800000
    one_plus = tl.reshape(tl.join(lo, hi), [R, GP]).to(tl.float32, bitcast=True)
    return one_plus - (1.0 - 2.0 ** -17)


@triton.jit
def quantize_tile(x, start, k0, k1, QMAX: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Quantize the rows of ``x`` (fp32 [R, GP], padding lanes 0) as groups.

    Returns ``(codes int32 [R, GP], scales fp32 [R])`` by the rules of
    :func:`..reference.quantize_groups`; ``start`` [R] int64 (even) is each row's first
    random-stream index.
    """
    # absmax on the bit patterns, as the CPU kernels do: with the sign cleared IEEE order is
    # integer order and NaN/Inf are the patterns >= 0x7F800000 (a float max on a GPU does not
    # promise to propagate NaN); one integer reduction instead of two.
    bits = x.to(tl.int32, bitcast=True)
    mag = tl.max(bits & 0x7FFFFFFF, axis=1)
    bad = mag >= 0x7F800000
    scale = tl.math.div_rn(mag.to(tl.float32, bitcast=True),
                           tl.full(mag.shape, QMAX, tl.float32))
    scale = tl.where(bad, float("nan"), scale)
    usable = scale > 0
    inv = tl.math.div_rn(tl.full(mag.shape, 1.0, tl.float32), tl.where(usable, scale, 1.0))
    if STOCHASTIC:
        u = uniform_tile(start, k0, k1, x.shape[1])
    else:
        u = 0.5
    # A group holding NaN/Inf codes q = 0: its values are cleared to +0 (an integer mask per
    # row, so that no NaN reaches the conversion and the compiler keeps one instruction per
    # element instead of moving a select into the packed bytes), and floor(0 + u) = 0. A
    # group of zeros gets q = 0 the same way (inv = 1).
    keep = tl.where(bad, 0, -1)[:, None]
    x = (bits & keep).to(tl.float32, bitcast=True)
    q = tl.floor(x * inv[:, None] + u).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    return q + (QMAX + 1), scale


@triton.jit
def dequantize_tile(codes, scale, QMAX: tl.constexpr):
    """``(code - offset) * scale`` in fp32; ``scale`` broadcasts against ``codes``.

    The code becomes a float without a conversion instruction: ``0x4B000000 | code`` is the
    float ``2**23 + code``, and subtracting ``2**23 + offset`` is exact."""
    magic = (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
    return (magic - (8388608.0 + QMAX + 1)) * scale


@triton.jit
def store_groups(out_ptr, scale_index, payload, row_valid, codes, scale,
                 G: tl.constexpr, GP: tl.constexpr, BITS: tl.constexpr):
    """Write every row's scale at ``scale_index[r]`` (fp32 units of ``out_ptr``) and its packed
    codes at byte ``payload[r]``.

    ``out_ptr`` is the wire buffer (uint8, 4-byte aligned); ``scale_index``/``payload``/
    ``row_valid`` [R], int64 (see [Note: 64-bit offsets]); ``codes`` int32 [R, GP].
    """
    tl.store(out_ptr.to(tl.pointer_type(tl.float32)) + scale_index, scale, mask=row_valid)
    if BITS == 2:
        # [R, GP/4, 2, 2]: element 4i + 2a + b at [i, a, b]; split b, then a
        even, odd = tl.split(tl.reshape(codes, [codes.shape[0], GP // 4, 2, 2]))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        t = tl.arange(0, GP // 4)
        tl.store(out_ptr + row_offsets(payload, GP // 4, VEC // 4),
                 (c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)).to(tl.uint8),
                 mask=row_valid[:, None] & (t < G // 4)[None, :])
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, [codes.shape[0], GP // 2, 2]))
        t = tl.arange(0, GP // 2)
        tl.store(out_ptr + row_offsets(payload, GP // 2, VEC // 2), (lo | (hi << 4)).to(tl.uint8),
                 mask=row_valid[:, None] & (t < G // 2)[None, :])
    else:
        t = tl.arange(0, GP)
        tl.store(out_ptr + row_offsets(payload, GP, VEC), codes.to(tl.uint8),
                 mask=row_valid[:, None] & (t < G)[None, :])


@triton.jit
def load_codes(wire_ptr, payload, start, row_valid, G: tl.constexpr, GP: tl.constexpr,
               BITS: tl.constexpr):
    """int32 codes [R, GP] of elements ``start[r] .. start[r] + G - 1`` of the payload that
    begins at byte ``payload[r]`` (``start`` on a byte: even at 4 bits, a multiple of 4 at 2);
    lanes ``>= G`` and invalid rows give 0."""
    if BITS == 2:
        t = tl.arange(0, GP // 4)
        mask = row_valid[:, None] & (t < G // 4)[None, :]
        packed = tl.load(wire_ptr + row_offsets(payload + start // 4, GP // 4, VEC // 4), mask=mask,
                         other=0).to(tl.int32)
        # [R, GP/4, 2 (a), 2 (b)] holding element 4i + 2a + b: the inverse of store_groups
        even = tl.join(packed & 0x03, (packed >> 4) & 0x03)
        odd = tl.join((packed >> 2) & 0x03, packed >> 6)
        codes = tl.reshape(tl.join(even, odd), [packed.shape[0], GP])
    elif BITS == 4:
        t = tl.arange(0, GP // 2)
        mask = row_valid[:, None] & (t < G // 2)[None, :]
        packed = tl.load(wire_ptr + row_offsets(payload + start // 2, GP // 2, VEC // 2), mask=mask,
                         other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0x0F, packed >> 4), [packed.shape[0], GP])
    else:
        t = tl.arange(0, GP)
        mask = row_valid[:, None] & (t < G)[None, :]
        codes = tl.load(wire_ptr + row_offsets(payload + start, GP, VEC), mask=mask,
                        other=0).to(tl.int32)
    return codes


@triton.jit
def _butterfly(x, S: tl.constexpr):
    """One butterfly stage of half-width ``h = 2**S`` on the columns of ``x`` [R, GP]: column
    j of each 2h-run (j < h) becomes ``x[j] + x[j+h]``, column j + h ``x[j] - x[j+h]``.

    The partner of every column is found without moving the tile to another layout: the two
    members of a pair, as int32 bit patterns, are summed along an axis of 2 (wrapping; in a
    thread's registers, or one warp shuffle), and each member subtracts itself. The upper
    member flips its own sign bit, so that ``partner + x`` is the reference's ``a + c`` for
    the lower member and ``a + (-c) = a - c`` for the upper one, exactly (IEEE addition is
    commutative and ``a - c`` is defined as ``a + (-c)``): one shuffle, one integer and one
    float instruction per element and stage."""
    R: tl.constexpr = x.shape[0]
    GP: tl.constexpr = x.shape[1]
    H: tl.constexpr = 1 << S
    bits = x.to(tl.int32, bitcast=True)
    pair_sum = tl.sum(tl.reshape(bits, [R, GP // (2 * H), 2, H]), axis=2, keep_dims=True)
    both = tl.reshape(tl.broadcast_to(pair_sum, [R, GP // (2 * H), 2, H]), [R, GP])
    partner = (both - bits).to(tl.float32, bitcast=True)
    sign = (((tl.arange(0, GP) >> S) & 1) << 31)[None, :]  # 0x80000000 in upper columns
    return partner + (bits ^ sign).to(tl.float32, bitcast=True)


@triton.jit
def hadamard_tile(x, h_scale, LOG2_HB: tl.constexpr):
    """Transform every contiguous block of ``2**LOG2_HB`` values of each row of ``x`` [R, GP]
    (``GP`` a multiple of the block) as :mod:`..hadamard` does, bit for bit: butterflies of
    half-width 1, 2, .., HB/2 in fp32, then a multiplication by ``h_scale`` (fp32
    ``1/sqrt(HB)``)."""
    for s in tl.static_range(LOG2_HB):
        x = _butterfly(x, s)
    return x * h_scale


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


def tile_rows(kernel: str, group_size: int) -> tuple[int, int, int]:
    """``(R, GP, warps)`` of a kernel for a group size: groups per program, padded group
    width, warps (from :data:`LAUNCH`)."""
    elements, warps = LAUNCH[kernel]
    gp = triton.next_power_of_2(group_size)
    return max(1, elements // gp), gp, warps


def seed_words(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32
