#!/usr/bin/env python
"""Train the same small GPT once per quantization method and compare the loss curves.

    python tools/loss_compare.py                                  # all 7 methods, ~25 min on 2 cores
    python tools/loss_compare.py --methods baseline SDP4Bit --train-iters 50
    python tools/loss_compare.py --report-only                    # re-read the runs, rewrite the report
    python tools/loss_compare.py -- --seed 7                      # flags after -- go to pretrain_gpt.py

Every method runs ``pretrain_gpt.py`` under ``torchrun --standalone --nproc-per-node 4`` with
``--dp-ranks-per-node 2`` (2 simulated nodes x 2 ranks, so both gradient hops carry traffic),
the same seed, data, model and schedule; only the SDP4Bit flags differ. Each run's
``--metrics-jsonl`` is read back and ``<out-dir>/loss_curves.md`` and ``.json`` are written:
training loss at selected iterations, validation loss at each evaluation, and the final
validation loss of each method next to the baseline's (absolute and relative difference).
This is the measurement behind the paper's Table 1 claim (SDP4Bit's loss matches the
unquantized baseline), at toy scale on CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from summarize_metrics import read_metrics  # noqa: E402  (sibling tool, not a package)

_TLQ = ["--quantized-gradients", "--gq-group-size-intra", "128", "--gq-group-size-inter", "128"]
_QWD = ["--quantized-weights"]
# Method name -> its SDP4Bit flags (the paper's Table 1 columns plus ULq, ZeRO++'s 4-bit/4-bit).
METHODS: dict[str, list[str]] = {
    "baseline": [],
    "qW": _QWD + ["--weight-quantization-mode", "direct"],
    "qWD": _QWD,
    "TLq": _TLQ,
    "ULq": _TLQ + ["--gradient-quantization-bits-intra", "4"],
    "TLq-HS": _TLQ + ["--hadamard-transform"],
    "SDP4Bit": _QWD + _TLQ + ["--hadamard-transform"],
}

NPROC = 4
DP_RANKS_PER_NODE = 2


def model_flags(train_iters: int, eval_interval: int, eval_iters: int, seed: int) -> list[str]:
    """The flags shared by every method: the quickstart's model, trained longer."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(train_iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "5",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--bf16", "--seed", str(seed), "--split", "98,2,0",
        "--use-distributed-optimizer", "--dp-ranks-per-node", str(DP_RANKS_PER_NODE),
        "--log-interval", "5", "--eval-interval", str(eval_interval), "--eval-iters", str(eval_iters),
    ]


def data_flags() -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_default_data.py"),
                          "--print-flags"], check=True, capture_output=True, text=True, cwd=ROOT)
    flags = out.stdout.split()
    if not flags:
        raise ValueError("tools/prepare_default_data.py --print-flags printed nothing: "
                         "run it by hand to see why the dataset could not be prepared")
    return flags


def command(method: str, metrics: Path, common: list[str], extra: list[str]) -> list[str]:
    return ["torchrun", "--standalone", "--nproc-per-node", str(NPROC), "pretrain_gpt.py",
            *common, *METHODS[method], "--metrics-jsonl", str(metrics), *extra]


def run_method(method: str, run_dir: Path, cmd: list[str]) -> float:
    """Train one method, its console output in ``run_dir/<method>/train.log``; seconds taken."""
    out = run_dir / method
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # pretrain_gpt.py appends: start clean
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS=os.environ.get("PYTHONWARNINGS", "ignore"))
    start = time.monotonic()
    with open(out / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{method}: pretrain_gpt.py exited with {proc.returncode}; "
                           f"see {out / 'train.log'}")
    return time.monotonic() - start


def select_iterations(logged: list[int], count: int) -> list[int]:
    """About ``count`` logged iterations spread evenly from the first to the last."""
    if not logged:
        raise ValueError("no logged training iteration to select from")
    if count < 2 or len(logged) <= count:
        return list(logged)
    step = (len(logged) - 1) / (count - 1)
    return sorted({logged[round(i * step)] for i in range(count)})


def compare(curves: dict[str, tuple[list[dict], list[dict]]], points: int,
            baseline: str = "baseline") -> dict:
    """Loss tables from each method's (training, validation) records.

    The training-loss iterations are those every method logged; final validation losses are
    compared with ``baseline``'s when it is among the methods.
    """
    if not curves:
        raise ValueError("no method to compare")
    common = None
    for name, (train, _) in curves.items():
        its = {r["iteration"] for r in train}
        common = its if common is None else common & its
    if not common:
        raise ValueError("the methods logged no training iteration in common: "
                         "run them with the same --log-interval and --train-iters")
    iters = select_iterations(sorted(common), points)
    train_loss = {name: {it: next(r["lm_loss"] for r in train if r["iteration"] == it)
                         for it in iters} for name, (train, _) in curves.items()}
    val_loss = {name: {r["iteration"]: r["val_lm_loss"] for r in val}
                for name, (_, val) in curves.items()}
    final = {}
    base = curves.get(baseline)
    base_val = base[1][-1] if base and base[1] else None
    for name, (train, val) in curves.items():
        entry = {"final_train_iteration": train[-1]["iteration"],
                 "final_train_loss": train[-1]["lm_loss"]}
        if val:
            entry["val_iteration"] = val[-1]["iteration"]
            entry["val_loss"] = val[-1]["val_lm_loss"]
            if base_val is not None:
                if base_val["iteration"] != val[-1]["iteration"]:
                    raise ValueError(f"{name}'s last evaluation is at iteration "
                                     f"{val[-1]['iteration']}, {baseline}'s at "
                                     f"{base_val['iteration']}: rerun both to the same length")
                diff = val[-1]["val_lm_loss"] - base_val["val_lm_loss"]
                entry["val_diff"] = diff
                entry["val_diff_pct"] = 100.0 * diff / base_val["val_lm_loss"]
        final[name] = entry
    return {"train_iterations": iters, "train_loss": train_loss, "val_loss": val_loss,
            "final": final}


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass  # not Linux: platform's answer stands
    import torch
    import triton
    from importlib.metadata import version
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__,
            "megatron_core": version("megatron-core")}


def _bar(value: float, lo: float, hi: float, width: int = 40) -> str:
    frac = 0.0 if hi <= lo else (value - lo) / (hi - lo)
    return "#" * max(1, round(frac * width))


def render_markdown(report: dict) -> str:
    res, meta = report["results"], report["meta"]
    methods = list(res["final"])
    lines = ["# Loss curves: SDP4Bit and its ablations against the unquantized baseline (CPU)", "",
             "Produced by `tools/loss_compare.py`: one training run per method, identical model, "
             "data, seed and schedule; only the communication quantization differs. "
             f"{NPROC} processes on one machine stand in for 2 nodes x {DP_RANKS_PER_NODE} GPUs "
             f"(`--dp-ranks-per-node {DP_RANKS_PER_NODE}`), so the weight all-gather and both "
             "gradient hops (intra 8-bit, inter 4-bit) carry quantized traffic. One seed: "
             "differences of a few tenths of a percent are within run-to-run noise at this scale.",
             "",
             f"- command: `{meta['command']}`",
             f"- per-method run (baseline shown): `{meta['example_run']}`",
             f"- machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores (CPU only, gloo)",
             f"- versions: python {meta['machine']['python']}, torch {meta['machine']['torch']}, "
             f"triton {meta['machine']['triton']}, megatron-core {meta['machine']['megatron_core']}",
             f"- date: {meta['date']}",
             "- wall time per method (s): " + ", ".join(
                 f"{m} {meta['seconds'][m]:.0f}" for m in methods if m in meta["seconds"]),
             "", "## Method flags", "", "| method | flags (added to the common ones) |", "|---|---|"]
    lines += [f"| {m} | `{' '.join(METHODS[m]) or '(none)'}` |" for m in methods]
    lines += ["", "## Final validation loss", "",
              "| method | val loss | diff to baseline | diff % | train loss, last log interval |",
              "|---|---|---|---|---|"]
    for m in methods:
        f = res["final"][m]
        diff = f"{f['val_diff']:+.4f}" if "val_diff" in f else "-"
        pct = f"{f['val_diff_pct']:+.2f}%" if "val_diff_pct" in f else "-"
        val = f"{f['val_loss']:.4f}" if "val_loss" in f else "-"
        lines.append(f"| {m} | {val} | {diff} | {pct} | {f['final_train_loss']:.4f} |")
    vals = [res["final"][m]["val_loss"] for m in methods if "val_loss" in res["final"][m]]
    if vals:
        lo, hi = min(vals) - 0.02, max(vals)
        lines += ["", "```", f"final validation loss (bars start at {lo:.3f})"]
        lines += [f"{m:>9s} {res['final'][m]['val_loss']:.4f} "
                  f"{_bar(res['final'][m]['val_loss'], lo, hi)}"
                  for m in methods if "val_loss" in res["final"][m]]
        lines.append("```")
    evals = sorted({it for v in res["val_loss"].values() for it in v})
    if evals:
        lines += ["", "## Validation loss at each evaluation", "",
                  "| method | " + " | ".join(f"it {it}" for it in evals) + " |",
                  "|---" * (len(evals) + 1) + "|"]
        for m in methods:
            row = [f"{res['val_loss'][m][it]:.4f}" if it in res["val_loss"][m] else "-"
                   for it in evals]
            lines.append(f"| {m} | " + " | ".join(row) + " |")
    its = res["train_iterations"]
    lines += ["", "## Training lm loss at selected iterations (mean over the log interval ending there)",
              "", "| method | " + " | ".join(f"it {it}" for it in its) + " |",
              "|---" * (len(its) + 1) + "|"]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(f"{res['train_loss'][m][it]:.4f}" for it in its) + " |")
    if report.get("note"):
        lines += ["", report["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="methods to run, in this order (default: all)")
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--points", type=int, default=9,
                        help="training-loss columns in the report (default 9)")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "loss_compare",
                        help="one subfolder per method with metrics.jsonl and train.log")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks",
                        help="where loss_curves.md and loss_curves.json go")
    parser.add_argument("--report-only", action="store_true",
                        help="do not train: rebuild the report from the runs in --run-dir")
    parser.add_argument("--note", default="", help="a line appended to the report")
    args = parser.parse_args(argv)
    if args.train_iters % args.eval_interval:
        parser.error(f"--train-iters {args.train_iters} is not a multiple of --eval-interval "
                     f"{args.eval_interval}: the final validation loss would not be at the end")

    common = model_flags(args.train_iters, args.eval_interval, args.eval_iters, args.seed)
    common += data_flags()
    seconds: dict[str, float] = {}
    for method in args.methods:
        cmd = command(method, args.run_dir / method / "metrics.jsonl", common, extra)
        if not args.report_only:
            print(f"== {method}: {' '.join(cmd)}", flush=True)
            seconds[method] = run_method(method, args.run_dir, cmd)
            print(f"   done in {seconds[method]:.0f} s", flush=True)
    curves = {m: read_metrics(args.run_dir / m / "metrics.jsonl") for m in args.methods}
    shown = " ".join(["python tools/loss_compare.py", *(argv or []), *(["--", *extra] if extra else [])])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    prev = args.out_dir / "loss_curves.json"
    if args.report_only and prev.exists():
        # The report describes the runs, not this re-read: keep their command, date and timings.
        old = json.loads(prev.read_text())["meta"]
        shown, date, seconds = old["command"], old["date"], old.get("seconds", {})
    report = {
        "meta": {"command": shown, "example_run": " ".join(command(args.methods[0],
                 args.run_dir / args.methods[0] / "metrics.jsonl", common, extra)).replace(
                     f"{ROOT}/", ""),  # paths relative to the repository in the report
                 "machine": machine(), "seconds": seconds, "seed": args.seed, "date": date,
                 "methods": {m: METHODS[m] for m in args.methods}},
        "results": compare(curves, args.points),
        "note": args.note,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "loss_curves.json").write_text(json.dumps(report, indent=1) + "\n")
    md = render_markdown(report)
    (args.out_dir / "loss_curves.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
