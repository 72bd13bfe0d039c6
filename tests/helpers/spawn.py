"""Run a function on several local gloo ranks; shared by every distributed test.

``spawn(fn, world_size, *args, timeout=...)`` starts ``world_size`` processes, gives each
the test process's environment plus the usual torchrun variables (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; the store is the parent's, bound to
a port the OS picks, as torchrun's agent hosts it), initialises the default process group on
gloo, calls ``fn(rank, world_size, *args)``, and destroys the group.

The processes are forks of the session's fork server (``tests/helpers/forkserver.py``: torch and
megatron-core imported once); the test process's environment is sent with every start.

The parent never hangs: it raises ``RuntimeError`` carrying the child's traceback as soon
as one rank fails (the others, possibly stuck in a collective, are terminated), and the
same after ``timeout`` seconds. ``fn`` and ``args`` must be picklable (module-level
functions), as the forkserver start method requires.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from tests.helpers import forkserver as _forkserver

__all__ = ["spawn"]


def _child(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        # the store is the parent's (as torchrun's agent hosts it): every rank is its client
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    # Several ranks share few cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    report: str | None = None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            fn(rank, world_size, *args)
        except BaseException:  # everything, KeyboardInterrupt included, goes to the parent
            # Report before tearing the group down: the teardown makes peers blocked in a
            # collective fail too, and the parent should see this root cause first.
            report = traceback.format_exc()
            results.put((rank, report))
        finally:
            dist.destroy_process_group()
    except BaseException:
        if report is None:
            results.put((rank, traceback.format_exc()))
        return
    if report is None:
        results.put((rank, None))


def _drain(results: Any, grace: float) -> list[tuple[int, str | None]]:
    out = []
    deadline = time.monotonic() + grace
    while (left := deadline - time.monotonic()) > 0:
        try:
            out.append(results.get(timeout=left))
        except queue.Empty:
            break
    return out


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any failure."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    ctx = _forkserver.context()
    results = ctx.Queue()
    # The ranks' store, hosted here on a port the OS picks as it binds (a port found free
    # and bound later by rank 0 could be taken meanwhile by a test running beside this one).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, port, fn, args, results, environ),
                    daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    failure: str | None = None
    try:
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = (
                    f"timed out after {timeout:.0f} s waiting for ranks {sorted(pending)} "
                    f"of {getattr(fn, '__name__', fn)}"
                )
                break
            try:
                rank, tb = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r in pending if not procs[r].is_alive() and procs[r].exitcode != 0]
                if dead and results.empty():
                    # Give a reported traceback the chance to arrive before blaming the exit.
                    time.sleep(0.5)
                    if results.empty():
                        failure = (
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                            "without reporting (killed, or crashed in native code)"
                        )
                        break
                continue
            pending.discard(rank)
            if tb is not None:
                failure = f"rank {rank} of {world_size} failed:\n{tb}"
                others = _drain(results, grace=1.0)
                failed = sorted({r for r, t in others if t is not None and r != rank})
                if failed:
                    failure += f"\n(ranks {failed} failed after it; their errors are likely knock-on)"
                break
    finally:
        for proc in procs:
            if failure is not None and proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    if failure is not None:
        raise RuntimeError(failure)
