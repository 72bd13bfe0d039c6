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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.dryrun, pytest.mark.distributed]

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
        "--lr 3e-3 --bf16 --use-distributed-optimizer --log-interval 1 --mock-data "
        "--vocab-size 128 --seed 7 --quantized-weights --quantized-gradients "
        "--hadamard-transform").split()


def _launch(script: list[str], args: list[str], nproc: int) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc script...`` through tests/helpers/launch.py (the ranks
    forked from the session's fork server, torchrun's contract kept)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    return _launch_module.torchrun(script[0], [*script[1:], *TINY, *args], nproc=nproc,
                                   env=env, cwd=ROOT, timeout=300)


def _dryrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    return _launch([os.path.join(ROOT, "dev", "cuda_dryrun.py")], args, nproc)


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
