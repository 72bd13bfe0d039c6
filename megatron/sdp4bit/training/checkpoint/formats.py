"""``--ckpt-format``: which format a save writes and which a load accepts.

``torch_dist`` (the default, :mod:`.torch_dist_format`) and ``torch`` (one file per rank,
:mod:`.torch_format`). A load finds the format of the folder the tracker names; one that
is not ``--ckpt-format`` is refused unless ``--auto-detect-ckpt-format``, which is also how
a checkpoint is converted: load it with that flag and save with the other format.

``--ckpt-step N`` (Megatron-LM's flag) loads ``iter_N`` instead of the iteration the tracker
names. A load that finds its checkpoint damaged names the newest complete one beside it
and this flag. Before anything of a checkpoint is read, ``--load``, its tracker and every
file of the checkpoint folder must keep the trust rule (``files.check_trusted``).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch.distributed as dist

from megatron.sdp4bit.integration.version import megatron_core_version
from megatron.sdp4bit.training.checkpoint import files, torch_dist_format, torch_format
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
    """Rank 0: (format of the folder to load or None, its manifest, problem)."""
    try:
        files.check_trusted(root)
        iteration = _iteration(root, ckpt_step)
        if iteration is None:
            return None, None, None
        directory = files.iteration_dir(root, iteration)
        if not os.path.isdir(directory):
            return None, None, None  # the per-rank loader names this problem
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


def load(args: argparse.Namespace, model_chunks, optimizer, scheduler,
         settings: dict[str, Any]) -> tuple[int, int]:
    """Collective: restore from the latest checkpoint under ``--load``; returns (iteration,
    consumed samples), (0, 0) when there is none."""
    verdict: list = [None, None, None]
    if dist.get_rank() == 0:
        verdict = list(_probe(args.load, args.ckpt_step))
    dist.broadcast_object_list(verdict, src=0)
    found, manifest, problem = verdict
    if problem is not None:
        try:
            damaged = _iteration(args.load, args.ckpt_step)
        except CheckpointError:
            damaged = None
        raise CheckpointError(with_earlier(problem, args.load, damaged))
    if found is not None and found != args.ckpt_format and not args.auto_detect_ckpt_format:
        raise CheckpointError(
            f"the checkpoint in {args.load} is in format {found}, this run's --ckpt-format is "
            f"{args.ckpt_format}: pass --ckpt-format {found}, or --auto-detect-ckpt-format to "
            f"load it and save in {args.ckpt_format} (which converts it)")
    options = dict(load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                   allow_sdp4bit_change=args.allow_changed_sdp4bit_settings,
                   allow_data_change=args.allow_changed_data)
    iteration = _iteration(args.load, args.ckpt_step) if found is not None else None
    try:
        if found == "torch_dist":
            directory = files.iteration_dir(args.load, iteration)
            return torch_dist_format.load_checkpoint(directory, manifest, model_chunks,
                                                     optimizer, scheduler, settings,
                                                     fully_parallel=args.ckpt_fully_parallel_load,
                                                     **options)
        return torch_format.load_checkpoint(args.load, model_chunks, optimizer, scheduler,
                                            settings, allow_no_manifest=args.load_without_manifest,
                                            iteration=args.ckpt_step, **options)
    except CheckpointError as err:
        raise CheckpointError(with_earlier(str(err), args.load, iteration)) from None


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
