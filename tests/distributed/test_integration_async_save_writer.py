"""``--async-save``'s background write on 2 gloo ranks, with megatron-core's own asynchronous
writer (a process forked per save) and this trainer's finalize step
(``training/checkpoint/async_save.py``, ``torch_dist_format.publish``).

One spawn, three saves of a sharded tensor (each rank its half):

* iteration 1, finalized while waiting: manifest, folder and tracker appear; the files hold
  the values of the moment the save was scheduled, though the tensor changed right after
  (the fork froze them; the optimizer's fp32 shards are such tensors);
* iteration 2, scheduled: until finalized, only ``iter_0000002.partial`` exists and the
  tracker names 1; published by the finalize;
* iteration 3, scheduled and then aborted (a failing run): the writers are killed, nothing is
  published, the tracker still names 2 and no writer process is left;
* iteration 4, rank 1's writer slowed (``FileSystemWriterAsync.write_preloaded_data``
  replaced in the rank, so that the fork inherits it) and killed with SIGKILL in the middle
  of its write: every rank fails the save with one line naming rank 1's writer and the
  signal, the tracker still names 2, and nothing the writer forked outlives it (megatron-core
  0.16.1 writes the bucket from a child of the writer, which used to wait forever);
* iteration 5, with a 2-second time limit, rank 1's writer stopped (SIGSTOP): the blocking
  finalize ends after the limit on every rank with one line naming rank 1 and the save; the
  writer and its children are killed, the results queue's server ends with the close.

Runs in both passes of ``dev/run_tests.sh``: the writer differs between megatron-core 0.16.1
(a per-bucket child) and 0.19.2 (threads).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed


def _schedule(saves, root: str, iteration: int, tensor) -> str:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron.sdp4bit.integration import async_save as background
    from megatron.sdp4bit.training.checkpoint import files, torch_dist_format
    from megatron.sdp4bit.training.checkpoint.async_save import PendingSave

    rank, world = dist.get_rank(), dist.get_world_size()
    partial = files.iteration_dir(root, iteration) + ".partial"
    if rank == 0:
        os.makedirs(partial)
    dist.barrier()
    state = {"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world)),
             "iteration": iteration}
    with saves.strategy() as strategy:
        request = dist_checkpointing.save(state, partial, sharded_strategy=strategy,
                                          async_sharded_save=True,
                                          **background.save_keywords())
    saves.schedule(request, PendingSave(root, partial, iteration, {"test": True}),
                   torch_dist_format.publish)
    return partial


_SLOWED: dict[str, str | None] = {"markers": None}
"""Where the slowed write leaves its marker: set in rank 1 only, inherited by its writer."""


def _slow_write(original):
    """``FileSystemWriterAsync.write_preloaded_data``, which, while ``_SLOWED`` names a
    folder, leaves a marker named after the writing process there and sleeps a minute
    first (0.16.1 runs it in the writer's per-bucket child, 0.19.2 in the writer)."""
    import time

    def write_preloaded_data(*args, **kwargs):
        if _SLOWED["markers"] is not None:
            with open(os.path.join(_SLOWED["markers"], f"writing.{os.getpid()}"), "w"):
                pass
            time.sleep(60)
        return original(*args, **kwargs)

    return staticmethod(write_preloaded_data)


def _writer_in_the_middle(markers: str):
    """Rank 1, once its slowed writer is writing: the writer process (a child of this
    rank) and every process it forked."""
    import time

    import psutil

    from tests.helpers.processes import family

    deadline = time.monotonic() + 60
    while not (found := [n for n in os.listdir(markers) if n.startswith("writing.")]):
        assert time.monotonic() < deadline, "the writer never started writing"
        time.sleep(0.05)
    writing = psutil.Process(int(found[0].split(".")[1]))
    chain = [writing, *writing.parents()]
    writer = next(p for p in chain if p.ppid() == os.getpid())
    os.remove(os.path.join(markers, found[0]))
    return family(writer.pid)


def _load(root: str, iteration: int):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}
    return dist_checkpointing.load(request, os.path.join(root, f"iter_{iteration:07d}"))["w"]


def _worker(rank: int, world: int, root: str, markers: str) -> None:
    import multiprocessing
    import time

    import torch
    import torch.distributed as dist

    from megatron.sdp4bit.integration import enable_cpu_mode
    from megatron.sdp4bit.training.checkpoint import files, integrity
    from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves

    # the spawn helper's ranks are daemonic, which may not start processes; a trainer's rank
    # is not one
    multiprocessing.current_process().daemon = False
    enable_cpu_mode()
    saves = AsyncSaves(timeout_seconds=600.0)
    tensor = torch.arange(4, dtype=torch.float32) + 10 * rank

    _schedule(saves, root, 1, tensor)
    tensor.add_(100.0)  # training goes on: the checkpoint keeps the values scheduled
    assert saves.pending == [1]
    assert saves.finalize(blocking=True) == [1]
    assert files.latest_iteration(root) == 1
    directory = files.iteration_dir(root, 1)
    manifest = files.read_manifest(directory)
    assert (manifest["iteration"], manifest["settings"]) == (1, {"test": True})
    for name, entry in manifest["files"].items():
        path = os.path.join(directory, name)
        assert integrity.mismatch(path, integrity.file_hash(path), entry) is None
    assert torch.equal(_load(root, 1), torch.arange(4, dtype=torch.float32) + 10 * rank)

    partial = _schedule(saves, root, 2, tensor)
    dist.barrier()
    # not finalized yet: nothing of iteration 2 is visible
    assert os.path.isdir(partial) and not os.path.exists(files.iteration_dir(root, 2))
    assert files.latest_iteration(root) == 1
    while 2 not in saves.finalize(blocking=False):  # Megatron-LM's per-iteration check
        time.sleep(0.05)  # an iteration's work
    assert files.latest_iteration(root) == 2 and not os.path.exists(partial)
    assert torch.equal(_load(root, 2), torch.arange(4, dtype=torch.float32) + 10 * rank + 100)

    partial = _schedule(saves, root, 3, tensor)
    saves.close(abort=True)  # a failing run: not a collective
    dist.barrier()
    assert multiprocessing.active_children() == []  # writers and the results' manager gone
    assert files.latest_iteration(root) == 2
    assert not os.path.exists(files.iteration_dir(root, 3))
    assert saves.pending == []

    _killed_and_stuck_writers(rank, root, tensor, markers)


def _killed_and_stuck_writers(rank: int, root: str, tensor, markers: str) -> None:
    import multiprocessing
    import signal
    import time

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    from megatron.sdp4bit.training.checkpoint import files
    from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves
    from megatron.sdp4bit.training.checkpoint.files import CheckpointError
    from tests.helpers.processes import describe, kill_all, still_alive

    original = FileSystemWriterAsync.__dict__["write_preloaded_data"].__func__
    FileSystemWriterAsync.write_preloaded_data = _slow_write(original)
    if rank == 1:
        _SLOWED["markers"] = markers
    tree = []
    try:
        # iteration 4: rank 1's writer killed in the middle of its write
        saves = AsyncSaves(timeout_seconds=600.0)
        _schedule(saves, root, 4, tensor)
        if rank == 1:
            tree = _writer_in_the_middle(markers)
            os.kill(tree[0].pid, signal.SIGKILL)
        with pytest.raises(CheckpointError) as err:
            saves.finalize(blocking=True)
        pid = re.search(r"\(pid (\d+)\)", str(err.value))
        assert pid is not None, str(err.value)
        assert str(err.value) == (
            f"saving iteration 4 to {root} failed: rank 1's checkpoint writer (pid "
            f"{pid[1]}) was killed by signal SIGKILL before it finished; its partial folder "
            f"is removed and iteration 2 in {root} stays the current checkpoint; restart the "
            "run (a SIGKILL nobody sent is often the kernel's out-of-memory killer: see "
            "dmesg)")
        if rank == 1:
            assert int(pid[1]) == tree[0].pid
            left = still_alive(tree, within=5)
            assert not left, f"outlived the killed writer: {describe(left)}"
        saves.close(abort=True)
        dist.barrier()
        assert files.latest_iteration(root) == 2
        assert not os.path.exists(files.iteration_dir(root, 4) + ".partial")

        # iteration 5: rank 1's writer stopped; the wait ends at its 2-second limit (rank
        # 0's is longer: its writer may be slow to finish on a loaded machine)
        saves = AsyncSaves(timeout_seconds=2.0 if rank == 1 else 60.0)
        scheduled = time.monotonic()
        _schedule(saves, root, 5, tensor)
        if rank == 1:
            tree = _writer_in_the_middle(markers)
            os.kill(tree[0].pid, signal.SIGSTOP)
        with pytest.raises(CheckpointError) as err:
            saves.finalize(blocking=True)
        waited = time.monotonic() - scheduled
        assert 2.0 < waited < 2.0 + 20, waited
        assert re.fullmatch(
            rf"saving iteration 5 to {re.escape(root)} failed: rank 1's checkpoint writer "
            r"\(pid \d+\) had not finished after \d+\.\d s, its time limit being 2\.0 s: it "
            rf"was killed; its partial folder is removed and iteration 2 in {re.escape(root)} "
            r"stays the current checkpoint; the limit is --async-save-timeout-seconds plus "
            r"1 s per 10 MiB the rank writes; a writer that runs this long is stopped or its "
            r"file system hangs: check it, raise the flag if the file system is only slow, "
            r"and restart the run", str(err.value)), str(err.value)
        saves.close(abort=True)
        dist.barrier()
        if rank == 1:
            left = still_alive(tree, within=5)
            assert not left, f"outlived the stopped writer: {describe(left)}"
        assert multiprocessing.active_children() == []  # the results' manager too
        assert files.latest_iteration(root) == 2
    finally:
        kill_all(tree)
        FileSystemWriterAsync.write_preloaded_data = staticmethod(original)
        _SLOWED["markers"] = None


def test_async_save_publishes_at_finalize_and_a_failed_run_publishes_nothing(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    spawn(_worker, 2, str(tmp_path / "ckpt"), str(markers))
