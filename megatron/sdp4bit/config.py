"""The one configuration object of SDP4Bit.

Every SDP4Bit command-line flag is generated from the fields of :class:`SDP4BitConfig`
(``megatron.sdp4bit.training.cli.arguments``), so a flag and its meaning live in one place.
This module imports nothing from the rest of the package: every layer may use it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

SUPPORTED_BITS = (2, 4, 8)
"""Bit widths the quantizer, its wire format and every kernel backend implement."""
ACCEPTED_BITS = {
    "weight_quantization_bits": (4, 8),
    "gradient_quantization_bits_intra": (4, 8),
    "gradient_quantization_bits_inter": (2, 4, 8),
}
"""The bit widths each flag accepts. 2 bits are offered on the inter-node gradient hop only:
that is where bytes are scarcest, and the only place they are tested end to end."""
KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
"""The kernel backends, the one list of them (``quantization.backend.KernelBackend`` is made
from it; the ``--kernel-backend`` choices are read from the field below)."""


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_bits(name: str, bits: int, accepted: tuple[int, ...] = SUPPORTED_BITS) -> None:
    """Raise ``ValueError`` unless ``bits`` is one of ``accepted``."""
    if bits not in accepted:
        raise ValueError(f"{name}={bits} is not supported: use one of {accepted}")


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
    """Bits on the inter-node hop of the gradient reduce-scatter: 2, 4 or 8 (2 bits: the
    levels -1, 0, 1 times the group's absmax)."""

    gq_group_size_inter: int = 128
    """Group size on the inter-node hop."""

    gradient_error_feedback: bool = False
    """Error feedback on the inter-node hop: each rank adds what its last inter-node
    requantization of a bucket lost before the next one (memory: 1/N of the gradient
    buckets, at 8 bits by default)."""

    gradient_error_feedback_decay: float = 0.0
    """Error feedback: weight of the previous error in each update, in [0, 1) (0 = classic
    error feedback)."""

    gradient_error_feedback_reset_interval: int = 0
    """Error feedback: zero the error every this many reduce-scatters of a bucket (0 =
    never)."""

    gradient_error_feedback_storage: Literal["int8", "fp32"] = "int8"
    """Error feedback: keep the error at 8 bits (groups of the inter hop) or in fp32."""

    gradient_error_feedback_rounding: Literal["stochastic", "nearest"] = "stochastic"
    """Error feedback: rounding of the compensated inter-node quantization: stochastic
    (as --quantization-rounding) or round-to-nearest, the classic form of error feedback
    (the other quantizers keep --quantization-rounding)."""

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
        for name, accepted in ACCEPTED_BITS.items():
            check_bits(name, getattr(self, name), accepted)
        for name in ("wq_group_size", "gq_group_size_intra", "gq_group_size_inter"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value % 2:
                raise ValueError(f"{name}={value} must be a positive even integer")
        if self.gradient_quantization_bits_inter == 2 and self.gq_group_size_inter % 4:
            # Four 2-bit codes per byte: a group must fill whole bytes.
            raise ValueError(f"gq_group_size_inter={self.gq_group_size_inter} must be a "
                             "multiple of 4 at 2 bits (four codes per byte)")
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
        ef_knobs = {"gradient_error_feedback_decay": 0.0,
                    "gradient_error_feedback_reset_interval": 0,
                    "gradient_error_feedback_storage": "int8",
                    "gradient_error_feedback_rounding": "stochastic"}
        if not self.gradient_error_feedback:
            for name, default in ef_knobs.items():
                if getattr(self, name) != default:
                    raise ValueError(f"{name}={getattr(self, name)} needs "
                                     "gradient_error_feedback=True")
        elif not self.quantized_gradients:
            raise ValueError("gradient_error_feedback=True needs quantized_gradients=True: it "
                             "compensates the quantized inter-node hop")
        if not 0.0 <= self.gradient_error_feedback_decay < 1.0:
            raise ValueError(f"gradient_error_feedback_decay={self.gradient_error_feedback_decay}"
                             " must be in [0, 1)")
        if self.gradient_error_feedback_reset_interval < 0:
            raise ValueError("gradient_error_feedback_reset_interval="
                             f"{self.gradient_error_feedback_reset_interval} must be >= 0")
        if self.gradient_error_feedback_storage not in ("int8", "fp32"):
            raise ValueError("gradient_error_feedback_storage="
                             f"{self.gradient_error_feedback_storage!r}: use 'int8' or 'fp32'")
        if self.gradient_error_feedback_rounding not in ("stochastic", "nearest"):
            raise ValueError("gradient_error_feedback_rounding="
                             f"{self.gradient_error_feedback_rounding!r}: use 'stochastic' or "
                             "'nearest'")
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
                f"{self.gradients_quantization_start_iteration}"
                + (", error feedback on the inter hop (decay "
                   f"{self.gradient_error_feedback_decay}, "
                   + (f"reset every {self.gradient_error_feedback_reset_interval} calls"
                      if self.gradient_error_feedback_reset_interval else "never reset")
                   + f", {self.gradient_error_feedback_storage} storage"
                   + (", round-to-nearest" if self.gradient_error_feedback_rounding == "nearest"
                      else "") + ")"
                   if self.gradient_error_feedback else ""))
        parts.append(f"{self.quantization_rounding} rounding, {self.kernel_backend} kernels")
        return " | ".join(parts)

    def replace(self, **changes) -> "SDP4BitConfig":
        return dataclasses.replace(self, **changes)
