"""SDP4Bit inside Megatron-LM's own trainer (``megatron.training``), the plug-in.

A Megatron-LM script (their ``pretrain_gpt.py``, or one of one's own that calls
``megatron.training.pretrain``) runs unchanged; :func:`enable`, called before it imports
``megatron.training``, makes the trainer take SDP4Bit's flags and quantize its collectives::

    from megatron.sdp4bit.integration import megatron_lm
    megatron_lm.enable()

``python -m megatron.sdp4bit.megatron_lm SCRIPT_OR_MODULE FLAGS...`` does exactly that, then
runs the script (docs/megatron_lm.md). The run's SDP4Bit is an ``SDP4BitLifecycle``
(lifecycle.py), as in our trainer; this module calls it at Megatron-LM's points, each an
entry of the replacement table in the scope ``megatron_lm`` (checked on megatron-core 0.19.2,
whose wheel ships ``megatron.training``; another release is decided by the same table).

[Note: where the plug-in enters Megatron-LM's trainer]
Megatron-LM's trainer looks each entry of ``TRAINER`` up in its module at call time, so the
plug-in wraps them there: the flag group, the lifecycle at validation (refusals in one line
before Megatron-LM's checks), the build inside the bucket padding and the install after the
load, the iteration's bytes into the log line, the end line, and the checkpoint's
error-feedback state and Adam step counts (megatron_lm_checkpoint.py); megatron_lm_bridges.py
has two more. Why each, in detail: docs/megatron_lm.md, "Where the plug-in enters
Megatron-LM's trainer".
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from megatron.sdp4bit.config_flags import add_sdp4bit_flags
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.lifecycle import SDP4BitLifecycle
from megatron.sdp4bit.integration.megatron_lm_args import config_of_megatron_lm_args, refuse
from megatron.sdp4bit.integration.megatron_lm_bridges import (
    COMPILE_HELPERS,
    PYTHON_312,
    training_installed,
)
from megatron.sdp4bit.integration.megatron_lm_checkpoint import (
    PendingLoad,
    wrap_generate_state_dict,
    wrap_load_base_checkpoint,
    wrap_load_checkpoint,
)
from megatron.sdp4bit.integration.padding import sdp4bit_padding
from megatron.sdp4bit.integration.patches import MODULE, declare
from megatron.sdp4bit.integration.version import check_megatron_core_version

__all__ = ["PYTHON_312", "TRAINER", "config_of_megatron_lm_args", "disable", "enable",
           "enabled", "lifecycle"]

_NOTE = "[Note: where the plug-in enters Megatron-LM's trainer] (integration/megatron_lm.py)"
_ARGUMENTS = "megatron.training.arguments"
_TRAINING = "megatron.training.training"
_CHECKPOINTING = "megatron.training.checkpointing"

_lifecycle: SDP4BitLifecycle | None = None  # this process's run, from its validated flags
_pending_load = PendingLoad()  # between Megatron-LM's two reads of a checkpoint
_applied: tuple[patches.Applied, ...] = ()  # the bridge, then the trainer's entries


def lifecycle() -> SDP4BitLifecycle | None:
    """The run's SDP4Bit in this process (None before Megatron-LM validated the flags)."""
    return _lifecycle


# --- the replacements -----------------------------------------------------------------------

def _add_megatron_arguments(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        parser = original(parser)
        add_sdp4bit_flags(parser)
        return parser
    return add_megatron_arguments


def _validate_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 (Megatron-LM's signature)
        global _lifecycle
        # First, so that the one line is not lost after Megatron-LM's dump of its arguments.
        try:
            config = config_of_megatron_lm_args(args)
        except ValueError as err:
            refuse(str(err))
        _lifecycle = SDP4BitLifecycle(config)
        return original(args, defaults)
    return validate_args


def _setup_model_and_optimizer(original: Callable) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        run = _lifecycle
        if run is None or not run.config.enabled:
            return original(*args, **kwargs)
        with sdp4bit_padding(run.config):
            model, optimizer, scheduler = original(*args, **kwargs)
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.utils import get_model_config

        for chunk in model:
            model_config = get_model_config(chunk)
            if model_config.finalize_model_grads_func is None:  # what train() sets, set earlier
                model_config.finalize_model_grads_func = finalize_model_grads
        try:
            run.install(model, optimizer)
        except ValueError as err:
            refuse(str(err))
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _train_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        run = _lifecycle
        if run is None or run.handle is None:
            return original(*args, **kwargs)
        # train() passes it by name; position 7 in the signature checked
        run.start_iteration(kwargs["iteration"] if "iteration" in kwargs else args[7])
        out = original(*args, **kwargs)
        run.finish_iteration()
        # Since the previous step, not since start_iteration: a parameter sync that
        # Megatron-LM forces between iterations (before a save, with --overlap-param-gather)
        # is counted in the next line rather than in none.
        scalars = run.take_bytes().scalars()
        loss_dict = out[0]
        if loss_dict:  # the last pipeline stage's: training_log adds it to the log line
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            for name, value in scalars.items():
                loss_dict[name] = torch.tensor([float(value)], device=device)
        return out
    return train_step


def _train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(*args, **kwargs):
        result = original(*args, **kwargs)
        line = _lifecycle.end_line() if _lifecycle is not None else None  # collective
        if line is not None:
            print(line, flush=True)
        return result
    return train


def _checkpoint(wrap: Callable) -> Callable:
    def replacement(original: Callable) -> Callable:
        return functools.wraps(original)(wrap(original, lifecycle, _pending_load))
    return replacement


def _declare(name: str, owner: str, attribute: str, replacement: Any, fingerprint: str,
             **kwargs: Any) -> patches.Replacement:
    return declare(f"megatron_lm.{name}", owner, attribute, MODULE, replacement, note=_NOTE,
                   checked={"0.19.2": fingerprint}, applies=training_installed,
                   scope=patches.MEGATRON_LM, **kwargs)


TRAINER = (
    COMPILE_HELPERS,
    _declare("add_megatron_arguments", _ARGUMENTS, "add_megatron_arguments",
             _add_megatron_arguments, "(parser)", wraps=True),
    _declare("validate_args", _ARGUMENTS, "validate_args", _validate_args,
             "(args, defaults)", wraps=True),
    _declare("setup_model_and_optimizer", _TRAINING, "setup_model_and_optimizer",
             _setup_model_and_optimizer,
             "(model_type, model_provider_func, checkpointing_context, *, cfg_container, "
             "pg_collection)", wraps=True),
    _declare("load_checkpoint", _TRAINING, "load_checkpoint",
             lambda original: functools.wraps(original)(wrap_load_checkpoint(original)),
             "(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, "
             "checkpointing_context, skip_load_to_model_and_opt, tp_group, pp_group, "
             "dp_cp_group, dp_group, expt_dp_group, rng_state_key_prefix)", wraps=True),
    _declare("train_step", _TRAINING, "train_step", _train_step,
             "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, "
             "forward_backward_func, iteration, pg_collection, p2p_communicator)", wraps=True),
    _declare("generate_state_dict", _CHECKPOINTING, "generate_state_dict",
             _checkpoint(wrap_generate_state_dict),
             "(args, model, optimizer, opt_param_scheduler, rng_state, iteration, "
             "optim_sd_kwargs, model_sd_kwargs, rerun_state)", wraps=True),
    _declare("_load_base_checkpoint", _CHECKPOINTING, "_load_base_checkpoint",
             _checkpoint(wrap_load_base_checkpoint),
             "(load_dir, args, rank0, sharded_state_dict, checkpointing_context, dp_cp_group, "
             "expt_dp_group, gpt_compat_layer_maps)", wraps=True),
    _declare("train", _TRAINING, "train", _train,
             "(forward_step_func, model, optimizer, opt_param_scheduler, train_data_iterator, "
             "valid_data_iterator, process_non_loss_data_func, config, checkpointing_context, "
             "non_loss_data_func, inference_model, p2p_communicator, pg_collection)",
             wraps=True),
)


def enabled() -> bool:
    return bool(_applied)


def enable(*, allow_untested_version: bool = False) -> None:
    """Make Megatron-LM's trainer in this process take SDP4Bit's flags and, when one of them
    quantizes, run SDP4Bit (module docstring). Call it before the script imports
    ``megatron.training``'s modules (the Python 3.11 bridge must be in place first);
    idempotent. Refused in one line (``RuntimeError``) without ``megatron.training``, or on
    a release where a target of the plug-in moved (``allow_untested_version``: as
    ``install_sdp4bit``'s)."""
    global _applied
    if _applied:
        return
    if not training_installed():
        raise RuntimeError(
            "SDP4Bit's Megatron-LM plug-in needs Megatron-LM's trainer (megatron.training): "
            "install megatron-core==0.19.2 (its wheel ships it) or put a Megatron-LM checkout "
            "on PYTHONPATH")
    bridge = patches.apply([PYTHON_312])
    try:
        check_megatron_core_version(
            scopes=(patches.SEAM, patches.PADDING, patches.MEGATRON_LM),
            allow_untested_version=allow_untested_version)
        _applied = (bridge, patches.apply(TRAINER))
    except BaseException:
        bridge.revert()
        raise


def disable() -> None:
    """Put back everything :func:`enable` replaced (tests; a run keeps it until exit)."""
    global _applied, _lifecycle
    for part in reversed(_applied):
        part.revert()
    _applied, _lifecycle, _pending_load.ask = (), None, False
