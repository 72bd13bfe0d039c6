"""SDP4Bit inside Megatron-LM's own trainer (``megatron.training``), the plug-in.

A Megatron-LM script (their ``pretrain_gpt.py``, or one of one's own that calls
``megatron.training.pretrain``) runs unchanged; :func:`enable`, called before it imports
``megatron.training``, makes the trainer take SDP4Bit's flags and quantize its collectives::

    from megatron.sdp4bit.integration import megatron_lm
    megatron_lm.enable()

``python -m megatron.sdp4bit.megatron_lm SCRIPT_OR_MODULE FLAGS...`` does exactly that, then
runs the script (docs/megatron_lm.md). Every attribute the plug-in replaces is an entry of
the replacement table, in the scope ``megatron_lm`` (checked on megatron-core 0.19.2, the
release whose wheel ships ``megatron.training``; another release is decided by the same
table, for this scope too).

[Note: where the plug-in enters Megatron-LM's trainer]
Checked against megatron-core 0.19.2's ``megatron/training`` (``training.py``,
``arguments.py``), which looks each of these names up in its module at call time:

* ``arguments.add_megatron_arguments(parser)``: ``parse_args`` builds Megatron-LM's parser
  with it, before the script's own ``extra_args_provider``; the wrapper adds SDP4Bit's flag
  group (``config_flags.add_sdp4bit_flags``, the trainer's own group; ``--seed`` is
  Megatron-LM's, as in our trainer). None of the group's flags is one of Megatron-LM's.
* ``arguments.validate_args(args, defaults)``: before Megatron-LM's own checks (which end
  by printing every argument), the wrapper builds the :class:`SDP4BitConfig` and runs
  ``check_supported`` on the layout the flags ask for, so a bad value or an unsupported
  layout stops every rank with one line before anything is built (exit status 2, as
  argparse).
* ``training.setup_model_and_optimizer``: builds the DDP chunks (the buckets laid out by
  ``get_model``), the optimizer (``get_megatron_optimizer``, which ``training.py`` imported
  into its namespace) and loads ``--load``. The wrapper runs all of it inside
  ``sdp4bit_padding`` (0.19.2 lays the buckets out in ``optimizer/param_layout.py``, called
  from DDP's constructor) and installs SDP4Bit on the model chunks and the distributed
  optimizer when it returns: after the load, so that loading a checkpoint runs
  megatron-core's own copies (a qWD install would leave the main-to-model copy to an
  all-gather that a load never issues). It sets the model config's
  ``finalize_model_grads_func`` to megatron-core's ``finalize_model_grads``, exactly what
  ``train()`` sets when it is unset (it keeps one that is set), so that ``install_sdp4bit``
  sees that the schedule reduces the gradients.
* ``training.load_checkpoint`` (``checkpointing.load_checkpoint``, imported into
  ``training.py``): without Apex or Transformer Engine (every CPU machine; torch's Adam),
  the distributed optimizer's ``state_dict()`` reads the Adam step count, which exists only
  after a first step, so loading a ``torch_dist`` checkpoint into a fresh optimizer stops on
  an assertion. The wrapper first gives such an optimizer its states with megatron-core's
  own ``_init_optimizer_states_with_dummy_values`` (a step with zero gradients on the main
  parameters, as megatron-core does before its FSDP loads); the load overwrites every value
  it made, but one: the ``dp_reshardable`` load (Megatron-LM's default) brings the Adam
  step count back in the parameter groups only (``param_groups[i]["step"]``), and the
  per-parameter ``step`` that torch's Adam reads for its bias correction stays the dummy
  step's 1, so every step after a resume would differ from the uninterrupted run's. The
  wrapper sets each parameter's ``step`` to its group's (a tensor of its own: torch's Adam
  increments it in place).
* ``training.train_step(..., iteration=...)``: the wrapper starts SDP4Bit's iteration
  (``handle.set_iteration``: the rounding streams, ``--gradients-quantization-start-iteration``)
  with the loop's iteration counter, which a resumed run restores from the checkpoint, and
  adds the bytes sent since the previous iteration's line to the returned ``loss_dict`` (the last pipeline stage's, the
  one whose dict has entries), so they appear in Megatron-LM's log line and, when
  ``--tensorboard-dir`` is set, as TensorBoard scalars under ``sdp4bit/``.
* ``training.train(...)``: when the loop returns, the wrapper prints SDP4Bit's end line,
  with a check that the model replicas are bitwise identical across the data-parallel
  ranks (qWD's invariant): a checksum of every parameter's bits on each rank, gathered over
  the data-parallel group (an object collective), printed, so that two runs (a resumed one
  and an uninterrupted one) can be compared bit for bit too.
* ``checkpointing.generate_state_dict`` and ``checkpointing._load_base_checkpoint``: with
  ``--gradient-error-feedback``, Megatron-LM's ``torch_dist`` checkpoints hold each rank's
  error state and a load brings it back (``megatron_lm_checkpoint.py``; restored by the
  install, which follows the load).
* ``typing.override`` (added, Python < 3.12 only): ``megatron/training/models/gpt.py`` and
  ``hybrid.py`` import it, and ``megatron.training`` imports them; nothing else of
  ``megatron.training`` needs Python 3.12. The added decorator does what Python 3.12's does
  (sets ``__override__``; type checkers read it, the runtime does not).
* ``megatron.core.datasets.utils.compile_helpers``: Megatron-LM's ``initialize_megatron``
  runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits if it fails; the wheel
  ships ``helpers_cpp`` compiled and no Makefile, so there the make always fails. The wrapper
  skips the build when ``helpers_cpp`` imports (a checkout without it still builds).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.config_flags import (
    add_sdp4bit_flags,
    in_flag_words,
    sdp4bit_config_from_args,
)
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.install import SDP4BitHandle, install_sdp4bit
from megatron.sdp4bit.integration.megatron_lm_checkpoint import (
    PendingLoad,
    wrap_generate_state_dict,
    wrap_load_base_checkpoint,
)
from megatron.sdp4bit.integration.padding import sdp4bit_padding
from megatron.sdp4bit.integration.patches import MODULE, declare
from megatron.sdp4bit.integration.support import Setup, check_supported
from megatron.sdp4bit.integration.version import check_megatron_core_version

__all__ = ["BYTE_KEYS", "disable", "enable", "enabled", "replica_checksum", "run_state"]

_NOTE = "[Note: where the plug-in enters Megatron-LM's trainer] (integration/megatron_lm.py)"
_TRAINING = "megatron.training.training"
_CHECKPOINTING = "megatron.training.checkpointing"


def save_refusal(args: Any) -> str | None:
    """Why ``--gradient-error-feedback`` cannot save with these flags (None: it can). Only
    the ``torch_dist`` format's checkpoints hold the error state (megatron_lm_checkpoint.py)."""
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        return (f"--gradient-error-feedback with --save needs --ckpt-format torch_dist in "
                f"Megatron-LM's trainer (got {args.ckpt_format}): the other formats' "
                "checkpoints do not hold the error state, so a resume would not be bit-exact")
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        return ("--gradient-error-feedback cannot be combined with --non-persistent-ckpt-type "
                "local: local checkpoints do not hold the error state; use global")
    return None


_ARGUMENTS = "megatron.training.arguments"

BYTE_KEYS = {
    "sdp4bit/params bytes": ("param_intra_bytes", "param_inter_bytes"),
    "sdp4bit/params bytes unquantized": ("param_intra_bytes_baseline",
                                         "param_inter_bytes_baseline"),
    "sdp4bit/grads bytes": ("grad_intra_bytes", "grad_inter_bytes"),
    "sdp4bit/grads bytes unquantized": ("grad_intra_bytes_baseline", "grad_inter_bytes_baseline"),
}
"""The log line's (and TensorBoard's) per-iteration fields: bytes this rank sent in the
quantized collectives, and what megatron-core's unquantized ones send (comm/stats.py)."""


@dataclasses.dataclass
class PluginRun:
    """What the plug-in knows about the run in this process."""

    config: SDP4BitConfig | None = None
    """From the parsed flags (None until Megatron-LM validated them)."""
    handle: SDP4BitHandle | None = None
    model: list = dataclasses.field(default_factory=list)
    counted: dict[str, int] = dataclasses.field(default_factory=dict)
    """The byte counters when the last log line took its share."""
    iterations: int = 0
    pending_load: PendingLoad = dataclasses.field(default_factory=PendingLoad)
    """Error feedback's state in the checkpoint being loaded (megatron_lm_checkpoint.py)."""


_RUN = PluginRun()
_applied: tuple[patches.Applied, ...] = ()  # the bridge, then the trainer's entries


def run_state() -> PluginRun:
    """The plug-in's state in this process (the model chunks, the handle, the byte totals)."""
    return _RUN


def _training_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _refuse(message: str) -> None:
    """Stop every rank with one line (rank 0 prints it), as argparse does: exit status 2."""
    if _rank() == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# --- the replacements -----------------------------------------------------------------------

def _override(method: Callable) -> Callable:
    """Python 3.12's ``typing.override`` (sets ``__override__``; nothing else at run time)."""
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


def _compile_helpers(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            original()
    return compile_helpers


def _add_megatron_arguments(original: Callable) -> Callable:
    @functools.wraps(original)
    def add_megatron_arguments(parser):
        parser = original(parser)
        add_sdp4bit_flags(parser)
        return parser
    return add_megatron_arguments


def setup_of_args(args: Any) -> Setup:
    """The :class:`Setup` Megatron-LM's flags ask for (checked before anything is built)."""
    return Setup(
        distributed_optimizer=bool(args.use_distributed_optimizer),
        fp32_params=not (args.bf16 or args.fp16),
        distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        reduce_scatter_with_fp32_accumulation=bool(
            getattr(args, "reduce_scatter_with_fp32_accumulation", False)),
        megatron_fsdp=bool(getattr(args, "use_megatron_fsdp", False)
                           or getattr(args, "use_torch_fsdp2", False)),
        reuse_grad_buf_for_mxfp8_param_ag=bool(
            getattr(args, "reuse_grad_buf_for_mxfp8_param_ag", False)),
        # Megatron-LM sets --expert-tensor-parallel-size to the TP size when not given
        expert_tensor_parallel=bool(getattr(args, "num_experts", None)) and (
            getattr(args, "expert_tensor_parallel_size", None)
            or args.tensor_model_parallel_size) > 1,
        fp8_param_gather=bool(getattr(args, "fp8_param_gather", False)),
        fp4_param_gather=bool(getattr(args, "fp4_param_gather", False)),
        precision_aware_optimizer=bool(getattr(args, "use_precision_aware_optimizer", False)),
    )


def _validate_args(original: Callable) -> Callable:
    @functools.wraps(original)
    def validate_args(args, defaults={}):  # noqa: B006 (Megatron-LM's signature)
        # First, so that the one line is not lost after Megatron-LM's dump of its arguments.
        try:
            config = sdp4bit_config_from_args(args)
        except ValueError as err:
            _refuse(in_flag_words(err))
        try:
            check_supported(config, setup_of_args(args), command_line=True)
        except ValueError as err:
            _refuse(str(err))
        if config.gradient_error_feedback and getattr(args, "save", None):
            reason = save_refusal(args)
            if reason:
                _refuse(reason)
        _RUN.config = config
        return original(args, defaults)
    return validate_args


def _setup_model_and_optimizer(original: Callable) -> Callable:
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        config = _RUN.config
        if config is None or not config.enabled:
            return original(*args, **kwargs)
        with sdp4bit_padding(config):
            model, optimizer, scheduler = original(*args, **kwargs)
        if optimizer is None:
            _refuse("the SDP4Bit flags quantize the training collectives, and this run has no "
                    "optimizer (--skip-train): drop --quantized-weights/--quantized-gradients")
        _install(model, optimizer, config)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _install(model: list, optimizer, config: SDP4BitConfig) -> None:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    for chunk in model:
        model_config = get_model_config(chunk)
        if model_config.finalize_model_grads_func is None:  # what train() sets, set earlier
            model_config.finalize_model_grads_func = finalize_model_grads
    try:
        handle = install_sdp4bit(model, optimizer, config)
    except ValueError as err:
        _refuse(str(err))
    _RUN.handle, _RUN.model = handle, list(model)
    _RUN.counted = handle.stats.snapshot()
    if _rank() == 0:
        print(f"SDP4Bit installed on {len(handle.buckets)} bucket(s) of Megatron-LM's "
              f"trainer: {config.describe()}", flush=True)
        if config.gradient_error_feedback:
            print(f"SDP4Bit error feedback on the inter-node hop: "
                  f"{handle.error_feedback_nbytes / 2**20:.2f} MiB of error state on this "
                  "rank", flush=True)
    if config.gradient_error_feedback:
        _restore_error_feedback(handle)


def _restore_error_feedback(handle: SDP4BitHandle) -> None:
    """The state a load brought back (kept until now: the install follows the load)."""
    pending = _RUN.pending_load  # the wrappers hold this object: emptied, not replaced
    reason = pending.skipped
    if pending.ask:
        reason = handle.load_error_feedback_state(pending.state)
    pending.ask, pending.skipped, pending.state = False, None, None
    if reason is not None and _rank() == 0:
        print(f"note: --gradient-error-feedback starts from zero error: {reason}", flush=True)


def _error_feedback_on() -> bool:
    return _RUN.config is not None and _RUN.config.gradient_error_feedback


def _error_feedback_now() -> Any:
    return _RUN.handle.error_feedback_state() if _RUN.handle is not None else None


def _generate_state_dict(original: Callable) -> Callable:
    return functools.wraps(original)(wrap_generate_state_dict(
        original, _error_feedback_on, _error_feedback_now, _RUN.pending_load))


def _load_base_checkpoint(original: Callable) -> Callable:
    return functools.wraps(original)(wrap_load_base_checkpoint(
        original, _error_feedback_on, _RUN.pending_load))


def _load_checkpoint(original: Callable) -> Callable:
    @functools.wraps(original)
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


def _train_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def train_step(*args, **kwargs):
        handle = _RUN.handle
        if handle is None:
            return original(*args, **kwargs)
        # train() passes it by name; position 7 in the signature checked
        handle.set_iteration(kwargs["iteration"] if "iteration" in kwargs else args[7])
        out = original(*args, **kwargs)
        # Since the previous iteration's share, not since set_iteration: a parameter sync that
        # Megatron-LM forces between iterations (before a save, with --overlap-param-gather)
        # is counted in the next line rather than in none.
        now = handle.stats.snapshot()
        step = {counter: now[counter] - _RUN.counted.get(counter, 0) for counter in now}
        _RUN.counted = now
        _RUN.iterations += 1
        loss_dict = out[0]
        if loss_dict:  # the last pipeline stage's: training_log adds it to the log line
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            for key, counters in BYTE_KEYS.items():
                loss_dict[key] = torch.tensor([float(sum(step[c] for c in counters))],
                                              device=device)
        return out
    return train_step


def _train(original: Callable) -> Callable:
    @functools.wraps(original)
    def train(*args, **kwargs):
        result = original(*args, **kwargs)
        if _RUN.handle is not None:
            _print_end_line()
        return result
    return train


def replica_checksum(model_chunks: list) -> int:
    """A checksum of the bits of every parameter (in order), computed where they live:
    the sum of each 16/32-bit pattern times its position, per parameter, folded together
    (int64 arithmetic, wrapping). Equal replicas give equal checksums; one flipped bit
    changes it."""
    total = 0
    for chunk in model_chunks:
        for param in chunk.parameters():
            flat = param.detach().reshape(-1)
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            bits = flat.view(ints).to(torch.int64)
            weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
            value = int((bits * weights).sum().item())
            total = (total * 1_000_003 + value) % (1 << 63)
    return total


def _replicas_line() -> str:
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    checksum = replica_checksum(_RUN.model)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, checksum, group=group)
    verdict = ("bitwise identical" if len(set(gathered)) == 1 else
               f"DIFFERENT ({len(set(gathered))} distinct checksums)")
    return (f"model replicas on the {len(gathered)} data-parallel ranks: {verdict}, "
            f"checksum {checksum:016x}")


def _print_end_line() -> None:
    replicas = _replicas_line()  # collective: every rank
    if _rank() != dist.get_world_size() - 1:  # Megatron-LM's log line is the last rank's
        return
    state, totals = _RUN.handle.state, _RUN.handle.stats.snapshot()  # all since install

    def ratio(sent: str, baseline: str) -> str:
        total = sum(totals[c] for c in BYTE_KEYS[baseline])
        return f"{sum(totals[c] for c in BYTE_KEYS[sent]) / total:.4f}" if total else "-"

    print(f"SDP4Bit on this rank: {sum(state.grad_calls.values())} quantized gradient "
          f"reduce-scatters, {sum(state.param_calls.values())} quantized parameter all-gathers, "
          f"{sum(state.unquantized_grad_calls.values())} unquantized (before "
          f"--gradients-quantization-start-iteration) in {_RUN.iterations} iterations; bytes "
          f"sent / unquantized: params {ratio('sdp4bit/params bytes', 'sdp4bit/params bytes unquantized')}, "
          f"grads {ratio('sdp4bit/grads bytes', 'sdp4bit/grads bytes unquantized')}; "
          f"{replicas}", flush=True)


def _declare(name: str, owner: str, attribute: str, replacement: Any, fingerprint: str,
             **kwargs: Any) -> patches.Replacement:
    return declare(f"megatron_lm.{name}", owner, attribute, MODULE, replacement, note=_NOTE,
                   checked={"0.19.2": fingerprint}, applies=_training_installed,
                   scope=patches.MEGATRON_LM, **kwargs)


PYTHON_312 = _declare("typing.override", "typing", "override", _override, "<absent>", adds=True)
"""Added before ``megatron.training`` is imported (the release walk adds it too)."""
TRAINER = (
    _declare("compile_helpers", "megatron.core.datasets.utils", "compile_helpers",
             _compile_helpers, "()", wraps=True),
    _declare("add_megatron_arguments", _ARGUMENTS, "add_megatron_arguments",
             _add_megatron_arguments, "(parser)", wraps=True),
    _declare("validate_args", _ARGUMENTS, "validate_args", _validate_args,
             "(args, defaults)", wraps=True),
    _declare("setup_model_and_optimizer", _TRAINING, "setup_model_and_optimizer",
             _setup_model_and_optimizer,
             "(model_type, model_provider_func, checkpointing_context, *, cfg_container, "
             "pg_collection)", wraps=True),
    _declare("load_checkpoint", _TRAINING, "load_checkpoint", _load_checkpoint,
             "(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, "
             "checkpointing_context, skip_load_to_model_and_opt, tp_group, pp_group, "
             "dp_cp_group, dp_group, expt_dp_group, rng_state_key_prefix)", wraps=True),
    _declare("train_step", _TRAINING, "train_step", _train_step,
             "(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config, "
             "forward_backward_func, iteration, pg_collection, p2p_communicator)", wraps=True),
    _declare("generate_state_dict", _CHECKPOINTING, "generate_state_dict",
             _generate_state_dict,
             "(args, model, optimizer, opt_param_scheduler, rng_state, iteration, "
             "optim_sd_kwargs, model_sd_kwargs, rerun_state)", wraps=True),
    _declare("_load_base_checkpoint", _CHECKPOINTING, "_load_base_checkpoint",
             _load_base_checkpoint,
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
    if not _training_installed():
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
    global _applied
    for part in reversed(_applied):
        part.revert()
    _applied = ()
