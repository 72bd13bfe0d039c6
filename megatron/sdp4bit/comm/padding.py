"""How long a bucket must be for the quantized collectives.

[Note: padding rule]
A bucket of ``L`` elements is cut into ``W`` shards of ``S = L / W`` (one per DP rank), and for
the gradient reduce-scatter every shard into ``P`` slices of ``c = S / P``. The two-level
all-to-all sends, per slice, messages made of whole chunks of ``c`` values (intra hop: ``M``
chunks, inter hop: one chunk), so

* ``c`` must hold whole quantization groups of *both* hops (a group never straddles a shard,
  a slice or a chunk) and whole Hadamard blocks;
* every message must keep the wire format's 4-byte alignment
  (:func:`megatron.sdp4bit.quantization.format.check_message_shape`): ``c * bits / 8`` must be
  a multiple of 4, i.e. ``c`` a multiple of ``32 / bits`` (8 at 4 bits, 4 at 8 bits).

The weight all-gather sends one message of ``S`` values per rank, so ``S`` must hold whole
weight groups and be a multiple of ``32 / weight_bits``.

Requiring these of ``c`` (not of the ``M * c`` values of an intra message) makes the divisor
independent of how the DP ranks are spread over nodes: it depends on the DP size only, so a
bucket laid out once works for every topology.
"""

from __future__ import annotations

import math

from megatron.sdp4bit.comm.config import GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.config import SDP4BitConfig, check_bits

# Bytes of alignment every message keeps inside a wire buffer (fp32 scales come first).
_ALIGN_BYTES = 4


def _alignment_elements(bits: int) -> int:
    check_bits("bits", bits)
    return _ALIGN_BYTES * 8 // bits


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value} must be a positive integer")


def required_divisor(dp_size: int, *, weight_group: int | None = None, weight_bits: int = 4,
                     intra_group: int | None = None, intra_bits: int = 8,
                     inter_group: int | None = None, inter_bits: int = 4,
                     slices: int = 1, hadamard_block: int = 0) -> int:
    """The number a bucket's length must be a multiple of (see [Note: padding rule]).

    ``weight_group`` / ``weight_bits``: the quantized parameter all-gather (None = not used).
    ``intra_*`` / ``inter_*``: the two hops of the quantized gradient reduce-scatter (pass both
    group sizes, or neither when gradients are not quantized); ``slices``: pipeline slices P;
    ``hadamard_block``: 0 = off. With nothing quantized the divisor is ``dp_size``.
    """
    _check_positive("dp_size", dp_size)
    _check_positive("slices", slices)
    if (intra_group is None) != (inter_group is None):
        raise ValueError(
            "pass both intra_group and inter_group (the gradient reduce-scatter uses both "
            "hops) or neither"
        )
    shard_unit = 1  # what S must be a multiple of
    if weight_group is not None:
        _check_positive("weight_group", weight_group)
        shard_unit = math.lcm(shard_unit, weight_group, _alignment_elements(weight_bits))
    if intra_group is not None:
        _check_positive("intra_group", intra_group)
        _check_positive("inter_group", inter_group)
        if hadamard_block < 0:
            raise ValueError(f"hadamard_block={hadamard_block} must be >= 0 (0 = off)")
        slice_unit = math.lcm(intra_group, inter_group, max(hadamard_block, 1),
                              _alignment_elements(intra_bits), _alignment_elements(inter_bits))
        shard_unit = math.lcm(shard_unit, slices * slice_unit)
    return dp_size * shard_unit


def divisor_from_config(config: SDP4BitConfig, dp_size: int) -> int:
    """:func:`required_divisor` for whatever ``config`` quantizes."""
    kwargs: dict[str, int] = {}
    if config.quantized_weights:
        kwargs.update(WeightQuantConfig.from_sdp4bit(config).divisor_kwargs())
    if config.quantized_gradients:
        kwargs.update(GradientQuantConfig.from_sdp4bit(config).divisor_kwargs())
    return required_divisor(dp_size, **kwargs)


def pad_numel(numel: int, divisor: int) -> int:
    """The smallest multiple of ``divisor`` that is >= ``numel``."""
    if numel < 0:
        raise ValueError(f"numel={numel} must be >= 0")
    _check_positive("divisor", divisor)
    return -(-numel // divisor) * divisor


def check_padded(numel: int, divisor: int, what: str = "buffer") -> None:
    """Raise ``ValueError`` (with the fix) unless ``numel`` is a multiple of ``divisor``."""
    if numel % divisor:
        raise ValueError(
            f"{what} of {numel} elements is not a multiple of {divisor}: pad it to "
            f"pad_numel({numel}, {divisor}) = {pad_numel(numel, divisor)} "
            "(megatron.sdp4bit.comm.padding)"
        )
