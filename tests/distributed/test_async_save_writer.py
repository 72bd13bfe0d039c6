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
  published, the tracker still names 2 and no writer process is left.
"""

from __future__ import annotations

import os

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


def _load(root: str, iteration: int):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), (0, rank, world))}
    return dist_checkpointing.load(request, os.path.join(root, f"iter_{iteration:07d}"))["w"]


def _worker(rank: int, world: int, root: str) -> None:
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
    saves = AsyncSaves()
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


def test_async_save_publishes_at_finalize_and_a_failed_run_publishes_nothing(tmp_path):
    spawn(_worker, 2, str(tmp_path))
