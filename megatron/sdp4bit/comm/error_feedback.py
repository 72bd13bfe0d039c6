"""Error feedback on the inter-node hop of the two-level gradient reduce-scatter.

[Note: error feedback on the inter-node hop]
Between the hops every rank sums the N intra-node messages of a slice into ``t`` (``M * c``
values: the node's partial sums of the M chunks this rank forwards, one per node) and
requantizes them at the inter bits. With error feedback it keeps what that requantization
lost and adds it back at the next call of the same bucket (LoCo's form of error feedback):

* ``v = t + e``                           (compensate)
* ``sent = D(Q(v))``                      (quantize as without feedback, same random stream)
* ``e <- decay * e + (1 - decay) * (v - sent)``   (update; ``decay = 0``: classic feedback)
* ``e <- 0`` before every ``reset_interval``-th call (0 = never): an old error need not fit
  the current gradients;
* ``Q`` rounds as the hop does (stochastic by default) or, with ``rounding="nearest"``
  (``--gradient-error-feedback-rounding nearest``), to nearest: the classic form, where the
  feedback corrects the rounding's bias instead of adding a second source of noise;
* ``e`` is stored at 8 bits (``int8``: the 8-bit group quantizer, round to nearest, groups
  of the inter hop) or in fp32.

With ``decay = 0`` and fp32 storage the sums telescope: over calls 1..T the bucket's inter
messages carry ``sum_t t_t - e_T``, so what the hop loses over T steps is one step's error,
not T of them. Non-finite values (an iteration whose gradients overflow, which the optimizer
skips) leave the error where it was, element by element, so one bad step cannot poison the
state.

[Note: a non-finite saved error]
So a run never holds, and never saves, a non-finite error. A checkpoint whose state decodes
to NaN or Inf (fp32 storage: a value; int8: a group scale) was changed after it was written,
and adding it back would make every later inter-hop message non-finite: each step skipped,
on every resume of that checkpoint. Such a state is not loaded: the error starts from zero
on every rank, with one line naming the rank and bucket (:func:`first_damaged` agrees on it
across ranks, so every rank says and does the same). Zero rather than a refusal: the error
is a correction of at most one step's quantization error per element, not model state;
zero is what every run starts from and what a resume on another layout uses; and the
weights and the optimizer, which the checkpoint's integrity rests on, are read as usual. A
refusal would leave a checkpoint that no flag could resume.

The state holds ``P * M * c = M * S`` values per bucket (S the shard): ``1 / N`` of the
bucket, the size of what the rank sends on the inter hop, not of the whole gradient. It
applies to the two-hop path only (N > 1 and M > 1): with one node there is no inter-node
hop, and with one rank per node the single hop quantizes the rank's raw input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from megatron.sdp4bit.comm.config import GradientQuantConfig
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.format import message_nbytes

STORAGE_BITS = 8


@dataclass(frozen=True)
class ErrorFeedbackConfig:
    """The knobs of error feedback (see [Note: error feedback on the inter-node hop])."""

    decay: float = 0.0
    """Weight of the previous error in the update; 0 keeps the latest error only."""

    reset_interval: int = 0
    """Zero the error before every this-many-th call of a bucket; 0 = never."""

    storage: Literal["int8", "fp32"] = "int8"
    """How the error is kept between calls."""

    rounding: Literal["stochastic", "nearest"] = "stochastic"
    """Rounding of the compensated quantization: ``stochastic`` follows the hop's (the
    gradient config's), ``nearest`` rounds to nearest whatever the hop's."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"decay={self.decay} must be in [0, 1)")
        if not isinstance(self.reset_interval, int) or self.reset_interval < 0:
            raise ValueError(f"reset_interval={self.reset_interval} must be an integer >= 0")
        if self.storage not in ("int8", "fp32"):
            raise ValueError(f"storage={self.storage!r}: use 'int8' or 'fp32'")
        if self.rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding={self.rounding!r}: use 'stochastic' or 'nearest'")

    @classmethod
    def from_sdp4bit(cls, config: SDP4BitConfig) -> "ErrorFeedbackConfig | None":
        """None unless ``config.gradient_error_feedback``."""
        if not config.gradient_error_feedback:
            return None
        return cls(decay=config.gradient_error_feedback_decay,
                   reset_interval=config.gradient_error_feedback_reset_interval,
                   storage=config.gradient_error_feedback_storage,
                   rounding=config.gradient_error_feedback_rounding)


def check_two_hops(ranks_per_node: int, nodes: int) -> None:
    if ranks_per_node < 2 or nodes < 2:
        raise ValueError(
            f"--gradient-error-feedback applies to the inter-node hop of the two-hop path: it "
            f"needs more than one DP rank per node and more than one node (here "
            f"{ranks_per_node} x {nodes}); drop the flag")


class ErrorFeedback:
    """The inter-hop error of one bucket on one rank (one per bucket, kept across calls)."""

    def __init__(self, bucket_numel: int, ranks_per_node: int, nodes: int,
                 grad_config: GradientQuantConfig, config: ErrorFeedbackConfig,
                 device: torch.device | str = "cpu") -> None:
        check_two_hops(ranks_per_node, nodes)
        p = grad_config.pipeline_slices
        shard = bucket_numel // (ranks_per_node * nodes)
        self.config = config
        self.backend = grad_config.kernel_backend
        self.group_size = grad_config.inter_group_size
        self.slice_numel = nodes * (shard // p)  # M chunks of c per slice
        self.slices = p
        self.calls = 0
        """Calls so far (what the reset interval counts)."""
        if config.storage == "fp32":
            self.state = torch.zeros(p * self.slice_numel, dtype=torch.float32, device=device)
        else:
            self._slice_nbytes = message_nbytes(self.slice_numel, STORAGE_BITS, self.group_size)
            self.state = torch.empty(p * self._slice_nbytes, dtype=torch.uint8, device=device)
            self._zero()

    @property
    def nbytes(self) -> int:
        """Bytes of the state on the device."""
        return self.state.numel() * self.state.element_size()

    def _zero(self) -> None:
        if self.config.storage == "fp32":
            self.state.zero_()
        else:  # an all-zero message: zero scales, code 128 (q = 0)
            for i in range(self.slices):
                self._store(i, torch.zeros(self.slice_numel, device=self.state.device))

    def _load(self, i: int, state: torch.Tensor | None = None) -> torch.Tensor:
        """Slice ``i`` of the error in fp32, from ``state`` (default: this bucket's own)."""
        state = self.state if state is None else state
        if self.config.storage == "fp32":
            return state[i * self.slice_numel:(i + 1) * self.slice_numel]
        error = torch.empty(self.slice_numel, dtype=torch.float32, device=state.device)
        ops.tlq_receiver(state[i * self._slice_nbytes:(i + 1) * self._slice_nbytes],
                         error, n_in=1, bits=STORAGE_BITS, group_size=self.group_size,
                         hadamard_block=0, backend=self.backend)
        return error

    def is_finite(self, state: torch.Tensor) -> bool:
        """Whether ``state``, a saved state of this bucket's shape and dtype, decodes to a
        finite error ([Note: a non-finite saved error])."""
        state = state.to(self.state.device)
        return all(bool(torch.isfinite(self._load(i, state)).all())
                   for i in range(self.slices))

    def _store(self, i: int, error: torch.Tensor) -> None:
        if self.config.storage == "fp32":
            self.state[i * self.slice_numel:(i + 1) * self.slice_numel].copy_(error)
            return
        ops.tlq_sender(error, self.state[i * self._slice_nbytes:(i + 1) * self._slice_nbytes],
                       num_dests=1, blocks_per_dest=1, slices=1, bits=STORAGE_BITS,
                       group_size=self.group_size, hadamard_block=0, stochastic=False, seed=0,
                       backend=self.backend)

    def start_call(self) -> None:
        """Once per reduce-scatter call, before its first slice: the periodic reset."""
        interval = self.config.reset_interval
        if interval and self.calls % interval == 0 and self.calls:
            self._zero()
        self.calls += 1

    def requantize(self, recv: torch.Tensor, send: torch.Tensor, i: int, *,
                   grad_config: GradientQuantConfig, ranks_per_node: int, nodes: int,
                   seed: int) -> None:
        """Slice ``i`` between the hops: sum the N intra messages of ``recv``, compensate,
        quantize into the M inter messages of ``send`` (the bytes
        :func:`~megatron.sdp4bit.quantization.ops.tlq_middle` writes when the error is 0),
        and update the error."""
        cfg, backend = grad_config, grad_config.kernel_backend
        total = torch.empty(self.slice_numel, dtype=torch.float32, device=send.device)
        ops.tlq_receiver(recv, total, n_in=ranks_per_node, bits=cfg.intra_bits,
                         group_size=cfg.intra_group_size, hadamard_block=0, backend=backend)
        error = self._load(i)
        v = total + error
        ops.tlq_sender(v, send, num_dests=nodes, blocks_per_dest=1, slices=1,
                       bits=cfg.inter_bits, group_size=cfg.inter_group_size, hadamard_block=0,
                       stochastic=cfg.stochastic and self.config.rounding == "stochastic",
                       seed=seed, backend=backend)
        sent = torch.empty_like(total)
        ops.qwd_receiver(send, sent, world=nodes, bits=cfg.inter_bits,
                         group_size=cfg.inter_group_size, accumulate=False, backend=backend)
        new = v - sent
        if self.config.decay:
            new = self.config.decay * error + (1.0 - self.config.decay) * new
        self._store(i, torch.where(torch.isfinite(new), new, error))

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint must hold for a bit-exact resume."""
        return {"state": self.state.detach().cpu().clone(), "calls": self.calls}

    def load_state_dict(self, saved: dict[str, object]) -> None:
        state = saved["state"]
        if not isinstance(state, torch.Tensor) or state.shape != self.state.shape or \
                state.dtype != self.state.dtype:
            raise ValueError("the saved error-feedback state does not fit this bucket "
                             f"({tuple(self.state.shape)} {self.state.dtype}): resume with "
                             "the same bucket sizes, topology and --gradient-error-feedback-*")
        self.state.copy_(state)
        self.calls = int(saved["calls"])


def first_damaged(bucket_id: int | None, device: torch.device | str) -> tuple[int, int] | None:
    """Collective over the default group (a no-op without ``torch.distributed``): the first
    rank whose saved error is non-finite and its bucket (``bucket_id``: this rank's first
    such bucket, None when its state is finite), or None when no rank's is
    ([Note: a non-finite saved error])."""
    if not (dist.is_available() and dist.is_initialized()):
        return None if bucket_id is None else (0, bucket_id)
    world = dist.get_world_size()
    # min over ranks of (rank, bucket), encoded as one integer; world * 2**32 means "none"
    mine = world << 32 if bucket_id is None else (dist.get_rank() << 32) + bucket_id
    found = torch.tensor([mine], dtype=torch.int64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    value = int(found.item())
    return None if value >> 32 >= world else (value >> 32, value & 0xFFFFFFFF)
