#!/usr/bin/env python
"""Many short 4-rank runs, each a fresh save then a resume, to catch failures at exit.

A process that ends with a thread still inside a C++ call can abort at interpreter exit
(``terminate called without an active exception``, SIGABRT) after its work is done;
it happens in a few runs out of many, so one run proves nothing. This tool repeats
``--save`` then ``--load`` (the resume with ``--dp-ranks-per-node 4``) and counts the
launches that did not exit 0 or printed ``terminate called``.

    python -m dev.stress_shutdown --runs 12 [--heartbeat-timeout-seconds 120]

Data: the default corpus (tools/prepare_default_data.py, cached in data/cache).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 1 --bf16 "
        "--use-distributed-optimizer --log-interval 1 --eval-interval 100 --eval-iters 1 "
        "--split 90,10,0 --seed 7 --train-iters 4 --save-interval 2 --quantized-weights "
        "--quantized-gradients --hadamard-transform").split()


def _launch(flags: list[str], timeout: int) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=ROOT)
    text = res.stdout + res.stderr
    ok = res.returncode == 0 and "terminate called" not in text
    errors = [x for x in text.splitlines() if "error:" in x or "terminate called" in x]
    return ok, "" if ok else f"rc {res.returncode}: " + " | ".join(errors[:5] or [text[-800:]])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=12, help="save+resume pairs (2 launches each)")
    p.add_argument("--heartbeat-timeout-seconds", default="120")
    p.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    args = p.parse_args()
    data = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_default_data.py"),
                           "--print-flags"], capture_output=True, text=True, check=True
                          ).stdout.split()
    common = TINY + data + ["--heartbeat-timeout-seconds", args.heartbeat_timeout_seconds]
    failures, start = 0, time.time()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as d:
            save = ["--save", os.path.join(d, "ckpt"), "--data-cache-path",
                    os.path.join(d, "cache")]
            for label, extra in (("save", ["--exit-interval", "2", "--dp-ranks-per-node", "2"]),
                                 ("resume", ["--dp-ranks-per-node", "4",
                                             "--load", os.path.join(d, "ckpt")])):
                ok, why = _launch(common + save + extra, args.timeout)
                if not ok:
                    failures += 1
                    print(f"run {run} {label}: FAILED {why}", flush=True)
        print(f"run {run}: {failures} failed launch(es) so far, {time.time() - start:.0f} s",
              flush=True)
    print(f"{2 * args.runs} launches, {failures} failed, {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
