"""The Triton kernels compile for real GPUs (Ampere sm_80, Hopper sm_90) on a machine
without one: ``triton.compile`` with a CUDA target and the ``ptxas`` that ships with triton.

The interpreter tests prove the kernels' arithmetic; these prove that the same source
lowers to GPU code, and check the PTX facts the bit-exactness relies on: fp32 divisions are
IEEE ``div.rn`` (never ``div.full``/``div.approx``), no approximate instruction at all, and
no fused multiply-add in any kernel (every kernel, Hadamard included, must match the
references bit for bit). The launches are specialised as Triton's launcher specialises them
(16-byte divisibility of aligned buffers and sizes), and no pointer offset may be computed
with 32-bit arithmetic on sizes, program ids or loop counters: production wire buffers
exceed 2**31 bytes (``tests/helpers/triton_ir.py``, [Note: which offsets must be 64-bit]).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from tests.helpers import triton_ir as _triton_ir

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    cmd = [sys.executable, "-m", "tests.helpers.compile_check", "--arch", str(arch), "--bits", str(bits),
           "--hadamard", str(hadamard), "--in-dtype", in_dtype, "--out-dtype", out_dtype]
    if rounding == "nearest":
        cmd.append("--nearest")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
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
        assert c["int32_offsets"] == [], c
        # compiled as launched: the fresh (aligned) buffers carry the divisibility hint
        pointers = {"_qwd_sender_kernel": {"main_ptr", "out_ptr"},
                    "_qwd_receiver_kernel": {"wire_ptr", "replica_ptr"},
                    "_tlq_sender_kernel": {"inp_ptr", "out_ptr"},
                    "_tlq_middle_kernel": {"wire_ptr", "out_ptr"},
                    "_tlq_receiver_kernel": {"wire_ptr", "out_ptr"}}[c["kernel"]]
        assert pointers <= set(c["divisible_by_16"]), c
    senders = [c for c in compiled if c["kernel"] in ("_qwd_sender_kernel", "_tlq_sender_kernel",
                                                     "_tlq_middle_kernel")]
    assert all(c["float_divs"] == ["div.rn.f32"] for c in senders)


# The loop over incoming messages as it compiled before offsets were made 64-bit (TTIR of
# _tlq_middle_kernel, trimmed): ``k * in_nbytes`` in i32 wraps once the wire exceeds 2**31.
_LOOP_I32 = """
    %c4_i32 = arith.constant 4 : i32
    %p = tt.bitcast %wire_ptr : !tt.ptr<i8> -> !tt.ptr<f32>
    %r = tt.make_range {end = 32 : i32, start = 0 : i32} : tensor<32xi32>
    %acc = scf.for %k = %c1 to %n_in step %c1 iter_args(%a = %z) -> (tensor<32xf32>)  : i32 {
      %base = arith.muli %k, %in_nbytes : i32 loc(#loc1)
      %q = arith.divsi %base, %c4_i32 : i32
      %ptr = tt.addptr %p, %q : !tt.ptr<f32>, i32
      %s = tt.splat %ptr : !tt.ptr<f32> -> tensor<32x!tt.ptr<f32>>
      %ps = tt.addptr %s, %r : tensor<32x!tt.ptr<f32>>, tensor<32xi32>
"""


def test_int32_offset_check_finds_the_wrapping_product():
    """The IR check has teeth: the pre-fix loop is flagged, its 64-bit form is not, and a
    text without any pointer arithmetic is an error rather than a pass."""
    assert _triton_ir.offset_violations(_LOOP_I32) == [
        "%base = arith.muli %k, %in_nbytes : i32"]
    fixed = _LOOP_I32.replace(
        "%base = arith.muli %k, %in_nbytes : i32",
        "%k64 = arith.extsi %k : i32 to i64\n      %n64 = arith.extsi %in_nbytes : i32 to i64\n"
        "      %base = arith.muli %k64, %n64 : i64").replace(
        "%q = arith.divsi %base, %c4_i32 : i32", "%q = arith.divsi %base, %c4_i64 : i64")
    assert _triton_ir.offset_violations(fixed) == []
    # arithmetic on compile-time bounds only (tl.arange times a constexpr) is fine
    bounded = _LOOP_I32.replace("arith.muli %k, %in_nbytes", "arith.muli %r, %c4_i32")
    assert _triton_ir.offset_violations(bounded) == []
    with pytest.raises(ValueError, match="no tt.addptr found"):
        _triton_ir.offset_violations("%x = arith.muli %a, %b : i32")
