"""The compiled CPU kernels against the torch references: the same bytes, always.

The CPU kernels are the production path of every CPU run (``KernelBackend.AUTO`` picks them
for CPU tensors), so they are checked bit for bit against the references over every layout,
bit width, rounding mode, Hadamard block and dtype, on sizes large enough to cross many
groups; then their build: cached per source and machine, built once by concurrent
processes, and a clear fallback (one warning, the reference runs) when no compiler exists.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron.sdp4bit.quantization import cpu_kernels as ck
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization import reference as ref
from megatron.sdp4bit.quantization.backend import KernelBackend, resolve_backend
from tests.unit import _kernel_checks as kc

ROOT = Path(__file__).resolve().parents[2]
CPU = "cpu"
SEEDS = [12345, (0x9E3779B9 << 32) | 0x80000001]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ids(value):
    return str(value)


def test_kernels_build_here():
    """CI and the quickstart run on machines with a C compiler: the kernels must load."""
    assert ck.unavailable_reason() is None
    assert resolve_backend(KernelBackend.AUTO, torch.empty(1)) is KernelBackend.CPU


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("replica", ["bf16", "fp32", "fp16", None],
                         ids=["bf16", "fp32", "fp16", "direct"])
@pytest.mark.parametrize("bits,group,numel", [(4, 64, 192), (8, 64, 192), (4, 96, 192),
                                              (4, 2048, 3 * 2048), (8, 128, 8192)], ids=_ids)
def test_qwd_sender(bits, group, numel, replica, stochastic):
    for seed in SEEDS:
        kc.check_qwd_sender(CPU, impl=ck, numel=numel, bits=bits, group=group,
                            replica_dtype=DTYPES.get(replica), stochastic=stochastic,
                            seed=seed)


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("bits,group,world", [(4, 64, 1), (4, 64, 3), (8, 32, 3),
                                              (4, 96, 2), (4, 2048, 4)], ids=_ids)
def test_qwd_receiver(bits, group, world, dtype, accumulate):
    kc.check_qwd_receiver(CPU, impl=ck, world=world, shard=2 * group, bits=bits, group=group,
                          replica_dtype=DTYPES[dtype], accumulate=accumulate, seed=world)


# (blocks_per_dest M, num_dests N, slices P, chunk c): the two-level layout, N=1, M=1,
# pipelined, a chunk smaller than a group (groups then span chunks), and a large one.
LAYOUTS = [(2, 2, 1, 64), (2, 3, 2, 64), (1, 4, 1, 128), (3, 1, 2, 64), (2, 2, 2, 32),
           (2, 4, 2, 1024)]


# chunks hold whole Hadamard blocks (the comm layer's padding guarantees it)
SENDER_CASES = [(layout, h) for layout in LAYOUTS for h in (0, 32, 16, 8, 4)
                if layout[3] % max(h, 1) == 0]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("layout,hadamard", SENDER_CASES, ids=_ids)
def test_tlq_sender(layout, hadamard, bits, stochastic):
    blocks, dests, slices, chunk = layout
    for dtype in DTYPES.values():
        kc.check_tlq_sender(CPU, impl=ck, blocks=blocks, dests=dests, slices=slices,
                            chunk=chunk, bits=bits, group=64, hadamard=hadamard, dtype=dtype,
                            stochastic=stochastic, seed=SEEDS[1])


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("n_in,n_out", [(1, 1), (3, 1), (2, 2), (4, 2), (8, 4)], ids=_ids)
@pytest.mark.parametrize("bits_in,group_in,bits_out,group_out",
                         [(8, 64, 4, 64), (4, 64, 8, 64), (8, 128, 4, 64), (8, 32, 4, 64),
                          (8, 128, 4, 128)], ids=_ids)
def test_tlq_middle(bits_in, group_in, bits_out, group_out, n_in, n_out, stochastic):
    kc.check_tlq_middle(CPU, impl=ck, n_in=n_in, numel=1024, bits_in=bits_in,
                        group_in=group_in, n_out=n_out, bits_out=bits_out,
                        group_out=group_out, stochastic=stochastic, seed=SEEDS[0] + n_in)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("scale,accumulate", [(1.0, False), (1 / 3, False), (0.25, True)],
                         ids=["sum", "mean3", "mean4-add"])
@pytest.mark.parametrize("hadamard", [0, 32, 16, 8, 2], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("bits,n_in", [(4, 1), (4, 3), (8, 2), (4, 8)], ids=_ids)
def test_tlq_receiver(bits, n_in, hadamard, scale, accumulate, dtype):
    kc.check_tlq_receiver(CPU, impl=ck, n_in=n_in, numel=512, bits=bits, group=64,
                          hadamard=hadamard, scale=scale, accumulate=accumulate,
                          dtype=DTYPES[dtype], seed=n_in)


@pytest.mark.parametrize("bits", [4, 8])
def test_nonfinite_groups(bits):
    """NaN/Inf inputs give NaN scales exactly where the reference has them, and NaN groups
    on the wire come out NaN (never hidden), as in the reference."""
    kc.check_qwd_sender(CPU, impl=ck, numel=192, bits=bits, group=64,
                        replica_dtype=torch.bfloat16, stochastic=True, seed=1, nonfinite=True)
    kc.check_tlq_sender(CPU, impl=ck, blocks=2, dests=2, slices=1, chunk=64, bits=bits,
                        group=64, hadamard=32, dtype=torch.float32, stochastic=False, seed=1,
                        nonfinite=True)
    kc.check_tlq_middle(CPU, impl=ck, n_in=3, numel=256, bits_in=8, group_in=64, n_out=2,
                        bits_out=bits, group_out=64, stochastic=True, seed=5, nan_group=2)
    kc.check_tlq_receiver(CPU, impl=ck, n_in=2, numel=256, bits=bits, group=64, hadamard=32,
                          scale=0.5, accumulate=True, dtype=torch.bfloat16, seed=5,
                          nan_group=1)
    kc.check_qwd_receiver(CPU, impl=ck, world=2, shard=128, bits=bits, group=64,
                          replica_dtype=torch.bfloat16, accumulate=True, seed=5, nan_group=1)


def test_noncontiguous_inputs_are_read_in_order():
    """A strided input is read as its flattened values (the kernels copy it first)."""
    base = torch.randn(256, 2)
    a = torch.empty(fmt.message_nbytes(256, 4, 64), dtype=torch.uint8)
    b = torch.empty_like(a)
    ref.tlq_sender(base[:, 0], a, num_dests=1, blocks_per_dest=1, slices=1, bits=4,
                   group_size=64, hadamard_block=32, stochastic=True, seed=3)
    ck.tlq_sender(base[:, 0], b, num_dests=1, blocks_per_dest=1, slices=1, bits=4,
                  group_size=64, hadamard_block=32, stochastic=True, seed=3)
    assert torch.equal(a, b)


def test_errors_match_the_other_kernels():
    wire = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="4-byte aligned"):
        ck.qwd_sender(torch.randn(64), None, wire[1:], bits=4, group_size=64,
                      stochastic=False, seed=0)
    with pytest.raises(ValueError, match="replica must be contiguous"):
        ck.qwd_receiver(wire, torch.zeros(256, 2)[:, 0], world=1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="holds 16 elements, not a multiple of "
                                         "hadamard_block=32"):
        ck.tlq_sender(torch.randn(256), wire, num_dests=4, blocks_per_dest=4, slices=1,
                      bits=4, group_size=64, hadamard_block=32, stochastic=False, seed=0)
    with pytest.raises(ValueError, match="must divide one another"):
        ck.tlq_middle(wire, wire, n_in=1, numel=192, bits_in=8, group_size_in=64, n_out=1,
                      bits_out=8, group_size_out=96, stochastic=False, seed=0)
    with pytest.raises(ValueError, match="dtype torch.float64: use float32, bfloat16 or"):
        ck.qwd_sender(torch.randn(64, dtype=torch.float64), None, wire, bits=4,
                      group_size=64, stochastic=False, seed=0)


def test_cpu_backend_refuses_other_devices():
    with pytest.raises(ValueError, match="the CPU kernel backend takes CPU tensors, got meta"):
        resolve_backend("cpu", torch.empty(1, device="meta"))


# ------------------------------------------------------------------------------ building


def test_library_name_depends_on_source_flags_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv(ck.CACHE_ENV, str(tmp_path))
    cc = ck._compiler()
    first = ck._library_path(cc)
    assert first.parent == tmp_path and first.name.startswith("cpu_kernels-")
    monkeypatch.setattr(ck, "_cpu_flags", lambda: "flags : sse2")
    assert ck._library_path(cc) != first  # another CPU shares the cache folder
    monkeypatch.setattr(ck, "CFLAGS", ck.CFLAGS + ("-DX",))
    assert len({first, ck._library_path(cc)}) == 2


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_concurrent_first_use_builds_once(tmp_path):
    """Four processes starting together (the ranks of a node) share one build."""
    env = {**os.environ, ck.CACHE_ENV: str(tmp_path)}
    code = ("from megatron.sdp4bit.quantization import cpu_kernels as ck\n"
            "assert ck.unavailable_reason() is None, ck.unavailable_reason()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert len(list(tmp_path.glob("*.so"))) == 1
    assert not list(tmp_path.glob("tmp*"))  # no half-written library left behind


def test_without_a_compiler_the_reference_runs_after_one_warning(tmp_path):
    env = {**os.environ, ck.CACHE_ENV: str(tmp_path), "CC": "no-such-cc",
           "PATH": str(tmp_path)}  # no cc, gcc or clang either
    done = _python("""
        import warnings, torch
        from megatron.sdp4bit.quantization import ops, reference, format as fmt
        x = torch.randn(256)
        outs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                out = torch.empty(fmt.message_nbytes(256, 4, 64), dtype=torch.uint8)
                ops.qwd_sender(x, None, out, bits=4, group_size=64, stochastic=True, seed=1)
                outs.append(out)
        expected = torch.empty_like(outs[0])
        reference.qwd_sender(x, None, expected, bits=4, group_size=64, stochastic=True, seed=1)
        assert all(torch.equal(o, expected) for o in outs)
        assert len(caught) == 1, [str(w.message) for w in caught]
        print(caught[0].message)
        try:
            ops.qwd_sender(x, None, out, bits=4, group_size=64, stochastic=True, seed=1,
                           backend="cpu")
        except ImportError as err:
            print(err)
    """, env)
    assert done.returncode == 0, done.stderr
    warning, error = done.stdout.strip().splitlines()
    assert warning == ("SDP4Bit CPU kernels unavailable (no C compiler found (set CC, or "
                       "install gcc)); the slower torch references run instead")
    assert error.startswith("the CPU kernel backend was requested but cannot run: no C "
                            "compiler found")


def test_a_failing_compiler_is_named(tmp_path):
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'fakecc: broken' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    env = {**os.environ, ck.CACHE_ENV: str(tmp_path / "cache"), "CC": str(fake)}
    done = _python("""
        from megatron.sdp4bit.quantization import cpu_kernels as ck
        print(ck.unavailable_reason())
    """, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{fake} failed to compile cpu_kernels.c: fakecc: broken"


def test_ops_dispatch_to_cpu_kernels_by_default():
    x = torch.randn(4096)
    a = torch.empty(fmt.message_nbytes(4096, 4, 128), dtype=torch.uint8)
    b = torch.empty_like(a)
    for backend, out in (("torch", a), ("auto", b)):
        ops.tlq_sender(x, out, num_dests=2, blocks_per_dest=2, slices=1, bits=4,
                       group_size=128, hadamard_block=32, stochastic=True, seed=9,
                       backend=backend)
    assert torch.equal(a, b)
