#!/usr/bin/env python
"""Run pretrain_gpt.py's CUDA branch on a CPU-only machine, with NCCL's rules on collectives.

    torchrun --nproc-per-node 2 dev/cuda_dryrun.py <pretrain_gpt.py flags>
    torchrun --nproc-per-node 4 dev/cuda_dryrun.py -m megatron.sdp4bit.megatron_lm SCRIPT <flags>

The second form runs a module as ``python -m`` would (the Megatron-LM plug-in's launcher,
whose script then runs Megatron-LM's own trainer) instead of pretrain_gpt.py.

Every rank believes it has a GPU (``torch.cuda.is_available()`` is True), computes on the
CPU for real, and talks gloo underneath; a collective that NCCL would refuse on a GPU run
(a host tensor, a non-contiguous one, sizes that do not fit the group) stops the run with
one line naming the collective, the group and the tensor (exit status 3). How it works and
what it does not see: docs/cuda_dryrun.md. Refused on a machine with a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "pretrain_gpt.py")

from megatron.sdp4bit.testing import cuda_dryrun  # noqa: E402


def _run_trainer(argv: list[str]) -> int:
    """pretrain_gpt.py's ``main`` with ``argv`` as its command line (the script's own
    ``__main__`` block would end the process with ``os._exit`` before the summary here)."""
    sys.argv = [TRAINER, *argv]
    trainer = runpy.run_path(TRAINER, run_name="pretrain_gpt")
    try:
        return trainer["main"](argv)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)


def _run_module(module: str, argv: list[str]) -> int:
    """``python -m module argv...`` in this process."""
    sys.argv = [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


def run(argv: list[str] | None = None, before_main: Callable[[], None] | None = None) -> int:
    """Switch this process to the dry run, then run pretrain_gpt.py. ``before_main`` runs
    in between (the tests plant bugs with it)."""
    cuda_dryrun.enable_cuda_dryrun()
    argv = sys.argv[1:] if argv is None else argv
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print("cuda dry run: torch.cuda.is_available() is True; every collective is checked "
              "against NCCL's rules, gloo carries it", flush=True)
    if before_main is not None:
        before_main()
    try:
        if argv[:1] == ["-m"] and len(argv) > 1:
            code = _run_module(argv[1], argv[2:])
        else:
            code = _run_trainer(argv)
    except cuda_dryrun.CudaDryRunError as err:
        if rank != "0":  # rank 0 first, as the trainer's own errors (pretrain_gpt._fail)
            time.sleep(3)
        print(f"cuda_dryrun.py: error: rank {rank}: {err}", file=sys.stderr, flush=True)
        return 3
    if rank == "0" and code == 0:
        print(f"cuda dry run: done, {cuda_dryrun.CHECKED_CALLS[0]} collectives on rank 0 "
              "passed NCCL's rules", flush=True)
    return code


def _stop_children() -> None:
    """``os._exit`` skips multiprocessing's finalizers, so the processes it started (the
    ``spawn`` manager megatron-core's ``torch_dist`` writer starts in Megatron-LM's trainer)
    would outlive the rank, reparented to PID 1, ~450 MB each: stop them first."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)


if __name__ == "__main__":
    code = run()
    _stop_children()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as pretrain_gpt.py ends: no finalization of torch's modules
