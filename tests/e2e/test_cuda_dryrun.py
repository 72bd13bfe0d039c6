"""The CUDA dry run (testing/cuda_dryrun.py, dev/cuda_dryrun.py): pretrain_gpt.py's
CUDA branch on CPU, with NCCL's rules on every collective.

The real code passes it through training, evaluation, a checkpoint save and a resume; each
of three planted GPU-only bugs (tests/helpers/dryrun_plant.py) stops it with the one line that
names the collective, the group and the host tensor. ``pytest -m dryrun`` runs these alone.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.helpers import launch as _launch_module
from tests.helpers import shared_device
from tests.helpers.trainer import one_error_line

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.dryrun, pytest.mark.distributed]
# How many devices the dry run emulates (testing/cuda_dryrun.py's DEVICES_ENV; only
# dev/cuda_dryrun.py imports that module)
DEVICES_ENV = "SDP4BIT_DRYRUN_DEVICES"

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
        "--lr 3e-3 --bf16 --use-distributed-optimizer --log-interval 1 --mock-data "
        "--vocab-size 128 --seed 7 --quantized-weights --quantized-gradients "
        "--hadamard-transform").split()


def _launch(script: list[str], args: list[str], nproc: int,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script...`` through tests/helpers/launch.py (the ranks
    forked from the session's fork server, torchrun's contract kept)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **(env or {}))
    env.pop("TRITON_INTERPRET", None)
    return _launch_module.torchrun(script[0], [*script[1:], *TINY, *args], nproc=nproc,
                                   env=env, cwd=ROOT, timeout=300)


def _dryrun(args: list[str], nproc: int = 2,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _launch([os.path.join(ROOT, "dev", "cuda_dryrun.py")], args, nproc, env)


def test_trains_evaluates_saves_and_resumes_on_the_cuda_branch(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # 2 nodes x 2 ranks: both hops of the gradient all-to-all, the qWD all-gather; the
    # timer table, --exit-duration-in-mins and --exit-signal-handler add their own collectives
    first = _dryrun(["--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1",
                     "--dp-ranks-per-node", "2", "--save", ckpt, "--save-interval", "3",
                     "--timing-log-level", "1", "--exit-duration-in-mins", "1000",
                     "--exit-signal-handler"], nproc=4)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    out = first.stdout
    assert "cuda dry run: torch.cuda.is_available() is True" in out
    assert re.search(r"iteration\s+3/\s+3 .*lm loss: [0-9.E+-]+", out)
    assert "validation loss at iteration 3" in out
    assert f"successfully saved checkpoint from iteration       3 to {ckpt} [ t 1/1, p 1/1 ]" \
        in out
    checked = int(re.search(r"cuda dry run: done, (\d+) collectives", out).group(1))
    assert checked >= 3 * 3  # per step at least: loss, finiteness, the two quantized hops
    second = _dryrun(["--train-iters", "4", "--dp-ranks-per-node", "2", "--load", ckpt,
                      "--use-checkpoint-opt_param-scheduler"], nproc=4)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert f"loaded checkpoint from {ckpt} at iteration 3" in second.stdout
    assert re.search(r"iteration\s+4/\s+4 ", second.stdout)


def test_four_ranks_share_one_device_with_gloo_on_the_cuda_branch():
    """The GPU test's mode (tests/gpu/test_training_cuda.py) on one emulated device: 4 ranks
    on cuda:0 (the dry run refuses any other ordinal, as CUDA does), 2 nodes x 2, every SDP4Bit
    flag with both overlaps over 4 buckets; each rank quantizes one reduce-scatter and one
    all-gather per bucket and step (each step's update is sent once)."""
    iterations = 3
    res = _dryrun(["--train-iters", str(iterations), "--ddp-bucket-size", "20000",
                   *shared_device.MODE, *shared_device.SDP4BIT],
                  nproc=shared_device.RANKS, env={DEVICES_ENV: "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out = res.stdout
    assert shared_device.SHARING.search(out).groups() == ("4", "1"), out[-3000:]
    assert "data-parallel topology: 4 ranks = 2 per node x 2 nodes" in out
    assert shared_device.counts(out) == (4, *shared_device.expected_counts(4, iterations)) \
        == (4, 12, 12)
    assert re.search(r"cuda dry run: done, \d+ collectives on rank 0 passed", out)


def test_nccl_refuses_ranks_that_would_share_a_device():
    res = _dryrun(["--train-iters", "1", "--distributed-backend", "nccl"], nproc=2,
                  env={DEVICES_ENV: "1"})
    assert one_error_line(res) == (
        "2 ranks on this node and 1 CUDA device(s): NCCL cannot put two ranks on one device "
        "(ncclInvalidUsage): start at most one rank per device (torchrun --nproc-per-node 1), "
        "or pass --distributed-backend gloo to let ranks share the devices (collectives "
        "through host memory: for tests, not speed)")


@pytest.mark.release_independent  # megatron-core's TP paths: test_pretrain_gpt.py's TP2 run
def test_tensor_parallel_sdp4bit_on_the_cuda_branch():
    """TP 2 x DP 2 with sequence parallelism: the TP group's broadcasts that keep the copies
    of the weights TP does not split equal (integration/tp_duplicates.py), and the sequence
    parallel layers' collectives and device allocations (in their backward pass too), pass
    NCCL's rules too."""
    res = _dryrun(["--train-iters", "2", "--tensor-model-parallel-size", "2",
                   "--sequence-parallel", "--dp-ranks-per-node", "1"], nproc=4)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert re.search(r"iteration\s+2/\s+2 .*lm loss: [0-9.E+-]+", res.stdout)
    assert re.search(r"cuda dry run: done, \d+ collectives on rank 0 passed", res.stdout)


@pytest.mark.parametrize("bug, expected", [
    ("mean-loss-cpu",
     r"all_reduce on group DATA_PARALLEL\S* \(global ranks \[0, 1\]\): tensor 'tensor' "
     r"\(float32 \[1\]\) is in host memory"),
    ("finite-host-scalar",
     r"all_reduce on the default group \(global ranks \[0, 1\]\): tensor 'tensor' "
     r"\(float32 \[1\]\) is in host memory"),
    ("param-gather-host-buffer",
     r"all_gather_\w+ on group \S+ \(global ranks \[0, 1\]\): tensor 'input_tensor' "
     r"\(uint8 \[\d+\]\) is in host memory"),
])
@pytest.mark.release_independent  # the dry run's rule checks; the trainer: the test above
def test_planted_gpu_bug_stops_the_dry_run(bug, expected):
    res = _launch([os.path.join(ROOT, "tests", "helpers", "dryrun_plant.py"), bug],
                  ["--train-iters", "2"], nproc=2)
    assert res.returncode != 0, res.stdout[-3000:]
    lines = [l for l in res.stderr.splitlines() if "cuda_dryrun.py: error:" in l]
    assert lines, res.stderr[-5000:]
    assert re.search(expected, lines[0]), lines[0]
