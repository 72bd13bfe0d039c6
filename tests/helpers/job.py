"""``run_job``: ``subprocess.run`` for a command that starts ``torchrun`` through a shell.

A plain ``subprocess.run(..., timeout=...)`` kills only the process it started, so a shell
script's ``torchrun`` and its workers would outlive a timed-out test and keep the cores
busy. Here the command gets its own session, and every process left in it is killed when
it returns, times out or fails.
"""

from __future__ import annotations

import os
import signal
import subprocess


def run_job(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s:\n"
                             f"{out[-2000:]}{err[-3000:]}") from None
    finally:
        _kill_group(proc.pid)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
