"""Checkpoints: every rank writes its own file; nothing is trusted before it is verified.

Files, atomic writes, checksums and the run lock: :mod:`.files`. This module
decides what goes in (model chunk, optimizer shard, RNG, error-feedback state, schedule, the
run's settings) and what a load accepts:

* the layout (world, TP, PP, DP, buckets) and the model's shape must equal this run's, and
  the SDP4Bit settings too unless ``--allow-changed-sdp4bit-settings``: one sentence names
  every difference;
* the learning-rate schedule follows Megatron-LM: a schedule flag that differs from the
  checkpoint's is refused unless ``--override-opt_param-scheduler`` (the command line wins)
  or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint wins);
* ``--no-load-optim`` restores the 16-bit model weights and copies them into the fp32 main
  parameters (Megatron-LM's ``reload_model_params``), so the first step continues from the
  checkpoint's weights, not from the random initialization;
* weights holding NaN/Inf are never written: :func:`save_checkpoint` refuses, and the last
  good checkpoint stays current.

Rank 0 checks what all ranks share (tracker, manifest, settings) and broadcasts the
verdict; every rank checks its own file's checksum and all ranks learn the first failure,
so every rank stops with the same message.

[Note: why the optimizer shard is saved as the inner optimizer's state]
The distributed optimizer's inner ``torch.optim`` optimizer owns exactly this rank's fp32
main-parameter shards and their moments. Saving that state plus the main tensors, and
restoring them in place, repeats the uninterrupted run bit for bit without any collective.
Restoring the main params from the (bf16) model weights instead would lose the low bits,
and with qWD the replica differs from the main params by design.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from megatron.sdp4bit.training.checkpoint import common, disk_space, files
from megatron.sdp4bit.training.checkpoint import settings as settings_contract
from megatron.sdp4bit.training.guards import hooks
from megatron.sdp4bit.training.checkpoint.files import CheckpointError

def _optimizer_state(optimizer) -> list[dict[str, Any]]:
    states = []
    for opt in common.inner_optimizers(optimizer):
        inner = opt.optimizer
        scaler = getattr(opt, "grad_scaler", None)
        states.append({
            "inner": inner.state_dict(),
            "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        })
    return states


def _load_optimizer_state(optimizer, states: list[dict[str, Any]], directory: str) -> None:
    opts = common.inner_optimizers(optimizer)
    if len(opts) != len(states):
        raise CheckpointError(f"checkpoint {directory} has {len(states)} optimizers, this run "
                              f"{len(opts)}: resume with the same model and precision flags")
    for opt, state in zip(opts, states):
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        saved = state["main_params"]
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in saved]:
            raise CheckpointError(f"optimizer shard shapes in {directory} differ from this "
                                  "run's: resume with the same model, parallel layout and "
                                  "bucket size")
        inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and state["grad_scaler"] is not None:
            scaler.load_state_dict(state["grad_scaler"])


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    # DDP and Float16Module forward load_state_dict without returning torch's key report.
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_state(model_chunks) -> list[dict[str, torch.Tensor]]:
    # Transformer Engine keeps non-tensor ``_extra_state`` (fp8 metadata); it is not needed to
    # resume a bf16/fp32 run and would defeat weights_only loading.
    return [{k: v for k, v in _unwrap(m).state_dict().items() if isinstance(v, torch.Tensor)}
            for m in model_chunks]


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler, settings: dict[str, Any], *, sdp4bit=None) -> str:
    """Collective: write this iteration's checkpoint; returns its folder. Refuses (with
    :class:`CheckpointError`, on every rank, writing nothing) when weights are non-finite.
    ``sdp4bit``: the run's SDP4Bit lifecycle (its error-feedback state is this rank's)."""
    if not common.weights_finite(model_chunks, optimizer):
        raise CheckpointError(f"not saving iteration {iteration}: the weights hold NaN or Inf; "
                              f"the last complete checkpoint in {root} stays current")
    rank = dist.get_rank()
    directory = files.iteration_dir(root, iteration)
    name = f"rank_{rank:05d}.pt"
    entry, error = None, None
    payload = {"model": _model_state(model_chunks), "optimizer": _optimizer_state(optimizer),
               "rng": common.rng_state()}
    error_feedback = common.error_feedback_state(sdp4bit)
    if error_feedback is not None:
        payload["error_feedback"] = error_feedback
    disk_space.check_space(root, None, iteration, disk_space.tensor_bytes(payload))
    try:  # a full disk on one rank must stop every rank, not leave them waiting
        files.make_dir(directory)
        entry = files.save_file(payload, os.path.join(directory, name))
    except CheckpointError as err:
        error = str(err)
    hooks.fire("save-files-written", iteration)
    entries: list[tuple[str, dict | None, str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (name, entry, error))
    first = next((e for _, _, e in entries if e is not None), None)
    if first is not None:  # every rank holds the gathered errors: no second collective
        raise CheckpointError(first)
    if rank == 0:
        manifest = {n: e for n, e, _ in entries}
        try:
            manifest["common.pt"] = files.save_file(
                {"iteration": iteration, "consumed_samples": consumed_samples,
                 "scheduler": scheduler.state_dict()}, os.path.join(directory, "common.pt"))
            files.write_manifest(directory, iteration, manifest, settings)
        except CheckpointError as err:
            error = str(err)
    common.first_error(error)  # every file and the manifest are complete: now the tracker
    if rank == 0:
        try:
            files.write_tracker(root, iteration)
        except CheckpointError as err:
            error = str(err)
    common.first_error(error)
    return directory


def _inspect(root: str, settings: dict[str, Any], allow_sdp4bit_change: bool,
             allow_data_change: bool = False, allow_no_manifest: bool = False,
             iteration: int | None = None) -> tuple[int | None, dict | None, str | None]:
    """Rank 0's checks: (iteration, manifest, problem); ``iteration`` (``--ckpt-step``)
    instead of the tracker's."""
    try:
        if iteration is None:
            iteration = files.latest_iteration(root)
        if iteration is None:
            return None, None, None
        directory = files.iteration_dir(root, iteration)
        if not os.path.isdir(directory):
            return None, None, (f"{os.path.join(root, files.TRACKER)} names iteration "
                                f"{iteration} but {directory} does not exist: the checkpoint "
                                "folder was moved or pruned")
        manifest = files.read_manifest(directory)
        if manifest is None:
            if allow_no_manifest:
                return iteration, None, None
            return None, None, (f"checkpoint {directory} has no {files.MANIFEST}: nothing in it "
                                "can be verified (checksums, layout, settings); restore the "
                                "manifest, load an earlier checkpoint, or pass "
                                "--load-without-manifest to load it unchecked")
        if (note := files.unsealed_note(directory, manifest)) is not None:
            print(f"note: {note}", flush=True)
        problem = settings_contract.settings_problem(
            manifest["settings"], settings, directory, allow_sdp4bit_change, allow_data_change)
        expected = {f"rank_{r:05d}.pt" for r in range(dist.get_world_size())} | {"common.pt"}
        for name in sorted(expected - set(manifest["files"])):
            problem = problem or f"the manifest of {directory} does not list {name}"
        for name, entry in sorted(manifest["files"].items()):
            path = os.path.join(directory, name)
            if problem is None and not os.path.isfile(path):
                problem = (f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                           "load an earlier one")
            elif problem is None and os.path.getsize(path) != entry["bytes"]:
                problem = (f"checkpoint file {path} is {os.path.getsize(path)} bytes, the "
                           f"manifest says {entry['bytes']}: it is truncated")
        return iteration, manifest, problem
    except CheckpointError as err:
        return None, None, str(err)


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, settings: dict[str, Any], *,
                    load_optim: bool = True, load_rng: bool = True,
                    allow_sdp4bit_change: bool = False, allow_data_change: bool = False,
                    allow_no_manifest: bool = False, iteration: int | None = None,
                    sdp4bit=None) -> tuple[int, int]:
    """Collective: restore this rank's state from the latest checkpoint under ``root`` (or
    ``iteration``'s); returns (iteration, consumed samples), (0, 0) when there is none."""
    verdict = [None, None, None]
    if dist.get_rank() == 0:
        verdict = list(_inspect(root, settings, allow_sdp4bit_change, allow_data_change,
                                allow_no_manifest, iteration))
    dist.broadcast_object_list(verdict, src=0)
    iteration, manifest, problem = verdict
    if problem is not None:
        raise CheckpointError(problem)
    if iteration is None:
        return 0, 0
    directory = files.iteration_dir(root, iteration)
    entries = manifest["files"] if manifest is not None else {}
    own, saved_common, error = None, None, None
    try:
        saved_common = files.read_verified(os.path.join(directory, "common.pt"),
                                           entries.get("common.pt"))
        name = f"rank_{dist.get_rank():05d}.pt"
        own = files.read_verified(os.path.join(directory, name), entries.get(name))
    except CheckpointError as err:
        error = str(err)
    common.first_error(error)
    error = None
    try:
        for chunk, state in zip(model_chunks, own["model"]):
            missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise CheckpointError(f"model in {directory} does not match this model: "
                                      f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        if load_optim:
            common.check_schedule(scheduler, saved_common["scheduler"], directory)
            _load_optimizer_state(optimizer, own["optimizer"], directory)
            scheduler.load_state_dict(saved_common["scheduler"])
    except CheckpointError as err:
        error = str(err)
    common.first_error(error)
    if not load_optim:
        # The fp32 main params still hold the random initialization: take the loaded model.
        for opt in common.inner_optimizers(optimizer):
            opt.reload_model_params()
    if load_rng:
        common.set_rng_state(own["rng"])
    # The layout is this run's (checked above): the saved error is this rank's own.
    common.restore_error_feedback(sdp4bit, own.get("error_feedback"), directory)
    return saved_common["iteration"], saved_common["consumed_samples"]
