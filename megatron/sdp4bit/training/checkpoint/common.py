"""What both checkpoint formats share: the schedule check, the RNG state, the inner
optimizers, the finiteness check before a save, and the collective that gives every rank
the first error.

:mod:`.torch_format` (one file per rank) and :mod:`.torch_dist_format` (megatron-core's
``dist_checkpointing``) build on these; files, checksums and the lock are :mod:`.files`;
the settings a resume must agree with are :mod:`.settings`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.guards.finite import all_finite

# Schedule fields of megatron-core's OptimizerParamScheduler.state_dict() and their flags
# (steps are counted in samples, as Megatron-LM does).
SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-* (samples)",
    "lr_decay_steps": "--lr-decay-iters/--train-iters (decay samples)",
    "lr_decay_style": "--lr-decay-style", "start_wd": "--start-weight-decay",
    "end_wd": "--end-weight-decay", "wd_incr_steps": "--train-iters (weight-decay samples)",
    "wd_incr_style": "--weight-decay-incr-style",
}


def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def first_error(message: str | None) -> None:
    """Collective: raise on every rank the first (by rank) non-None message of any rank."""
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    first = next((m for m in messages if m is not None), None)
    if first is not None:
        raise CheckpointError(first)


def weights_finite(model_chunks, optimizer) -> bool:
    tensors = [p for m in model_chunks for p in m.parameters()]
    for opt in inner_optimizers(optimizer):
        tensors += [p for g in opt.optimizer.param_groups for p in g["params"]]
    return all_finite(tensors)


def check_schedule(scheduler, saved: dict[str, Any], directory: str) -> None:
    if scheduler.override_opt_param_scheduler or scheduler.use_checkpoint_opt_param_scheduler:
        return
    current = scheduler.state_dict()
    diff = [k for k in SCHEDULE_FLAGS if k in saved and saved[k] != current.get(k)]
    if diff:
        changes = ", ".join(f"{SCHEDULE_FLAGS[k]} {saved[k]} -> {current.get(k)}" for k in diff)
        raise CheckpointError(f"resuming {directory} would change its schedule: {changes}; "
                              "pass --override-opt_param-scheduler to use this command line's "
                              "schedule, or --use-checkpoint-opt_param-scheduler to keep the "
                              "checkpoint's")


def error_feedback_state(sdp4bit) -> dict[str, Any] | None:
    """What a checkpoint holds of ``--gradient-error-feedback``: this rank's error state, as
    the run's SDP4Bit lifecycle (``sdp4bit``, or None) gives it, or None."""
    return sdp4bit.error_feedback_state() if sdp4bit is not None else None


def restore_error_feedback(sdp4bit, saved: dict[str, Any] | None, directory: str,
                           not_restorable: str | None = None) -> None:
    """Hand ``saved`` (the checkpoint's error state) to the run's SDP4Bit lifecycle, which
    restores it or says in one line why the error starts from zero (a checkpoint saved
    without the flag, another data-parallel layout or bucket size: the resume is then not
    bit-exact). ``not_restorable``: why the caller did not read the state."""
    if sdp4bit is not None:
        sdp4bit.restore_error_feedback(saved, skipped=not_restorable, where=directory)
