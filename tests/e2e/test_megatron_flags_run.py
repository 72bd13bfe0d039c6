"""One ``torchrun`` of ``pretrain_gpt.py`` (2 ranks, CPU) with Megatron-LM's sample-based
training, ``--exit-duration-in-mins``, TensorBoard switches and ``--empty-unused-memory-level``
(nothing to release on CPU: the step runs through it); its console is checked for
megatron-core's noise, for the progress lines (rank 0 only) and for Megatron-LM's start and
save lines, its TensorBoard for Megatron-LM's tags."""

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
             "--log-batch-size-to-tensorboard --distributed-timeout-minutes 3 "
             "--empty-unused-memory-level 2").split(),
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
    # Megatron-LM's start and save lines (observe/logging.py), each once
    assert out.count("------------------------ arguments ------------------------") == 1
    assert "  train_iters " + "." * 37 + " 10\n" in out  # derived from --train-samples
    # GPT of 2 layers, hidden 64, FFN 256, 32 positions, output layer tied to the embedding;
    # --mock-data's 1024 ids plus the end-of-document id, padded to a multiple of 128: 1152
    # rows. 1152*64 + 32*64 + 2 * (two layer norms 4*64 + QKV 64*192+192 + projection
    # 64*64+64 + MLP 64*256+256 + 256*64+64) + final layer norm 2*64. Printed by
    # data-parallel rank 0 only.
    params = 1152 * 64 + 32 * 64 + 2 * (4 * 64 + 64 * 192 + 192 + 64 * 64 + 64
                                        + 64 * 256 + 256 + 256 * 64 + 64) + 2 * 64
    assert out.count(" > number of parameters on (tensor, pipeline) model parallel rank "
                     f"(0, 0): {params}\n") == 1, out[:3000]
    assert out.count(f"] saving checkpoint at iteration       1 to {ckpt} in torch_dist "
                     "format") == 1
    assert out.count(f"] successfully saved checkpoint from iteration       1 to {ckpt} "
                     "[ t 1/1, p 1/1 ]") == 1
    # Megatron-LM's TensorBoard tags, the loss the same as the metrics file's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"lm loss", "lm loss vs samples", "learning-rate", "batch-size", "grad-norm",
            "loss-scale", "iteration-time", "throughput",
            "sdp4bit/grads-inter-bytes"} <= set(events.Tags()["scalars"])
    (loss,) = events.Scalars("lm loss")
    assert loss.step == 1 and abs(loss.value - record["lm_loss"]) <= 1e-6 * record["lm_loss"]
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [16]


@pytest.mark.release_independent
def test_transformer_engine_without_cuda_is_refused_before_start_up():
    """pretrain_gpt.py checks what the machine has right after parsing: one line, exit 2,
    nothing started (CUDA_VISIBLE_DEVICES= hides any GPU, so every machine lacks CUDA)."""
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
           *("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
             "--micro-batch-size 2 --train-iters 2 --lr 1e-3 --mock-data "
             "--transformer-impl transformer_engine").split()]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.splitlines() == [
        "pretrain_gpt.py: error: --transformer-impl transformer_engine runs Transformer "
        "Engine's CUDA kernels and there is no CUDA device here: --transformer-impl local"]
    assert "initializing torch.distributed" not in res.stdout and "arguments" not in res.stdout
