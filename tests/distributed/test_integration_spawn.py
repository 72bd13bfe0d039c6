"""The shared spawn helper reports a failing rank's traceback and never hangs."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed


def _sum_ranks(rank: int, world_size: int, expected: int) -> None:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    assert int(t) == expected, int(t)


def _rank1_fails_others_block(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # would wait forever for rank 1


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(60)


def test_spawn_runs_collectives_and_reports_failures() -> None:
    spawn(_sum_ranks, 3, 0 + 1 + 2, timeout=60)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 3 failed.*ValueError: boom from rank 1"):
        spawn(_rank1_fails_others_block, 3, timeout=60)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 3 s"):
        spawn(_sleeps, 2, timeout=3)
    assert time.monotonic() - start < 30
