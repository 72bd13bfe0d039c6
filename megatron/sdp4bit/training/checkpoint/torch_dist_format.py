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

[Note: the writer on CPU]
megatron-core's ``torch_dist`` save prepares the write plan, then hands the writing to
forked processes fed through a ``spawn`` multiprocessing manager, after a
``torch.cuda.synchronize()``. Without CUDA the synchronize raises, and the spawned manager
hangs under torchrun. The in-process writer keeps megatron-core's plan,
metadata and file layout but writes the buckets in this process, one after another, with
megatron-core's own per-bucket writer (``FileSystemWriterAsync.write_preloaded_data``,
fsync included), and gives the writer a local results queue instead of the spawned
manager's. :func:`in_process_writer` binds that on one strategy, for one save. It is used
on CPU and on GPU alike: saves are synchronous here.

[Note: the fully reshardable save of a buffer with several buckets]
megatron-core's ``fully_reshardable`` save (``sharded_param_state_fully_reshardable``, in
0.16.1 and 0.19.2) gathers a buffer's optimizer state with ``get_parameter_state_dp_zero``,
which packs the buckets one after another *without* the padding between them, and then
cuts every parameter out of that packed tensor at ``param_index_map``'s offsets, which
count the padding. With one bucket per buffer the two agree. With more (the tied
embedding gets a bucket of its own under PP > 1; ``--ddp-bucket-size`` with
``--overlap-grad-reduce``), every parameter after the first bucket is written shifted by
the padding before it, and the last one is filled up with zeros (megatron-core then warns
"param range exceeds unpadded buffer ... data corruption"): its fp32 main weights and Adam
moments on disk are wrong, and a resume from them jumps (the loss of a PP 2 -> 1 resume went
from 5.42 to 6.14 one step after the load). The load side slices each parameter by its own
range and is right. :func:`bucket_space_world_tensors` puts every bucket's values back at
its offset in the buffer (zeros in the padding) before megatron-core cuts them, for the
save and for the (empty) tensors a load builds its request from.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import queue
import shutil
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)

from megatron.sdp4bit.integration import checkpoint_space, patches
from megatron.sdp4bit.integration.patches import INSTANCE, MODULE, both, declare
from megatron.sdp4bit.training.checkpoint import common
from megatron.sdp4bit.training.checkpoint import disk_space, files, safe_load
from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.guards import faults

FORMAT_NAME = "torch_dist"
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable")
# Layout entries a checkpoint of each sharding type may change on resume.
RESHARDABLE = {"dp_reshardable": {"world_size", "dp"},
               "fully_reshardable": {"world_size", "dp", "tp", "pp", "ddp_bucket_size"}}


def _in_process_callbacks(strategy: TorchDistSaveShardedStrategy):
    """The strategy's ``_get_save_and_finalize_callbacks`` with the buckets written in this
    process (see [Note: the writer on CPU])."""

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret,
                                         *_async_strategy) -> AsyncRequest:
        # megatron-core 0.19 passes its async strategy's name too; the write below is
        # in-process whatever it names.
        transforms = [writer.transforms] if hasattr(writer, "transforms") else []

        def write() -> None:
            results: dict[int, list] = {}
            buckets = FileSystemWriterAsync.preload_tensors(writer.write_buckets or [],
                                                            non_blocking=False)
            for i, bucket in enumerate(buckets):
                done, count = queue.Queue(), queue.Queue()
                count.put(i)
                FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, done, count,
                                                           True)
                _, result = done.get()
                if isinstance(result, Exception):
                    raise result
                results[i] = result
            writer.results_queue = queue.Queue()
            writer.results_queue.put(results)

        def finalize() -> None:
            save_state_dict_async_finalize(*save_state_dict_ret)

        return AsyncRequest(write, (), [finalize])

    return _get_save_and_finalize_callbacks


def _local_results_queue(original: Any) -> queue.Queue:
    # FileSystemWriterAsync asks a module-level getter for its results queue, which starts a
    # spawn-context manager process the first time; our writer replaces the queue anyway.
    return queue.Queue()


_WRITER_NOTE = "[Note: the writer on CPU] (training/checkpoint/torch_dist_format.py)"
_STRATEGIES = "megatron.core.dist_checkpointing.strategies"
SAVE_CALLBACKS = declare(
    "checkpoint.save_callbacks", f"{_STRATEGIES}.torch:TorchDistSaveShardedStrategy",
    "_get_save_and_finalize_callbacks", INSTANCE, _in_process_callbacks, note=_WRITER_NOTE,
    checked={"0.16.1": "(self, writer, save_state_dict_ret)",
             "0.19.2": "(self, writer, save_state_dict_ret, async_strategy)"})
RESULTS_QUEUE = declare(
    "checkpoint.results_queue", f"{_STRATEGIES}.filesystem_async", "_results_queue", MODULE,
    _local_results_queue, wraps=True, note=_WRITER_NOTE, checked=both("<NoneType>"))


@contextlib.contextmanager
def in_process_writer() -> Iterator[TorchDistSaveShardedStrategy]:
    """megatron-core's torch_dist save strategy writing its buckets in this process, with no
    manager process for the results, for one save (see [Note: the writer on CPU])."""
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    with patches.applied([SAVE_CALLBACKS.on(strategy), RESULTS_QUEUE]):
        yield strategy


# megatron-core's own integrity manifest (0.19: save/load(verify_integrity=True)).
MEGATRON_INTEGRITY = "integrity.json"


def megatron_integrity_check() -> bool:
    """Whether this megatron-core's ``dist_checkpointing`` has ``verify_integrity`` (0.19.2
    has it: rank 0 hashes every file into ``integrity.json`` after the save and re-hashes
    them before the load; 0.16.1 has no check of its own). Used on top of the manifest."""
    return all("verify_integrity" in inspect.signature(f).parameters
               for f in (dist_checkpointing.save, dist_checkpointing.load))


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


def model_state(model_chunks) -> dict[str, Any]:
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(m).sharded_state_dict() for i, m in enumerate(model_chunks)}


def _in_buffer_space(opt):
    """``opt.get_parameter_state_dp_zero`` returning its world tensors in the buffer's
    coordinates (see [Note: the fully reshardable save of a buffer with several buckets])."""
    original = type(opt).get_parameter_state_dp_zero

    def get_parameter_state_dp_zero(self, *args, **kwargs):
        state = original(self, *args, **kwargs)
        if state is None:
            return None
        # A load asks for empty tensors (its request's shapes): then nothing is copied.
        empty = kwargs.get("empty_data", len(args) > 1 and args[1])
        for gbuf_idx, buffer in enumerate(self.buffers):
            starts = [start for start, _ in buffer.bucket_indices]
            lengths = [bucket.numel_unpadded for bucket in buffer.buckets]
            for world in state[gbuf_idx].values():
                # "numel_unpadded" is an int; one packed tensor at a time is kept alongside
                for key in [k for k, v in world.items() if isinstance(v, torch.Tensor)]:
                    packed = world[key]
                    if packed.numel() != sum(lengths):
                        raise RuntimeError(
                            f"megatron-core's gathered optimizer state {key!r} holds "
                            f"{packed.numel()} values, its buckets {sum(lengths)}: this "
                            "megatron-core lays it out differently; save with dp_reshardable")
                    spread = packed.new_zeros(buffer.numel)
                    offset = 0
                    for start, length in zip(starts, lengths):
                        if not empty:
                            spread[start:start + length] = packed[offset:offset + length]
                        offset += length
                    world[key] = spread
                    del packed
        return state

    return get_parameter_state_dp_zero


def _tolerating_missing_step(opt):
    """``opt._set_main_param_and_optimizer_states`` passing the current ``step`` through
    (see :func:`tolerate_missing_step`)."""
    original = type(opt)._set_main_param_and_optimizer_states

    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group]["params"][order]
        step = self.optimizer.state[main].get("step")
        if step is not None and "step" not in tensors:
            tensors = {**tensors, "step": step.clone()}
        original(self, model_param, tensors)

    return _set_main_param_and_optimizer_states


_DIST_OPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
BUCKET_SPACE = declare(
    "checkpoint.get_parameter_state_dp_zero", _DIST_OPT, "get_parameter_state_dp_zero",
    INSTANCE, _in_buffer_space,
    note="[Note: the fully reshardable save of a buffer with several buckets] "
         "(training/checkpoint/torch_dist_format.py)",
    checked=both("(self, use_gloo_comm, empty_data, return_on_all_ranks)"))
MISSING_STEP = declare(
    "checkpoint.set_main_param_and_optimizer_states", _DIST_OPT,
    "_set_main_param_and_optimizer_states", INSTANCE, _tolerating_missing_step,
    note="[Note: the fully reshardable load has no step] "
         "(training/checkpoint/torch_dist_format.py)",
    checked=both("(self, model_param, tensors)"))


@contextlib.contextmanager
def bucket_space_world_tensors(opts) -> Iterator[None]:
    """For one ``sharded_state_dict`` call: the optimizers' gathered world tensors in the
    buffer's coordinates ([Note: the fully reshardable save of a buffer with several
    buckets])."""
    with patches.applied([BUCKET_SPACE.on(opt) for opt in opts]):
        yield


@contextlib.contextmanager
def tolerate_missing_step(opts) -> Iterator[None]:
    """For one ``load_state_dict`` call of a fully_reshardable checkpoint.

    [Note: the fully reshardable load has no step]
    The fully_reshardable load hands megatron-core's state setter no ``step`` (it is kept in
    the param groups), and the setter, on the torch-Adam path, copies every key the Adam
    state has, ``step`` included. The replacement passes the current step through; the
    checkpoint's is set afterwards by :func:`_restore_steps`."""
    with patches.applied([MISSING_STEP.on(opt) for opt in opts]):
        yield


def _sharded_state(model_chunks, optimizer, sharding_type: str, *, is_loading: bool,
                   with_optimizer: bool, with_rng: bool) -> dict[str, Any]:
    state = model_state(model_chunks)
    if with_optimizer:
        model_sd = {k: v for part in state.values() for k, v in part.items()}
        opts = common.inner_optimizers(optimizer)
        with bucket_space_world_tensors(opts if sharding_type == "fully_reshardable" else []):
            state["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading,
                metadata={"distrib_optim_sharding_type": sharding_type})
    if with_rng:
        state["rng_state"] = _rng_object()
    return state


def file_hash(path: str) -> dict[str, Any]:
    """SHA-256 and size of a file, read in blocks; the file is fsync'ed on the way."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
        os.fsync(f.fileno())
    return {"sha256": digest.hexdigest(), "bytes": size}


def shared_listing(directory: str) -> list[str]:
    names: list = [sorted(os.listdir(directory)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def hash_shares(directory: str, names: list[str]) -> dict[str, dict]:
    """Collective: every rank hashes every world-size-th file; all ranks get all entries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: file_hash(os.path.join(directory, n)) for n in names[rank::world]}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def save_checkpoint(root: str, iteration: int, consumed_samples: int, model_chunks, optimizer,
                    scheduler, settings: dict[str, Any], *, sharding_type: str,
                    fully_parallel: bool = False) -> str:
    """Collective: write this iteration's torch_dist checkpoint; returns its folder."""
    if not common.weights_finite(model_chunks, optimizer):
        raise CheckpointError(f"not saving iteration {iteration}: the weights hold NaN or Inf; "
                              f"the last complete checkpoint in {root} stays current")
    final = files.iteration_dir(root, iteration)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    state = _sharded_state(model_chunks, optimizer, sharding_type, is_loading=False,
                           with_optimizer=True, with_rng=True)
    state.update(iteration=iteration, consumed_samples=consumed_samples,
                 opt_param_scheduler=scheduler.state_dict(), checkpoint_version=3.0)
    disk_space.check_space(root, partial, iteration, checkpoint_space.written_bytes(state))
    with in_process_writer() as strategy:
        if fully_parallel:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
        extra = {"verify_integrity": True} if megatron_integrity_check() else {}
        dist_checkpointing.save(state, partial, sharded_strategy=strategy,
                                validate_access_integrity=True, **extra)
    if faults.active("die-saving", iteration, dist.get_rank()):
        os._exit(17)
    dist.barrier()
    entries = hash_shares(partial, shared_listing(partial))
    if dist.get_rank() == 0:
        files.write_manifest(partial, iteration, entries,
                             {**settings, "ckpt_format": FORMAT_NAME,
                              "optim_sharding": sharding_type})
        old = final + ".old"
        if os.path.isdir(final):  # the same iteration saved again: keep it until replaced
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(partial, final)
        files.fsync_dir(root)
        shutil.rmtree(old, ignore_errors=True)
        files.write_tracker(root, iteration)
    dist.barrier()
    return final


def settings_problem(saved: dict[str, Any], current: dict[str, Any], directory: str,
                     allow_sdp4bit_change: bool, allow_data_change: bool = False) -> str | None:
    """What forbids resuming a torch_dist checkpoint with this run's settings (None: nothing).
    The layout entries its optimizer sharding can change are left out of the comparison."""
    sharding = saved.get("optim_sharding", "dp_reshardable")
    free = RESHARDABLE.get(sharding, set())
    # dp_reshardable keeps the optimizer's buckets: with bucketing on, their size must stay.
    strip = lambda s: {**s, "layout": {k: v for k, v in s.get("layout", {}).items()  # noqa: E731
                                       if k not in free}}
    problem = common.settings_problem(strip(saved), strip(current), directory,
                                         allow_sdp4bit_change, allow_data_change)
    if problem is not None and sharding == "dp_reshardable" and (
            saved.get("layout", {}).get("tp") != current["layout"]["tp"]
            or saved.get("layout", {}).get("pp") != current["layout"]["pp"]):
        problem += ("; a TP or PP change needs a checkpoint saved with "
                    "--dist-ckpt-optim-fully-reshardable")
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


def verify_files(directory: str, manifest: dict[str, Any]) -> str | None:
    """Collective: every file of the manifest is present with its size and SHA-256 (each
    rank reads every world-size-th file); returns the first problem, on every rank."""
    names = sorted(manifest["files"])
    problem = None
    for name in names[dist.get_rank()::dist.get_world_size()]:
        path = os.path.join(directory, name)
        entry = manifest["files"][name]
        if not os.path.isfile(path):
            problem = (f"checkpoint file {path} is missing: the checkpoint is incomplete; "
                       "load an earlier one")
        else:
            got = file_hash(path)
            if got["bytes"] != entry["bytes"]:
                problem = (f"checkpoint file {path} is {got['bytes']} bytes, the manifest says "
                           f"{entry['bytes']}: it is truncated or was replaced")
            elif got["sha256"] != entry["sha256"]:
                problem = (f"checkpoint file {path} does not match its SHA-256 in the "
                           "manifest: it changed after it was written (disk or copy error); "
                           "load an earlier checkpoint")
        if problem:
            break
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def _restore_steps(optimizer, loaded: dict[str, Any]) -> None:
    """Give every parameter's Adam state its own ``step``, the checkpoint's.

    On megatron-core's torch-Adam path (no Apex or Transformer Engine: CPU runs) two things go
    wrong after ``DistributedOptimizer.load_state_dict``: every parameter's state gets one
    shared step tensor (torch's Adam increments each in place, so it would advance once per
    parameter per step), and the dp_reshardable load then copies into it the step the state
    held *before* the load (kept in the load dict as a non-persistent object). Either makes
    the bias correction of the next steps wrong.
    """
    opts = common.inner_optimizers(optimizer)
    parts = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    for opt, part in zip(opts, parts):
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # Apex/TE optimizers keep the step in their param groups
        step = float(steps.pop())
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def load_checkpoint(directory: str, manifest: dict[str, Any] | None, model_chunks, optimizer,
                    scheduler, settings: dict[str, Any], *, load_optim: bool = True,
                    load_rng: bool = True, allow_sdp4bit_change: bool = False,
                    allow_data_change: bool = False,
                    fully_parallel: bool = False) -> tuple[int, int]:
    """Collective: restore a torch_dist checkpoint folder (already named by the tracker);
    returns (iteration, consumed samples)."""
    if manifest is None:
        raise CheckpointError(f"{directory} holds a distributed checkpoint without "
                              f"{files.MANIFEST}: it was not written by this trainer or its "
                              "save did not finish; load an earlier one")
    saved = manifest["settings"]
    problem = settings_problem(saved, settings, directory, allow_sdp4bit_change,
                               allow_data_change)
    if problem is not None:
        raise CheckpointError(problem)
    problem = verify_files(directory, manifest)
    if problem is not None:
        raise CheckpointError(problem)
    problem = safe_load.dist_checkpoint_problem(directory)
    if problem is not None:
        raise CheckpointError(problem)
    same_layout = saved["layout"] == settings["layout"]
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
    state = _sharded_state(model_chunks, optimizer, saved.get("optim_sharding",
                                                              "dp_reshardable"),
                           is_loading=True, with_optimizer=load_optim, with_rng=with_rng)
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
        _restore_steps(optimizer, loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        for opt in common.inner_optimizers(optimizer):
            opt.reload_model_params()
    if with_rng:
        common.set_rng_state(loaded["rng_state"])
    return loaded["iteration"], loaded["consumed_samples"]
