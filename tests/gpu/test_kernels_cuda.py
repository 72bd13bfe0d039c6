"""The fused Triton kernels, compiled for CUDA, against the torch references.

Each test runs ``dev/cuda_checks.py`` for one operation in a fresh process without
``TRITON_INTERPRET`` (the test runner sets it for the CPU tests, and Triton reads it when the
kernels are defined), so what runs here is the compiled kernel a training job uses.
"""

import os
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


@pytest.mark.parametrize("op", ["qwd_sender", "qwd_receiver", "tlq_sender", "tlq_middle",
                                "tlq_receiver"])
def test_kernel_matches_reference_on_cuda(op):
    pytest.importorskip("triton", reason="triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "dev.cuda_checks", op], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
