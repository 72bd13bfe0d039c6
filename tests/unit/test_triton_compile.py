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

The PTX budget: every kernel, compiled for Hopper in the configurations users run, is held
to what its structure should cost per element (``tests/helpers/ptx_budget.py``, [Note: the
PTX budget]; docs/gpu.md says what this proxy can and cannot see). The kernels before the
restructuring fail it: barriers (tlq_sender: 31 for 1), 64-bit divisions (13 for 0), hash
rounds (4 multiplies per element for 2), divisions per element, SASS per element.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("triton")

from tests.helpers import triton_ir as _triton_ir

ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = {"_qwd_sender_kernel", "_qwd_receiver_kernel", "_tlq_sender_kernel",
           "_tlq_middle_kernel", "_tlq_receiver_kernel"}
CASES = [  # arch, bits, hadamard, input dtype, output dtype, rounding
    (90, 4, 32, "float32", "float32", "stochastic"),  # what users run: the budget's cases
    (90, 2, 32, "bfloat16", "bfloat16", "stochastic"),
    (90, 8, 0, "bfloat16", "bfloat16", "nearest"),
    (80, 4, 0, "float16", "bfloat16", "stochastic"),
    (80, 8, 16, "float32", "float32", "nearest"),
]
BUDGET_CASES = CASES[:2]
_ID = "sm{}-b{}-H{}-{}-{}-{}".format


@functools.lru_cache(maxsize=None)
def _compiled_all() -> dict[tuple, tuple[dict, ...]]:
    """Every kernel of every case, compiled in one subprocess (once per test session: one
    interpreter's start instead of one per case)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = cache
        cmd = [sys.executable, "-m", "tests.helpers.compile_check"]
        for case in CASES:
            cmd += ["--case", ",".join(map(str, case))]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900,
                              cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return _by_case(lines)


def _by_case(lines: list[dict]) -> dict[tuple, tuple[dict, ...]]:
    """compile_check's lines grouped by the case each names."""
    found: dict[tuple, list[dict]] = {case: [] for case in CASES}
    for line in lines:
        arch, bits, hadamard, in_dtype, out_dtype, rounding = line.pop("case").split(",")
        found[int(arch), int(bits), int(hadamard), in_dtype, out_dtype, rounding].append(line)
    return {case: tuple(kernels) for case, kernels in found.items()}


def _compiled(*case) -> tuple[dict, ...]:
    """Every kernel of one case."""
    return _compiled_all()[case]


@pytest.mark.parametrize("case", CASES, ids=lambda c: _ID(*c))
def test_kernels_compile_for_gpu(case):
    arch = case[0]
    compiled = _compiled(*case)
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


# [Note: the PTX budget] in tests/helpers/ptx_budget.py. Per element = per element a thread
# holds; the message loops' counts are per message. Limits: what the restructured kernels
# compile to (triton 3.8, sm_90), with headroom only where a count is not structural (SASS).
#   loads/stores: instructions per element (a lost vectorization multiplies them);
#   load_bytes/store_bytes: the narrowest access of the tile's data, in bytes;
#   barriers, shared_stores: static counts per kernel (a layout conversion adds both);
#   hash: hash multiplies per element (2 = one two-round hash per pair of elements);
#   divisions: IEEE divisions per element (2 per group, none per element);
#   sass: SASS instructions per element (kernels without a message loop).
BUDGETS = {
    "_tlq_sender_kernel": dict(loads=0.25, stores=0.32, barriers=1, shared_stores=1, hash=2,
                               divisions=0.5, sass=72),
    "_qwd_sender_kernel": dict(loads=0.5, stores=0.32, barriers=1, shared_stores=1, hash=2,
                               divisions=0.25, sass=48),
    "_qwd_receiver_kernel": dict(loads=0.57, stores=0.25, barriers=0, shared_stores=0,
                                 sass=24),
    "_tlq_middle_kernel": dict(loads=0.5, stores=0.32, barriers=1, shared_stores=1, hash=2,
                               divisions=0.5),
    "_tlq_receiver_kernel": dict(loads=0.5, stores=0.25, barriers=0, shared_stores=0),
}
# The narrowest access, in bytes, by kernel and case: the fp32/bf16 data in runs of four
# values (16 / 8 bytes), the codes of four values (4 bytes at 8 bits, 2 at 4, 1 at 2).
WIDTHS = {
    (4, "float32"): {"_tlq_sender_kernel": dict(load_bytes=16, store_bytes=4),
                     "_qwd_sender_kernel": dict(load_bytes=8, store_bytes=2),
                     "_qwd_receiver_kernel": dict(load_bytes=2, store_bytes=8),
                     "_tlq_middle_kernel": dict(load_bytes=4, store_bytes=2),
                     "_tlq_receiver_kernel": dict(load_bytes=2, store_bytes=16)},
    (2, "bfloat16"): {"_tlq_sender_kernel": dict(load_bytes=8, store_bytes=4),
                      "_qwd_sender_kernel": dict(load_bytes=8, store_bytes=1),
                      "_qwd_receiver_kernel": dict(load_bytes=1, store_bytes=8),
                      "_tlq_middle_kernel": dict(load_bytes=4, store_bytes=1),
                      "_tlq_receiver_kernel": dict(load_bytes=1, store_bytes=8)},
}


def budget_violations(c: dict, budget: dict, widths: dict) -> list[str]:
    """What kernel ``c`` (one line of compile_check) spends beyond ``budget``, one line per
    excess; empty when it fits."""
    from megatron.sdp4bit.quantization.triton_tlq import MESSAGES_PER_PASS

    per_thread = c["constexprs"]["R"] * c["constexprs"]["GP"] / (32 * c["num_warps"])
    passes = MESSAGES_PER_PASS + 1 if c["kernel"] in ("_tlq_middle_kernel",
                                                      "_tlq_receiver_kernel") else 1
    loads, stores = c["global_loads"], c["global_stores"]
    found = {
        "loads": sum(loads.values()) / passes / per_thread,
        "stores": sum(stores.values()) / per_thread,
        "barriers": c["barriers"],
        "shared_stores": c["shared_stores"],
        "hash": c["hash_multiplies"] / per_thread,
        "divisions": c["float_divisions"] / per_thread,
        "sass": c["sass_instructions"] / per_thread,
    }
    out = [f"{name} {found[name]:g} > {limit:g}" for name, limit in budget.items()
           if found[name] > limit]
    if "hash" not in budget and c["hash_multiplies"]:
        out.append(f"hash {found['hash']:g} > 0")
    if "divisions" not in budget and c["float_divisions"]:
        out.append(f"divisions {found['divisions']:g} > 0")
    for name, accesses in (("load_bytes", loads), ("store_bytes", stores)):
        narrowest = min(int(width) for width in accesses)
        if narrowest < widths[name]:
            out.append(f"{name} {narrowest} < {widths[name]}")
    for name in ("int64_divisions", "local_accesses", "local_bytes", "stack_bytes"):
        if c[name]:
            out.append(f"{name} {c[name]} > 0")
    return out


@pytest.mark.parametrize("case", BUDGET_CASES, ids=lambda c: _ID(*c))
def test_kernels_fit_their_ptx_budget(case):
    """Each kernel, compiled for Hopper as users run it (stochastic rounding, Hadamard 32,
    8-bit intra hop, 4-bit or 2-bit inter hop, groups of 128 and 2048), within its budget:
    vectorized accesses, no spills, no layout conversion of the tile, one hash per two
    elements, no division per element, no 64-bit division."""
    compiled = _compiled(*case)
    widths = WIDTHS[case[1], case[3]]
    report = {c["kernel"]: budget_violations(c, BUDGETS[c["kernel"]], widths[c["kernel"]])
              for c in compiled}
    assert not any(report.values()), "over budget:\n" + "\n".join(
        f"{kernel}: {'; '.join(excess)}" for kernel, excess in report.items() if excess)


def test_the_budget_check_has_teeth():
    """A kernel that converts its tile through shared memory, spills, hashes every element
    twice, divides per element or by a 64-bit size, or loads scalars fails, one line per
    excess."""
    compiled = {c["kernel"]: c for c in _compiled(*BUDGET_CASES[0])}
    sender = compiled["_tlq_sender_kernel"]
    widths = WIDTHS[4, "float32"]["_tlq_sender_kernel"]
    assert budget_violations(sender, BUDGETS["_tlq_sender_kernel"], widths) == []
    worse = dict(sender, barriers=31, shared_stores=24, hash_multiplies=64, float_divisions=21,
                 int64_divisions=13, local_bytes=8, sass_instructions=2440,
                 global_loads={"4": 16})
    assert budget_violations(worse, BUDGETS["_tlq_sender_kernel"], widths) == [
        "loads 1 > 0.25", "barriers 31 > 1", "shared_stores 24 > 1", "hash 4 > 2",
        "divisions 1.3125 > 0.5", "sass 152.5 > 72", "load_bytes 4 < 16",
        "int64_divisions 13 > 0", "local_bytes 8 > 0"]
