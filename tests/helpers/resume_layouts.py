"""The layouts of the resume tests and the noise bound of a resharded resume.

tests/e2e/test_dist_checkpoint.py resumes the runs of :data:`LAYOUTS` on other layouts;
benchmarks/noise_spread.py measures, on the same layouts, the rounding-noise spread that the
tests' loss bound :func:`noise_bound` is made of.
"""

from __future__ import annotations

import json
import os

from tests.helpers.trainer import METHODS, ROOT, TINY

BASE = list(TINY)
for flag, value in (("--train-iters", "8"), ("--log-interval", "1"), ("--eval-interval", "100")):
    BASE[BASE.index(flag) + 1] = value
BASE += ["--hidden-dropout", "0", "--attention-dropout", "0", *METHODS["SDP4Bit"]]
# The layouts of the resume tests' runs: name -> (processes, flags).
LAYOUTS = {
    "dp4": (4, ["--dp-ranks-per-node", "2"]),  # the reference; the TP/PP case resumes on it
    "dp2": (2, ["--dp-ranks-per-node", "1"]),
    "dp8": (8, ["--dp-ranks-per-node", "4"]),
    "tp2pp2dp2": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                      "2", "--dp-ranks-per-node", "1"]),
}


# (2) From the second iteration on the runs differ by SDP4Bit's rounding noise: from step 5 the
#     resumed run draws its stochastic rounding on another topology (other quantization
#     groups, shards and seeds). Two uninterrupted runs that differ only in --rounding-seed
#     differ by the same kind of noise, drawn from step 1, so their loss differences are at
#     least as spread. benchmarks/noise_spread.py launches every layout of LAYOUTS with
#     4 rounding seeds and takes the RMS of the relative differences |a - b| / a over all
#     pairs and iterations 5-8; benchmarks/noise_spread.json records it, and the bound is
#     NOISE_FACTOR x the largest RMS (for a difference of roughly normal spread, |x| > 4 RMS
#     has a probability of 6e-5; 24 samples per layout estimate the RMS within about 15%).
#     The first iteration after a TP change differs too: TP splits the row-parallel matmuls
#     and the vocabulary's softmax differently (partial sums rounded to bf16 before the
#     all-reduce): rounding noise on part of the model, within (2) (the baseline's first
#     iteration after TP 2 x PP 2 -> TP 1 moved by 2.3e-5; docs/checkpoints.md).
NOISE_ITERATIONS = (5, 6, 7, 8)
NOISE_FACTOR = 4
NOISE_RECORD = os.path.join(ROOT, "benchmarks", "noise_spread.json")


def noise_bound() -> float:
    """The relative bound of (2): NOISE_FACTOR x the largest RMS that
    benchmarks/noise_spread.py recorded."""
    with open(NOISE_RECORD, encoding="utf-8") as f:
        return NOISE_FACTOR * max(r["rms"] for r in json.load(f)["layouts"].values())
