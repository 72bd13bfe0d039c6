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

[Note: Megatron-LM's asynchronous save and nvidia-resiliency-ext]
Megatron-LM 0.19.2 keeps ``--async-save`` for its distributed formats only with
``--use-persistent-ckpt-worker`` (without it, ``validate_args`` turns it off with a warning
and saves synchronously). Its writer then comes from ``--async-strategy``: ``nvrx``, the
default, imports nvidia-resiliency-ext's ``checkpointing.async_ckpt`` (``AsyncCallsQueue``,
``FileSystemWriterAsync``, ``get_write_results_queue``...; megatron-core's
``strategies/nvrx.py`` asks for version >= 0.6.0), and ``mcore`` megatron-core's own, which
needs nothing more. Without that package the nvrx writer stops the first save, after the
training it follows; :func:`async_save_refusal` refuses the combination before anything is
built (the version read from the distribution's metadata). The newest release on PyPI when
this was written, 0.4.1 (a cp311 x86_64 wheel; it installs and its ``async_ckpt.core``
imports on a CPU machine), cannot serve 0.19.2: it has no ``get_write_results_queue``, and
with it installed ``import megatron.core`` itself fails (0.19.2's ``strategies/torch.py``
checks the version at import through ``nvidia_resiliency_ext.__version__``, which 0.4.1
lacks: ``AttributeError``). So no environment here installs it. The ``mcore`` writer is not
tested here: it runs in a
process of its own (a ``forkserver`` child), which the CUDA dry run does not reach (there
``torch.cuda.device_count()`` is 0, and the writer's set-up divides by it).

:func:`wrap_load_checkpoint`: without Apex or Transformer Engine (torch's Adam), the optimizer
states must exist before a ``torch_dist`` load, and the Adam step count comes back in the
parameter groups only ([Note: where the plug-in enters Megatron-LM's trainer], megatron_lm.py).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Callable
from typing import Any

import torch

from megatron.sdp4bit.integration.dist_checkpointing import EF_KEY, error_feedback_sharded

__all__ = ["LAYOUT_KEY", "PendingLoad", "async_save_refusal", "layout_of_args", "save_refusal",
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


def async_save_refusal(args: Any) -> str | None:
    """Why Megatron-LM's ``--async-save`` cannot run with these flags here (None: it can),
    [Note: Megatron-LM's asynchronous save and nvidia-resiliency-ext]."""
    if not (args.async_save and args.use_persistent_ckpt_worker
            and args.async_strategy == "nvrx"):
        return None
    from megatron.core.dist_checkpointing.strategies.nvrx import NVRX_MIN_VERSION
    from packaging.version import Version

    try:  # the distribution's version (0.4.1's module has no __version__)
        installed = importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None and Version(installed) >= Version(NVRX_MIN_VERSION):
        return None
    have = "is not installed" if installed is None else f"is not installed ({installed} is)"
    return (f"--async-save with --async-strategy nvrx (Megatron-LM's default) needs "
            f"nvidia-resiliency-ext >= {NVRX_MIN_VERSION}, which {have}: install it, or pass "
            "--async-strategy mcore (megatron-core's own writer), or drop --async-save")


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
