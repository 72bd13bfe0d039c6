"""``--ckpt-format``: which format a save writes and which a load accepts; and which
checkpoint a run starts from, and how.

``torch_dist`` (the default, :mod:`.torch_dist_format`) and ``torch`` (one file per rank,
:mod:`.torch_format`). A load finds the format of the folder the tracker names; one that
is not ``--ckpt-format`` is refused unless ``--auto-detect-ckpt-format``, which is also how
a checkpoint is converted: load it with that flag and save with the other format.

``--finetune``, ``--pretrained-checkpoint`` (used while ``--load`` holds no checkpoint) and
a torch_dist checkpoint without this trainer's manifest (Megatron-LM's) load the model's
weights alone (:mod:`.weights_only`, Megatron-LM's fine-tuning semantics).

``--ckpt-step N`` (Megatron-LM's flag) loads ``iter_N`` of ``--load`` instead of the
iteration the tracker names. A load that finds its checkpoint damaged names the newest
complete one beside it and this flag. Before anything of a checkpoint is read, the folder,
its tracker and every file of the checkpoint must keep the trust rule
(``files.check_trusted``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, NamedTuple

import torch.distributed as dist

from megatron.sdp4bit.integration.version import megatron_core_version
from megatron.sdp4bit.training.checkpoint import (files, torch_dist_format, torch_format,
                                                  weights_only)
from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves
from megatron.sdp4bit.training.checkpoint.files import CheckpointError

def sharding_type(args: argparse.Namespace) -> str:
    return "fully_reshardable" if args.dist_ckpt_optim_fully_reshardable else "dp_reshardable"


def save(args: argparse.Namespace, iteration: int, consumed_samples: int, model_chunks,
         optimizer, scheduler, settings: dict[str, Any], sdp4bit=None,
         background: AsyncSaves | None = None) -> str:
    """Collective: save in ``--ckpt-format``; returns the folder. ``sdp4bit``: the
    run's SDP4Bit lifecycle, whose per-rank state (error feedback) the checkpoint holds too.
    ``background`` (``--async-save``, torch_dist only): schedule the save there instead of
    writing it now (:mod:`.async_save`)."""
    if args.ckpt_format == "torch_dist":
        return torch_dist_format.save_checkpoint(
            args.save, iteration, consumed_samples, model_chunks, optimizer, scheduler,
            settings, sharding_type=sharding_type(args),
            fully_parallel=args.ckpt_fully_parallel_save, sdp4bit=sdp4bit,
            background=background)
    assert background is None, "--async-save is refused with --ckpt-format torch"
    return torch_format.save_checkpoint(args.save, iteration, consumed_samples, model_chunks,
                                         optimizer, scheduler, settings,
                                         sdp4bit=sdp4bit)



def _iteration(root: str, ckpt_step: int | None) -> int | None:
    """The iteration to load: ``--ckpt-step``'s, else the tracker's (None: no checkpoint)."""
    if ckpt_step is None:
        return files.latest_iteration(root)
    if not os.path.isdir(files.iteration_dir(root, ckpt_step)):
        found = [int(n[5:]) for n in files.iteration_folders(root) if n[5:].isdigit()]
        raise CheckpointError(
            f"--ckpt-step {ckpt_step}: {files.iteration_dir(root, ckpt_step)} does not exist ("
            + (f"{root} holds iterations {', '.join(map(str, found[-5:]))}" if found else
               f"{root} holds no iter_* folder") + ")")
    return ckpt_step


def _probe(root: str, ckpt_step: int | None = None
           ) -> tuple[str | None, dict | None, str | None]:
    """Rank 0: (format of the folder to load, None when there is none; its manifest;
    problem)."""
    try:
        files.check_trusted(root)
        iteration = _iteration(root, ckpt_step)
        if iteration is None:
            return None, None, None
        directory = files.iteration_dir(root, iteration)
        if not os.path.isdir(directory):
            return None, None, (f"{os.path.join(root, files.TRACKER)} names iteration "
                                f"{iteration} but {directory} does not exist: the checkpoint "
                                "folder was moved or pruned")
        files.check_trusted(root, directory)
        if torch_dist_format.is_dist_checkpoint(directory):
            manifest = files.read_manifest(directory)
            return "torch_dist", manifest, release_problem(directory, manifest)
        return "torch", None, None
    except CheckpointError as err:
        return None, None, str(err)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:3])


def release_problem(directory: str, manifest: dict | None,
                    running: str | None = None) -> str | None:
    """Why this megatron-core cannot read the torch_dist checkpoint ``directory``, or None.

    [Note: checkpoints across megatron-core releases]
    The manifest records the release that wrote the checkpoint (``settings.megatron_core``).
    0.16.1 keeps the common state (iteration, schedule) in ``common.pt`` and says so in
    ``metadata.json`` (``common_backend``); 0.19.2 writes no ``common.pt`` and reads both
    layouts. So a checkpoint of 0.16.1 resumes under 0.19.2 (the same losses, bit for bit:
    ``tests/e2e/test_checkpoint_releases.py``), while 0.16.1 cannot read one of 0.19.2 (it
    fails on every rank looking for ``common.pt``): a checkpoint written by a newer release
    than the running one is refused, naming both. A manifest written before the release was
    recorded is placed by that layout."""
    running = running or megatron_core_version()
    saved = ((manifest or {}).get("settings") or {}).get("megatron_core")
    if not isinstance(saved, str):
        try:
            with open(os.path.join(directory, "metadata.json"), encoding="utf-8") as f:
                common_backend = "common_backend" in json.load(f)
        except (OSError, ValueError):
            return None  # the load names the damage
        if common_backend or _release(running) >= (0, 19):
            return None
        saved = "0.19 or later (no common.pt)"
    elif _release(saved) <= _release(running):
        return None
    return (f"checkpoint {directory} was written by megatron-core {saved}, and this run has "
            f"megatron-core {running}, which cannot read it: resume it with megatron-core "
            f"{saved.split()[0]} (requirements.txt pins it for Python >= 3.12), or load a "
            f"checkpoint written by {running}")


class Loaded(NamedTuple):
    """What :func:`load` restored: where from, and where the run continues."""

    iteration: int
    consumed_samples: int
    source: str | None  # the folder read (None: nothing was loaded)
    weights_only: bool  # --finetune semantics: iteration 0, fresh optimizer/schedule/RNG


def _verdict(root: str, ckpt_step: int | None = None) -> tuple[str | None, dict | None]:
    """Collective: rank 0 probes ``root``; every rank gets (format or None, manifest)."""
    verdict: list = [None, None, None]
    if dist.get_rank() == 0:
        verdict = list(_probe(root, ckpt_step))
    dist.broadcast_object_list(verdict, src=0)
    found, manifest, problem = verdict
    if problem is not None:
        try:
            damaged = _iteration(root, ckpt_step)
        except CheckpointError:
            damaged = None
        raise CheckpointError(with_earlier(problem, root, damaged))
    if manifest is not None and dist.get_rank() == 0:
        directory = files.iteration_dir(root, _iteration(root, ckpt_step))
        if (note := files.unsealed_note(directory, manifest)) is not None:
            print(f"note: {note}", flush=True)
    return found, manifest


def load(args: argparse.Namespace, model_chunks, optimizer, scheduler,
         settings: dict[str, Any], sdp4bit=None) -> Loaded:
    """Collective: restore from the latest checkpoint under ``--load``, or, when it holds
    none, from ``--pretrained-checkpoint`` with ``--finetune``'s semantics (Megatron-LM's
    rule); nothing loaded when there is neither. ``sdp4bit``: the run's SDP4Bit lifecycle,
    whose error-feedback state a resume restores (a weights-only start leaves it at zero)."""
    root, finetune, step = args.load, args.finetune, args.ckpt_step
    found, manifest = _verdict(root, step) if root else (None, None)
    if found is None and args.pretrained_checkpoint:
        root, finetune, step = args.pretrained_checkpoint, True, None
        found, manifest = _verdict(root)
        if found is None:
            raise CheckpointError(
                f"--pretrained-checkpoint {root} holds no checkpoint (no {files.TRACKER} naming "
                "an existing iteration folder)" + (f", nor does --load {args.load}"
                                                    if args.load else ""))
    if found is None:  # no tracker: Megatron-LM's "no checkpoint", a fresh start
        return Loaded(0, 0, None, finetune)
    if (root == args.load and args.pretrained_checkpoint
            and (not dist.is_initialized() or dist.get_rank() == 0)):
        print(f"note: --pretrained-checkpoint {args.pretrained_checkpoint} is not read: --load "
              f"{root} holds a checkpoint, which this run resumes (Megatron-LM's rule: the "
              "pretrained weights start a run only while --load holds none)", flush=True)
    iteration = _iteration(root, step)
    directory = files.iteration_dir(root, iteration)
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
                   allow_data_change=args.allow_changed_data, sdp4bit=sdp4bit)
    try:
        if found == "torch_dist":
            iteration, consumed = torch_dist_format.load_checkpoint(
                directory, manifest, model_chunks, optimizer, scheduler, settings,
                fully_parallel=args.ckpt_fully_parallel_load, **options)
        else:
            iteration, consumed = torch_format.load_checkpoint(
                root, model_chunks, optimizer, scheduler, settings,
                allow_no_manifest=args.load_without_manifest, iteration=step, **options)
    except CheckpointError as err:
        raise CheckpointError(with_earlier(str(err), root, iteration)) from None
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


# Words of the load's messages for a damaged checkpoint (not for a mismatched run).
DAMAGE = ("load an earlier", "truncated", "is missing", "does not match its SHA-256",
          "is corrupt", "is damaged", "integrity check")


def with_earlier(message: str, root: str, damaged: int | None) -> str:
    """``message`` with the newest complete checkpoint of ``root`` other than ``damaged``
    and the flag that loads it, when the message is about a damaged checkpoint."""
    if damaged is None or not any(word in message for word in DAMAGE):
        return message
    earlier = files.newest_complete(root, exclude=damaged)
    if earlier is None:
        return f"{message} (no other complete checkpoint is in {root})"
    return (f"{message} (the newest complete checkpoint in {root} is iteration {earlier}: "
            f"pass --ckpt-step {earlier} to load it)")
