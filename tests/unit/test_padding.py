"""The padding rule of the quantized collectives (megatron.sdp4bit.comm.padding)."""

from __future__ import annotations

import math

import pytest

from megatron.sdp4bit.comm.padding import (
    check_padded,
    divisor_from_config,
    pad_numel,
    required_divisor,
)
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.quantization.format import check_message_shape


def test_nothing_quantized_needs_only_the_dp_size() -> None:
    assert required_divisor(6) == 6


def test_weight_path() -> None:
    assert required_divisor(4, weight_group=2048) == 4 * 2048
    # a small group still needs 4-byte aligned payloads: 8 values at 4 bits, 4 at 8 bits
    assert required_divisor(3, weight_group=2, weight_bits=4) == 3 * 8
    assert required_divisor(3, weight_group=2, weight_bits=8) == 3 * 4


def test_gradient_path_is_per_slice() -> None:
    # c = L / (W P) must hold whole groups of both hops and whole Hadamard blocks
    assert required_divisor(8, intra_group=512, inter_group=128, slices=1) == 8 * 512
    assert required_divisor(8, intra_group=128, inter_group=128, slices=4,
                            hadamard_block=32) == 8 * 4 * 128
    assert required_divisor(2, intra_group=96, inter_group=64, slices=3) == 2 * 3 * 192


def test_both_paths_take_the_lcm() -> None:
    d = required_divisor(4, weight_group=2048, intra_group=512, inter_group=128, slices=8)
    assert d == 4 * math.lcm(2048, 8 * 512)


@pytest.mark.parametrize("bits_intra,bits_inter", [(8, 4), (4, 4), (8, 8), (4, 8), (8, 2),
                                                   (4, 2)])
@pytest.mark.parametrize("n,m", [(2, 1), (1, 2), (2, 3), (4, 2)])
def test_every_message_of_a_padded_bucket_is_well_formed(bits_intra: int, bits_inter: int,
                                                         n: int, m: int) -> None:
    """What the divisor promises, checked against the wire format's own rule."""
    w, p = n * m, 2
    gi = 12 if bits_inter == 2 else 6  # a 2-bit group fills whole bytes
    d = required_divisor(w, weight_group=6, intra_group=2, intra_bits=bits_intra,
                         inter_group=gi, inter_bits=bits_inter, slices=p)
    for length in (d, 3 * d):
        shard = length // w
        c = shard // p
        check_message_shape(shard, 4, 6)  # weight all-gather message
        check_message_shape(m * c, bits_intra, 2)  # intra message: M chunks of c
        check_message_shape(c, bits_inter, gi)  # inter message
        check_message_shape(shard, bits_intra, 2)  # single intra hop (M = 1)
        check_message_shape(shard, bits_inter, gi)  # single inter hop (N = 1)


def test_pad_numel() -> None:
    assert pad_numel(0, 64) == 0
    assert pad_numel(1, 64) == 64
    assert pad_numel(64, 64) == 64
    assert pad_numel(65, 64) == 128
    with pytest.raises(ValueError, match="numel=-1 must be >= 0"):
        pad_numel(-1, 64)
    with pytest.raises(ValueError, match="divisor=0 must be a positive integer"):
        pad_numel(10, 0)


def test_check_padded_says_how_to_fix() -> None:
    check_padded(128, 64)
    with pytest.raises(ValueError, match=r"bucket of 100 elements is not a multiple of 64: "
                                         r"pad it to pad_numel\(100, 64\) = 128"):
        check_padded(100, 64, "bucket")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pass both intra_group and inter_group"):
        required_divisor(4, intra_group=128)
    with pytest.raises(ValueError, match="dp_size=0 must be a positive integer"):
        required_divisor(0)
    with pytest.raises(ValueError, match="slices=0 must be a positive integer"):
        required_divisor(4, intra_group=128, inter_group=128, slices=0)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        required_divisor(4, weight_group=128, weight_bits=3)


def test_divisor_from_config() -> None:
    base = SDP4BitConfig()
    assert divisor_from_config(base, 4) == 4
    weights = base.replace(quantized_weights=True)
    assert divisor_from_config(weights, 4) == required_divisor(4, weight_group=2048)
    both = base.replace(quantized_weights=True, quantized_gradients=True,
                        gradient_alltoall_pipeline=4, hadamard_transform=True,
                        gq_group_size_intra=128)
    assert divisor_from_config(both, 8) == required_divisor(
        8, weight_group=2048, intra_group=128, inter_group=128, slices=4, hadamard_block=32)
