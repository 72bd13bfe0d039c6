"""SDP4Bit's quantized collectives, with the Triton kernels compiled for CUDA, inside real
training steps on one GPU (the integration's GPU test; the GPU check's ``gpu_tests`` step).

One GPU with one rank is a data-parallel world of 1, which quantizes nothing. So 4 ranks share
the one GPU (``--distributed-backend gloo``: NCCL refuses two ranks on one device, gloo
carries the collectives through host memory; docs/gpu.md, "Several ranks on one GPU") and act
as 2 nodes x 2 ranks (``--dp-ranks-per-node 2``): both hops of TLq-HS (8-bit inside a node,
4-bit across) and the qWD all-gather run between real processes, with every SDP4Bit flag,
``--overlap-grad-reduce --overlap-param-gather`` over 13 buckets and the two-slice all-to-all
pipeline (tests/helpers/shared_device.py). Asserted:

- the exact number of quantized collectives on a rank: 13 buckets x 12 iterations = 156
  reduce-scatters and as many all-gathers (``shared_device.expected_counts``), so a run
  that quantizes nothing fails here;
- the bf16 replicas bitwise identical on the data-parallel ranks after every iteration
  (``--check-replicas-interval 1`` stops the run at the first bucket that differs);
- the loss and gradient norm of every iteration bitwise equal to the same run with
  ``--kernel-backend torch`` (the torch references, on the same GPU): the kernels write the
  references' bytes, so nothing downstream may differ. A difference is a kernel that departs
  from its reference on a real message (the kernels step checks them on synthetic ones), or
  model compute that is not deterministic from run to run on this GPU (the message names the
  first iteration that differs).

What it cannot see: NCCL (its own kernels and streams, the timing and overlap of its
collectives with the backward pass, its communicator setup and error handling): gloo waits for
each collective on the host; placement on several GPUs (one device per rank, peer-to-peer or
NVLink transfers); speed (the GPU check's bandwidth and overhead steps measure the kernels).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.sdp4bit.training.observe.metrics_file import read_metrics
from tests.helpers import shared_device

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 12
BUCKETS = 13  # 4 layers of hidden 256 (3.5M parameters) in buckets of 200,000 elements
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--train-iters", str(ITERATIONS), "--lr", "3e-3",
         "--lr-warmup-iters", "2", "--bf16", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "1024", "--use-distributed-optimizer",
         "--ddp-bucket-size", "200000", "--log-interval", "1", "--eval-interval", "1000",
         "--eval-iters", "0", "--transformer-impl", "local"]


def _train(backend: str, metrics: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    first = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    # one GPU whatever the machine has; cuBLAS's deterministic workspace, so that the two
    # runs' model compute is the same
    env.update(CUDA_VISIBLE_DEVICES=first, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(shared_device.RANKS), "pretrain_gpt.py", *MODEL, *shared_device.MODE,
           *shared_device.SDP4BIT, "--kernel-backend", backend, "--metrics-jsonl",
           str(metrics)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done.stdout


def test_sdp4bit_quantizes_between_four_ranks_on_one_gpu(tmp_path):
    out = _train("triton", tmp_path / "triton.jsonl")
    sharing = shared_device.SHARING.search(out)
    assert sharing and sharing.groups() == ("4", "1"), out[-3000:]
    assert "data-parallel topology: 4 ranks = 2 per node x 2 nodes" in out
    assert "stochastic rounding, triton kernels" in out
    assert shared_device.counts(out) == (
        BUCKETS, *shared_device.expected_counts(BUCKETS, ITERATIONS)) == (BUCKETS, 156, 156)
    _train("torch", tmp_path / "torch.jsonl")
    triton, torch_ref = ([(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in
                          read_metrics(tmp_path / f"{name}.jsonl")[0]]
                         for name in ("triton", "torch"))
    assert [i for i, _, _ in triton] == list(range(1, ITERATIONS + 1))
    assert triton[-1][1] < triton[0][1] - 1.0, triton  # it learns: 7.1 -> 5.5 on the H200
    differ = [(a, b) for a, b in zip(triton, torch_ref) if a != b]
    assert not differ, f"first iteration that differs (triton, torch): {differ[0]}"
