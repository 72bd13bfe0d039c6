"""Unit tests of the torch reference quantizer (docs/design.md: numerics).

Error bounds used below, for a group with scale ``s = absmax / qmax``:

* round to nearest: ``|D(Q(x)) - x| <= s / 2``;
* stochastic: ``q = floor(x * (1/s) + u)`` lands on one of the two grid points around ``x/s``,
  so ``|D(Q(x)) - x| < s``; and it is unbiased: ``E[D(Q(x))] = x`` with per-trial variance
  ``p(1-p) s^2 <= s^2 / 4``.

fp32 arithmetic adds a relative error of a few ulps on top: ``SLACK`` covers it.
"""

import math

import pytest
import torch

from megatron.sdp4bit.quantization import (
    QuantizedTensor,
    dequantize,
    hadamard_transform,
    inverse_hadamard_transform,
    quantize,
)
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization.hadamard import hadamard_matrix
from megatron.sdp4bit.quantization.rng import derive_seed, uniform

SLACK = 1e-5
BITS = [2, 4, 8]


def _group_scales(x: torch.Tensor, group_size: int, bits: int) -> torch.Tensor:
    """Per-element scale, computed independently of the implementation."""
    g = x.float().reshape(-1, group_size)
    s = g.abs().amax(dim=1) / (2 ** (bits - 1) - 1)
    return s.repeat_interleave(group_size)


def _codes(q: QuantizedTensor) -> torch.Tensor:
    return fmt.unpack_codes(q.payload, q.bits).to(torch.int64) - 2 ** (q.bits - 1)


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_nearest_equals_formula(bits):
    torch.manual_seed(0)
    x = torch.randn(4 * 64) * torch.linspace(0.1, 10, 4 * 64)
    q = quantize(x, bits, 64, stochastic=False)
    qm = 2 ** (bits - 1) - 1
    s = x.reshape(-1, 64).abs().amax(1) / qm
    inverse = 1.0 / s  # rounded once per group (rng.py, [Note: rounding stream versions])
    expected = torch.floor(x.reshape(-1, 64) * inverse[:, None] + 0.5).clamp(-qm, qm)
    expected = expected.reshape(-1)
    assert torch.equal(q.scales, s)
    assert torch.equal(_codes(q), expected.to(torch.int64))
    assert torch.equal(dequantize(q), (expected.reshape(-1, 64) * s[:, None]).reshape(-1))


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_every_code_survives_pack_unpack(bits):
    n = 2**bits
    # every code, and every combination of the codes that share a byte
    codes = torch.arange(n, dtype=torch.uint8)
    if bits < 8:
        codes = torch.cartesian_prod(*[codes] * (8 // bits)).reshape(-1).to(torch.uint8)
    packed = fmt.pack_codes(codes, bits)
    assert packed.numel() == codes.numel() * bits // 8
    assert torch.equal(fmt.unpack_codes(packed, bits), codes)


def test_nibble_order_is_low_first():
    packed = fmt.pack_codes(torch.tensor([0x3, 0xA], dtype=torch.uint8), 4)
    assert packed.tolist() == [0xA3]


def test_two_bit_order_is_low_first():
    codes = torch.tensor([1, 2, 3, 0, 3, 3, 1, 2], dtype=torch.uint8)
    packed = fmt.pack_codes(codes, 2)
    assert packed.tolist() == [0b00_11_10_01, 0b10_01_11_11]


def test_two_bits_are_three_levels_of_absmax():
    """qmax = 2**(2-1) - 1 = 1: the scale is the absmax, the values -s, 0, s."""
    x = torch.tensor([0.2, -1.0, 0.6, 0.0, -0.4, 0.5, 0.49, -0.51])
    q = quantize(x, 2, 8, stochastic=False)  # padded to 16 values: two groups
    assert q.scales.tolist() == [1.0, 0.0]
    assert _codes(q).tolist() == [0, -1, 1, 0, 0, 1, 0, -1] + [0] * 8  # ties round upwards
    levels = set(dequantize(quantize(torch.randn(4096), 2, 128, seed=3)).unique().sign().tolist())
    assert levels == {-1.0, 0.0, 1.0}


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
def test_per_element_error_bound(bits, stochastic, dtype):
    torch.manual_seed(1)
    x = (torch.randn(8 * 128) * 3).to(dtype)
    q = quantize(x, bits, 128, stochastic=stochastic, seed=7)
    err = (dequantize(q) - x.float()).abs()
    s = _group_scales(x, 128, bits)
    if stochastic:
        assert bool((err < s * (1 + SLACK)).all())
    else:
        assert bool((err <= s / 2 * (1 + SLACK)).all())


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_stochastic_rounding_is_unbiased(bits):
    """Mean of n=1000 draws: std <= s / (2 sqrt(n)); assert within 6 std per element."""
    torch.manual_seed(2)
    n = 1000
    x = torch.randn(256)
    acc = torch.zeros_like(x)
    for i in range(n):
        acc += dequantize(quantize(x, bits, 64, stochastic=True, seed=derive_seed(5, i)))
    s = _group_scales(x, 64, bits)
    bound = 6 * s / (2 * math.sqrt(n))
    assert bool(((acc / n - x).abs() <= bound).all())
    # and round to nearest is biased on the same data: the test can tell the difference
    nearest = dequantize(quantize(x, bits, 64, stochastic=False))
    assert ((nearest - x).abs() > bound).any()


def test_same_seed_same_bytes():
    x = torch.randn(512)
    a = quantize(x, 4, 128, seed=11)
    b = quantize(x, 4, 128, seed=11)
    c = quantize(x, 4, 128, seed=12)
    assert torch.equal(a.data, b.data)
    assert not torch.equal(a.data, c.data)


def _mix32_exact(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_uniform_matches_exact_integer_hash():
    """The vectorized int64 hash (which relies on wrapping multiplies) equals exact integers:
    elements 2p and 2p + 1 take the low and high 16 bits of the word of pair p."""
    seed = 0x0123456789ABCDEF
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    idx = [0, 1, 2, 3, 12345, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    expected = []
    for i in idx:
        word = _mix32_exact(_mix32_exact((i >> 1) ^ k0) ^ k1)
        half = (word >> 16) if i & 1 else (word & 0xFFFF)
        expected.append((2 * half + 1) * 2.0**-17)
    got = [float(uniform(seed, i, 1)[0]) for i in idx]
    assert got == expected


def test_uniform_stream_is_counter_based():
    full = uniform(99, 0, 1000)
    assert torch.equal(uniform(99, 300, 200), full[300:500])
    assert torch.equal(uniform(99, 301, 7), full[301:308])  # odd start and length
    assert float(full.min()) >= 2.0**-17 and float(full.max()) <= 1 - 2.0**-17
    assert abs(float(uniform(3, 0, 100_000).mean()) - 0.5) < 0.005  # 5 std of U[0,1) mean


@pytest.mark.parametrize("numel", [1, 100, 129, 1000], ids=lambda n: f"n{n}")
def test_tail_is_padded_and_shape_restored(numel):
    x = torch.randn(numel)
    q = quantize(x, 4, 128, stochastic=False)
    assert q.numel == numel
    assert q.padded_numel % 128 == 0 and q.padded_numel >= numel
    y = dequantize(q)
    assert y.shape == x.shape
    assert bool(((y - x).abs() <= _group_scales(
        torch.cat([x, x.new_zeros(q.padded_numel - numel)]), 128, 4)[:numel] / 2 * (1 + SLACK)
    ).all())


def test_shape_and_dtype_are_restored():
    x = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    y = dequantize(quantize(x, 8, 16), dtype=torch.bfloat16)
    assert y.shape == (3, 5, 7) and y.dtype == torch.bfloat16


def test_empty_input():
    q = quantize(torch.zeros(0), 4, 128)
    assert q.wire_bytes == 0 and q.numel == 0
    assert dequantize(q).shape == (0,)


def test_all_zero_group_has_zero_scale():
    x = torch.randn(3 * 64)
    x[64:128] = 0
    q = quantize(x, 4, 64)
    assert q.scales[1].item() == 0.0
    y = dequantize(q)
    assert bool((y[64:128] == 0).all()) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"b{b}")
def test_non_finite_group_comes_back_non_finite(bad, bits):
    x = torch.randn(4 * 32)
    x[32 + 17] = bad
    y = dequantize(quantize(x, bits, 32))
    assert not bool(torch.isfinite(y[32:64]).any())
    assert bool(torch.isfinite(y[:32]).all()) and bool(torch.isfinite(y[64:]).all())


def test_wire_bytes_formula():
    q = quantize(torch.randn(4096), 4, 2048)
    assert q.wire_bytes == 4096 // 2 + 2 * 4
    q = quantize(torch.randn(1024), 8, 128)
    assert q.wire_bytes == 1024 + 8 * 4
    q = quantize(torch.randn(1024), 2, 128)
    assert q.wire_bytes == 1024 // 4 + 8 * 4
    # 32 / (2 + 32/128) = 14.2x fewer bytes than fp32
    assert round(1024 * 4 / q.wire_bytes, 1) == 14.2


def test_two_bit_group_must_fill_bytes():
    with pytest.raises(ValueError, match="group_size=6 must be a multiple of 4 at 2 bits"):
        quantize(torch.randn(64), 2, 6)


@pytest.mark.parametrize("block", [1, 2, 8, 32, 128], ids=lambda b: f"H{b}")
def test_hadamard_is_orthogonal(block):
    h = hadamard_matrix(block).double()
    assert torch.allclose(h @ h.T, torch.eye(block, dtype=torch.float64), atol=1e-6)


def test_hadamard_inverse_round_trips():
    x = torch.randn(64 * 32) * 100
    y = inverse_hadamard_transform(hadamard_transform(x, 32), 32)
    assert float((y - x).norm() / x.norm()) < 1e-6


def test_hadamard_lowers_4bit_error_on_outliers():
    torch.manual_seed(3)
    # about one outlier per group, 10x the typical magnitude (gradient-like heavy tail)
    x = torch.randn(256 * 128)
    x[torch.randint(0, x.numel(), (x.numel() // 128,))] *= 10.0
    plain = (dequantize(quantize(x, 4, 128, stochastic=False)) - x).norm() / x.norm()
    smoothed = (dequantize(quantize(x, 4, 128, hadamard_block=32, stochastic=False))
                - x).norm() / x.norm()
    # measured: 0.28 without and 0.11 with the transform
    assert smoothed < 0.5 * plain


@pytest.mark.parametrize("bits", [0, 1, 3, 16], ids=lambda b: f"b{b}")
def test_unsupported_bits_are_refused(bits):
    with pytest.raises(ValueError, match=f"bits={bits} is not supported"):
        quantize(torch.randn(64), bits, 64)


def test_group_not_multiple_of_hadamard_block_is_refused():
    with pytest.raises(ValueError, match="group_size=48 is not a multiple of hadamard_block=32"):
        quantize(torch.randn(96), 4, 48, hadamard_block=32)


def test_hadamard_block_not_power_of_two_is_refused():
    with pytest.raises(ValueError, match="hadamard_block=24 must be a power of two"):
        quantize(torch.randn(96), 4, 48, hadamard_block=24)
    with pytest.raises(ValueError, match="hadamard_block=12 must be a power of two"):
        hadamard_transform(torch.randn(96), 12)


@pytest.mark.parametrize("group_size", [0, -8, 7], ids=lambda g: f"g{g}")
def test_bad_group_size_is_refused(group_size):
    with pytest.raises(ValueError, match=f"group_size={group_size} must be a positive even"):
        quantize(torch.randn(64), 4, group_size)


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.arange(64), 4, 64)
