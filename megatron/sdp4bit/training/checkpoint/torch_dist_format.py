"""``--ckpt-format torch_dist``: checkpoints through ``megatron.core.dist_checkpointing``.

The tensors are megatron-core's: the model's ``sharded_state_dict()`` and the distributed
optimizer's ``sharded_state_dict(..., metadata={"distrib_optim_sharding_type": ...})``,
written by megatron-core's ``torch_dist`` strategy (PyTorch Distributed Checkpoint files).
Replicas are written once (megatron-core keeps only the main replica), and a load reads
only the slices this rank needs, so the data-parallel size may change on resume
(``dp_reshardable``), and TP/PP too with ``fully_reshardable``. What this module adds on
top is what the per-rank format (:mod:`.torch_format`) has: the settings recorded and
checked, a SHA-256 manifest, no non-finite checkpoint, and a folder that becomes visible
(renamed, synced) only when complete. See docs/checkpoints.md.

What megatron-core needs changed for that (its writer run in this process, the fully
reshardable optimizer state's offsets and step) is ``integration/dist_checkpointing.py``;
the manifest's hashes are ``integrity.py``.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from megatron.sdp4bit import atomic_files
from megatron.sdp4bit.integration import async_save, checkpoint_space
from megatron.sdp4bit.integration.dist_checkpointing import (
    EF_KEY,
    MEGATRON_INTEGRITY,
    bucket_space_world_tensors,
    error_feedback_sharded,
    in_process_writer,
    megatron_integrity_check,
    restore_steps,
    tolerate_missing_step,
)
from megatron.sdp4bit.training.checkpoint import (common, disk_space, files, integrity, safe_load,
                                                  stored_shapes)
from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves, PendingSave
from megatron.sdp4bit.training.checkpoint import settings as settings_contract
from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.guards import hooks

FORMAT_NAME = "torch_dist"
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")
# Layout entries a checkpoint of each sharding type may change on resume. The expert-parallel
# size ("ep") only between sizes above 1 (:func:`expert_parallel_problem`).
RESHARDABLE = {"dp_reshardable": {"world_size", "dp"},
               "fully_reshardable": {"world_size", "dp", "tp", "pp", "vpp", "ddp_bucket_size",
                                     "ep"}}
# What a dp_reshardable checkpoint cannot change and a fully reshardable one can, by the layout
# entries that differ: the hint its refusal ends with.
_NEEDS_FULLY_RESHARDABLE = ((("tp", "pp"), "a TP or PP change"),
                            (("ep",), "an expert-parallel size change (between sizes above 1)"),
                            (("vpp",), "a change of the interleaved pipeline's chunks"))


def is_dist_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a megatron-core distributed checkpoint."""
    return os.path.isfile(os.path.join(directory, "metadata.json"))


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _rng_object() -> ShardedObject:
    # One entry per (PP, TP, DP) rank, as Megatron-LM's fully parallel save stores it.
    pp, tp = (parallel_state.get_pipeline_model_parallel_rank(),
              parallel_state.get_tensor_model_parallel_rank())
    dp = parallel_state.get_data_parallel_rank()
    shape = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_tensor_model_parallel_world_size(),
             parallel_state.get_data_parallel_world_size())
    return ShardedObject("rng_state", common.rng_state(), shape, (pp, tp, dp), replica_id=0)


def error_feedback_skipped(saved: dict[str, Any], same_layout: bool) -> str | None:
    """Why a run with error feedback does not read the state of a checkpoint whose manifest
    recorded ``saved`` (None: it reads it). Like the RNG's, the state is the error of what
    each rank sent: it means nothing on another layout."""
    if not saved.get(EF_KEY):
        return "the checkpoint was saved without --gradient-error-feedback"
    if not same_layout:
        return "the checkpoint was saved with another parallel layout or bucket size"
    return None


def model_state(model_chunks) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(m).sharded_state_dict() for i, m in enumerate(model_chunks)}


def _sharded_state(model_chunks, optimizer, sharding_type: str, *, is_loading: bool,
                   with_optimizer: bool, with_rng: bool,
                   error_feedback: dict[str, Any] | None = None) -> dict[str, Any]:
    state = model_state(model_chunks)
    if with_optimizer:
        # The optimizer maps its parameters to the model's sharded tensors by identity, in
        # a dict of any nesting: the model chunks of the interleaved pipeline stay apart
        # (their local names repeat: each has its decoder.layers.0).
        model_sd = dict(state) if len(state) > 1 else state["model"]
        opts = common.inner_optimizers(optimizer)
        with bucket_space_world_tensors(opts if sharding_type == "fully_reshardable" else []):
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading,
                metadata={"distrib_optim_sharding_type": sharding_type})
    if with_rng:
        state["rng_state"] = _rng_object()
    if error_feedback is not None:
        state[EF_KEY] = error_feedback_sharded(error_feedback)
    return state


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler, settings: dict[str, Any], *, sharding_type: str,
                    fully_parallel: bool = False, sdp4bit=None,
                    background: AsyncSaves | None = None) -> str:
    """Collective: write this iteration's torch_dist checkpoint; returns its folder.
    ``sdp4bit``: the run's SDP4Bit lifecycle (its error-feedback state is this rank's).
    ``background`` (``--async-save``): the state is taken now and megatron-core's forked
    writer writes it while training goes on; :func:`publish` (manifest, rename, tracker)
    runs in the save's finalize step (:mod:`.async_save`), so the folder returned exists
    only once ``background`` has finalized the save."""
    if not common.weights_finite(model_chunks, optimizer):
        raise CheckpointError(f"not saving iteration {iteration}: the weights hold NaN or Inf; "
                              f"the last complete checkpoint in {root} stays current")
    final = files.iteration_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    # taken now (the error state is a copy): an asynchronous save writes it later
    error_feedback = common.error_feedback_state(sdp4bit)
    state = _sharded_state(model_chunks, optimizer, sharding_type, is_loading=False,
                           with_optimizer=True, with_rng=True, error_feedback=error_feedback)
    state.update(iteration=iteration, consumed_samples=consumed_samples,
                 opt_param_scheduler=scheduler.state_dict(), checkpoint_version=3.0)
    local_bytes = checkpoint_space.written_bytes(state)
    disk_space.check_space(root, partial, iteration, local_bytes)
    hooks.fire("save-space-checked", root, iteration)
    manifest_settings = {**settings, "ckpt_format": FORMAT_NAME, "optim_sharding": sharding_type,
                         # a load asks for the state only where it was written
                         **({EF_KEY: True} if error_feedback is not None else {})}
    extra = {"verify_integrity": True} if megatron_integrity_check() else {}
    if background is not None:
        with background.strategy() as strategy:
            request = dist_checkpointing.save(
                state, partial, sharded_strategy=_parallel(strategy, fully_parallel),
                validate_access_integrity=True, async_sharded_save=True, **extra,
                **async_save.save_keywords())
        background.schedule(request, PendingSave(root, partial, iteration, manifest_settings,
                                                 local_bytes), publish)
        return final
    try:
        with in_process_writer() as strategy:
            dist_checkpointing.save(state, partial,
                                    sharded_strategy=_parallel(strategy, fully_parallel),
                                    validate_access_integrity=True, **extra)
    except CheckpointException as err:  # a write failed: raised on every rank together
        raise disk_space.failed_save(root, partial, iteration, err) from err
    publish(PendingSave(root, partial, iteration, manifest_settings))
    return final


def _parallel(strategy, fully_parallel: bool):
    if not fully_parallel:
        return strategy
    return FullyParallelSaveStrategyWrapper(
        strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))


def publish(save: PendingSave) -> None:
    """Collective, once every rank's files of ``save`` are written and megatron-core has
    finalized them: hash them into the manifest, rename the partial folder to its iteration's
    and point the tracker at it, in that order ([Note: what survives a crash], files.py)."""
    hooks.fire("save-files-written", save.iteration)
    dist.barrier()
    entries = integrity.hash_shares(save.partial, integrity.shared_listing(save.partial))
    if dist.get_rank() == 0:
        final = files.iteration_dir(save.root, save.iteration)
        files.write_manifest(save.partial, save.iteration, entries, save.settings)
        old = final + ".old"
        if os.path.isdir(final):  # the same iteration saved again: keep it until replaced
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(save.partial, final)
        atomic_files.fsync_dir(save.root)
        shutil.rmtree(old, ignore_errors=True)
        files.write_tracker(save.root, save.iteration)
    dist.barrier()


def settings_problem(saved: dict[str, Any], current: dict[str, Any], directory: str,
                     allow_sdp4bit_change: bool, allow_data_change: bool = False) -> str | None:
    """What forbids resuming a torch_dist checkpoint with this run's settings (None: nothing).
    The layout entries its optimizer sharding can change are left out of the comparison."""
    sharding = saved.get("optim_sharding", "dp_reshardable")
    free = RESHARDABLE.get(sharding, set())
    # dp_reshardable keeps the optimizer's buckets: with bucketing on, their size must stay.
    strip = lambda s: {**s, "layout": {k: v for k, v in s.get("layout", {}).items()  # noqa: E731
                                       if k not in free}}
    problem = settings_contract.settings_problem(strip(saved), strip(current), directory,
                                                    allow_sdp4bit_change, allow_data_change)
    before, now = saved.get("layout", {}), current["layout"]
    changed = [what for keys, what in _NEEDS_FULLY_RESHARDABLE if any(
        before.get(k) != now.get(k) and (k not in settings_contract.LATER_LAYOUT_KEYS
                                          or (k in before and k in now)) for k in keys)]
    if problem is not None and sharding == "dp_reshardable" and changed:
        problem += (f"; {changed[0]} needs a checkpoint saved with "
                    "--dist-ckpt-optim-fully-reshardable")
    if problem is None:
        problem = expert_parallel_problem(before, now, directory)
    old_model, new_model = saved.get("model", {}), current["model"]
    differ = {k for k in set(old_model) | set(new_model)
              if old_model.get(k) != new_model.get(k)}
    padded, tp = old_model.get("padded_vocab_size"), current["layout"]["tp"]
    if (problem is not None and problem.startswith(f"checkpoint {directory} was saved with "
                                                   "model ")
            and differ == {"padded_vocab_size"} and isinstance(padded, int) and padded % tp == 0):
        # Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP;
        # a TP change keeps the checkpoint's size with the divisor that gives it at this TP.
        problem += (f"; the vocabulary is padded to a multiple of --make-vocab-size-divisible-by "
                    f"x TP: at TP {tp}, --make-vocab-size-divisible-by {padded // tp} gives the "
                    f"checkpoint's {padded}")
    return problem


def expert_parallel_problem(saved: dict[str, Any], current: dict[str, Any],
                            directory: str) -> str | None:
    """A fully reshardable checkpoint's expert-parallel size may change, but not to or from 1:
    megatron-core gives the experts an optimizer of their own only above 1 (at 1 they share
    the dense one), so the optimizer state's names differ and its load fails (tried: EP 2 -> 4
    resumes, with the first loss the uninterrupted run's; EP 2 -> 1 fails in megatron-core)."""
    ep = saved.get("ep"), current.get("ep")
    if None in ep or ep[0] == ep[1] or 1 not in ep:
        return None
    return (f"checkpoint {directory} was saved with layout ep {ep[0]}; this run has ep {ep[1]}: "
            "megatron-core's optimizer state changes the expert-parallel size only between "
            "sizes above 1 (at 1 the experts share the dense optimizer); resume with "
            f"--expert-model-parallel-size {ep[0]}" + (" or another size above 1"
                                                        if ep[0] > 1 else ""))


def load_checkpoint(directory: str, manifest: dict[str, Any] | None, model_chunks, optimizer,
                    scheduler, settings: dict[str, Any], *, load_optim: bool = True,
                    load_rng: bool = True, allow_sdp4bit_change: bool = False,
                    allow_data_change: bool = False,
                    fully_parallel: bool = False, sdp4bit=None) -> tuple[int, int]:
    """Collective: restore a torch_dist checkpoint folder (already named by the tracker);
    returns (iteration, consumed samples). ``sdp4bit``: the run's SDP4Bit lifecycle, whose
    error-feedback state is restored when the checkpoint holds it for this very layout."""
    if manifest is None:
        raise CheckpointError(f"{directory} holds a distributed checkpoint without "
                              f"{files.MANIFEST}: it was not written by this trainer or its "
                              "save did not finish; load an earlier one")
    saved = manifest["settings"]
    problem = settings_problem(saved, settings, directory, allow_sdp4bit_change,
                               allow_data_change)
    if problem is not None:
        raise CheckpointError(problem)
    problem = integrity.verify_files(directory, manifest)
    if problem is not None:
        raise CheckpointError(problem)
    problem = safe_load.dist_checkpoint_problem(directory, manifest["files"])
    if problem is not None:
        raise CheckpointError(problem)
    same_layout = settings_contract.same_layout(saved, settings)
    saved_common = dist_checkpointing.load_common_state_dict(directory)
    if load_optim:
        common.check_schedule(scheduler, saved_common["opt_param_scheduler"], directory)
    if load_optim:
        # The optimizer's sharded_state_dict() reads the step count of the Adam state, which
        # exists only after a first step: take one with zero gradients, as megatron-core does
        # for its FSDP format; the load overwrites every value it made.
        for opt in common.inner_optimizers(optimizer):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
    # RNG streams belong to ranks: they are restored only when every rank is where it was.
    with_rng = load_rng and same_layout
    ef_now = common.error_feedback_state(sdp4bit)
    ef_skipped = error_feedback_skipped(saved, same_layout) if ef_now is not None else None
    state = _sharded_state(model_chunks, optimizer, saved.get("optim_sharding",
                                                              "dp_reshardable"),
                           is_loading=True, with_optimizer=load_optim, with_rng=with_rng,
                           error_feedback=ef_now if ef_skipped is None else None)
    problem = stored_shapes.resume_shape_problem(directory, state)
    if problem is not None:
        raise CheckpointError(problem)
    strategy = TorchDistLoadShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    # megatron-core 0.19's check too, for checkpoints it wrote integrity.json for (the
    # manifest's check above has already read every file).
    extra = {}
    if megatron_integrity_check() and MEGATRON_INTEGRITY in manifest["files"]:
        extra["verify_integrity"] = True
    try:
        loaded = dist_checkpointing.load(state, directory, sharded_strategy=strategy, **extra)
    except CheckpointingException as err:
        if not extra or "integrity" not in str(err).lower():
            raise
        detail = " ".join(str(err).split())
        raise CheckpointError(f"checkpoint {directory} fails megatron-core's integrity check "
                              f"({MEGATRON_INTEGRITY}): {detail[:300]}; load an earlier "
                              "checkpoint") from None
    keys = ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]
    for key, chunk in zip(keys, model_chunks):
        unwrap(chunk).load_state_dict(loaded[key], strict=True)
    if load_optim:
        with tolerate_missing_step(common.inner_optimizers(optimizer)):
            optimizer.load_state_dict(loaded["optimizer"])
        restore_steps(common.inner_optimizers(optimizer), loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        for opt in common.inner_optimizers(optimizer):
            opt.reload_model_params()
    if with_rng:
        common.set_rng_state(loaded["rng_state"])
    common.restore_error_feedback(sdp4bit, loaded.get(EF_KEY), directory, ef_skipped)
    return loaded["iteration"], loaded["consumed_samples"]
