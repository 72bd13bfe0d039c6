"""Helper processes that end with the process that started them.

``--async-save`` forks helper processes from the training process
(``integration/async_save.py``): the results-queue server (a ``multiprocessing`` manager,
started with the first save) and, for every save, megatron-core's writer, which under
megatron-core 0.16.1 forks one more process per bucket it writes (0.19.2 writes from threads
of the writer). None of them may outlive the job.

[Note: helper processes end with the job]
Each of these processes asks the kernel to kill it when its parent ends: Linux's
``prctl(PR_SET_PDEATHSIG, SIGKILL)``, called through ctypes as the first thing the child
does (:func:`die_with_parent`). A parent that ended before the call is caught by comparing
``getppid()`` with the parent's pid recorded before the fork. The setting is not inherited
by a fork, so the writer also registers an at-fork hook (:func:`children_die_with_this_process`)
that makes each process it forks do the same. The chain then ends from the top, whatever
ends it: the training process killed (``kill -9``, torchrun's SIGKILL, an out-of-memory kill)
or exiting with ``os._exit`` kills its manager and its writer; a writer killed kills its
per-bucket child. SIGKILL ends a stopped (SIGSTOP) process too, and nothing can catch it.

What was left before, and why: torchrun signals only the process groups of the workers
still running when it stops a job, so a worker that ended first (its error, ``kill -9``)
left its writer to itself; a killed writer left 0.16.1's per-bucket child waiting forever on
its results queue; and the manager watched its parent through the end of a pipe (the
``multiprocessing`` parent sentinel) whose writing end every later fork of the training
process, the writers included, inherited, so it lived as long as any writer did.

The kernel sends the signal when the *thread* that forked the child ends: the trainer forks
from its main thread, which lives as long as the process. Elsewhere than Linux there is no
``prctl``: a child of ``multiprocessing`` then watches its parent's sentinel from a daemon
thread instead (a stopped child cannot act on it). This module imports nothing heavy: a
``spawn`` child imports it to find these functions.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# Looked up once, here: a child forked from a process with threads should not dlopen.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_forking_parent: int | None = None  # set by the at-fork hook in the parent, read in the child


def die_with_parent(parent: int | None = None) -> None:
    """In a child just forked: be killed (SIGKILL) when the parent ends. ``parent``: its pid,
    recorded before the fork (default: ``multiprocessing``'s parent process)."""
    if parent is None:
        process = multiprocessing.parent_process()
        if process is None:
            return
        parent = process.pid
    if _PRCTL is not None:
        if _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent ended before the call: nobody would kill us
            os.kill(os.getpid(), signal.SIGKILL)
        return
    _watch_parent_sentinel()


def children_die_with_this_process() -> None:
    """Every process this process forks from now on is killed when this one ends (an
    at-fork hook calling :func:`die_with_parent` in each child)."""
    os.register_at_fork(before=_remember_parent, after_in_child=_die_with_forking_parent)


def exit_with_parent() -> None:
    """A ``multiprocessing`` initializer (the results-queue server's): the process ends when
    its parent does."""
    die_with_parent()


def _remember_parent() -> None:
    global _forking_parent
    _forking_parent = os.getpid()


def _die_with_forking_parent() -> None:
    die_with_parent(_forking_parent)


def _watch_parent_sentinel() -> None:
    """Without ``prctl``: a daemon thread ends this ``multiprocessing`` child when its
    parent's sentinel becomes readable (the parent ended)."""
    process = multiprocessing.parent_process()
    if process is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([process.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
