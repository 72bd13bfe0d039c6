"""Configuration of the quantized collectives (one frozen dataclass per collective).

These are what the collectives take; :meth:`from_sdp4bit` builds them from the command-line
configuration :class:`~megatron.sdp4bit.config.SDP4BitConfig`, so the comm layer can also be
used without it (benchmarks, tests, other frameworks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.sdp4bit.config import ACCEPTED_BITS, SDP4BitConfig, check_bits
from megatron.sdp4bit.quantization.backend import KernelBackend


def _check_group(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0 or value % 2:
        raise ValueError(f"{name}={value} must be a positive even integer")


def _check_backend(value: str) -> None:
    try:
        KernelBackend(value)
    except ValueError:
        raise ValueError(f"kernel_backend={value!r}: use one of "
                         f"{', '.join(b.value for b in KernelBackend)}") from None


@dataclass(frozen=True)
class GradientQuantConfig:
    """TLq / TLq-HS: the two-level quantized gradient reduce-scatter (docs/design.md §4)."""

    intra_bits: int = 8
    """Bits on the intra-node hop (and on the single hop when all ranks share one node)."""

    intra_group_size: int = 512
    """Elements per fp32 scale on the intra-node hop."""

    inter_bits: int = 4
    """Bits on the inter-node hop (and on the single hop when every node has one rank): 2, 4
    or 8; the intra hop takes 4 or 8."""

    inter_group_size: int = 128
    """Elements per fp32 scale on the inter-node hop."""

    hadamard_block: int = 0
    """Points of the block Hadamard transform applied before quantizing; 0 = off (TLq)."""

    pipeline_slices: int = 1
    """Slices P per shard; slice i's inter hop runs while slice i+1's intra hop is in flight."""

    stochastic: bool = True
    """Stochastic rounding (unbiased) if True, round-to-nearest otherwise."""

    kernel_backend: str = "auto"
    """Which implementation runs the fused ops: 'auto', 'torch', 'triton' or 'cpu'."""

    def __post_init__(self) -> None:
        check_bits("intra_bits", self.intra_bits,
                   ACCEPTED_BITS["gradient_quantization_bits_intra"])
        check_bits("inter_bits", self.inter_bits,
                   ACCEPTED_BITS["gradient_quantization_bits_inter"])
        _check_group("intra_group_size", self.intra_group_size)
        _check_group("inter_group_size", self.inter_group_size)
        if self.inter_bits * self.inter_group_size % 8:
            raise ValueError(f"inter_group_size={self.inter_group_size} must be a multiple of 4 "
                             f"at {self.inter_bits} bits (four codes per byte)")
        if self.hadamard_block:
            h = self.hadamard_block
            if h < 0 or h & (h - 1):
                raise ValueError(f"hadamard_block={h} must be 0 (off) or a power of two")
            for name in ("intra_group_size", "inter_group_size"):
                if getattr(self, name) % h:
                    raise ValueError(
                        f"{name}={getattr(self, name)} is not a multiple of hadamard_block={h}: "
                        "use a group size that the Hadamard block divides"
                    )
        if not isinstance(self.pipeline_slices, int) or self.pipeline_slices < 1:
            raise ValueError(f"pipeline_slices={self.pipeline_slices} must be an integer >= 1")
        _check_backend(self.kernel_backend)

    @classmethod
    def from_sdp4bit(cls, config: SDP4BitConfig) -> "GradientQuantConfig":
        return cls(
            intra_bits=config.gradient_quantization_bits_intra,
            intra_group_size=config.gq_group_size_intra,
            inter_bits=config.gradient_quantization_bits_inter,
            inter_group_size=config.gq_group_size_inter,
            hadamard_block=config.hadamard_block_size if config.hadamard_transform else 0,
            pipeline_slices=config.gradient_alltoall_pipeline,
            stochastic=config.stochastic,
            kernel_backend=config.kernel_backend,
        )

    def divisor_kwargs(self) -> dict[str, int]:
        """This config's arguments of :func:`~megatron.sdp4bit.comm.padding.required_divisor`."""
        return dict(intra_group=self.intra_group_size, intra_bits=self.intra_bits,
                    inter_group=self.inter_group_size, inter_bits=self.inter_bits,
                    slices=self.pipeline_slices, hadamard_block=self.hadamard_block)


@dataclass(frozen=True)
class WeightQuantConfig:
    """qWD (and the qW ablation): the quantized parameter all-gather (docs/design.md §4-5)."""

    bits: int = 4
    """Bits per quantized weight difference (or weight, in direct mode)."""

    group_size: int = 2048
    """Elements per fp32 scale."""

    mode: Literal["diff", "direct"] = "diff"
    """'diff' = qWD (send Q(main - replica), add it); 'direct' = qW (send Q(main), overwrite)."""

    target: Literal["main", "rounded-main"] = "main"
    """qWD only: 'main' sends Q(main - replica); 'rounded-main' sends
    Q(round_to_replica_dtype(main) - replica), zero where the rounded weight is unchanged."""

    stochastic: bool = True
    """Stochastic rounding (unbiased) if True, round-to-nearest otherwise."""

    kernel_backend: str = "auto"
    """Which implementation runs the fused ops: 'auto', 'torch', 'triton' or 'cpu'."""

    def __post_init__(self) -> None:
        check_bits("bits", self.bits, ACCEPTED_BITS["weight_quantization_bits"])
        _check_group("group_size", self.group_size)
        if self.mode not in ("diff", "direct"):
            raise ValueError(f"mode={self.mode!r}: use 'diff' (qWD) or 'direct' (qW)")
        if self.target not in ("main", "rounded-main"):
            raise ValueError(f"target={self.target!r}: use 'main' or 'rounded-main'")
        if self.target != "main" and self.mode != "diff":
            raise ValueError(f"target={self.target!r} applies to mode 'diff' (qWD) only")
        _check_backend(self.kernel_backend)

    @classmethod
    def from_sdp4bit(cls, config: SDP4BitConfig) -> "WeightQuantConfig":
        return cls(
            bits=config.weight_quantization_bits,
            group_size=config.wq_group_size,
            mode=config.weight_quantization_mode,
            target=config.weight_difference_target,
            stochastic=config.stochastic,
            kernel_backend=config.kernel_backend,
        )

    def divisor_kwargs(self) -> dict[str, int]:
        """This config's arguments of :func:`~megatron.sdp4bit.comm.padding.required_divisor`."""
        return dict(weight_group=self.group_size, weight_bits=self.bits)
