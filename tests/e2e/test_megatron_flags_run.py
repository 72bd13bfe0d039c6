"""One ``torchrun`` of ``pretrain_gpt.py`` (2 ranks, CPU) with Megatron-LM's sample-based
training, ``--exit-duration-in-mins`` and TensorBoard switches; its console is checked for
megatron-core's noise and for the progress lines (rank 0 only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NOISE = ("Apex is not installed", "Transformer Engine and Apex are not installed",
         "full scope is deprecated", "Unable to save MockGPTDataset indexes",
         "Rerun State Machine", "RerunStateMachine", "is deprecated. Please use",
         "GPTModel IS DEPRECATED", "full_param_layout not provided", "MimoModelConfig")


@pytest.mark.slow
@pytest.mark.distributed
def test_train_samples_and_exit_duration(tmp_path):
    """170 samples at 16 per iteration are 10 iterations; an exit duration of 1e-6 minutes has
    passed after the first, so both ranks stop there, after saving a checkpoint."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "new" / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"),
           *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--micro-batch-size 2 --global-batch-size 16 --train-samples 170 "
             "--lr-warmup-samples 32 --lr 1e-3 --bf16 --use-distributed-optimizer --mock-data "
             "--log-interval 1 --eval-interval 100 --eval-iters 1 --exit-duration-in-mins 1e-6 "
             "--log-batch-size-to-tensorboard --distributed-timeout-minutes 3").split(),
           "--save", str(ckpt), "--metrics-jsonl", str(metrics),
           "--tensorboard-dir", str(tmp_path / "tb")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    env.pop("PYTHONWARNINGS", None)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    out = res.stdout
    assert " iteration        1/      10 |" in out
    assert "learning rate: 5.000000E-04 |" in out  # 16 of 32 warm-up samples
    assert "exiting program after 1e-06 minutes at iteration 1" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    record = json.loads(metrics.read_text().splitlines()[0])
    assert (record["iteration"], record["consumed_tokens"]) == (1, 16 * 32)
    for phase in ("initializing torch.distributed: 2 process(es)",
                  "building the model, the optimizer and the datasets",
                  "training iterations 1 to 10, a log line every 1"):
        assert out.count(phase) == 1, out  # rank 0 only
    console = out + res.stderr
    assert not [n for n in NOISE if n in console], console[-4000:]
