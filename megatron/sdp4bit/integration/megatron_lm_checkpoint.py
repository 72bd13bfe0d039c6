"""Error feedback's state in Megatron-LM's own checkpoints (the plug-in, ``megatron_lm.py``).

``--gradient-error-feedback`` keeps, on each rank, the error of what the rank sent on the
inter-node hop; a resume is bit-exact only when that state comes back. Megatron-LM's trainer
builds what it saves and what it loads with ``checkpointing.generate_state_dict`` and reads
checkpoints with ``checkpointing._load_base_checkpoint``; both are looked up in their module
at call time, so the plug-in wraps them (entries of the replacement table, declared in
``megatron_lm.py``):

* saving (``torch_dist``, Megatron-LM's default format; the plug-in refuses the flag with
  ``--save`` in another): the state dict gains ``EF_KEY``, one ``ShardedObject`` per
  global rank (``dist_checkpointing.error_feedback_sharded``, the same entry
  ``pretrain_gpt.py``'s checkpoints hold), and :data:`LAYOUT_KEY`, the parallel layout it
  was saved with (in the checkpoint's common part). The state is copied when the dict is
  built, so Megatron-LM's ``--async-save`` writes the state of the iteration it saved;
* loading: Megatron-LM first reads the common part (``rank0=True``); when it holds
  :data:`LAYOUT_KEY` for this run's layout, the dict Megatron-LM loads into asks for
  ``EF_KEY`` too, and what comes back is kept until SDP4Bit is installed (after the load:
  ``megatron_lm.py``), which restores it. A checkpoint saved without the flag, with another
  layout or by ``--finetune``'s load starts the error from zero, and rank 0 says so in one
  line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from megatron.sdp4bit.integration.dist_checkpointing import EF_KEY, error_feedback_sharded

__all__ = ["LAYOUT_KEY", "PendingLoad", "layout_of_args", "wrap_generate_state_dict",
           "wrap_load_base_checkpoint"]

LAYOUT_KEY = "sdp4bit_error_feedback_layout"

_LAYOUT_ARGS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "data_parallel_size", "ddp_bucket_size",
                "dp_ranks_per_node")


def layout_of_args(args: Any) -> dict[str, Any]:
    """What a saved error state depends on, from Megatron-LM's parsed arguments."""
    return {name: getattr(args, name, None) for name in _LAYOUT_ARGS}


@dataclasses.dataclass
class PendingLoad:
    """The plug-in's view of the checkpoint being loaded."""

    ask: bool = False
    """Whether the load asks for ``EF_KEY`` (the checkpoint holds it for this layout)."""
    skipped: str | None = None
    """Why the state will not be loaded, when it will not."""
    state: Any = None
    """What the load brought back, until SDP4Bit is installed."""


def wrap_generate_state_dict(original: Callable, enabled: Callable[[], bool],
                             state_now: Callable[[], Any], pending: PendingLoad) -> Callable:
    """``generate_state_dict`` adding the error state (``enabled``: the run has the flag;
    ``state_now``: this rank's state, None before SDP4Bit is installed)."""
    def generate_state_dict(args, *rest, **kwargs):
        state_dict = original(args, *rest, **kwargs)
        if not enabled() or args.ckpt_format != "torch_dist":
            return state_dict
        if (kwargs.get("optim_sd_kwargs") or {}).get("is_loading"):
            if pending.ask:
                state_dict[EF_KEY] = error_feedback_sharded(None)
            return state_dict
        state = state_now()
        if state is not None:
            state_dict[EF_KEY] = error_feedback_sharded(state)
            state_dict[LAYOUT_KEY] = layout_of_args(args)
        return state_dict
    return generate_state_dict


def wrap_load_base_checkpoint(original: Callable, enabled: Callable[[], bool],
                              pending: PendingLoad) -> Callable:
    """``_load_base_checkpoint`` noting whether the checkpoint holds the state for this
    layout (the common part, read first) and keeping what the full load brings back."""
    def load_base_checkpoint(load_dir, args, rank0=False, *rest, **kwargs):
        loaded = original(load_dir, args, rank0, *rest, **kwargs)
        if not enabled():
            return loaded
        state_dict = loaded[0]
        if rank0:
            saved = state_dict.get(LAYOUT_KEY) if state_dict is not None else None
            pending.ask, pending.skipped = False, None
            if state_dict is None:
                pending.skipped = None  # nothing is loaded at all: nothing to say
            elif getattr(args, "finetune", False):
                pending.skipped = "--finetune starts from the checkpoint's weights only"
            elif saved is None:
                pending.skipped = "the checkpoint was saved without --gradient-error-feedback"
            elif saved != layout_of_args(args):
                pending.skipped = ("the checkpoint was saved with another parallel layout or "
                                   "bucket size")
            else:
                pending.ask = True
        elif state_dict is not None and pending.ask:
            pending.state = state_dict.pop(EF_KEY, None)
        return loaded
    return load_base_checkpoint
