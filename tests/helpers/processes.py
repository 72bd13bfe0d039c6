"""Which processes a test started are still alive: the no-orphans checks of the
fault-injection tests (a job's writers, their children, the results queue's server).

A process counts as gone once it no longer exists or is a zombie (it ended and only waits
for its parent, or for init, to reap it: it holds no files and runs nothing). ``psutil``'s
``is_running`` also compares the creation time, so a pid reused by another process does not
count as the one recorded.
"""

from __future__ import annotations

import time

import psutil


def family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process descended from it, as they are now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def is_alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_alive(processes: list[psutil.Process], within: float) -> list[psutil.Process]:
    """Those of ``processes`` still alive after waiting up to ``within`` seconds for them
    all to end."""
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in processes if is_alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)


def describe(processes: list[psutil.Process]) -> str:
    """One line per process, for an assertion's message."""
    lines = []
    for p in processes:
        try:
            lines.append(f"pid {p.pid} (parent {p.ppid()}, {p.status()}): "
                         f"{' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            lines.append(f"pid {p.pid} (gone)")
    return "; ".join(lines)


def kill_all(processes: list[psutil.Process]) -> None:
    """Clean-up after a failed check: SIGKILL whatever of ``processes`` is still alive."""
    for p in processes:
        if is_alive(p):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
