"""What an installed SDP4Bit keeps per run: configs, topology, counters, iteration."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron.sdp4bit.comm import CollectiveWork, CommStats, GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.quantization.rng import derive_seed

# Kinds of collective, folded into the seed so gradients and weights draw unrelated noise.
KIND_GRAD = 0
KIND_PARAM = 1


@dataclass
class RunState:
    """Shared by the replaced methods of every bucket group and optimizer of one install."""

    config: SDP4BitConfig
    grad_config: GradientQuantConfig
    weight_config: WeightQuantConfig
    stats: CommStats = field(default_factory=CommStats)
    iteration: int = 0
    """The training iteration in progress (set by the trainer through the handle)."""
    grad_calls: Counter = field(default_factory=Counter)
    """Quantized reduce-scatters issued, per bucket id."""
    param_calls: Counter = field(default_factory=Counter)
    """Quantized all-gathers issued, per bucket id."""
    unquantized_grad_calls: Counter = field(default_factory=Counter)
    """megatron-core reduce-scatters issued before gradients_quantization_start_iteration."""
    pending_grad_works: list[tuple[int, CollectiveWork]] = field(default_factory=list)
    """(bucket id, work) of the async quantized reduce-scatters whose inter-node hop is not
    issued yet, in the order they were started (grad_sync.py, [Note: advancing earlier
    buckets])."""
    early_grad_advances: Counter = field(default_factory=Counter)
    """Per bucket id: reduce-scatters advanced by a later bucket's start (before the wait)."""

    def seed(self, kind: int, bucket_id: int, group_id: int) -> int:
        """Rounding-noise seed of one collective: (user seed, iteration, bucket, kind, group).

        ``group_id`` (the lowest global rank of the DP group) keeps the streams of different
        DP groups (other TP/PP ranks) apart; the comm layer adds the DP rank and the hop.
        """
        return derive_seed(self.config.seed, self.iteration, bucket_id, kind, group_id)

    @property
    def quantize_gradients_now(self) -> bool:
        return (self.config.quantized_gradients
                and self.iteration >= self.config.gradients_quantization_start_iteration)
