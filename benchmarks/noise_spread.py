#!/usr/bin/env python
"""The run-to-run spread of the loss that SDP4Bit's rounding noise alone causes, on the runs of
tests/e2e/test_dist_checkpoint.py: the figure behind that test's bound for resharded resumes.

    python -m benchmarks.noise_spread                    # every layout, seeds 7-10
    python -m benchmarks.noise_spread --layouts dp4 --seeds 7 8
    python -m benchmarks.noise_spread --write-results    # also benchmarks/noise_spread.{md,json}

For each layout of the test (processes and parallel flags: :data:`LAYOUTS`, which the test
imports from here) the test's uninterrupted run (:data:`BASE`: the tiny GPT on the tests'
corpus, ``dev/tiny_runs.py``, SDP4Bit, dropout off, 8 iterations) is launched once per
``--rounding-seed`` (with the real ``torchrun``); the runs share the data order, the
initialization and everything else, so they differ only in the stochastic-rounding noise.
For every pair of seeds and every iteration the test compares after a resume (5 to 8) the
relative loss difference |a - b| / a is taken; per layout their root mean square (RMS) is
printed, and the test's bound, :data:`NOISE_FACTOR` x the largest RMS (the test reads it
with :func:`noise_bound` from ``benchmarks/noise_spread.json``). A resharded resume differs from its reference by
the same kind of noise, drawn on another topology from step 5 on (fewer steps
than a pair of seeds, which differ from step 1), so its differences are at most as spread.
The seed 7 run of each layout is the test's own reference run.

About 10 minutes on 2 cores (16 launches). Prints the figures; writes files only with
``--write-results``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import results
from dev.tiny_runs import TINY
from megatron.sdp4bit.training.cli.methods import METHOD_FLAGS

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SEEDS = (7, 8, 9, 10)  # 7 is the test's --seed: its reference run is among them

BASE = list(TINY)
for _flag, _value in (("--train-iters", "8"), ("--log-interval", "1"),
                      ("--eval-interval", "100")):
    BASE[BASE.index(_flag) + 1] = _value
BASE += ["--hidden-dropout", "0", "--attention-dropout", "0", *METHOD_FLAGS["SDP4Bit"]]
"""The resume tests' uninterrupted run, without its data flags (tests/e2e/test_dist_checkpoint.py)."""
# The layouts of the resume tests' runs: name -> (processes, flags).
LAYOUTS = {
    "dp4": (4, ["--dp-ranks-per-node", "2"]),  # the reference; the TP/PP case resumes on it
    "dp2": (2, ["--dp-ranks-per-node", "1"]),
    "dp8": (8, ["--dp-ranks-per-node", "4"]),
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                      "2", "--dp-ranks-per-node", "1"]),
}


# [Note: the noise bound of a resharded resume]
# (the part (2) of tests/e2e/test_dist_checkpoint.py's loss bound)
# From the second iteration on the runs differ by SDP4Bit's rounding noise: from step 5 the
# resumed run draws its stochastic rounding on another topology (other quantization groups,
# shards and seeds). Two uninterrupted runs that differ only in --rounding-seed differ by the
# same kind of noise, drawn from step 1, so their loss differences are at least as spread.
# This benchmark launches every layout of LAYOUTS with 4 rounding seeds and takes the RMS of
# the relative differences |a - b| / a over all pairs and iterations 5-8;
# benchmarks/noise_spread.json records it, and the bound is NOISE_FACTOR x the largest RMS
# (for a difference of roughly normal spread, |x| > 4 RMS has a probability of 6e-5; 24
# samples per layout estimate the RMS within about 15%). The first iteration after a TP
# change differs too: TP splits the row-parallel matmuls and the vocabulary's softmax
# differently (partial sums rounded to bf16 before the all-reduce): rounding noise on part of
# the model, within (2) (the baseline's first iteration after TP 2 x PP 2 -> TP 1 moved by
# 2.3e-5; docs/checkpoints.md).
NOISE_ITERATIONS = (5, 6, 7, 8)
NOISE_FACTOR = 4
NOISE_RECORD = ROOT / "benchmarks" / "noise_spread.json"


def noise_bound() -> float:
    """The relative bound of a resharded resume's loss ([Note: the noise bound of a resharded
    resume]): NOISE_FACTOR x the largest RMS recorded in ``benchmarks/noise_spread.json``."""
    with open(NOISE_RECORD, encoding="utf-8") as f:
        return NOISE_FACTOR * max(r["rms"] for r in json.load(f)["layouts"].values())


def pair_differences(losses: dict[int, dict[int, float]], iterations) -> list[float]:
    """Relative loss differences |a - b| / a of every pair of seeds at every iteration.
    ``losses``: seed -> iteration -> loss."""
    out = []
    for s, t in itertools.combinations(sorted(losses), 2):
        for it in iterations:
            a, b = losses[s][it], losses[t][it]
            out.append(abs(a - b) / a)
    return out


def rms(values: list[float]) -> float:
    return math.sqrt(sum(v * v for v in values) / len(values))


def measure(layouts: list[str], seeds: list[int], work: Path) -> dict:
    from dev.tiny_runs import build_corpus, torchrun, train_lines

    data = build_corpus(work / "data")
    result = {}
    for name in layouts:
        nproc, flags = LAYOUTS[name]
        losses: dict[int, dict[int, float]] = {}
        for seed in seeds:
            t0 = time.time()
            res = torchrun(BASE + data + flags + ["--rounding-seed", str(seed)], nproc=nproc)
            if res.returncode != 0:
                raise RuntimeError(f"{name} seed {seed}: the run failed (exit "
                                   f"{res.returncode}):\n{res.stderr[-3000:]}")
            losses[seed] = {m["iteration"]: m["lm_loss"] for m in train_lines(res.stdout)}
            print(f"{name} seed {seed}: " + " ".join(
                f"{losses[seed][i]:.6f}" for i in sorted(losses[seed]))
                + f"  ({time.time() - t0:.0f} s)", flush=True)
        diffs = pair_differences(losses, NOISE_ITERATIONS)
        result[name] = {"nproc": nproc, "flags": flags, "losses": {
            str(s): {str(i): v for i, v in sorted(d.items())} for s, d in losses.items()},
            "rms": rms(diffs), "max": max(diffs), "samples": len(diffs)}
    return result


def render(record: dict) -> str:
    lines = ["# Rounding-noise spread of the resharding tests' runs", "",
             "Written by `benchmarks/noise_spread.py` (see its docstring). Each layout's "
             "run of `tests/e2e/test_dist_checkpoint.py` launched once per `--rounding-seed` "
             "(nothing else differs); relative loss differences |a - b| / a of every pair of "
             f"seeds at iterations {record['iterations'][0]}-{record['iterations'][-1]}.", "",
             f"- command: `{record['command']}`",
             f"- machine: {record['machine']}",
             f"- load average (1 min) before / after: {record['load_average'][0]:.1f} / "
             f"{record['load_average'][1]:.1f}",
             f"- date: {record['date']}", "",
             "| layout | processes | flags | pairs x iterations | RMS | max |",
             "|---|---:|---|---:|---:|---:|"]
    for name, r in record["layouts"].items():
        lines.append(f"| {name} | {r['nproc']} | `{' '.join(r['flags'])}` | {r['samples']} | "
                     f"{r['rms']:.2e} | {r['max']:.2e} |")
    lines += ["", f"The test's bound (NOISE_FACTOR {record['factor']} x the largest RMS): "
              f"{record['bound']:.2e} relative.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=list(DEFAULT_SEEDS))
    parser.add_argument("--work-dir", type=Path, help="keep the corpus here (default: a "
                        "temporary folder, removed at the end)")
    parser.add_argument("--write-results", action="store_true",
                        help="also write benchmarks/noise_spread.{md,json} (else print only)")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(cli)
    if len(set(args.seeds)) < 2:
        parser.error("--seeds needs two different seeds at least")
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        layouts = measure(args.layouts, sorted(set(args.seeds)), work)
    largest = max(r["rms"] for r in layouts.values())
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    record = {
        **results.header(__file__, cli, machine, load_before),
        "iterations": list(NOISE_ITERATIONS), "seeds": sorted(set(args.seeds)),
        "layouts": layouts, "factor": NOISE_FACTOR, "bound": NOISE_FACTOR * largest}
    print()
    print(render(record))
    if args.write_results:
        results.write("noise_spread", record, render)


if __name__ == "__main__":
    main()
