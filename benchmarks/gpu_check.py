"""The steps of the GPU check (``bash dev/gpu_check.sh``), one process per step.

    python -m benchmarks.gpu_check STEP --results DIR [--rehearse]

Steps: ``env`` (device, driver, versions, the installed wheels' requirements),
``kernels`` (every Triton kernel bit for bit against the torch reference:
``tests/helpers/cuda_checks.py``), ``bandwidth`` (``benchmarks/gpu_bandwidth.py``),
``overhead`` (``benchmarks/gpu_overhead.py``) and ``report`` (``benchmarks/gpu_report.py``:
``gpu.md`` and ``gpu.json`` from what the others wrote). Each writes ``DIR/STEP.json``, so a
step that fails or runs out of time loses only its own figures. ``--rehearse`` runs the same
code on CPU: the kernels in Triton's interpreter (``TRITON_INTERPRET=1``) at tiny sizes and a
tiny model, to know the command works before a GPU is at hand; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
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
STEPS = ("env", "kernels", "bandwidth", "overhead", "report")


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
        commit=_run(["git", "rev-parse", "HEAD"]), cpu_count=os.cpu_count())
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
    """``tests/helpers/cuda_checks.py`` on the GPU for the five operations at once, one process
    each (a fresh machine compiles some 70 kernel variants: in parallel they fit the step's
    budget); in the rehearsal one process runs them all (2 cores). Then ``kernels.json``."""
    from tests.helpers import cuda_checks

    device = _device(rehearse).type
    extra = ["--device", "cpu", "--tiny", "--limit", "1"] if rehearse else []
    groups = [list(cuda_checks.CASES)] if rehearse else [[op] for op in cuda_checks.CASES]
    procs = [(group, subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.cuda_checks", *group, "--json",
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
    parser.add_argument("--results", type=Path, required=True, help="the results folder")
    parser.add_argument("--rehearse", action="store_true",
                        help="on CPU: interpreted kernels, tiny sizes, tiny model")
    parser.add_argument("--wheels", type=Path, help="env: the wheel folder installed")
    parser.add_argument("--write-results", action="store_true",
                        help="report: also write benchmarks/gpu.{md,json}")
    args = parser.parse_args(argv)
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
