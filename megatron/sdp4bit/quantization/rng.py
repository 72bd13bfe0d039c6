"""Counter-based random stream for stochastic rounding.

[Note: counter-based rounding noise]
Every random number is a pure function of (seed, index): ``u = hash(seed, i)``. Nothing is
carried from one call to the next, so a resumed run repeats the uninterrupted one bit for bit
as long as it derives the same seed, and the Triton kernels can compute the very same numbers
as the torch references (``uint32`` arithmetic wraps identically in both).

``seed`` is 64 bits; the comm layer derives it with :func:`derive_seed` from (user seed,
iteration, bucket, rank, hop, slice). ``i`` is the element's index in the operation's output
numbering and must be below 2**32.

The hash is two rounds of the ``lowbias32`` integer finalizer (a bijection on uint32):
``h = mix(mix(i ^ k0) ^ k1)`` with ``k0``/``k1`` the low/high words of the seed, and
``u = (h >> 8) * 2**-24``: 24 bits, exact in fp32, uniform on ``[0, 1)``.
"""

from __future__ import annotations

import torch

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


# Elements per chunk, i.e. the int64 scratch: 256 KiB on CPU, where the dozen hash passes
# then stay in cache; 32 MiB on other devices, enough to keep kernel launches few. Never the
# whole tensor: a bucket of 2.7B elements would need a 21.6 GB scratch.
_CHUNK = 1 << 15
_DEVICE_CHUNK = 1 << 22


def chunk_elements(device: torch.device | str) -> int:
    return _CHUNK if torch.device(device).type == "cpu" else _DEVICE_CHUNK


def uniform(seed: int, start: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 uniforms in [0, 1) for indices ``start .. start + numel - 1`` of stream ``seed``.

    Computed in chunks (:func:`chunk_elements`), so the int64 scratch is bounded on every
    device; on CPU, cache-sized chunks are also about 4x faster than one pass per operation
    over the whole tensor.
    """
    if start < 0 or start + numel > (1 << 32):
        raise ValueError(f"random-stream indices [{start}, {start + numel}) exceed 2**32")
    k0, k1 = split_seed(seed)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    chunk = chunk_elements(device)
    scratch = torch.empty(min(chunk, numel), dtype=torch.int64, device=device)
    for lo in range(0, numel, chunk):
        hi = min(numel, lo + chunk)
        h = scratch[: hi - lo]
        torch.arange(start + lo, start + hi, out=h)
        h ^= k0
        mix32_(h)
        h ^= k1
        mix32_(h)
        h >>= 8
        out[lo:hi].copy_(h)
    return out.mul_(2.0**-24)


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
