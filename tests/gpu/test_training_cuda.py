"""pretrain_gpt.py on one CUDA GPU with every SDP4Bit flag on (the integration's GPU check).

With one process the data-parallel world is 1: the quantized collectives still run on their
degenerate topology (every message quantized, dequantized and applied; nothing to send),
with the Triton kernels on CUDA, through megatron-core's NCCL process groups. Also runs
the unquantized baseline and checks both losses fall and stay close.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "8",
         "--global-batch-size", "16", "--train-iters", "60", "--lr", "3e-3",
         "--lr-warmup-iters", "5", "--bf16", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "1024", "--use-distributed-optimizer",
         "--log-interval", "10", "--eval-interval", "60", "--eval-iters", "2"]
SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform",
           "--gq-group-size-intra", "128", "--kernel-backend", "triton"]
LOSS = re.compile(r"lm loss: ([0-9.E+-]+)")


def _train(extra: list[str]) -> tuple[list[float], str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "pretrain_gpt.py", *MODEL, *extra]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return [float(x) for x in LOSS.findall(done.stdout)], done.stdout


def test_sdp4bit_trains_on_one_gpu():
    base, _ = _train([])
    quant, out = _train(SDP4BIT)
    assert "SDP4Bit installed on" in out
    assert re.search(r"SDP4Bit on this rank: [1-9]\d* quantized gradient reduce-scatters, "
                     r"[1-9]\d* quantized parameter all-gathers", out)
    assert base[-1] < base[0] and quant[-1] < quant[0]
    assert abs(quant[-1] - base[-1]) <= 0.05 * base[-1]
