"""Checkpoints: every rank writes its own file; loading never unpickles arbitrary objects.

Layout under ``--save`` (Megatron-LM's tracker file name)::

    latest_checkpointed_iteration.txt        the last complete iteration, written last
    iter_0000100/common.pt                   rank 0: iteration, consumed samples, schedule,
                                             world layout
    iter_0000100/rank_00003.pt               every rank: its model chunk (the bf16 replica;
                                             identical across DP ranks, kept per rank so a
                                             rank needs no other file), its optimizer shard
                                             (fp32 main params + Adam moments + scaler) and
                                             its RNG states

Files are written to a temporary name and renamed, then all ranks meet at a barrier
before rank 0 updates the tracker: a crash mid-save leaves the previous checkpoint valid.
Files hold only tensors, numbers, strings, lists and dicts, and are read with
``torch.load(weights_only=True)``.

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
from megatron.core import parallel_state, tensor_parallel

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(ValueError):
    """A missing, incomplete or corrupt checkpoint, or one from another layout."""


def _iter_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_state(optimizer) -> list[dict[str, Any]]:
    states = []
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        scaler = getattr(opt, "grad_scaler", None)
        states.append({
            "inner": inner.state_dict(),
            "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]],
            "grad_scaler": scaler.state_dict() if scaler is not None else None,
        })
    return states


def _load_optimizer_state(optimizer, states: list[dict[str, Any]]) -> None:
    opts = _inner_optimizers(optimizer)
    if len(opts) != len(states):
        raise CheckpointError(f"checkpoint has {len(states)} optimizers, this run {len(opts)}")
    for opt, state in zip(opts, states):
        inner = opt.optimizer
        params = [p for g in inner.param_groups for p in g["params"]]
        saved = state["main_params"]
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in saved]:
            raise CheckpointError("optimizer shard shapes differ from the checkpoint's: "
                                  "resume with the same model, parallel layout and bucket size")
        inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        scaler = getattr(opt, "grad_scaler", None)
        if scaler is not None and state["grad_scaler"] is not None:
            scaler.load_state_dict(state["grad_scaler"])


def _rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


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


def _layout() -> dict[str, int]:
    return {"world_size": dist.get_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size()}


def _atomic_save(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler) -> str:
    """Collective: every rank writes its file; returns the iteration directory."""
    rank = dist.get_rank()
    directory = _iter_dir(root, iteration)
    os.makedirs(directory, exist_ok=True)
    _atomic_save({"model": _model_state(model_chunks), "optimizer": _optimizer_state(optimizer),
                  "rng": _rng_state()}, os.path.join(directory, f"rank_{rank:05d}.pt"))
    if rank == 0:
        _atomic_save({"iteration": iteration, "consumed_samples": consumed_samples,
                      "scheduler": scheduler.state_dict(), "layout": _layout()},
                     os.path.join(directory, "common.pt"))
    dist.barrier()
    if rank == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(f"{iteration}\n")
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return directory


def _read(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete "
                              "or was written by a different number of ranks")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated or foreign files
        raise CheckpointError(f"checkpoint file {path} is corrupt or not a checkpoint "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from err


def latest_iteration(root: str) -> int | None:
    """The iteration named by the tracker file, ``None`` when ``root`` holds no checkpoint."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number")
    return int(text)


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, *, load_optim: bool = True,
                    load_rng: bool = True) -> tuple[int, int]:
    """Restore this rank's state; returns (iteration, consumed samples). (0, 0) if none."""
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    directory = _iter_dir(root, iteration)
    common = _read(os.path.join(directory, "common.pt"))
    if common["layout"] != _layout():
        raise CheckpointError(f"checkpoint {directory} was written with layout {common['layout']}, "
                              f"this run has {_layout()}: resume with the same layout")
    own = _read(os.path.join(directory, f"rank_{dist.get_rank():05d}.pt"))
    for chunk, state in zip(model_chunks, own["model"]):
        missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointError(f"model in {directory} does not match this model: missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}")
    if load_optim:
        _load_optimizer_state(optimizer, own["optimizer"])
        scheduler.load_state_dict(common["scheduler"])
    if load_rng:
        _set_rng_state(own["rng"])
    return common["iteration"], common["consumed_samples"]
