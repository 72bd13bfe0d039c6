"""``torchrun --nproc-per-node N script.py ARGS`` (``torchrun()``) and ``python script.py ARGS``
(``python()``) for the end-to-end tests, with the processes forked from the session's fork
server (tests/helpers/forkserver.py) instead of started as fresh interpreters.

A four-rank ``torchrun`` of the tiny GPT spends most of its time starting and ending
interpreters: 3-5 s of CPU per rank importing torch and megatron-core, 1-3 s finalizing
them, the agent's own start; the training itself takes a few seconds. ``torchrun()`` here
keeps the part of torchrun's contract that the trainer sees and forks the ranks ready:

* the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``, ``OMP_NUM_THREADS=1``...), with
  the rendezvous store hosted by the launcher as torchrun's agent hosts it
  (``TORCHELASTIC_USE_AGENT_STORE``; the trainer's heartbeats use it);
* the script runs as ``__main__`` (``runpy``), with ``sys.argv`` and ``sys.path[0]`` as
  ``python script.py`` sets them, in the given working folder;
* every rank writes to the launch's shared stdout and stderr (torchrun's workers inherit
  the agent's);
* when a rank fails, the others get SIGTERM, then SIGKILL after a grace period, and the
  launch's exit code is 1 (torchrun's ``ChildFailedError``); all ranks exiting 0 give 0;
* a launch past ``timeout`` is killed and raises ``subprocess.TimeoutExpired``.

What it does not do: the agent's process tree (ranks are children of the fork server, not of
a launcher process: the tests that stop or kill ranks or the agent, or check what torchrun
prints, start the real ``torchrun``), restarts, multi-node rendezvous, and megatron-core's
import-time warnings (printed once, by the server: the tests of the console's noise use the
real ``torchrun``).
"""

from __future__ import annotations

import datetime
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from tests.helpers import forkserver as _forkserver

GRACE_S = 5.0  # between SIGTERM and SIGKILL, as torchrun's agent waits for its workers


def _worker(script: str, args: list[str], environ: dict[str, str], cwd: str,
            out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    import torch

    torch.set_num_threads(int(environ.get("OMP_NUM_THREADS", "1")))
    sys.argv = [script, *args]
    sys.path[:0] = [os.path.dirname(os.path.abspath(script))] + [
        p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # A script ending in os._exit (pretrain_gpt.py) never returns here; one that returns or
    # raises SystemExit exits with multiprocessing's code for it.
    runpy.run_path(script, run_name="__main__")


def torchrun(script: str, args: list[str], *, nproc: int, env: dict[str, str], cwd: str,
             timeout: float) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks; returns what ``subprocess.run(capture_output=True,
    text=True)`` of the ``torchrun`` command would."""
    import torch.distributed as dist

    # Port 0: the OS picks a free one as the store binds it (no race with other tests).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    port = store.port
    base = dict(env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1",
                ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc),
                TORCHELASTIC_RUN_ID=uuid.uuid4().hex, TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_USE_AGENT_STORE="True")
    cmd = ["torchrun", "--nproc-per-node", str(nproc), "--master-port", str(port), script,
           *args]
    try:
        return _run(cmd, script, args, [dict(base, RANK=str(r), LOCAL_RANK=str(r),
                                             ROLE_RANK=str(r)) for r in range(nproc)],
                    cwd, timeout)
    finally:
        del store


def python(script: str, args: list[str], *, env: dict[str, str], cwd: str,
           timeout: float) -> subprocess.CompletedProcess:
    """``python script args`` with exactly ``env``, as one process forked from the server;
    returns what ``subprocess.run(capture_output=True, text=True)`` would (the exit code is
    the script's, negative for a signal)."""
    return _run(["python", script, *args], script, args, [dict(env)], cwd, timeout)


def _run(cmd: list[str], script: str, args: list[str], environs: list[dict[str, str]],
         cwd: str, timeout: float) -> subprocess.CompletedProcess:
    ctx = _forkserver.context()
    with tempfile.TemporaryDirectory(prefix="launch-") as tmp:
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        procs = []
        try:
            for environ in environs:
                procs.append(ctx.Process(target=_worker, args=(
                    script, list(args), environ, cwd, out_path, err_path)))
                procs[-1].start()
            code = _wait(procs, time.monotonic() + timeout)
        finally:
            _stop(procs)
        with open(out_path, encoding="utf-8", errors="replace") as f:
            out = f.read()
        with open(err_path, encoding="utf-8", errors="replace") as f:
            err = f.read()
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


def _wait(procs, deadline: float) -> int | None:
    """One process: its exit code. Several (ranks): 0 when every one exited 0, 1 as soon as
    one failed. None at the deadline."""
    while time.monotonic() < deadline:
        codes = [p.exitcode for p in procs]
        if len(procs) == 1 and codes[0] is not None:
            return codes[0]
        if any(c not in (None, 0) for c in codes):
            return 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)
    return None


def _stop(procs) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
