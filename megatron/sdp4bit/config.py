"""The one configuration object of SDP4Bit.

Every SDP4Bit command-line flag is generated from the fields of :class:`SDP4BitConfig`
(``megatron.sdp4bit.training.cli.arguments``), so a flag and its meaning live in one place.
This module imports nothing from the rest of the package: every layer may use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

SUPPORTED_BITS = (4, 8)
KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
"""The kernel backends, the one list of them (``quantization.backend.KernelBackend`` is made
from it; the ``--kernel-backend`` choices are read from the field below)."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_bits(name: str, bits: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is a supported bit width."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}={bits} is not supported: use one of {SUPPORTED_BITS}")


@dataclass(frozen=True)
class SDP4BitConfig:
    """What SDP4Bit quantizes and how. Field ``foo_bar`` is the flag ``--foo-bar``."""

    quantized_weights: bool = False
    """qWD: send 4-bit quantized weight differences in the parameter all-gather."""

    weight_quantization_bits: int = 4
    """Bits of each quantized weight (difference): 4 or 8."""

    wq_group_size: int = 2048
    """Elements sharing one fp32 scale in the weight all-gather."""

    weight_quantization_mode: Literal["diff", "direct"] = "diff"
    """``diff`` = qWD (quantize w_main - w_replica); ``direct`` = the paper's qW ablation
    (quantize the weights themselves)."""

    weight_difference_target: Literal["main", "rounded-main"] = "main"
    """What qWD moves the 16-bit replica towards: ``main`` quantizes the fp32 main weights
    minus the replica (every element's sub-ulp residual is sent again each step);
    ``rounded-main`` quantizes the main weights rounded to the replica's dtype minus the
    replica (zero wherever that rounding did not change), as the authors' code does."""

    quantized_gradients: bool = False
    """TLq: two-level quantized all-to-all in place of the gradient reduce-scatter."""

    gradient_quantization_bits_intra: int = 8
    """Bits on the intra-node hop of the gradient reduce-scatter: 4 or 8."""

    gq_group_size_intra: int = 512
    """Group size on the intra-node hop (the paper's scripts pass 128)."""

    gradient_quantization_bits_inter: int = 4
    """Bits on the inter-node hop of the gradient reduce-scatter: 4 or 8."""

    gq_group_size_inter: int = 128
    """Group size on the inter-node hop."""

    hadamard_transform: bool = False
    """TLq-HS: smooth gradient outliers with a block Hadamard transform before quantizing."""

    hadamard_block_size: int = 32
    """Points of the block Hadamard transform (a power of two dividing both gradient
    group sizes)."""

    gradient_alltoall_pipeline: int = 1
    """Slices P of every shard; slice i's inter-node hop overlaps slice i+1's intra hop."""

    gradients_quantization_start_iteration: int = 0
    """Iterations run with the unquantized reduce-scatter before TLq starts."""

    quantization_rounding: Literal["stochastic", "nearest"] = "stochastic"
    """Rounding of every quantizer: unbiased stochastic rounding or round-to-nearest."""

    dp_ranks_per_node: int | None = None
    """Data-parallel ranks per node N; ``None`` = detect from where the ranks run (host
    name and torchrun's node rank, never the GPU count). N consecutive DP ranks must run on
    one node: a cyclic placement is refused (use ``srun --distribution=block``)."""

    seed: int = 1234
    """Seed of the counter-based stochastic-rounding streams."""

    kernel_backend: Literal[KERNEL_BACKENDS] = "auto"
    """``auto`` = Triton kernels for CUDA tensors (refused, not replaced, when triton cannot
    be imported), compiled CPU kernels for CPU tensors (built on first use with the system C
    compiler); ``torch`` = the pure-torch references; ``triton`` / ``cpu`` force one of the
    compiled backends. All give the same bits."""

    def __post_init__(self) -> None:
        check_bits("weight_quantization_bits", self.weight_quantization_bits)
        check_bits("gradient_quantization_bits_intra", self.gradient_quantization_bits_intra)
        check_bits("gradient_quantization_bits_inter", self.gradient_quantization_bits_inter)
        for name in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 2:
                raise ValueError(f"{name}={value} must be a positive even integer")
        if self.weight_quantization_mode not in ("diff", "direct"):
            raise ValueError(
                f"weight_quantization_mode={self.weight_quantization_mode!r}: use 'diff' or 'direct'"
            )
        if self.weight_difference_target not in ("main", "rounded-main"):
            raise ValueError(f"weight_difference_target={self.weight_difference_target!r}: "
                             "use 'main' or 'rounded-main'")
        if self.weight_difference_target != "main" and (
                not self.quantized_weights or self.weight_quantization_mode != "diff"):
            # Only qWD sends a difference; accepting the setting elsewhere would ignore it.
            raise ValueError(
                f"weight_difference_target={self.weight_difference_target} applies to qWD "
                "only: it needs quantized_weights with weight_quantization_mode=diff")
        if self.quantization_rounding not in ("stochastic", "nearest"):
            raise ValueError(
                f"quantization_rounding={self.quantization_rounding!r}: use 'stochastic' or 'nearest'"
            )
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"kernel_backend={self.kernel_backend!r}: use one of {', '.join(KERNEL_BACKENDS)}"
            )
        if not _is_power_of_two(self.hadamard_block_size):
            raise ValueError(
                f"hadamard_block_size={self.hadamard_block_size} must be a power of two"
            )
        if self.hadamard_transform:
            for name in ("gq_group_size_intra", "gq_group_size_inter"):
                value = getattr(self, name)
                if value % self.hadamard_block_size:
                    raise ValueError(
                        f"{name}={value} is not a multiple of hadamard_block_size="
                        f"{self.hadamard_block_size}"
                    )
        intra, inter = self.gq_group_size_intra, self.gq_group_size_inter
        if intra % inter and inter % intra:
            # Between the hops every rank requantizes the intra hop's sums in inter groups;
            # the compiled kernels need each inter group to read one intra scale or whole
            # intra groups (quantization.checks.check_group_nesting). Checked here so that
            # every backend refuses it at parse time, not at the first collective.
            raise ValueError(
                f"gq_group_size_intra={intra} and gq_group_size_inter={inter} must divide "
                "one another (e.g. 128 and 128, or 512 and 128)"
            )
        if self.gradient_alltoall_pipeline < 1:
            raise ValueError(
                f"gradient_alltoall_pipeline={self.gradient_alltoall_pipeline} must be >= 1"
            )
        if self.gradients_quantization_start_iteration < 0:
            raise ValueError(
                "gradients_quantization_start_iteration="
                f"{self.gradients_quantization_start_iteration} must be >= 0"
            )
        if self.dp_ranks_per_node is not None and self.dp_ranks_per_node < 1:
            raise ValueError(f"dp_ranks_per_node={self.dp_ranks_per_node} must be >= 1")

    @property
    def stochastic(self) -> bool:
        return self.quantization_rounding == "stochastic"

    @property
    def enabled(self) -> bool:
        return self.quantized_weights or self.quantized_gradients

    def describe(self) -> str:
        """One line saying what is quantized and how (the start-up line of every trainer)."""
        parts = []
        if self.quantized_weights:
            name = "qW (direct)"
            if self.weight_quantization_mode == "diff":
                name = "qWD" + (" of the rounded main weights"
                                if self.weight_difference_target == "rounded-main" else "")
            parts.append(f"weights {name} {self.weight_quantization_bits}-bit, "
                         f"group {self.wq_group_size}")
        if self.quantized_gradients:
            name = "TLq-HS" if self.hadamard_transform else "TLq"
            hadamard = (f", Hadamard {self.hadamard_block_size}" if self.hadamard_transform
                        else "")
            parts.append(
                f"gradients {name} intra {self.gradient_quantization_bits_intra}-bit group "
                f"{self.gq_group_size_intra}, inter {self.gradient_quantization_bits_inter}-bit "
                f"group {self.gq_group_size_inter}{hadamard}, pipeline "
                f"{self.gradient_alltoall_pipeline}, from iteration "
                f"{self.gradients_quantization_start_iteration}")
        parts.append(f"{self.quantization_rounding} rounding, {self.kernel_backend} kernels")
        return " | ".join(parts)

    def replace(self, **changes) -> "SDP4BitConfig":
        return dataclasses.replace(self, **changes)
