"""The plug-in's part in Megatron-LM's own checkpoints (``megatron_lm.py`` declares the
replacements): the error-feedback state they hold, and the load of a fresh torch optimizer.

``--gradient-error-feedback`` keeps, on each rank, the error of what the rank sent on the
inter-node hop; a resume is bit-exact only when that state comes back. The state belongs to
the run's :class:`~megatron.sdp4bit.integration.lifecycle.SDP4BitLifecycle`, as in our
trainer; Megatron-LM's trainer builds what it saves and what it loads with
``checkpointing.generate_state_dict`` and reads checkpoints with
``checkpointing._load_base_checkpoint``, both looked up in their module at call time:

* saving (``torch_dist``, Megatron-LM's default format; :func:`save_refusal` refuses the
  flag with ``--save`` in another): the state dict gains ``EF_KEY``, one ``ShardedObject``
  per global rank (``dist_checkpointing.error_feedback_sharded``, the same entry our
  trainer's checkpoints hold), and :data:`LAYOUT_KEY`, the parallel layout it was saved
  with (in the checkpoint's common part). The state is copied when the dict is built, so
  Megatron-LM's ``--async-save`` writes the state of the iteration it saved;
* loading: Megatron-LM first reads the common part (``rank0=True``); when it holds
  :data:`LAYOUT_KEY` for this run's layout, the dict Megatron-LM loads into asks for
  ``EF_KEY`` too, and what comes back goes to the lifecycle, which restores it at the
  install (after the load). A checkpoint saved without the flag, with another layout or by
  ``--finetune``'s load starts the error from zero, and rank 0 says so in one line.

:func:`wrap_load_checkpoint`: without Apex or Transformer Engine (torch's Adam), the optimizer
states must exist before a ``torch_dist`` load, and the Adam step count comes back in the
parameter groups only ([Note: where the plug-in enters Megatron-LM's trainer], megatron_lm.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from megatron.sdp4bit.integration.dist_checkpointing import EF_KEY, error_feedback_sharded

__all__ = ["LAYOUT_KEY", "PendingLoad", "layout_of_args", "save_refusal",
           "wrap_generate_state_dict", "wrap_load_base_checkpoint", "wrap_load_checkpoint"]

LAYOUT_KEY = "sdp4bit_error_feedback_layout"

_LAYOUT_ARGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "data_parallel_size", "ddp_bucket_size",
                "dp_ranks_per_node")


def layout_of_args(args: Any) -> dict[str, Any]:
    """What a saved error state depends on, from Megatron-LM's validated arguments."""
    return {name: getattr(args, name) for name in _LAYOUT_ARGS}


def save_refusal(args: Any) -> str | None:
    """Why ``--gradient-error-feedback`` cannot save with these flags (None: it can)."""
    if args.ckpt_format != "torch_dist":
        return (f"--gradient-error-feedback with --save needs --ckpt-format torch_dist in "
                f"Megatron-LM's trainer (got {args.ckpt_format}): the other formats' "
                "checkpoints do not hold the error state, so a resume would not be bit-exact")
    if args.non_persistent_ckpt_type == "local":
        return ("--gradient-error-feedback cannot be combined with --non-persistent-ckpt-type "
                "local: local checkpoints do not hold the error state; use global")
    return None


@dataclasses.dataclass
class PendingLoad:
    """Between Megatron-LM's two reads of a checkpoint: whether the full load asks for
    ``EF_KEY`` (the common part holds it for this layout)."""

    ask: bool = False


def _with_error_feedback(lifecycle) -> bool:
    return lifecycle is not None and lifecycle.config.gradient_error_feedback


def wrap_generate_state_dict(original: Callable, lifecycle: Callable[[], Any],
                             pending: PendingLoad) -> Callable:
    """``generate_state_dict`` adding the error state (``lifecycle``: the run's, or None
    before Megatron-LM validated the flags)."""
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original(args, *rest, **kwargs)
        if not _with_error_feedback(lifecycle()) or args.ckpt_format != "torch_dist":
            return state_dict
        if (kwargs.get("optim_sd_kwargs") or {}).get("is_loading"):
            if pending.ask:
                state_dict[EF_KEY] = error_feedback_sharded(None)
            return state_dict
        state = lifecycle().error_feedback_state()
        if state is not None:
            state_dict[EF_KEY] = error_feedback_sharded(state)
            state_dict[LAYOUT_KEY] = layout_of_args(args)
        return state_dict
    return generate_state_dict


def wrap_load_base_checkpoint(original: Callable, lifecycle: Callable[[], Any],
                              pending: PendingLoad) -> Callable:
    """``_load_base_checkpoint`` noting whether the checkpoint holds the state for this
    layout (the common part, read first) and handing what the full load brings back, or why
    it brings nothing, to the lifecycle."""
    def load_base_checkpoint(load_dir, args, rank0=False, *rest, **kwargs):
        loaded = original(load_dir, args, rank0, *rest, **kwargs)
        run = lifecycle()
        if not _with_error_feedback(run):
            return loaded
        state_dict = loaded[0]
        if rank0:
            pending.ask = False
            if state_dict is None:
                return loaded  # nothing is loaded at all: nothing to say
            saved = state_dict.get(LAYOUT_KEY)
            skipped = None
            if args.finetune:
                skipped = "--finetune starts from the checkpoint's weights only"
            elif saved is None:
                skipped = "the checkpoint was saved without --gradient-error-feedback"
            elif saved != layout_of_args(args):
                skipped = "the checkpoint was saved with another parallel layout or bucket size"
            pending.ask = skipped is None
            if skipped is not None:
                run.restore_error_feedback(None, skipped=skipped)
        elif state_dict is not None and pending.ask:
            run.restore_error_feedback(state_dict.pop(EF_KEY, None))
        return loaded
    return load_base_checkpoint


def wrap_load_checkpoint(original: Callable) -> Callable:
    """``training.load_checkpoint`` giving torch's Adam its states before the load and every
    parameter its own step count after it."""
    def load_checkpoint(ddp_model, optimizer, *args, **kwargs):
        from megatron.core.optimizer import distrib_optimizer

        torch_adam = [] if optimizer is None or distrib_optimizer.HAVE_APEX_OR_TE else [
            opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(opt, distrib_optimizer.DistributedOptimizer)]
        for opt in torch_adam:
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
        loaded = original(ddp_model, optimizer, *args, **kwargs)
        for opt in torch_adam:  # the checkpoint's step count, one tensor per parameter
            for group in opt.optimizer.param_groups:
                if group.get("step") is None:
                    continue
                for param in group["params"]:
                    state = opt.optimizer.state.get(param)
                    if state and isinstance(state.get("step"), torch.Tensor):
                        state["step"] = torch.full_like(state["step"], float(group["step"]))
        return loaded
    return load_checkpoint
