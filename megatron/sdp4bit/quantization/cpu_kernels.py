"""Fused CPU kernels: ``cpu_kernels.c`` compiled on first use, called through ctypes.

Each function has the signature and semantics of its namesake in :mod:`.reference` and
produces the same bytes (same random stream, codes, scales and sums: the C code repeats the
reference's fp32 operations in the same order; the unit tests compare them bit for bit).
They make one pass over memory on one thread, about 20-50x faster than the references,
which allocate a temporary per torch operation.

[Note: building the CPU kernels]
The first call compiles ``cpu_kernels.c`` (one C11 file, no dependencies, ~1 s) with the
system C compiler (``$CC``, else ``cc``/``gcc``/``clang``) into a shared library under
``$SDP4BIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/sdp4bit`` or ``~/.cache/sdp4bit``). The
library's name hashes the source, the flags, the compiler's version and this CPU's feature
flags, so a changed source, compiler or machine (a cluster's home directory is shared by
nodes of different CPUs) builds anew; several processes starting at once take a file lock
and build once. The compiler writes into a private temporary folder; the library is then
copied into the cache under a temporary name and renamed, so no reader sees half of one.
Flags: ``-O3 -march=native`` for the vector units of this CPU, and ``-ffp-contract=off``
with no ``-ffast-math``: no fused multiply-add and no reassociation, so every result is the
reference's IEEE result (``-fno-trapping-math`` and ``-fno-math-errno`` only drop
floating-point exception flags and ``errno``, which lets ``floorf`` vectorize; no value
changes). Half-precision values are converted by integer operations on their bits, so any
C11 compiler builds the file (GCC 11, the default of Ubuntu 22.04 and RHEL 9, has no
half-precision type on x86). ``pip install`` brings nothing: a C compiler is all it needs.
When the compiler fails, the warning quotes its first line naming an error.

[Note: the cache is private]
Loading a library runs its constructors in every rank, so a library another local user could
have written must never be loaded (a shared ``$SDP4BIT_CACHE_DIR`` or ``$XDG_CACHE_HOME``, a
group-writable home). The cache folder is created with mode 0700; a cache folder or library
that is a symbolic link, is not owned by this user, or is writable by group or others is
refused (the fallback below, its warning naming the path and the fix): the trust rule of
``megatron/sdp4bit/trusted_paths.py`` (root's files and this user's private group count as
this user's), without its allowance for links. The checks hold for
what is loaded, not merely for a name: the folder is opened with ``O_NOFOLLOW`` and checked
with ``fstat``, the library is opened through that descriptor with ``O_NOFOLLOW`` and checked
with ``fstat``, and the loader is given ``/proc/self/fd/N``, the very file checked. That
descriptor stays open: the loader knows a library by its name, and a reused number would
name another file. (Where ``/proc`` is missing the path is loaded, its folder private.)

When the library cannot be built or loaded (no compiler, a read-only cache, a refused cache,
...), :func:`available` is False, one warning line names why, once in every process that
falls back (each rank says so for itself: each is slowed), and ``KernelBackend.AUTO`` runs
the torch references on CPU tensors instead (same bits, slower); asking for
``KernelBackend.CPU`` explicitly raises ``ImportError`` with the reason.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import secrets
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.quantization import checks
from megatron.sdp4bit.quantization.hadamard import block_scale
from megatron.sdp4bit.quantization.rng import split_seed

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CACHE_ENV = "SDP4BIT_CACHE_DIR"
CFLAGS = ("-std=gnu11", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno",
          "-fno-trapping-math", "-fPIC", "-shared")
# x86: use the full width of AVX-512 where this CPU has it (GCC defaults to 256 bits).
if platform.machine() in ("x86_64", "AMD64"):
    CFLAGS += ("-mprefer-vector-width=512",)
ABI_VERSION = 2
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _u32, _int, _f32, _ptr = (ctypes.c_int64, ctypes.c_uint32, ctypes.c_int,
                                ctypes.c_float, ctypes.c_void_p)
_SIGNATURES = {
    "sdp4bit_convert": (_ptr, _int, _ptr, _int, _i64),
    "sdp4bit_qwd_sender": (_ptr, _int, _ptr, _int, _ptr, _i64, _i64, _int, _int, _u32, _u32),
    "sdp4bit_qwd_receiver": (_ptr, _ptr, _int, _i64, _i64, _i64, _int, _int),
    "sdp4bit_tlq_sender": (_ptr, _int, _ptr, _i64, _i64, _i64, _i64, _i64, _int, _i64, _f32,
                           _int, _u32, _u32),
    "sdp4bit_tlq_middle": (_ptr, _ptr, _i64, _i64, _int, _i64, _i64, _int, _i64, _int, _u32,
                           _u32),
    "sdp4bit_tlq_receiver": (_ptr, _ptr, _int, _i64, _i64, _i64, _int, _i64, _f32, _f32, _int,
                             _int),
}


class BuildError(RuntimeError):
    """The CPU kernels could not be built or loaded; the message says why."""


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sdp4bit"


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise BuildError("no C compiler found (set CC, or install gcc)")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def _library_path(cc: str) -> Path:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"{cc} --version failed: {err}") from None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), version.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def _compiler_error(stderr: str) -> str:
    """The line of a compiler's stderr that says what failed: the first that names an error
    (GCC opens with context lines such as "In function ..."), else the last non-empty one."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if "error" in line.lower():
            return line
    return lines[-1] if lines else "(no output)"


def _refuse_foreign(st: os.stat_result, what: str, path: Path, owner_fix: str,
                    mode_fix: str) -> None:
    """Refuse a cache entry that breaks the trust rule (``trusted_paths``: another user's, or
    writable by anyone else): code in it would run here."""
    found = trusted_paths.stat_problem(st)
    if found is not None:
        fix = owner_fix if found.startswith("belongs") else mode_fix
        raise BuildError(f"{what} {path} {found}: refused; {fix}")


def _open_cache_dir(folder: Path) -> int:
    """A descriptor of the cache folder, created with mode 0700 when missing; refused when it
    is a symbolic link, not this user's or writable by group or others."""
    created = False
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(folder, 0o700)
        created = True
    except FileExistsError:
        pass
    except OSError as err:
        raise BuildError(f"cannot create the cache folder {folder}: {err}") from None
    fix = f"set {CACHE_ENV} to a folder of yours"
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        if folder.is_symlink():
            raise BuildError(f"the cache folder {folder} is a symbolic link: refused; "
                             f"{fix}") from None
        raise BuildError(f"cannot open the cache folder {folder}: {err}") from None
    try:
        _refuse_foreign(os.fstat(fd), "the cache folder", folder, fix, "chmod 700 it")
        if created:  # exactly 0700, whatever the umask (which can only have removed bits)
            os.fchmod(fd, 0o700)
    except OSError as err:
        os.close(fd)
        raise BuildError(f"cannot use the cache folder {folder}: {err}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_library(dir_fd: int, path: Path) -> int | None:
    """A descriptor of the library ``path`` in the folder ``dir_fd``, ``None`` when there is
    none yet; refused when it is a symbolic link, not a file, not this user's or writable by
    group or others."""
    fix = "delete it to rebuild"
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        try:
            link = stat.S_ISLNK(os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
        except OSError:
            link = False
        if link:
            raise BuildError(f"the library {path} is a symbolic link: refused; {fix}") from None
        raise BuildError(f"cannot open {path}: {err}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BuildError(f"the library {path} is not a regular file: refused; {fix}")
        _refuse_foreign(st, "the library", path, fix, fix)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _build(cc: str, dir_fd: int, target: Path) -> None:
    """Compile into a private temporary folder, then copy into the cache folder ``dir_fd``
    under a temporary name and rename it to ``target``'s name."""
    import fcntl

    lock = os.open(target.with_suffix(".lock").name,
                   os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                   dir_fd=dir_fd)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then find it built
        try:
            os.stat(target.name, dir_fd=dir_fd, follow_symlinks=False)
            return  # built meanwhile (checked when opened)
        except FileNotFoundError:
            pass
        with tempfile.TemporaryDirectory(prefix="sdp4bit-build-") as private:
            out = os.path.join(private, target.name)
            result = subprocess.run([cc, *CFLAGS, "-o", out, str(SOURCE), "-lm"],
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise BuildError(f"{cc} failed to compile {SOURCE.name}: "
                                 f"{_compiler_error(result.stderr or result.stdout)}")
            with open(out, "rb") as f:
                data = f.read()
        tmp = f"tmp-{secrets.token_hex(8)}.so"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o700, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                os.fchmod(f.fileno(), 0o755)  # whatever the umask: not group/other-writable
            # atomic: a reader sees no half-written library
            os.replace(tmp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except FileNotFoundError:
                pass
            raise
    finally:
        os.close(lock)


def _load(fd: int, path: Path) -> ctypes.CDLL:
    """Load the library open on ``fd`` (checked), by its descriptor where /proc allows."""
    by_fd = f"/proc/self/fd/{fd}"
    return ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(path))


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """Build (once per machine) and load the library; raises :class:`BuildError`."""
    cc = _compiler()
    path = _library_path(cc)
    dir_fd = _open_cache_dir(path.parent)
    try:
        fd = _open_library(dir_fd, path)
        if fd is None:
            try:
                _build(cc, dir_fd, path)
            except (OSError, subprocess.SubprocessError) as err:
                raise BuildError(f"building {path} failed: {err}") from None
            fd = _open_library(dir_fd, path)
            if fd is None:
                raise BuildError(f"{path} is missing right after its build")
    finally:
        os.close(dir_fd)
    try:
        lib = _load(fd, path)  # fd stays open for good: see [Note: the cache is private]
    except OSError as err:
        os.close(fd)
        raise BuildError(f"cannot load {path}: {err}") from None
    if lib.sdp4bit_abi_version() != ABI_VERSION:
        raise BuildError(f"{path} is not ABI version {ABI_VERSION}: delete it to rebuild")
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """``None`` when the kernels load, else one line saying why they do not."""
    try:
        _library()
    except BuildError as err:
        return str(err)
    return None


def available(*, warn: bool = True) -> bool:
    """Whether the CPU kernels can run here; the first failure warns once (one line)."""
    reason = unavailable_reason()
    if reason is not None and warn:
        _warn_once(reason)
    return reason is None


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    # Every rank that falls back says so (training.noise lets this warning through on the
    # ranks it otherwise silences), naming its rank under torchrun.
    rank = os.environ.get("RANK")
    where = "" if rank is None else f" on rank {rank}"
    warnings.warn(f"SDP4Bit CPU kernels unavailable{where} ({reason}); the slower torch "
                  "references run instead", RuntimeWarning, stacklevel=3)


def _call(name: str, *args) -> None:
    try:
        lib = _library()
    except BuildError as err:
        raise ImportError(f"the CPU kernel backend was requested but cannot run: {err}; "
                          "use KernelBackend.TORCH") from None
    if getattr(lib, name)(*args) != 0:
        raise MemoryError(f"{name}: out of memory for its scratch buffer")


def _dtype(t: torch.Tensor, name: str) -> int:
    if t.device.type != "cpu":
        raise ValueError(f"the CPU kernels take CPU tensors; {name} is on {t.device}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}: use float32, bfloat16 or float16")
    return _DTYPES[t.dtype]


def convert(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst.copy_(src)`` through the kernels' own element conversions (every operation's
    loads and stores), for contiguous CPU tensors of float32, bfloat16 or float16."""
    if src.numel() != dst.numel() or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("convert takes two contiguous tensors of the same size")
    _call("sdp4bit_convert", src.data_ptr(), _dtype(src, "src"), dst.data_ptr(),
          _dtype(dst, "dst"), src.numel())


def qwd_sender(main_shard: torch.Tensor, replica_shard: torch.Tensor | None, out: torch.Tensor,
               *, bits: int, group_size: int, stochastic: bool, seed: int) -> None:
    """CPU version of :func:`..reference.qwd_sender` (same arguments and bytes)."""
    numel = checks.qwd_sender_sizes(main_shard, replica_shard, out, bits=bits,
                                    group_size=group_size, stochastic=stochastic)
    main = main_shard.reshape(-1).contiguous()
    replica = None if replica_shard is None else replica_shard.reshape(-1).contiguous()
    k0, k1 = split_seed(seed)
    _call("sdp4bit_qwd_sender", main.data_ptr(), _dtype(main, "main_shard"),
          None if replica is None else replica.data_ptr(),
          0 if replica is None else _dtype(replica, "replica_shard"), out.data_ptr(), numel,
          group_size, bits, int(stochastic), k0, k1)


def qwd_receiver(wire: torch.Tensor, replica: torch.Tensor, *, world: int, bits: int,
                 group_size: int, accumulate: bool = True) -> None:
    """CPU version of :func:`..reference.qwd_receiver` (same arguments and bytes)."""
    shard = checks.qwd_receiver_sizes(wire, replica, world=world, bits=bits,
                                      group_size=group_size)
    _call("sdp4bit_qwd_receiver", wire.data_ptr(), replica.data_ptr(),
          _dtype(replica, "replica"), world, shard, group_size, bits, int(accumulate))


def tlq_sender(inp: torch.Tensor, out: torch.Tensor, *, num_dests: int, blocks_per_dest: int,
               slices: int, bits: int, group_size: int, hadamard_block: int,
               stochastic: bool, seed: int) -> None:
    """CPU version of :func:`..reference.tlq_sender` (same arguments and bytes)."""
    chunk, _ = checks.tlq_sender_sizes(
        inp, out, num_dests=num_dests, blocks_per_dest=blocks_per_dest, slices=slices,
        bits=bits, group_size=group_size, hadamard_block=hadamard_block, stochastic=stochastic)
    flat = inp.reshape(-1).contiguous()
    k0, k1 = split_seed(seed)
    _call("sdp4bit_tlq_sender", flat.data_ptr(), _dtype(flat, "inp"), out.data_ptr(),
          num_dests, blocks_per_dest, slices, chunk, group_size, bits, hadamard_block,
          block_scale(hadamard_block) if hadamard_block else 1.0, int(stochastic), k0, k1)


def tlq_middle(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, numel: int,
               bits_in: int, group_size_in: int, n_out: int, bits_out: int,
               group_size_out: int, stochastic: bool, seed: int) -> None:
    """CPU version of :func:`..reference.tlq_middle` (same arguments and bytes)."""
    checks.tlq_middle_sizes(
        wire_in, out, n_in=n_in, numel=numel, bits_in=bits_in, group_size_in=group_size_in,
        n_out=n_out, bits_out=bits_out, group_size_out=group_size_out, stochastic=stochastic)
    k0, k1 = split_seed(seed)
    _call("sdp4bit_tlq_middle", wire_in.data_ptr(), out.data_ptr(), n_in, numel, bits_in,
          group_size_in, n_out, bits_out, group_size_out, int(stochastic), k0, k1)


def tlq_receiver(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                 group_size: int, hadamard_block: int, scale: float = 1.0,
                 accumulate: bool = False) -> None:
    """CPU version of :func:`..reference.tlq_receiver` (same arguments and bytes)."""
    numel = checks.tlq_receiver_sizes(wire_in, out, n_in=n_in, bits=bits,
                                      group_size=group_size, hadamard_block=hadamard_block)
    _call("sdp4bit_tlq_receiver", wire_in.data_ptr(), out.data_ptr(), _dtype(out, "out"),
          n_in, numel, group_size, bits, hadamard_block,
          block_scale(hadamard_block) if hadamard_block else 1.0, float(scale),
          int(scale != 1.0), int(accumulate))
