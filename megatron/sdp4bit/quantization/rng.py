"""Counter-based random stream for stochastic rounding.

[Note: counter-based rounding noise]
Every random number is a pure function of (seed, index): ``u = hash(seed, i)``. Nothing is
carried from one call to the next, so a resumed run repeats the uninterrupted one bit for bit
as long as it derives the same seed, and the Triton kernels can compute the very same numbers
as the torch references (``uint32`` arithmetic wraps identically in both).

``seed`` is 64 bits; the comm layer derives it with :func:`derive_seed` from (user seed,
iteration, bucket, rank, hop, slice). ``i`` is the element's index in the operation's output
numbering and must be below 2**32.

One 32-bit hash serves two elements. Elements ``2p`` and ``2p + 1`` share the word
``w = mix(mix(p ^ k0) ^ k1)`` (two rounds of the ``lowbias32`` integer finalizer, a bijection
on uint32; ``k0``/``k1`` the low/high words of the seed); the even element takes its low 16
bits, the odd one its high 16 bits, and a half ``m`` becomes ``u = (2m + 1) * 2**-17``: the
midpoints of 2**16 equal cells of ``[0, 1)``, exact in fp32.

Bias of a 16-bit uniform: write ``y = n + f`` (``f`` in [0, 1)); ``floor(y + u) = n + 1``
exactly when ``u >= 1 - f``, which holds for ``2**16 - ceil(2**16 (1 - f) - 1/2)`` of the 2**16
values of ``m``, so ``E[floor(y + u)] - y`` lies in ``(-2**-17, 2**-17]`` (of a step) for every
``y``, with mean zero over ``f``. The fp32 arithmetic around it (``x * (1/s)`` and ``+ u``,
each rounded to nearest) moves ``y`` by at most ``|y| * 2**-23 + 2**-18`` for ``|y| <= 128``:
below ``2**-16`` of a step at 8 bits and ``2**-17`` at 4 and 2 bits. So every rounding is
unbiased to ``3 * 2**-17 ~ 2.3e-5`` of a step, far below what the statistical tests resolve
(``tests/unit/test_rounding_statistics.py``: 1/100 of a step).

[Note: rounding stream versions]
Version 0.2.0 of the project changed the stream and the quantizer's arithmetic so that the
GPU kernels run at the memory bound: one hash per two elements with 16-bit uniforms as above
(0.1.0: one two-round hash per element, ``u = (w >> 8) * 2**-24``), and ``x * (1/s)`` with
the reciprocal rounded once per group (0.1.0: ``x / s`` per element). Every backend changed
together and they agree bit for bit, but a 0.2.0 run rounds differently from a 0.1.0 run:
a checkpoint saved by 0.1.0 resumes under 0.2.0 with the same model, optimizer and error
state, but the resumed run is not bit-exact to 0.1.0's uninterrupted run (both are unbiased
and statistically equivalent). ``STREAM_VERSION`` names the current one.
"""

from __future__ import annotations

import torch

STREAM_VERSION = "0.2.0"
MASK32 = 0xFFFFFFFF
MIX_C1 = 0x7FEB352D
MIX_C2 = 0x846CA68B
_GOLDEN64 = 0x9E3779B97F4A7C15


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, in place, on an int64 tensor holding uint32 values.

    The products overflow int64 (up to 2**64); torch's int64 multiply wraps like the
    hardware's, and only the low 32 bits are kept, which wrapping leaves exact. (The unit
    tests check this against Python's exact integers.)
    """
    x ^= x >> 16
    x *= MIX_C1
    x &= MASK32
    x ^= x >> 15
    x *= MIX_C2
    x &= MASK32
    x ^= x >> 16
    return x


def split_seed(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & MASK32, seed >> 32


# Pairs of elements per chunk: the int64 scratch holds a chunk's words and their halves
# (3 x 2**14 values, 384 KiB, on CPU, where the dozen hash passes then stay in cache;
# 3 x 2**21, 48 MiB, on other devices, enough to keep kernel launches few). Never the whole
# tensor: a bucket of 2.7B elements would need a 32 GB scratch.
_CHUNK = 1 << 14
_DEVICE_CHUNK = 1 << 21


def chunk_pairs(device: torch.device | str) -> int:
    return _CHUNK if torch.device(device).type == "cpu" else _DEVICE_CHUNK


def pair_words(seed: int, first: int, count: int, out: torch.Tensor) -> torch.Tensor:
    """The hash words ``w`` of pairs ``first .. first + count - 1`` into ``out`` (int64
    scratch of at least ``count`` elements, holding uint32 values)."""
    k0, k1 = split_seed(seed)
    w = out[:count]
    torch.arange(first, first + count, out=w)
    w ^= k0
    mix32_(w)
    w ^= k1
    return mix32_(w)


def uniform(seed: int, start: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 uniforms in (0, 1) for indices ``start .. start + numel - 1`` of stream ``seed``.

    Computed in chunks of pairs (:func:`chunk_pairs`), so the int64 scratch is bounded on
    every device; on CPU, cache-sized chunks are also about 4x faster than one pass per
    operation over the whole tensor.
    """
    if start < 0 or start + numel > (1 << 32):
        raise ValueError(f"random-stream indices [{start}, {start + numel}) exceed 2**32")
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel == 0:
        return out
    first, end = start >> 1, ((start + numel - 1) >> 1) + 1  # the pairs that hold the range
    chunk = min(chunk_pairs(device), end - first)
    words = torch.empty(chunk, dtype=torch.int64, device=device)
    halves = torch.empty(chunk, 2, dtype=torch.int64, device=device)
    for lo in range(first, end, chunk):
        n = min(end, lo + chunk) - lo
        w = pair_words(seed, lo, n, words)
        torch.bitwise_and(w, 0xFFFF, out=halves[:n, 0])  # element 2p: the low half
        torch.bitwise_right_shift(w, 16, out=halves[:n, 1])  # element 2p + 1: the high half
        e0, e1 = max(2 * lo, start), min(2 * (lo + n), start + numel)
        m = halves[:n].view(-1)[e0 - 2 * lo: e1 - 2 * lo]
        out[e0 - start: e1 - start].copy_(m.mul_(2).add_(1))
    return out.mul_(2.0**-17)


def derive_seed(*parts: int) -> int:
    """Fold integers (seed, iteration, bucket, rank, hop, ...) into one 64-bit seed.

    A splitmix64-style fold: different tuples give unrelated seeds.
    """
    state = 0
    for part in parts:
        state = (state + _GOLDEN64 + (int(part) & ((1 << 64) - 1))) & ((1 << 64) - 1)
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
        state = z ^ (z >> 31)
    return state
