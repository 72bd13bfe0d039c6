"""megatron-core's ``dist_checkpointing`` as the ``torch_dist`` format needs it: the
workarounds, each a replacement of the table (``patches.py``) applied for one call.

``training/checkpoint/torch_dist_format.py`` saves and loads through megatron-core's
``dist_checkpointing``; what it needs changed in megatron-core is here, since this layer is
the only one that replaces megatron-core attributes:

* :func:`in_process_writer`: the save strategy writing in this process ([Note: the writer on
  CPU]);
* :func:`bucket_space_world_tensors`: the fully reshardable save's gathered optimizer state
  at the buckets' offsets ([Note: the fully reshardable save of a buffer with several
  buckets]);
* :func:`tolerate_missing_step` and :func:`restore_steps`: the fully reshardable load's
  missing ``step`` and the torch-Adam path's shared one ([Note: the fully reshardable load
  has no step]);
* :func:`megatron_integrity_check`: whether this release checks its own files (0.19.2).

[Note: the writer on CPU]
megatron-core's ``torch_dist`` save prepares the write plan, then hands the writing to
forked processes that report through a queue of a ``spawn`` multiprocessing manager, after a
``torch.cuda.synchronize()``. A synchronous save gains nothing from the processes (it waits
for them), and the manager is a process per rank that imports the main script again. The
in-process writer keeps megatron-core's plan,
metadata and file layout but writes the buckets in this process, one after another, with
megatron-core's own per-bucket writer (``FileSystemWriterAsync.write_preloaded_data``,
fsync included), and gives the writer a local results queue instead of the spawned
manager's. :func:`in_process_writer` binds that on one strategy, for one save. It is used
on CPU and on GPU alike for the synchronous save; ``--async-save`` uses megatron-core's own
writer processes instead (integration/async_save.py). A bucket that fails to write (a full
disk) is put in that queue as the writer processes put theirs, so megatron-core's finalize
step still gathers every rank's result and raises on every rank together.

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
import inspect
import queue
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import (
    save_state_dict_async_finalize,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.patches import CHECKPOINT, INSTANCE, MODULE, both, declare


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
            writer.results_queue = queue.Queue()
            for i, bucket in enumerate(buckets):
                done, count = queue.Queue(), queue.Queue()
                count.put(i)
                FileSystemWriterAsync.write_preloaded_data(transforms, i, bucket, done, count,
                                                           True)
                _, result = done.get()
                if isinstance(result, Exception):
                    # handed on as megatron-core's writer processes hand it on: the finalize
                    # step gathers every rank's result and raises on every rank together
                    # (raising here would leave the other ranks waiting in that gather)
                    writer.results_queue.put(result)
                    return
                results[i] = result
            writer.results_queue.put(results)

        def finalize() -> None:
            save_state_dict_async_finalize(*save_state_dict_ret)

        return AsyncRequest(write, (), [finalize])

    return _get_save_and_finalize_callbacks


def _local_results_queue(original: Any, results: Any = None) -> Any:
    # FileSystemWriterAsync asks a module-level getter for its results queue, which starts a
    # spawn-context manager process the first time. The in-process writer replaces the queue
    # anyway; the asynchronous save's forked writer needs one across processes, and gets
    # ``results``, the one --async-save owns (integration/async_save.py).
    return queue.Queue() if results is None else results


_WRITER_NOTE = "[Note: the writer on CPU] (integration/dist_checkpointing.py)"
_STRATEGIES = "megatron.core.dist_checkpointing.strategies"
SAVE_CALLBACKS = declare(
    "checkpoint.save_callbacks", f"{_STRATEGIES}.torch:TorchDistSaveShardedStrategy",
    "_get_save_and_finalize_callbacks", INSTANCE, _in_process_callbacks, note=_WRITER_NOTE,
    scope=CHECKPOINT,
    checked={"0.16.1": "(self, writer, save_state_dict_ret)",
             "0.19.2": "(self, writer, save_state_dict_ret, async_strategy)"})
RESULTS_QUEUE = declare(
    "checkpoint.results_queue", f"{_STRATEGIES}.filesystem_async", "_results_queue", MODULE,
    _local_results_queue, wraps=True, note=_WRITER_NOTE, checked=both("<NoneType>"),
    scope=CHECKPOINT)


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
         "(integration/dist_checkpointing.py)",
    checked=both("(self, use_gloo_comm, empty_data, return_on_all_ranks)"), scope=CHECKPOINT)
MISSING_STEP = declare(
    "checkpoint.set_main_param_and_optimizer_states", _DIST_OPT,
    "_set_main_param_and_optimizer_states", INSTANCE, _tolerating_missing_step,
    note="[Note: the fully reshardable load has no step] "
         "(integration/dist_checkpointing.py)",
    checked=both("(self, model_param, tensors)"), scope=CHECKPOINT)


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
    checkpoint's is set afterwards by :func:`restore_steps`."""
    with patches.applied([MISSING_STEP.on(opt) for opt in opts]):
        yield


def restore_steps(opts: list, loaded: dict[str, Any]) -> None:
    """Give every parameter's Adam state its own ``step``, the checkpoint's.

    On megatron-core's torch-Adam path (no Apex or Transformer Engine: CPU runs) two things go
    wrong after ``DistributedOptimizer.load_state_dict``: every parameter's state gets one
    shared step tensor (torch's Adam increments each in place, so it would advance once per
    parameter per step), and the dp_reshardable load then copies into it the step the state
    held *before* the load (kept in the load dict as a non-persistent object). Either makes
    the bias correction of the next steps wrong. ``opts``: the distributed optimizers
    (one, or a chained optimizer's); ``loaded``: their part of the loaded state.
    """
    parts = [loaded] if len(opts) == 1 else [loaded[i] for i in range(len(opts))]
    for opt, part in zip(opts, parts):
        steps = {g["step"] for g in part["optimizer"]["param_groups"] if "step" in g}
        if len(steps) != 1:
            continue  # Apex/TE optimizers keep the step in their param groups
        step = float(steps.pop())
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


EF_KEY = "sdp4bit_error_feedback"
"""The key of ``--gradient-error-feedback``'s state in a ``torch_dist`` checkpoint (this
trainer's and, through the plug-in, Megatron-LM's)."""


def error_feedback_sharded(state: Any) -> ShardedObject:
    """The error state as one entry per global rank: the error is of what this rank sent on
    the inter hop, so it has no replica (unlike the RNG's, context- and expert-parallel ranks
    keep their own)."""
    return ShardedObject(EF_KEY, state, (torch.distributed.get_world_size(),),
                         (torch.distributed.get_rank(),), replica_id=0)
