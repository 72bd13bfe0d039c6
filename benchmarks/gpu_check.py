"""The steps of the GPU check (``bash dev/gpu_check.sh``), one process per step.

    python -m benchmarks.gpu_check STEP --results DIR [--rehearse]
    python -m benchmarks.gpu_check stamp

Steps: ``env`` (device, driver, versions, the project's commit, the installed wheels'
requirements), ``kernels`` (every Triton kernel bit for bit against the torch reference:
``dev/cuda_checks.py``, run as a process), ``bandwidth`` (``benchmarks/gpu_bandwidth.py``),
``overhead`` (``benchmarks/gpu_overhead.py``) and ``report`` (``benchmarks/gpu_report.py``:
``gpu.md`` and ``gpu.json`` from what the others wrote). Each writes ``DIR/STEP.json``, so a
step that fails or runs out of time loses only its own figures. ``--rehearse`` runs the same
code on CPU: the kernels in Triton's interpreter (``TRITON_INTERPRET=1``) at tiny sizes and a
tiny model, to know the command works before a GPU is at hand; its figures mean nothing.

[Note: the commit of a copied tree]
The machine that runs the check may get a copy of the working tree without ``.git`` (the
borrowed GPU machine does: tracked files and untracked ones git does not ignore). ``stamp``,
run in the checkout before the copy (``bash dev/gpu_check.sh --stamp``), writes :data:`STAMP`:
the commit, whether the tree had changes git sees (modified or untracked files), and git's
hash of the bytes of every tracked file as the tree holds it then (uncommitted changes
included). Without ``.git`` the env step believes the stamp only if every listed file still
has its hash (a stamp from another state of the tree does not match), and the report then
says "unknown" rather than a wrong commit; in a checkout git answers and the stamp is not
read.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("env", "kernels", "bandwidth", "overhead", "report", "stamp")
# The five fused operations, each checked by dev/cuda_checks.py in its own process (its CASES;
# benchmarks import nothing of dev/, tests/unit/test_gpu_check.py compares the two)
KERNELS = ("qwd_sender", "qwd_receiver", "tlq_sender", "tlq_middle", "tlq_receiver")
STAMP = "dev/gpu_check_stamp.json"  # [Note: the commit of a copied tree]


def _device(rehearse: bool) -> torch.device:
    if rehearse:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--rehearse runs the kernels in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 (dev/gpu_check.sh does)")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or rehearse on this one with "
                         "--rehearse")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: on CUDA the kernels must be compiled")
    return torch.device("cuda")


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                              cwd=root)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _blob_hash(path: Path) -> str:
    """git's object id of the file's bytes (``git hash-object``)."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _dirty(root: Path) -> bool | None:
    """Whether the checkout has changes git sees (modified, staged or untracked files; the
    stamp itself aside), None when git cannot tell."""
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    if status is None:
        return None
    return any(line[3:].strip() != STAMP for line in status.splitlines())


def write_stamp(root: Path) -> dict:
    """[Note: the commit of a copied tree]: write ``root/STAMP`` from git; refused outside a
    checkout."""
    head, files = _git(root, "rev-parse", "HEAD"), _git(root, "ls-files", "-z")
    dirty = _dirty(root)
    if head is None or files is None or dirty is None:
        raise SystemExit(f"{root} is not a git checkout: the stamp records its commit")
    # the working tree's bytes (a tracked file deleted in it is left out; a submodule is a
    # folder, not a file)
    blobs = {path: _blob_hash(root / path) for path in filter(None, files.split("\0"))
             if (root / path).is_file()}
    stamp = dict(commit=head.strip(), dirty=dirty, files=blobs)
    (root / STAMP).write_text(json.dumps(stamp, indent=0) + "\n")
    return stamp


def project_commit(root: Path) -> str | None:
    """The commit of the tree at ``root``, with " (with uncommitted changes)" when it has
    some; None when it cannot be known ([Note: the commit of a copied tree])."""
    if (root / ".git").exists():
        head, dirty = _git(root, "rev-parse", "HEAD"), _dirty(root)
        if head is None or dirty is None:
            return None
        return head.strip() + (" (with uncommitted changes)" if dirty else "")
    try:
        stamp = json.loads((root / STAMP).read_text())
        commit, dirty, files = stamp["commit"], stamp["dirty"], stamp["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for path, blob in files.items():
        try:
            if _blob_hash(root / path) != blob:
                return None
        except OSError:
            return None
    return commit + (" (with uncommitted changes)" if dirty else "")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def wheel_requirements(wheels: list[Path]) -> list[dict]:
    """Each wheel's unconditional requirements and whether this interpreter satisfies them
    (the wheels are installed with ``--no-deps``: the image must hold the rest)."""
    from packaging.requirements import Requirement

    rows = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(name).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = _version(req.name)
            rows.append(dict(wheel=wheel.name, requires=str(req), installed=have,
                             ok=have is not None and req.specifier.contains(have,
                                                                            prereleases=True)))
    return rows


def env_step(rehearse: bool, wheels_dir: Path | None) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rehearsal=rehearse, python=platform.python_version(), executable=sys.executable,
        platform=platform.platform(), torch=torch.__version__, torch_cuda=torch.version.cuda,
        triton=triton_version, megatron_core=_version("megatron-core"),
        commit=project_commit(ROOT), cpu_count=os.cpu_count())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, multiprocessors=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}",
                    nvidia_smi=_run(["nvidia-smi", "--query-gpu=name,driver_version,"
                                     "memory.total", "--format=csv,noheader"]))
    else:
        info.update(device=f"CPU ({platform.machine()}), no CUDA device")
    wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir and wheels_dir.is_dir() else []
    info["wheels"] = [w.name for w in wheels]
    info["wheel_requirements"] = wheel_requirements(wheels)
    missing = [r for r in info["wheel_requirements"] if not r["ok"]]
    for row in missing:
        print(f"unsatisfied: {row['wheel']} requires {row['requires']}, installed "
              f"{row['installed']}")
    print(json.dumps({k: v for k, v in info.items() if k != "wheel_requirements"}, indent=1))
    return info


def kernels_step(rehearse: bool, results: Path) -> int:
    """``dev/cuda_checks.py`` on the GPU for the five operations at once, one process each (a
    fresh machine compiles every kernel variant the cases need: in parallel they fit the
    step's budget); in the rehearsal one process runs them all (2 cores). Then
    ``kernels.json``."""
    device = _device(rehearse).type
    extra = ["--device", "cpu", "--tiny", "--limit", "1"] if rehearse else []
    groups = [list(KERNELS)] if rehearse else [[op] for op in KERNELS]
    procs = [(group, subprocess.Popen(
        [sys.executable, "-m", "dev.cuda_checks", *group, "--json",
         str(results / f"kernels_{group[0]}.json"), *extra], cwd=ROOT)) for group in groups]
    ops, failed = [], False
    for group, proc in procs:
        code = proc.wait()
        failed |= code != 0
        part = results / f"kernels_{group[0]}.json"
        done = json.loads(part.read_text())["ops"] if part.exists() else []
        part.unlink(missing_ok=True)
        ops += done
        ops += [dict(op=op, cases=0, failures=1, seconds=None, failed=[dict(
            case={}, error=f"the check process exited {code} before this operation's end")])
            for op in group[len(done):]]
    (results / "kernels.json").write_text(
        json.dumps(dict(device=device, tiny=rehearse, ops=ops), indent=1) + "\n")
    return 1 if failed or any(r["failures"] for r in ops) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=STEPS)
    parser.add_argument("--results", type=Path,
                        help="the results folder (every step but stamp)")
    parser.add_argument("--rehearse", action="store_true",
                        help="on CPU: interpreted kernels, tiny sizes, tiny model")
    parser.add_argument("--wheels", type=Path, help="env: the wheel folder installed")
    parser.add_argument("--write-results", action="store_true",
                        help="report: also write benchmarks/gpu.{md,json}")
    args = parser.parse_args(argv)
    if args.step == "stamp":
        stamp = write_stamp(ROOT)
        print(f"wrote {STAMP}: commit {stamp['commit']}"
              + (", with uncommitted changes" if stamp["dirty"] else "")
              + f", {len(stamp['files'])} files")
        return 0
    if args.results is None:
        parser.error(f"the {args.step} step needs --results DIR")
    results = args.results.resolve()
    results.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        (results / f"{args.step}.json").write_text(json.dumps(result, indent=1) + "\n")

    if args.step == "env":
        save(env_step(args.rehearse, args.wheels))
        return 0
    if args.step == "kernels":
        return kernels_step(args.rehearse, results)
    if args.step == "bandwidth":
        from benchmarks import gpu_bandwidth

        gpu_bandwidth.run(args.rehearse, _device(args.rehearse), save)
        return 0
    if args.step == "overhead":
        from benchmarks import gpu_overhead

        save(gpu_overhead.run(args.rehearse, _device(args.rehearse), results))
        return 0
    from benchmarks import gpu_report

    if args.write_results and args.rehearse:
        raise SystemExit("--write-results: a rehearsal's figures are not GPU figures; "
                         "benchmarks/gpu.md is written only from a GPU run")
    report = gpu_report.build(results, args.rehearse)
    written = gpu_report.write(report, results)
    if args.write_results:
        written += gpu_report.write(report, ROOT / "benchmarks")
    out = os.environ.get("OUT")
    if out:
        for path in [results / "gpu.md", results / "gpu.json", *gpu_report.logs(results)]:
            shutil.copy2(path, Path(out) / path.name)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
