"""The GPU check's report: ``gpu.json`` (everything the steps wrote, with the commands) and
``gpu.md`` (the tables), from the results folder of ``bash dev/gpu_check.sh``.

A step's figures are missing from the report when the step failed or ran out of its time
budget; the steps table says which (exit 124: its budget ran out).
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

STEP_FILES = ("env", "kernels", "bandwidth", "overhead")
LOGS = ("gpu_check.log", "baseline_train.log")
COMMAND = "bash dev/gpu_check.sh"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(results: Path) -> list[dict]:
    """``steps.tsv``: one line per step that the shell ran: name, exit status, seconds, budget."""
    rows = []
    path = results / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, budget = line.split("\t")
            rows.append(dict(step=name, exit=int(rc), seconds=float(seconds),
                             budget_s=int(budget), timed_out=int(rc) in (124, 137)))
    return rows


def _gpu_tests(results: Path) -> dict | None:
    """pytest's JUnit XML of ``tests/gpu``: counts and each test's outcome."""
    path = results / "gpu_tests.xml"
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = f"{tag}: {(node.get('message') or '').splitlines()[0][:200]}" \
                    if node.get("message") else tag
        tests.append(dict(name=case.get("name"), seconds=float(case.get("time", 0)),
                          outcome=outcome))
    return dict(cases=tests, **{k: int(suite.get(k, 0)) for k in
                                ("tests", "failures", "errors", "skipped")})


def build(results: Path, rehearsal: bool) -> dict:
    flag = " --rehearse" if rehearsal else ""
    return dict(
        command=COMMAND + flag, rehearsal=rehearsal, env=_load(results / "env.json") or {},
        steps=_steps(results),
        kernels=_load(results / "kernels.json"), gpu_tests=_gpu_tests(results),
        bandwidth=_load(results / "bandwidth.json"), overhead=_load(results / "overhead.json"),
        commands={
            "kernels": "python -m dev.cuda_checks all"
                       + (" --device cpu --tiny --limit 1" if rehearsal else ""),
            "gpu_tests": "python -m pytest tests/gpu/test_training_cuda.py",
            "bandwidth": "python -m benchmarks.gpu_check bandwidth" + flag,
            "overhead": "python -m benchmarks.gpu_check overhead" + flag,
        })


def logs(results: Path) -> list[Path]:
    return [results / name for name in LOGS if (results / name).exists()]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _kernel_lines(k: dict | None) -> list[str]:
    if not k:
        return ["Not measured (the step failed or ran out of time: see the steps table).", ""]
    lines = ["| operation | cases | failures | seconds |", "|---|---:|---:|---:|"]
    lines += [f"| {r['op']} | {r['cases']} | {r['failures']} | {r['seconds']} |"
              for r in k["ops"]]
    for r in k["ops"]:
        lines += [f"- FAILED {r['op']}: `{json.dumps(f['case'])}`: {f['error'].splitlines()[-1]}"
                  for f in r["failed"]]
    return lines + [""]


def _bandwidth_lines(b: dict | None) -> list[str]:
    if not b:
        return ["Not measured (the step failed or ran out of time: see the steps table).", ""]
    plans = sorted({(r["backend"], r["warmup"], r["iters"]) for r in b["rows"]
                    if r["backend"] != "-"})
    copy = b.get("copy_gb_per_s")
    head = (f"Device copy bandwidth (`dst.copy_(src)` of the largest buffer, bytes read + "
            f"written): **{copy:.0f} GB/s**. " if copy else "No copy measured. ")
    head += (f"Worst Triton kernel at the largest bucket: "
             f"**{_pct(b.get('worst_triton_vs_copy'))}** of it (goal >= {_pct(b['goal'])}). "
             f"Timing: {b['timing']}; "
             + "; ".join(f"{p[0]}: {p[1]} warm-up, {p[2]} timed calls" for p in plans) + ".")
    lines = [head, "",
             "| bucket | operation | Triton ms | Triton GB/s | vs copy | torch ms | torch GB/s "
             "| vs copy | Triton speed-up |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    torch_rows = {(r["bucket"], r["op"]): r for r in b["rows"] if r["backend"] == "torch"}
    for r in b["rows"]:
        if r["backend"] == "torch":
            continue
        t = torch_rows.get((r["bucket"], r["op"]))
        tcells = (f"{t['ms']:.3f} | {t['gb_per_s']:.0f} | {_pct(t['vs_copy'])} | "
                  f"{t['ms'] / r['ms']:.1f}x") if t else "- | - | - | -"
        lines.append(f"| {r['bucket']} | {r['op']} | {r['ms']:.3f} | {r['gb_per_s']:.0f} | "
                     f"{_pct(r['vs_copy'])} | {tcells} |")
    lines += [f"- skipped: {s['bucket']} ({s['backend']}): {s['reason']}" for s in b["skipped"]]
    return lines + [""]


def _overhead_lines(o: dict | None) -> list[str]:
    if not o:
        return ["Not measured (the step failed or ran out of time: see the steps table).", ""]
    base = o["baseline"]
    lines = [f"Model: {o['model']}, {base['parameters']:,} parameters. Baseline step "
             f"(forward, backward, optimizer; median of {len(base['steps_ms'])} after "
             f"{base['warmup_iterations']} warm-up): **{base['step_ms']:.1f} ms** "
             f"({base['tflops_per_gpu']} TFLOP/s).", "",
             f"Baseline command: `{base['command']}`", "",
             f"SDP4Bit's added work per rank and step ({o['backend']} kernels, "
             f"{o['ranks_per_node']} ranks per node; median of {o['iters']} timed runs of "
             "each phase):", "",
             "| DP | N x M | bucket (elements) | shard | phases (ms) | total (ms) | % of step |",
             "|---:|---|---:|---:|---|---:|---:|"]
    for r in o["dp"]:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items())
        lines.append(f"| {r['dp']} | {r['ranks_per_node']} x {r['nodes']} | {r['bucket']:,} | "
                     f"{r['shard']:,} | {phases} | {r['total_ms']:.2f} | "
                     f"**{r['percent_of_step']:.2f}%** |")
    return lines + [""]


def render(report: dict) -> str:
    env = report["env"]
    lines = ["# GPU check", ""]
    if report["rehearsal"]:
        lines += ["**REHEARSAL on CPU** (kernels in Triton's interpreter, tiny sizes, tiny "
                  "model): these figures only show that every step runs; they measure "
                  "nothing.", ""]
    lines += [f"- command: `{report['command']}` (docs/gpu.md)",
              f"- device: {env.get('device')}"
              + (f"; nvidia-smi: {env['nvidia_smi']}" if env.get("nvidia_smi") else ""),
              f"- versions: python {env.get('python')}, torch {env.get('torch')} (CUDA "
              f"{env.get('torch_cuda')}), triton {env.get('triton')}, megatron-core "
              f"{env.get('megatron_core')}",
              f"- commit: {env.get('commit') or 'unknown'}; date: {env.get('date')}", "",
              "## Steps", "", "| step | exit | seconds | budget (s) |", "|---|---:|---:|---:|"]
    lines += [f"| {s['step']} | {s['exit']}{' (out of time)' if s['timed_out'] else ''} | "
              f"{s['seconds']:.0f} | {s['budget_s']} |" for s in report["steps"]]
    lines += ["", "## 1. Kernels against the torch references (bit for bit)", "",
              f"`{report['commands']['kernels']}`", ""] + _kernel_lines(report["kernels"])
    t = report["gpu_tests"]
    lines += ["GPU tests (`tests/gpu/test_training_cuda.py`: 4 ranks sharing the GPU, every "
              "SDP4Bit flag, the Triton kernels against the torch references): "
              + ("not run" if t is None else
                 f"{t['tests']} tests, {t['failures']} failures, {t['errors']} errors, "
                 f"{t['skipped']} skipped"), ""]
    if t:
        lines += [f"- {x['name']}: {x['outcome']} ({x['seconds']:.0f} s)" for x in t["cases"]]
        lines.append("")
    lines += ["## 2. Bandwidth at the paper's bucket sizes", ""]
    lines += _bandwidth_lines(report["bandwidth"])
    lines += ["## 3. SDP4Bit's compute overhead in a training step", ""]
    lines += _overhead_lines(report["overhead"])
    return "\n".join(lines)


def write(report: dict, folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    (folder / "gpu.md").write_text(render(report))
    return [folder / "gpu.json", folder / "gpu.md"]
