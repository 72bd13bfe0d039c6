"""What an installed SDP4Bit keeps per run: configs, topology, counters, iteration."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from megatron.sdp4bit.comm import (CollectiveWork, CommStats, ErrorFeedback, GradientQuantConfig,
                                   WeightQuantConfig)
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.quantization.rng import derive_seed

# Kinds of collective, folded into the seed so gradients and weights draw unrelated noise.
KIND_GRAD = 0
KIND_PARAM = 1
KIND_TIED_PARAM = 2  # the shared word embedding: see param_sync.py, [Note: tied embeddings]


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
    iteration_open: bool = False
    """``set_iteration`` was called since the last optimizer step (install.py, [Note: an
    iteration without set_iteration])."""
    iteration_ever_set: bool = False
    """``set_iteration`` was called at least once (for the wording of the refusal)."""
    error_feedback: dict[int, ErrorFeedback] = field(default_factory=dict)
    """Per bucket id: the inter-hop error state (``--gradient-error-feedback``), else empty."""
    expert_stats: CommStats | None = None
    """The part of :attr:`stats` sent for the expert-parallel buckets (set at install)."""
    grad_syncs_since_step: Counter = field(default_factory=Counter)
    """Per bucket id: gradient reduce-scatters (quantized or not) completed since the optimizer
    that owns the bucket last stepped; a step that finds a bucket of its own at zero would
    apply gradients that no rank reduced (step_checks.py, [Note: a loop that never reduces
    its gradients])."""
    params_due: dict[int, int] = field(default_factory=dict)
    """Bucket id -> the iteration of the optimizer step whose weight difference the bucket's
    next qWD all-gather sends; a bucket with no step since its last all-gather is absent
    (param_sync.py, [Note: a parameter sync sends each step once])."""

    def seed(self, kind: int, bucket_id: int, group_id: int,
             iteration: int | None = None) -> int:
        """Rounding-noise seed of one collective: (user seed, iteration, bucket, kind, group).

        ``group_id`` (the lowest global rank of the DP group) keeps the streams of different
        DP groups (other TP/PP ranks) apart; the comm layer adds the DP rank and the hop.
        ``iteration``: the iteration the noise belongs to (default the one in progress); a
        qWD all-gather passes the one of the step it sends, whenever it runs (param_sync.py,
        [Note: a parameter sync sends each step once]).
        """
        if iteration is None:
            iteration = self.iteration
        parts = (self.config.seed, iteration, bucket_id, kind, group_id)
        return derive_seed(*parts)

    def require_iteration(self, what: str) -> None:
        """Raise (one line) if ``what`` comes in an iteration that never called
        ``set_iteration`` (install.py, [Note: an iteration without set_iteration])."""
        if self.iteration_open:
            return
        when = ("before the first handle.set_iteration(...)" if not self.iteration_ever_set
                else f"after iteration {self.iteration}'s optimizer step without a new "
                "handle.set_iteration(...)")
        raise RuntimeError(
            f"SDP4Bit: {what} came {when}: call handle.set_iteration(iteration) at the start "
            "of every iteration (it seeds the rounding noise, which would otherwise repeat "
            "the last iteration's, and starts handle.step_stats())")

    @property
    def quantize_gradients_now(self) -> bool:
        return (self.config.quantized_gradients
                and self.iteration >= self.config.gradients_quantization_start_iteration)
