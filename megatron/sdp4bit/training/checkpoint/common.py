"""What both checkpoint formats share: the settings a resume must agree with, the schedule
check, the RNG state, the inner optimizers, the finiteness check before a save, and the
collective that gives every rank the first error.

:mod:`.torch_format` (one file per rank) and :mod:`.torch_dist_format` (megatron-core's
``dist_checkpointing``) build on these; files, checksums and the lock are :mod:`.files`.
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


def describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


# Model settings recorded since the Llama export (tools/checkpoint/export_hf.py): a manifest
# written before lacks them, and such a checkpoint still resumes (they are not compared).
LATER_MODEL_SETTINGS = ("norm_epsilon", "rotary_base", "rotary_percent")

# Model settings recorded since they were added, with the value every run had before (the
# trainer refused --openai-gelu until then): an older manifest is read as having that value,
# and compared.
LATER_MODEL_DEFAULTS = {"openai_gelu": False}


def saved_model_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A manifest's model settings, with :data:`LATER_MODEL_DEFAULTS` for what it lacks and
    this run's settings (``current["model"]``) record."""
    return {**{k: v for k, v in LATER_MODEL_DEFAULTS.items() if k in current["model"]},
            **saved.get("model", {})}


# SDP4Bit settings recorded since they were added, with the value every run had before:
# an older manifest lacks them and is read as having that value.
LATER_SDP4BIT_SETTINGS = {"weight_difference_target": "main"}


def settings_problem(saved: dict[str, Any], current: dict[str, Any], directory: str,
                      allow_sdp4bit_change: bool, allow_data_change: bool = False) -> str | None:
    if "model" in saved:
        saved = {**saved, "model": saved_model_settings(saved, current)}
        unrecorded = [k for k in LATER_MODEL_SETTINGS if k not in saved["model"]]
        current = {**current, "model": {k: v for k, v in current["model"].items()
                                        if k not in unrecorded}}
    for part, fix in (("layout", "resume with the same layout (or start a new run)"),
                      ("model", "resume with the same model flags")):
        if saved.get(part) != current[part]:
            diff = {k for k in set(saved.get(part, {})) | set(current[part])
                    if saved.get(part, {}).get(k) != current[part].get(k)}
            was = {k: saved.get(part, {}).get(k) for k in sorted(diff)}
            now = {k: current[part].get(k) for k in sorted(diff)}
            return (f"checkpoint {directory} was saved with {part} {describe(was)}; this run "
                    f"has {describe(now)}: {fix}")
    if "data" in current and saved.get("data") != current["data"] and not allow_data_change:
        old, new = saved.get("data") or {}, current["data"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        was = {k: old.get(k, "unrecorded") for k in diff}
        now = {k: new.get(k) for k in diff}
        return (f"checkpoint {directory} was trained with {describe(was)}; this run has "
                f"{describe(now)}: resume with the checkpoint's --data-path, --split and "
                "--seed, or pass --allow-changed-data to continue on other data")
    if "sdp4bit" in saved:
        saved = {**saved, "sdp4bit": {**{k: v for k, v in LATER_SDP4BIT_SETTINGS.items()
                                         if k in current["sdp4bit"]}, **saved["sdp4bit"]}}
    if saved.get("sdp4bit") != current["sdp4bit"] and not allow_sdp4bit_change:
        old, new = saved.get("sdp4bit", {}), current["sdp4bit"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        switches = [k for k in ("quantized_weights", "quantized_gradients") if k in diff]
        diff = switches or diff  # a part switched on or off: its own flags follow it
        was = {k: old.get(k, "off") for k in diff}
        now = {k: new.get(k, "off") for k in diff}
        return (f"checkpoint {directory} was trained with SDP4Bit {describe(was)}; this run "
                f"has {describe(now)}: use the same SDP4Bit flags, or pass "
                "--allow-changed-sdp4bit-settings to change the method on resume")
    return None


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
