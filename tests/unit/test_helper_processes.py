"""Helper processes end with the process that started them ([Note: helper processes end
with the job], ``megatron/sdp4bit/helper_processes.py``), with real forked processes:

* a process that calls ``children_die_with_this_process`` and is then killed takes what it
  forked with it, running or stopped (an ``--async-save`` writer and megatron-core 0.16.1's
  per-bucket child);
* a results-queue server whose parent is killed ends although a later fork of that parent
  (a writer) still holds the parent-watch pipe it inherited.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from multiprocessing.managers import SyncManager

import psutil
import pytest

from megatron.sdp4bit.helper_processes import (
    children_die_with_this_process,
    die_with_parent,
    exit_with_parent,
)
from tests.helpers.processes import describe, is_alive, kill_all, still_alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")
FORK = multiprocessing.get_context("fork")


def _sleep() -> None:
    time.sleep(120)


def _report_and_sleep(report) -> None:
    report.send(os.getpid())  # after the at-fork hooks: its parent's death is armed
    time.sleep(120)


def _writer(parent: int, report) -> None:
    """An ``--async-save`` writer's shape: dies with its parent, forks a child that does too
    (through the at-fork hook), which reports its pid; waits for it."""
    die_with_parent(parent)
    children_die_with_this_process()
    child = FORK.Process(target=_report_and_sleep, args=(report,))
    child.start()
    child.join()


def _trainer_with_a_server(report) -> None:
    """A training process's shape: starts the results-queue server, then forks a writer
    (which inherits the server's parent-watch pipe); reports both pids."""
    manager = SyncManager(ctx=FORK)
    manager.start(initializer=exit_with_parent)
    writer = FORK.Process(target=_sleep)
    writer.start()
    report.send((manager._process.pid, writer.pid))
    time.sleep(120)


def _reap(process: multiprocessing.Process) -> None:
    """Wait for a killed child to exit (``join`` would wait for its sentinel pipe, which the
    processes it forked hold open too)."""
    deadline = time.monotonic() + 10
    while process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)


def _start(target, *args) -> tuple[multiprocessing.Process, object]:
    mine, theirs = FORK.Pipe()
    process = FORK.Process(target=target, args=(*args, theirs))
    process.start()
    assert mine.poll(30), "the helper never reported"
    return process, mine.recv()


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_what_a_killed_writer_forked_dies_with_it(stopped):
    writer, child_pid = _start(_writer, os.getpid())
    child = psutil.Process(child_pid)
    try:
        if stopped:
            child.suspend()  # SIGSTOP: it cannot act on anything, only be killed
        os.kill(writer.pid, signal.SIGKILL)
        _reap(writer)
        left = still_alive([child], within=5)
        assert not left, f"outlived its killed parent: {describe(left)}"
    finally:
        kill_all([child])


def test_the_results_server_ends_with_its_parent_though_a_writer_holds_its_pipe():
    trainer, (server_pid, writer_pid) = _start(_trainer_with_a_server)
    server, writer = psutil.Process(server_pid), psutil.Process(writer_pid)
    try:
        os.kill(trainer.pid, signal.SIGKILL)
        _reap(trainer)
        left = still_alive([server], within=5)
        assert not left, f"the server outlived its parent: {describe(left)}"
    finally:
        kill_all([server, writer])


def test_a_parent_gone_before_the_call_is_noticed():
    """A child whose parent ended between the fork and ``die_with_parent`` would never get
    the signal: it ends itself."""
    def orphan() -> None:
        die_with_parent(parent=os.getppid() + 1_000_000)  # not its parent: "already gone"
        time.sleep(120)

    process = FORK.Process(target=orphan)
    process.start()
    process.join(10)
    assert process.exitcode == -signal.SIGKILL
