"""The Triton kernels compile for real GPUs (Ampere sm_80, Hopper sm_90) on a machine
without one: ``triton.compile`` with a CUDA target and the ``ptxas`` that ships with triton.

The interpreter tests prove the kernels' arithmetic; these prove that the same source
lowers to GPU code, and check the PTX facts the bit-exactness relies on: fp32 divisions are
IEEE ``div.rn`` (never ``div.full``/``div.approx``), no approximate instruction at all, and
no fused multiply-add in any kernel (every kernel, Hadamard included, must match the
references bit for bit).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = pathlib.Path(__file__).with_name("_compile_check.py")
KERNELS = {"_qwd_sender_kernel", "_qwd_receiver_kernel", "_tlq_sender_kernel",
           "_tlq_middle_kernel", "_tlq_receiver_kernel"}
CASES = [  # arch, bits, hadamard, input dtype, output dtype, rounding
    (90, 4, 32, "float32", "float32", "stochastic"),
    (90, 8, 0, "bfloat16", "bfloat16", "nearest"),
    (80, 4, 0, "float16", "bfloat16", "stochastic"),
    (80, 8, 16, "float32", "float32", "nearest"),
]


def _compile(tmp_path, arch, bits, hadamard, in_dtype, out_dtype, rounding) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    cmd = [sys.executable, str(SCRIPT), "--arch", str(arch), "--bits", str(bits),
           "--hadamard", str(hadamard), "--in-dtype", in_dtype, "--out-dtype", out_dtype]
    if rounding == "nearest":
        cmd.append("--nearest")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "sm{}-b{}-H{}-{}-{}-{}".format(*c))
def test_kernels_compile_for_gpu(tmp_path, case):
    arch = case[0]
    compiled = _compile(tmp_path, *case)
    assert {c["kernel"] for c in compiled} == KERNELS
    for c in compiled:
        assert c["arch"] == arch and c["cubin_bytes"] > 0
        assert c["approx"] == 0, c
        assert set(c["float_divs"]) <= {"div.rn.f32"}, c
        assert c["fma_f32"] == 0, c
    senders = [c for c in compiled if c["kernel"] in ("_qwd_sender_kernel", "_tlq_sender_kernel",
                                                     "_tlq_middle_kernel")]
    assert all(c["float_divs"] == ["div.rn.f32"] for c in senders)
