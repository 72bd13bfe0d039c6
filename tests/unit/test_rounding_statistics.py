"""Stochastic rounding, measured: unbiased to 1/100 of a step, independent across seeds, and
the stream itself (16-bit uniforms, two per hash word) as fine and as independent as
``megatron/sdp4bit/quantization/rng.py`` derives it.

Run on the backends that execute on CPU: the compiled CPU kernels (what ``auto`` runs on CPU
tensors) and the torch references. The Triton kernels give the references' bytes bit for bit
(test_triton_kernels.py, stochastic cases included), so whatever holds here holds for them.
The statistics read each rounding off the wire next to the quantizer's input
(``tests/helpers/noise.py``, [Note: rounding errors in steps]).

Sample sizes: a bin of f (10 bins) holds ~100k roundings of variance f(1-f) <= 1/4, so its
mean has a standard error <= 0.0016 step and the 6-sigma bound stays below 0.01 step
(``assert_unbiased`` fails the test if it does not). A ``0.95 u`` bias moves the low-f bins
by 0.03-0.05 step: 20-30 standard errors.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import noise as _noise
from megatron.sdp4bit.quantization import derive_seed, ops, quantize
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization.rng import uniform

BACKENDS = ["cpu", "torch"]
N = 1 << 20


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qwd(backend: str, seed: int, n: int = N) -> _noise.Rounding:
    """A 4-bit qWD message: main - replica, weight-difference-like (update-sized values)."""
    main = torch.randn(n, generator=_gen(seed))
    replica = (main - 1e-3 * torch.randn(n, generator=_gen(seed + 1))).to(torch.bfloat16)
    out = torch.empty(fmt.message_nbytes(n, 4, 2048), dtype=torch.uint8)
    ops.qwd_sender(main, replica, out, bits=4, group_size=2048, stochastic=True,
                   seed=derive_seed(7, seed), backend=backend)
    x = main - replica.float()
    return _noise.rounding(f"qwd{seed}", x, *_noise.decode(out, 1, n, 4, 2048))


def _tlq_sender(backend: str, seed: int) -> _noise.Rounding:
    """The 8-bit intra hop with the Hadamard transform: 2 nodes x 2 ranks, 2 slices."""
    inp = torch.randn(N, generator=_gen(seed))
    inp[::97] *= 20.0  # gradient-like outliers
    out = torch.empty(4 * fmt.message_nbytes(N // 4, 8, 128), dtype=torch.uint8)
    ops.tlq_sender(inp, out, num_dests=2, blocks_per_dest=2, slices=2, bits=8, group_size=128,
                   hadamard_block=32, stochastic=True, seed=derive_seed(8, seed),
                   backend=backend)
    x = _noise.sender_values(inp, 2, 2, 2, 32)
    return _noise.rounding(f"tlq_sender{seed}", x, *_noise.decode(out, 4, N // 4, 8, 128))


def _tlq_middle(backend: str, seed: int, bits_out: int = 4) -> _noise.Rounding:
    """Between the hops: 2 messages of 8-bit codes summed and requantized at 4 bits."""
    n_in, numel = 2, N
    wire = torch.empty(n_in * fmt.message_nbytes(numel, 8, 128), dtype=torch.uint8)
    scales, payload = fmt.split_messages(wire, n_in, numel, 8, 128)
    payload.copy_(torch.randint(0, 256, payload.shape, generator=_gen(seed), dtype=torch.uint8))
    scales.copy_(torch.rand(scales.shape, generator=_gen(seed + 1)) + 0.01)
    out = torch.empty(2 * fmt.message_nbytes(numel // 2, bits_out, 128), dtype=torch.uint8)
    ops.tlq_middle(wire, out, n_in=n_in, numel=numel, bits_in=8, group_size_in=128, n_out=2,
                   bits_out=bits_out, group_size_out=128, stochastic=True,
                   seed=derive_seed(9, seed), backend=backend)
    x = _noise.dequantized_sum(wire, n_in, numel, 8, 128)
    return _noise.rounding(f"tlq_middle{seed}", x,
                           *_noise.decode(out, 2, numel // 2, bits_out, 128))


def _tlq_middle_2bit(backend: str, seed: int) -> _noise.Rounding:
    """The same, requantized at 2 bits (levels -s, 0, s): the 2-bit inter-node hop."""
    return _tlq_middle(backend, seed, bits_out=2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", [_qwd, _tlq_sender, _tlq_middle, _tlq_middle_2bit],
                         ids=["qwd_sender", "tlq_sender", "tlq_middle", "tlq_middle_2bit"])
def test_fused_senders_round_without_bias(backend: str, op) -> None:
    _noise.assert_unbiased([op(backend, 1)], f"{op.__name__} on {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_rounding_noise_is_independent_across_seeds_and_neighbours(backend: str) -> None:
    """Derived seeds (consecutive iterations, buckets) give uncorrelated noise on the same
    data and on different data; neighbouring stream indices are uncorrelated too."""
    x = torch.randn(1 << 17, generator=_gen(3))
    runs = []
    for seed in (derive_seed(1, 0, 0), derive_seed(1, 1, 0), derive_seed(1, 0, 1),
                 derive_seed(2, 0, 0)):
        q = quantize(x, 4, 128, seed=seed, backend=backend)
        runs.append(_noise.rounding(f"seed {seed:#x}", x, *_noise.decode(q.data, 1, x.numel(),
                                                                          4, 128)))
    other = torch.randn(1 << 17, generator=_gen(4))
    q = quantize(other, 4, 128, seed=derive_seed(1, 2, 0), backend=backend)
    runs.append(_noise.rounding("other data", other, *_noise.decode(q.data, 1, other.numel(),
                                                                    4, 128)))
    assert _noise.assert_independent(runs, backend) == 10
    # neighbours within one stream: r_i against r_{i+1}
    r = runs[0]
    shifted = _noise.Rounding("next index", r.r[1:], r.v[1:], r.f[1:])
    assert abs(_noise.z_score(_noise.Rounding("index", r.r[:-1], r.v[:-1], r.f[:-1]),
                              shifted)) < _noise.Z_LIMIT


def test_the_independence_check_holds_for_nearly_exact_inputs() -> None:
    """After Adam's first step every difference of a group has the same magnitude: nearly all
    fractions are within 1e-5 of 0 or 1 and the variance is tiny. One independent rounding
    that goes the unlikely way (as measured on an integration run: r = 0.99999 where
    f = 8.6e-6) must not read as correlation, although z is far beyond 6; the check holds a
    bounded sum to Bernstein's limit instead ([Note: why the independence check is
    Bernstein's, not a z-limit])."""
    n = 12288
    f_a = torch.full((n,), 8.6e-6, dtype=torch.float64)
    r_a = -f_a.clone()
    r_a[100] = 1 - f_a[100]  # the rare round-up
    f_b = torch.full((n,), 1 - 2e-5, dtype=torch.float64)
    f_b[100] = 0.515
    r_b = 1 - f_b
    a = _noise.Rounding("a", r_a, f_a * (1 - f_a), f_a)
    b = _noise.Rounding("b", r_b, f_b * (1 - f_b), f_b)
    assert _noise.z_score(a, b) > 2 * _noise.Z_LIMIT
    assert _noise.assert_independent([a, b], "nearly exact inputs") == 1
    # where the variance is large the limit is about 6.5 standard deviations
    assert 6.4 < _noise.independence_limit(1e6) / 1e3 < 6.6


def test_the_statistics_have_power() -> None:
    """The checks fail where they must: a shared seed (same or different data) and a rounding
    offset of 0.95 u are far outside the limits at these sample sizes."""
    x = torch.randn(1 << 17, generator=_gen(5))
    y = torch.randn(1 << 17, generator=_gen(6))
    seed = derive_seed(1, 0, 0)

    def noise(values, label):
        q = quantize(values, 4, 128, seed=seed, backend="torch")
        return _noise.rounding(label, values, *_noise.decode(q.data, 1, values.numel(), 4, 128))

    assert _noise.z_score(noise(x, "a"), noise(x, "b")) > 100  # same seed, same data
    assert _noise.z_score(noise(x, "a"), noise(y, "b")) > 50  # same seed, other data
    with pytest.raises(AssertionError, match="correlated"):
        _noise.assert_independent([noise(x, "a"), noise(y, "b")], "shared seed")

    # 0.95 u: reconstruct each rounding's u-threshold from a fresh stream and bias it
    values = torch.randn(N, generator=_gen(7))
    s = values.view(-1, 128).abs().amax(1).repeat_interleave(128) / 7
    u = uniform(seed, 0, N)
    biased = torch.floor(values / s + 0.95 * u).clamp(-7, 7).to(torch.int64)
    with pytest.raises(AssertionError, match=r"biased rounding in f-bin \[0.0, 0.1\)"):
        _noise.assert_unbiased([_noise.rounding("0.95u", values, biased, s)], "0.95 u")
    fair = torch.floor(values / s + u).clamp(-7, 7).to(torch.int64)
    _noise.assert_unbiased([_noise.rounding("u", values, fair, s)], "u")
    with pytest.raises(AssertionError, match="resolve only"):  # too few samples: refused
        _noise.assert_unbiased([_noise.rounding("few", values[:4096], fair[:4096],
                                                s[:4096])], "few")


# ------------------------------------------------------- the stream: 16-bit uniforms in pairs


def _halves(u: torch.Tensor) -> torch.Tensor:
    """The 16-bit value m of each uniform u = (2m + 1) * 2**-17 (int64), checking the form."""
    m = ((u.double() * 2**17 - 1) / 2).round().to(torch.int64)
    assert torch.equal((2 * m + 1).double() * 2**-17, u.double()), "u is not a cell midpoint"
    assert int(m.min()) >= 0 and int(m.max()) < 1 << 16
    return m


def _pair_checks(m: torch.Tensor) -> None:
    """The even and the odd elements (low and high halves of one hash word) each use all 16
    bits, uniformly, and the two halves of a word are uncorrelated.

    Each half of 2**19 draws from 65536 values takes about 65536 (1 - e**-8) = 65514 of them
    (a stream of 8-bit uniforms takes 256, one with a stuck bit at most 32768). Each byte of
    m is uniform by a chi-square test over 256 bins (255 degrees of freedom: mean 255,
    standard deviation 22.6; the limit is 6 of them above the mean). The correlation of the
    two halves is N(0, 1/n) for independent halves; 6 / sqrt(n) is the limit."""
    even, odd = m[0::2], m[1::2]
    for name, half in (("even", even), ("odd", odd)):
        assert half.unique().numel() > 65000, f"{name} elements: too few distinct uniforms"
        for byte in (half & 0xFF, half >> 8):
            counts = torch.bincount(byte, minlength=256).double()
            expected = half.numel() / 256
            chi2 = float(((counts - expected) ** 2 / expected).sum())
            assert chi2 < 255 + 6 * (2 * 255) ** 0.5, f"{name} elements: chi2 {chi2:.0f}"
    a, b = even.double() - even.double().mean(), odd.double() - odd.double().mean()
    corr = float((a * b).sum() / ((a * a).sum() * (b * b).sum()).sqrt())
    assert abs(corr) * even.numel() ** 0.5 < _noise.Z_LIMIT, f"halves correlated: {corr:.4f}"


def test_uniforms_use_16_bits_and_independent_halves() -> None:
    _pair_checks(_halves(uniform(derive_seed(4, 2), 0, N)))


def test_the_stream_checks_have_power() -> None:
    """Broken streams fail: 8-bit uniforms, a stuck bit, and both elements of a pair on
    the same half of the word."""
    m = _halves(uniform(derive_seed(4, 3), 0, N))
    with pytest.raises(AssertionError, match="too few distinct"):
        _pair_checks(m & 0xFF00)  # 8 bits
    with pytest.raises(AssertionError, match="too few distinct"):
        _pair_checks(m & ~0x0010)  # one bit stuck at 0
    same = m.clone()
    same[1::2] = m[0::2]
    with pytest.raises(AssertionError, match="halves correlated"):
        _pair_checks(same)


def _worst_bias(u: torch.Tensor, y: torch.Tensor) -> float:
    """max over y of |mean over all u of floor(y + u) - y|, with y + u rounded to fp32 as the
    quantizers compute it."""
    worst = 0.0
    for part in y.split(128):
        t = torch.floor(part[:, None] + u[None, :]).double()
        worst = max(worst, float((t.mean(1) - part.double()).abs().max()))
    return worst


def test_rounding_bias_of_a_16_bit_uniform_is_bounded() -> None:
    """Exhaustively over the 2**16 values of the uniform (rng.py's derivation): the bias of
    floor(y + u) is at most 2**-17 of a step for exact addition, and the fp32 rounding of
    y + u moves at most one of the 2**16 outcomes (another 2**-16): so 3 * 2**-17, for y
    anywhere in the range of codes (|y| <= 128, fractions on and off the 2**-16 grid). A
    stream of 8-bit uniforms would be off by up to 2**-9: the check tells them apart."""
    g = _gen(8)
    y = torch.cat([torch.rand(256, generator=g) * 256 - 128,
                   torch.rand(256, generator=g) * 2 - 1,
                   torch.arange(-128 * 4, 128 * 4, dtype=torch.float32) / 4,
                   torch.tensor([2.0**-18, -(2.0**-18), 127.99999, -127.99999])])
    u16 = (2 * torch.arange(1 << 16) + 1).float() * 2.0**-17
    assert _worst_bias(u16, y) <= 3 * 2.0**-17
    u8 = (2 * torch.arange(1 << 8) + 1).float() * 2.0**-9
    assert _worst_bias(u8, y) > 2.0**-10


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_two_elements_of_a_hash_word_round_independently(backend: str) -> None:
    """The kernels' roundings, not only the stream: elements 2p and 2p + 1 share a hash word
    (low and high half), and 2p + 1 and 2p + 2 are neighbours of two words; both pairings
    give uncorrelated rounding errors. The same check on roundings that reuse one half for
    both elements fails by far (z ~ sqrt(n) / 2)."""
    r = _qwd(backend, 5)

    def part(sl: slice) -> _noise.Rounding:
        return _noise.Rounding(f"[{sl.start}::2]", r.r[sl], r.v[sl], r.f[sl])

    assert abs(_noise.z_score(part(slice(0, None, 2)), part(slice(1, None, 2)))) < _noise.Z_LIMIT
    assert abs(_noise.z_score(part(slice(1, -1, 2)), part(slice(2, None, 2)))) < _noise.Z_LIMIT

    # power: round the same values with the even element's uniform reused by the odd one
    main = torch.randn(N, generator=_gen(9))
    s = main.view(-1, 2048).abs().amax(1).repeat_interleave(2048) / 7
    u = uniform(derive_seed(7, 9), 0, N)
    u[1::2] = u[0::2]
    y = main * (1 / s)
    shared = _noise.rounding("shared", main, torch.floor(y + u).clamp(-7, 7).to(torch.int64), s)
    z = _noise.z_score(_noise.Rounding("even", shared.r[0::2], shared.v[0::2], shared.f[0::2]),
                       _noise.Rounding("odd", shared.r[1::2], shared.v[1::2], shared.f[1::2]))
    assert z > 50
