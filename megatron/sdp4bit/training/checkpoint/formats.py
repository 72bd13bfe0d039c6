"""``--ckpt-format``: which format a save writes and which a load accepts; and which
checkpoint a run starts from, and how.

``torch_dist`` (the default, :mod:`.torch_dist_format`) and ``torch`` (one file per rank,
:mod:`.torch_format`). A load finds the format of the folder the tracker names; one that
is not ``--ckpt-format`` is refused unless ``--auto-detect-ckpt-format``, which is also how
a checkpoint is converted: load it with that flag and save with the other format.

``--finetune``, ``--pretrained-checkpoint`` (used while ``--load`` holds no checkpoint) and
a torch_dist checkpoint without this trainer's manifest (Megatron-LM's) load the model's
weights alone (:mod:`.weights_only`, Megatron-LM's fine-tuning semantics).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, NamedTuple

import torch.distributed as dist

from megatron.sdp4bit.training.checkpoint import (files, torch_dist_format, torch_format,
                                                  weights_only)
from megatron.sdp4bit.training.checkpoint.files import CheckpointError


def sharding_type(args: argparse.Namespace) -> str:
    return "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"


def save(args: argparse.Namespace, iteration: int, consumed_samples: int, model_chunks,
         optimizer, scheduler, settings: dict[str, Any]) -> str:
    """Collective: save in ``--ckpt-format``; returns the folder."""
    if args.ckpt_format == "torch_dist":
        return torch_dist_format.save_checkpoint(
            args.save, iteration, consumed_samples, model_chunks, optimizer, scheduler,
            settings, sharding_type=sharding_type(args),
            fully_parallel=args.ckpt_fully_parallel_save)
    return torch_format.save_checkpoint(args.save, iteration, consumed_samples, model_chunks,
                                         optimizer, scheduler, settings)


def _probe(root: str) -> tuple[str | None, dict | None, str | None]:
    """Rank 0: (format of the tracker's folder, None when there is no tracker; its manifest;
    problem)."""
    try:
        iteration = files.latest_iteration(root)
        if iteration is None:
            return None, None, None
        directory = files.iteration_dir(root, iteration)
        if not os.path.isdir(directory):
            return None, None, (f"{os.path.join(root, files.TRACKER)} names iteration "
                                f"{iteration} but {directory} does not exist: the checkpoint "
                                "folder was moved or pruned")
        if torch_dist_format.is_dist_checkpoint(directory):
            return "torch_dist", files.read_manifest(directory), None
        return "torch", None, None
    except CheckpointError as err:
        return None, None, str(err)


class Loaded(NamedTuple):
    """What :func:`load` restored: where from, and where the run continues."""

    iteration: int
    consumed_samples: int
    source: str | None  # the folder read (None: nothing was loaded)
    weights_only: bool  # --finetune semantics: iteration 0, fresh optimizer/schedule/RNG


def _verdict(root: str) -> tuple[str | None, dict | None]:
    """Collective: rank 0 probes ``root``; every rank gets (format or None, manifest)."""
    verdict: list = [None, None, None]
    if dist.get_rank() == 0:
        verdict = list(_probe(root))
    dist.broadcast_object_list(verdict, src=0)
    found, manifest, problem = verdict
    if problem is not None:
        raise CheckpointError(problem)
    return found, manifest


def load(args: argparse.Namespace, model_chunks, optimizer, scheduler,
         settings: dict[str, Any]) -> Loaded:
    """Collective: restore from the latest checkpoint under ``--load``, or, when it holds
    none, from ``--pretrained-checkpoint`` with ``--finetune``'s semantics (Megatron-LM's
    rule); nothing loaded when there is neither."""
    root, finetune = args.load, args.finetune
    found, manifest = _verdict(root) if root else (None, None)
    if found is None and args.pretrained_checkpoint:
        root, finetune = args.pretrained_checkpoint, True
        found, manifest = _verdict(root)
        if found is None:
            raise CheckpointError(
                f"--pretrained-checkpoint {root} holds no checkpoint (no {files.TRACKER} naming "
                "an existing iteration folder)" + (f", nor does --load {args.load}"
                                                    if args.load else ""))
    if found is None:  # no tracker: Megatron-LM's "no checkpoint", a fresh start
        return Loaded(0, 0, None, finetune)
    directory = files.iteration_dir(root, files.latest_iteration(root))
    if finetune or (found == "torch_dist" and manifest is None):
        return _load_weights(args, root, directory, found, manifest, finetune, model_chunks,
                             optimizer, settings)
    if found != args.ckpt_format and not args.auto_detect_ckpt_format:
        raise CheckpointError(
            f"the checkpoint in {root} is in format {found}, this run's --ckpt-format is "
            f"{args.ckpt_format}: pass --ckpt-format {found}, or --auto-detect-ckpt-format to "
            f"load it and save in {args.ckpt_format} (which converts it)")
    if weights_only.is_model_only(manifest):
        source = manifest["settings"].get("source", "an import")
        raise CheckpointError(f"checkpoint {directory} holds model weights only ({source}): "
                              f"start from it with --finetune, or --pretrained-checkpoint {root}")
    options = dict(load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                   allow_sdp4bit_change=args.allow_changed_sdp4bit_settings,
                   allow_data_change=args.allow_changed_data)
    if found == "torch_dist":
        iteration, consumed = torch_dist_format.load_checkpoint(
            directory, manifest, model_chunks, optimizer, scheduler, settings,
            fully_parallel=args.ckpt_fully_parallel_load, **options)
    else:
        iteration, consumed = torch_format.load_checkpoint(
            root, model_chunks, optimizer, scheduler, settings,
            allow_no_manifest=args.load_without_manifest, **options)
    return Loaded(iteration, consumed, directory, False)


def _load_weights(args, root: str, directory: str, found: str, manifest: dict | None,
                  finetune: bool, model_chunks, optimizer, settings) -> Loaded:
    """The model's weights alone (:mod:`.weights_only`): ``--finetune``, or a torch_dist
    checkpoint without our manifest."""
    if found == "torch":
        # Per-rank files: the same layout is needed; the optimizer, schedule and RNG stay.
        torch_format.load_checkpoint(root, model_chunks, optimizer, None, settings,
                                     load_optim=False, load_rng=False,
                                     allow_sdp4bit_change=True, allow_data_change=True,
                                     allow_no_manifest=args.load_without_manifest)
        return Loaded(0, 0, directory, True)
    if manifest is None and not finetune and not (
            args.load_without_manifest and args.no_load_optim and args.no_load_rng):
        raise CheckpointError(
            f"{directory} holds a distributed checkpoint without {files.MANIFEST} (not written "
            "by this trainer, e.g. Megatron-LM's, or its save did not finish): start from its "
            "weights with --finetune (iteration 0), or pass --load-without-manifest "
            "--no-load-optim --no-load-rng to continue at its iteration with a fresh optimizer")
    iteration, consumed = weights_only.load_weights(
        directory, manifest, model_chunks, optimizer, settings, finetune=finetune,
        global_batch=args.global_batch_size, fully_parallel=args.ckpt_fully_parallel_load)
    return Loaded(iteration, consumed, directory, finetune)
