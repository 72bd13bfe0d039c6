"""Flags that need something installed on this machine: checked after parsing, before
``torch.distributed`` starts, so a missing package or device costs one line and no start-up.

:func:`parse_args` decides what a command line means, the same on every machine (a laptop
checks a cluster's script with it); :func:`check_installed` decides whether this machine can
run it:

* ``--transformer-impl transformer_engine`` and Transformer Engine's attention kernels
  (``--attention-backend flash|fused|unfused``, ``--use-flash-attn``) need CUDA and the
  ``transformer_engine`` package (``pip install -e ".[te]"``); ``--transformer-impl auto`` on
  CUDA without it runs megatron-core's local layers and says so once;
* ``--distributed-backend``: ``nccl`` needs CUDA, and one device per local rank; ``gloo``
  on CUDA lets ranks share devices (:mod:`.devices`, [Note: several ranks on one GPU]);
* ``--context-parallel-size`` > 1 needs Transformer Engine's attention (the trainer does
  not split batches over context-parallel ranks yet, so it is refused everywhere, naming
  the first reason);
* ``--tensorboard-dir`` needs ``tensorboard`` (the ``logging`` extra), ``--wandb-project``
  needs ``wandb`` (the ``wandb`` extra);
* SDP4Bit's quantized collectives replace megatron-core internals checked against
  particular releases: another release runs with a warning when every attribute the trainer
  replaces is as it was checked, and is refused otherwise (naming the first that moved) unless
  ``--allow-untested-megatron-core`` is given, which is then said loudly.

Warnings go to stderr from rank 0 (torchrun's ``$RANK``) only. ``parse_args(...,
check_machine=True)`` runs these checks as its last steps (:func:`installed_steps`), so
that what this machine lacks is named in the same message as the rest (errors.py, [Note:
every refusal in one message]).
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable

from megatron.sdp4bit.training.cli import devices
from megatron.sdp4bit.training.cli.errors import ArgumentsError, Refusals, warn

__all__ = ["TE_INSTALL", "check_installed", "installed_steps", "uses_transformer_engine"]

TE_INSTALL = 'pip install -e ".[te]"'  # setup.py's extra: a Transformer Engine release
# that both tested megatron-core releases accept


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_count() -> int:
    import torch

    return torch.cuda.device_count() if _cuda() else 0


def uses_transformer_engine(impl: str) -> bool:
    """Whether the model is built from Transformer Engine's layers: asked for, or ``auto``
    with CUDA and the package present (what :func:`check_installed` let through)."""
    return impl != "local" and _cuda() and _importable("transformer_engine")


def _check_transformer_engine(args: argparse.Namespace) -> None:
    cuda, te = _cuda(), _importable("transformer_engine")
    attention = args.attention_backend in ("flash", "fused", "unfused")
    if args.transformer_impl == "transformer_engine" or attention:
        what = ("--transformer-impl transformer_engine" if args.transformer_impl ==
                "transformer_engine" else f"--attention-backend {args.attention_backend} "
                "(or --use-flash-attn)")
        instead = ("--transformer-impl local" if args.transformer_impl == "transformer_engine"
                   else "drop the flag")
        if not cuda:
            raise ArgumentsError(f"{what} runs Transformer Engine's CUDA kernels and there is no "
                                 f"CUDA device here: {instead}")
        if not te:
            raise ArgumentsError(f"{what} needs Transformer Engine, which is not installed: "
                                 f"{TE_INSTALL}, or {instead}")
    elif args.transformer_impl == "auto" and cuda and not te:
        warn("--transformer-impl auto: Transformer Engine is not installed, so this run uses "
             "megatron-core's local layers (correct, slower on GPU); for Transformer Engine's: "
             f"{TE_INSTALL}")


def _check_context_parallel(args: argparse.Namespace) -> None:
    # Context parallelism splits every sequence over --context-parallel-size ranks; only
    # Transformer Engine's attention exchanges the keys and values between them (the local
    # spec's attention sees its own slice only and would be silently wrong).
    cp = args.context_parallel_size
    if cp == 1:
        return
    if not uses_transformer_engine(args.transformer_impl):
        why = ("--transformer-impl local does not use it" if args.transformer_impl == "local"
               else "there is no CUDA device here" if not _cuda()
               else f"Transformer Engine is not installed ({TE_INSTALL})")
        raise ArgumentsError(
            f"--context-parallel-size={cp} needs Transformer Engine's attention, and {why}: "
            "drop --context-parallel-size (accepted: 1)")
    raise ArgumentsError(
        f"--context-parallel-size={cp} is not supported by this trainer yet: it does not split "
        "its batches over context-parallel ranks (install_sdp4bit quantizes a model built "
        "with context parallelism in one's own loop); drop --context-parallel-size")


def _check_logging_packages(args: argparse.Namespace) -> None:
    for flag, value, package, extra in (
            ("--tensorboard-dir", args.tensorboard_dir, "tensorboard", "logging"),
            ("--wandb-project", args.wandb_project, "wandb", "wandb")):
        if value and not _importable(package):
            raise ArgumentsError(f"{flag} needs the {package} package, which is not installed: "
                                 f'pip install -e ".[{extra}]" (or pip install {package})')


def _check_megatron_core(args: argparse.Namespace, quantized: bool) -> None:
    if not quantized:  # megatron-core's own collectives: nothing of it is replaced
        return
    from megatron.sdp4bit.integration import (
        TESTED_MEGATRON_CORE_VERSIONS,
        check_megatron_core_version,
        patches,
    )

    # An untested release runs (with the integration's one warning line) when every
    # attribute the trainer replaces is as it was checked; otherwise it is refused, naming the
    # first that moved, unless the flag asks to run anyway. The trainer applies the seams,
    # the padding, the checkpoint writer's entries and, without CUDA, CPU mode's.
    scopes = (patches.SEAM, patches.PADDING, patches.CHECKPOINT) + (
        () if _cuda() else (patches.CPU_MODE,))
    try:
        installed = check_megatron_core_version(
            scopes=scopes, allow_untested_version=args.allow_untested_megatron_core,
            how_to_allow="pass --allow-untested-megatron-core")
    except RuntimeError as err:
        raise ArgumentsError(str(err)) from None
    if installed in TESTED_MEGATRON_CORE_VERSIONS or not args.allow_untested_megatron_core:
        return
    tested = " and ".join(TESTED_MEGATRON_CORE_VERSIONS)
    warn("!" * 20 + f" --allow-untested-megatron-core: megatron-core {installed} is NOT a "
         f"tested release (SDP4Bit was tested with {tested}); SDP4Bit replaces megatron-core "
         "internals that may have changed: check the losses against a baseline run "
         "before trusting this one " + "!" * 20)


def installed_steps(args: argparse.Namespace, quantized: Callable[[], bool]
                    ) -> list[tuple[str, Callable[[], None], tuple[str, ...]]]:
    """The checks of :func:`check_installed` as validation steps (name, check, the steps of
    ``validate.STEPS`` whose values it reads); ``quantized()``: whether the run installs
    SDP4Bit's collectives (read once the SDP4Bit flags are validated)."""
    return [("backend", lambda: devices.check_backend(args, _cuda(), _device_count()), ()),
            ("transformer engine", lambda: _check_transformer_engine(args), ("switches",)),
            ("context parallel", lambda: _check_context_parallel(args), ()),
            ("logging packages", lambda: _check_logging_packages(args), ()),
            ("megatron-core", lambda: _check_megatron_core(args, quantized()), ("sdp4bit",))]


def check_installed(args: argparse.Namespace, quantized: bool) -> None:
    """Refuse (one :class:`ArgumentsError` for all of them) the flags this machine cannot
    honour and warn once about the ones it honours at a cost (module docstring).
    ``quantized``: the run installs SDP4Bit's collectives (a quantization flag is on)."""
    refusals = Refusals()
    for name, step, _ in installed_steps(args, lambda: quantized):
        refusals.run(name, step)
    refusals.raise_if_any()
