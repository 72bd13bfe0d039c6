"""The compiled CPU kernels against the torch references: the same bytes, always.

The CPU kernels are the production path of every CPU run (``KernelBackend.AUTO`` picks them
for CPU tensors), so they are checked bit for bit against the references over every layout,
bit width, rounding mode, Hadamard block and dtype, on sizes large enough to cross many
groups, and their element conversions over every half-precision value; then their build:
cached per source and machine, built once by concurrent processes, a private cache that
refuses a library another user could have planted, and a clear fallback (one warning per
process, the reference runs) when the library cannot be built or is refused.
"""

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.quantization import cpu_kernels as ck
from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization import reference as ref
from megatron.sdp4bit.quantization.backend import KernelBackend, resolve_backend
from dev import kernel_checks as kc

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
                                              (2, 64, 192), (2, 96, 192),
                                              (4, 2048, 3 * 2048), (8, 128, 8192)], ids=_ids)
def test_qwd_sender(bits, group, numel, replica, stochastic):
    for seed in SEEDS:
        kc.check_qwd_sender(CPU, impl=ck, numel=numel, bits=bits, group=group,
                            replica_dtype=DTYPES.get(replica), stochastic=stochastic,
                            seed=seed)


@pytest.mark.parametrize("replica", ["bf16", "fp16"])
def test_qwd_sender_of_rounded_main_weights(replica):
    """qWD's 'rounded-main' target: 16-bit main weights, zero differences in every group."""
    for seed in SEEDS:
        kc.check_qwd_sender(CPU, impl=ck, numel=4096, bits=4, group=2048,
                            replica_dtype=DTYPES[replica], stochastic=True, seed=seed,
                            rounded_main=True)


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("bits,group,world", [(4, 64, 1), (4, 64, 3), (8, 32, 3),
                                              (2, 64, 3), (2, 96, 2),
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
@pytest.mark.parametrize("bits", [2, 4, 8])
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
                          (8, 128, 2, 64), (4, 64, 2, 128), (2, 64, 8, 32),
                          (8, 128, 4, 128)], ids=_ids)
def test_tlq_middle(bits_in, group_in, bits_out, group_out, n_in, n_out, stochastic):
    kc.check_tlq_middle(CPU, impl=ck, n_in=n_in, numel=1024, bits_in=bits_in,
                        group_in=group_in, n_out=n_out, bits_out=bits_out,
                        group_out=group_out, stochastic=stochastic, seed=SEEDS[0] + n_in)


def test_tlq_middle_groups_not_a_power_of_two():
    """Groups of 96 (the Triton kernel pads them to 128 lanes): the same bytes here too."""
    for n_in, n_out, bits_out in ((1, 1, 8), (3, 2, 4), (2, 2, 2)):
        kc.check_tlq_middle(CPU, impl=ck, n_in=n_in, numel=384, bits_in=8, group_in=96,
                            n_out=n_out, bits_out=bits_out, group_out=96, stochastic=True,
                            seed=7, nan_group=1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("scale,accumulate", [(1.0, False), (1 / 3, False), (0.25, True)],
                         ids=["sum", "mean3", "mean4-add"])
@pytest.mark.parametrize("hadamard", [0, 32, 16, 8, 2], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("bits,n_in", [(2, 1), (2, 3), (4, 1), (4, 3), (8, 2), (4, 8)],
                         ids=_ids)
def test_tlq_receiver(bits, n_in, hadamard, scale, accumulate, dtype):
    kc.check_tlq_receiver(CPU, impl=ck, n_in=n_in, numel=512, bits=bits, group=64,
                          hadamard=hadamard, scale=scale, accumulate=accumulate,
                          dtype=DTYPES[dtype], seed=n_in)


@pytest.mark.parametrize("bits", [2, 4, 8])
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


# ------------------------------------------------------------------ element conversions


def _bits(t: torch.Tensor) -> list[int]:
    """The bit patterns of a float tensor, as unsigned integers."""
    width = t.element_size() * 8
    view = {16: torch.int16, 32: torch.int32}[width]
    return [v & ((1 << width) - 1) for v in t.view(view).tolist()]


def _floats(patterns: list[int]) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


def test_every_half_converts_to_the_float_torch_gives():
    """All 65536 half bit patterns: zeros, subnormals, normals and infinities bit for bit as
    torch's .float(); a NaN stays a NaN of its sign, quieted, its payload kept (the rule of
    the F16C and ARM instructions; torch's own NaN bits differ between its vectorized loop
    and its scalar tail, and the kernels' contract leaves NaN payloads open)."""
    half = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = torch.full((1 << 16,), 7.0)
    ck.convert(half, out)
    nan = torch.isnan(half)
    assert int(nan.sum()) == 2 * 1023
    expected, actual = _bits(half.float()), _bits(out)
    for h in range(1 << 16):
        if nan[h]:
            assert actual[h] == ((h & 0x8000) << 16) | 0x7FC00000 | ((h & 0x3FF) << 13), hex(h)
        else:
            assert actual[h] == expected[h], (hex(h), hex(actual[h]), hex(expected[h]))


def test_floats_round_to_the_nearest_half_ties_to_even():
    """fp32 -> fp16 at its edges: every half, every midpoint between neighbours (a tie: to
    the even one) and the floats either side of it, overflow to Inf from 65520 up, underflow
    through the subnormals to zero, fp32 subnormals; bit for bit as torch's .half()."""
    half = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = half[torch.isfinite(half)].double().unique()  # ascending, one zero
    mids = ((finite[1:] + finite[:-1]) / 2).float()  # exact: 12 significant bits
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    edges = torch.tensor([65504.0, 65519.99609375, 65520.0, 65536.0, 1e38, float("inf"),
                          2.0 ** -25, 2.0 ** -26, 2.0 ** -14 - 2.0 ** -25, 1e-45, 1e-40,
                          1.1754942e-38, 1.1754944e-38, 0.0])
    edges = torch.cat([edges, -edges])
    x = torch.cat([finite.float(), mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   edges, torch.nextafter(edges, up), torch.nextafter(edges, down)])
    out = torch.empty(x.numel(), dtype=torch.float16)
    ck.convert(x, out)
    assert _bits(out) == _bits(x.half())
    # the rules themselves, torch aside (sign bit first)
    cases = {65519.99609375: 0x7BFF, 65520.0: 0x7C00, 2.0 ** -25: 0x0000,
             float(torch.nextafter(torch.tensor(2.0 ** -25), up)): 0x0001,
             2.0 ** -24 * 1.5: 0x0002, 2.0 ** -24 * 2.5: 0x0002,  # ties to even
             2.0 ** -14 - 2.0 ** -25: 0x0400,  # the largest subnormal's tie: the smallest normal
             1.0 + 2.0 ** -11: 0x3C00, 1.0 + 3 * 2.0 ** -11: 0x3C02, -0.0: 0x8000,
             float("-inf"): 0xFC00, 1e-40: 0x0000}
    x = torch.tensor(list(cases))
    ck.convert(x, out[: x.numel()])
    assert _bits(out[: x.numel()]) == list(cases.values())


def test_random_floats_round_as_torch_rounds():
    """A million random fp32 bit patterns (every exponent, NaNs included) to fp16: bit for
    bit as torch's .half(), NaN payloads included (torch's vectorized rule: quiet, top bits
    of the payload kept, sign kept)."""
    g = torch.Generator().manual_seed(7)
    x = _floats(torch.randint(0, 1 << 32, (1 << 20,), generator=g, dtype=torch.int64).tolist())
    x = torch.cat([x, _floats([0x7F800001, 0xFF800001, 0x7FC00000, 0x7FFFFFFF, 0xFFA00000])])
    out = torch.empty(x.numel(), dtype=torch.float16)
    ck.convert(x, out)
    finite = ~torch.isnan(x)
    assert torch.equal(out[finite].view(torch.int16), x[finite].half().view(torch.int16))
    expected_nan = [((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x1FF)
                    for u in _bits(x[~finite])]
    assert _bits(out[~finite]) == expected_nan


def test_the_source_needs_no_half_precision_type():
    """GCC 11 on x86 (Ubuntu 22.04, RHEL 9) has no _Float16: the conversions are bit
    operations; building as strict C11 with warnings as errors must pass."""
    text = ck.SOURCE.read_text()
    assert "_Float16" not in text and "__fp16" not in text and "__bf16" not in text
    for cc in ("gcc-11", ck._compiler()):
        if not shutil.which(cc):
            continue
        flags = [f for f in ck.CFLAGS if f != "-std=gnu11"]
        done = subprocess.run([cc, "-std=c11", "-Wall", "-Wextra", "-Werror", *flags, "-o",
                               os.devnull, str(ck.SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (cc, done.stderr)


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
    """Four processes starting together (the ranks of a node) share one build, in a cache
    folder they create private (mode 0700)."""
    cache = tmp_path / "home" / "cache" / "sdp4bit"
    env = {**os.environ, ck.CACHE_ENV: str(cache)}
    code = ("from megatron.sdp4bit.quantization import cpu_kernels as ck\n"
            "assert ck.unavailable_reason() is None, ck.unavailable_reason()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    libraries = list(cache.glob("*.so"))
    assert len(libraries) == 1 and stat.S_IMODE(libraries[0].stat().st_mode) == 0o755
    assert not list(cache.glob("tmp*"))  # no half-written library left behind


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


def _fake_compiler(tmp_path: Path, stderr: str) -> Path:
    """A compiler that answers --version and fails every build, printing ``stderr``."""
    (tmp_path / "fake.err").write_text(stderr)
    fake = tmp_path / "fakecc"
    fake.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && exit 0\n"
                    f"cat '{tmp_path / 'fake.err'}' >&2\nexit 1\n")
    fake.chmod(0o755)
    return fake


def test_a_failing_compiler_is_named(tmp_path):
    """No line names an error: the last non-empty one is quoted."""
    fake = _fake_compiler(tmp_path, "fakecc: note: starting\nfakecc: broken\n\n")
    env = {**os.environ, ck.CACHE_ENV: str(tmp_path / "cache"), "CC": str(fake)}
    done = _python("""
        from megatron.sdp4bit.quantization import cpu_kernels as ck
        print(ck.unavailable_reason())
    """, env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{fake} failed to compile cpu_kernels.c: fakecc: broken"


GCC11_STDERR = """\
{src}: In function 'load_f32':
{src}:54:15: error: '_Float16' is not supported on this target
   54 |         const _Float16 *s = (const _Float16 *)src + off;
      |               ^~~~~~~~
{src}:73:9: error: '_Float16' is not supported on this target
"""


@pytest.fixture
def fresh(monkeypatch):
    """The library, its reason and its warning computed anew in this process, and again
    after the test (a real library already loaded stays loaded)."""
    monkeypatch.delenv("RANK", raising=False)
    caches = (ck._library, ck.unavailable_reason, ck._warn_once)
    for cached in caches:
        cached.cache_clear()
    yield
    for cached in caches:
        cached.cache_clear()


def test_the_warning_quotes_the_compilers_error_line(tmp_path, monkeypatch, fresh):
    """GCC opens with a context line ("In function ..."): the warning quotes the first line
    that names an error, the one a user can act on."""
    fake = _fake_compiler(tmp_path, GCC11_STDERR.format(src=ck.SOURCE))
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(ck.CACHE_ENV, str(tmp_path / "cache"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_backend("auto", torch.empty(1)) is KernelBackend.TORCH
    assert [str(w.message) for w in caught] == [
        f"SDP4Bit CPU kernels unavailable ({fake} failed to compile cpu_kernels.c: "
        f"{ck.SOURCE}:54:15: error: '_Float16' is not supported on this target); the slower "
        "torch references run instead"]


# ------------------------------------------------------------------ a private cache folder

OTHER_UID = 65534  # "nobody": another user, as root can make a file's owner


def _refusal(monkeypatch, cache: Path) -> str:
    """The reason the library at ``cache`` is refused (a build error expected)."""
    monkeypatch.setenv(ck.CACHE_ENV, str(cache))
    with pytest.raises(ck.BuildError) as err:
        ck._library.__wrapped__()
    return str(err.value)


PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
/* A planted library: its constructor runs when it is loaded, and leaves a mark. */
__attribute__((constructor)) static void planted(void) {
    const char *mark = getenv("SDP4BIT_TEST_MARK");
    FILE *f = mark ? fopen(mark, "a") : NULL;
    if (f) {
        fputs(NAME "\n", f);
        fclose(f);
    }
}
int sdp4bit_abi_version(void) { return -1; }
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> dict[str, Path]:
    """Two small libraries whose constructors append "good" or "evil" to $SDP4BIT_TEST_MARK."""
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED_C)
    libraries = {}
    for name in ("good", "evil"):
        libraries[name] = folder / f"{name}.so"
        subprocess.run([ck._compiler(), "-shared", "-fPIC", f'-DNAME="{name}"', "-o",
                        str(libraries[name]), str(folder / "planted.c")], check=True,
                       timeout=300)
    return libraries


@pytest.fixture
def mark(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "mark"
    monkeypatch.setenv("SDP4BIT_TEST_MARK", str(path))
    return path


def _plant(cache: Path, library: Path) -> Path:
    """Copy ``library`` into ``cache`` (made 0700) under the name the kernels would load."""
    cache.mkdir(mode=0o700, exist_ok=True)
    target = cache / ck._library_path(ck._compiler()).name
    shutil.copyfile(library, target)
    target.chmod(0o755)
    return target


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(ck.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_new_cache_folder_is_private_whatever_the_umask(cache):
    old = os.umask(0)
    try:
        fd = ck._open_cache_dir(cache)
    finally:
        os.umask(old)
    os.close(fd)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_an_existing_folder_only_the_user_writes_is_used(cache):
    """Caches made before the folder was private (0755) stay in use."""
    cache.mkdir(mode=0o755)
    cache.chmod(0o755)
    os.close(ck._open_cache_dir(cache))
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_folder_others_can_write_is_refused(monkeypatch, cache, planted, mark, mode):
    _plant(cache, planted["evil"])
    cache.chmod(mode)
    if os.geteuid() == 0:  # a group of others ("nogroup"), not root's private group
        os.chown(cache, -1, OTHER_UID)
    elif mode == 0o770 and trusted_paths._private_group(cache.stat().st_gid, os.geteuid()):
        pytest.skip("the folder's group is this user's private group, which may write it")
    assert _refusal(monkeypatch, cache) == (
        f"the cache folder {cache} is writable by group or others (mode {mode:04o}): "
        "refused; chmod 700 it")
    assert not mark.exists()


def test_a_symlinked_folder_is_refused(monkeypatch, tmp_path, planted, mark):
    real = tmp_path / "real"
    _plant(real, planted["evil"])
    (tmp_path / "link").symlink_to(real)
    assert _refusal(monkeypatch, tmp_path / "link") == (
        f"the cache folder {tmp_path / 'link'} is a symbolic link: refused; set "
        "SDP4BIT_CACHE_DIR to a folder of yours")
    assert not mark.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another user")
def test_a_folder_of_another_user_is_refused(monkeypatch, cache, planted, mark):
    _plant(cache, planted["evil"])
    os.chown(cache, OTHER_UID, -1)
    assert _refusal(monkeypatch, cache) == (
        f"the cache folder {cache} belongs to uid {OTHER_UID}, not to this user (uid "
        f"{os.geteuid()}): refused; set SDP4BIT_CACHE_DIR to a folder of yours")
    assert not mark.exists()


def test_a_library_others_can_write_is_refused(monkeypatch, cache, planted, mark):
    library = _plant(cache, planted["evil"])
    library.chmod(0o666)
    assert _refusal(monkeypatch, cache) == (
        f"the library {library} is writable by group or others (mode 0666): refused; "
        "delete it to rebuild")
    assert not mark.exists()


def test_a_symlinked_library_is_refused(monkeypatch, cache, planted, mark):
    library = _plant(cache, planted["evil"])
    library.unlink()
    library.symlink_to(planted["evil"])  # a file of this user's, 0755: only the link is wrong
    assert _refusal(monkeypatch, cache) == (
        f"the library {library} is a symbolic link: refused; delete it to rebuild")
    assert not mark.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_library_of_another_user_is_refused(monkeypatch, cache, planted, mark):
    library = _plant(cache, planted["evil"])
    os.chown(library, OTHER_UID, -1)
    assert _refusal(monkeypatch, cache) == (
        f"the library {library} belongs to uid {OTHER_UID}, not to this user (uid "
        f"{os.geteuid()}): refused; delete it to rebuild")
    assert not mark.exists()


def test_the_file_checked_is_the_file_loaded(cache, planted, mark):
    """A library swapped in after the checks (a rename into the folder) is not the one
    loaded: the loader gets the checked file's descriptor, not its name."""
    library = _plant(cache, planted["good"])
    dir_fd = ck._open_cache_dir(cache)
    fd = ck._open_library(dir_fd, library)
    os.close(dir_fd)
    swap = cache / "swap.so"
    shutil.copyfile(planted["evil"], swap)
    os.replace(swap, library)
    ck._load(fd, library)  # fd stays open, as in _library: its number names this file
    assert mark.read_text() == "good\n"


def test_a_refused_cache_falls_back_with_one_warning(cache, fresh):
    """The documented fallback: one warning line naming the reason, the references run; the
    CPU backend asked for by name raises ImportError with the same reason."""
    cache.mkdir()
    cache.chmod(0o777)
    x = torch.randn(256)
    out, expected = (torch.empty(fmt.message_nbytes(256, 4, 64), dtype=torch.uint8)
                     for _ in range(2))
    ref.qwd_sender(x, None, expected, bits=4, group_size=64, stochastic=True, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            ops.qwd_sender(x, None, out, bits=4, group_size=64, stochastic=True, seed=1)
            assert torch.equal(out, expected)
    reason = (f"the cache folder {cache} is writable by group or others (mode 0777): refused; "
              "chmod 700 it")
    assert [str(w.message) for w in caught] == [
        f"SDP4Bit CPU kernels unavailable ({reason}); the slower torch references run instead"]
    with pytest.raises(ImportError) as err:
        ops.qwd_sender(x, None, out, bits=4, group_size=64, stochastic=True, seed=1,
                       backend="cpu")
    assert str(err.value) == (f"the CPU kernel backend was requested but cannot run: {reason}; "
                              "use KernelBackend.TORCH")
    assert list(cache.iterdir()) == []  # nothing built into it either


def test_ops_dispatch_to_cpu_kernels_by_default():
    x = torch.randn(4096)
    a = torch.empty(fmt.message_nbytes(4096, 4, 128), dtype=torch.uint8)
    b = torch.empty_like(a)
    for backend, out in (("torch", a), ("auto", b)):
        ops.tlq_sender(x, out, num_dests=2, blocks_per_dest=2, slices=1, bits=4,
                       group_size=128, hadamard_block=32, stochastic=True, seed=9,
                       backend=backend)
    assert torch.equal(a, b)
