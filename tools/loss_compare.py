#!/usr/bin/env python
"""Train the same small GPT once per quantization method and compare the loss curves.

    python tools/loss_compare.py                                  # all 7 methods, ~25 min on 2 cores
    python tools/loss_compare.py --methods baseline SDP4Bit --train-iters 50
    python tools/loss_compare.py --noise-seeds 1235 1236 1237     # + the baseline at 3 more seeds
    python tools/loss_compare.py --report-only                    # re-read the runs, rewrite the report
    python tools/loss_compare.py --from-json benchmarks/loss_curves.json   # redraw a recorded report
    python tools/loss_compare.py -- --seed 7                      # flags after -- go to pretrain_gpt.py

Every method runs ``pretrain_gpt.py`` under ``torchrun --standalone --nproc-per-node 4`` with
``--dp-ranks-per-node 2`` (2 simulated nodes x 2 ranks, so both gradient hops carry traffic),
the same seed, data, model and schedule; only the SDP4Bit flags differ. ``--noise-seeds``
adds baseline runs that differ only in ``--seed``: their spread is the seed-to-seed noise
every difference is to be read against. Each run's ``--metrics-jsonl`` is read back and
``loss_curves.md``, ``.json`` and ``.png`` are written to ``--run-dir`` (and to
``benchmarks/`` only with ``--write-results``): training loss at selected iterations,
validation loss at each evaluation, the final validation loss of each method next to the
baseline's (absolute and relative difference) and next to the noise band, and the picture
of all of it. This is the measurement behind the paper's Table 1 claim (SDP4Bit's loss
matches the unquantized baseline), at toy scale on CPU.
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

from megatron.sdp4bit.training.cli.methods import METHOD_FLAGS
from megatron.sdp4bit.training.observe.metrics_file import read_metrics
from megatron.sdp4bit.training.observe.plots import pyplot, save_small

ROOT = Path(__file__).resolve().parent.parent

# Method name -> its SDP4Bit flags (the paper's Table 1 columns plus ULq, ZeRO++'s 4-bit/4-bit;
# not the study's extra rows: qWD-rounded and SDP4Bit's -EF / -2bit variants).
METHODS: dict[str, list[str]] = {m: f for m, f in METHOD_FLAGS.items()
                                 if m != "qWD-rounded" and not m.startswith("SDP4Bit-")}

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


def noise_dir(seed: int) -> str:
    """The run folder of the baseline trained with another ``seed``."""
    return f"baseline-seed{seed}"


def run_method(name: str, run_dir: Path, cmd: list[str]) -> float:
    """Train one run, its console output in ``run_dir/<name>/train.log``; seconds taken."""
    out = run_dir / name
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)  # pretrain_gpt.py appends: start clean
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    start = time.monotonic()
    with open(out / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: pretrain_gpt.py exited with {proc.returncode}; "
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
            "final": final, "curves": {name: curve(train) for name, (train, _) in curves.items()}}


def curve(train: list[dict]) -> dict[str, list]:
    """Every logged training loss of a run (the picture draws all of them)."""
    return {"iteration": [r["iteration"] for r in train], "lm_loss": [r["lm_loss"] for r in train]}


def noise_band(baseline: tuple[list[dict], list[dict]], seed: int,
               others: dict[int, tuple[list[dict], list[dict]]]) -> dict:
    """The baseline's seed-to-seed spread: its final validation loss at ``seed`` and at every
    seed of ``others`` (baseline runs that differ only in ``--seed``), their range, and each
    run's training curve. Seeds are strings (JSON object keys)."""
    runs = {seed: baseline, **others}
    final, last_its = {}, set()
    for s, (_, val) in runs.items():
        if not val:
            raise ValueError(f"the baseline at seed {s} logged no validation loss")
        final[str(s)] = val[-1]["val_lm_loss"]
        last_its.add(val[-1]["iteration"])
    if len(last_its) != 1:
        raise ValueError(f"the baseline runs end their evaluations at different iterations "
                         f"{sorted(last_its)}: rerun them to the same length")
    lo, hi, main = min(final.values()), max(final.values()), final[str(seed)]
    return {"seeds": [str(s) for s in runs], "val_iteration": last_its.pop(),
            "final_val": final, "min": lo, "max": hi, "spread_pct": 100.0 * (hi - lo) / main,
            "curves": {str(s): curve(train) for s, (train, _) in runs.items()}}


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


def _int_keys(table: dict[str, dict]) -> dict[str, dict[int, float]]:
    """Per-iteration tables with int keys again (JSON turns them into strings)."""
    return {name: {int(k): v for k, v in row.items()} for name, row in table.items()}


def _results(report: dict) -> dict:
    """``report["results"]`` as :func:`compare` returns it, also after a JSON round trip; a
    report without full curves (older) gets them from its selected iterations."""
    res = dict(report["results"])
    res["train_loss"] = _int_keys(res["train_loss"])
    res["val_loss"] = _int_keys(res["val_loss"])
    if "curves" not in res:
        res["curves"] = {m: {"iteration": list(row), "lm_loss": list(row.values())}
                         for m, row in res["train_loss"].items()}
    return res


def render_markdown(report: dict) -> str:
    res, meta = _results(report), report["meta"]
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
             "- wall time per run (s): " + ", ".join(
                 f"{m} {v:.0f}" for m, v in meta["seconds"].items()),
             *([f"- 1-minute load average of the machine before and after the runs: "
                f"{meta['load'][0]:.1f}, {meta['load'][1]:.1f} (wall times compare methods "
                "only on an otherwise idle machine)"] if meta.get("load") else []),
             "", "## Method flags", "", "| method | flags (added to the common ones) |", "|---|---|"]
    lines += [f"| {m} | `{' '.join(METHODS[m]) or '(none)'}` |" for m in methods]
    band = report.get("noise")
    lines += ["", "## Final validation loss", "",
              "| method | val loss | diff to baseline | diff % | train loss, last log interval |"
              + (" inside the baseline's seed band |" if band else ""),
              "|---|---|---|---|---|" + ("---|" if band else "")]
    for m in methods:
        f = res["final"][m]
        diff = f"{f['val_diff']:+.4f}" if "val_diff" in f else "-"
        pct = f"{f['val_diff_pct']:+.2f}%" if "val_diff_pct" in f else "-"
        val = f"{f['val_loss']:.4f}" if "val_loss" in f else "-"
        row = f"| {m} | {val} | {diff} | {pct} | {f['final_train_loss']:.4f} |"
        if band:
            inside = "val_loss" in f and band["min"] <= f["val_loss"] <= band["max"]
            row += f" {'yes' if inside else 'no'} |"
        lines.append(row)
    if band:
        main = band["final_val"][band["seeds"][0]]
        lines += ["", "## Seed-to-seed noise of the baseline", "",
                  f"The baseline again with only `--seed` changed (it changes the initialization "
                  f"and the order of the samples). Final validation loss at iteration "
                  f"{band['val_iteration']}:", "", "| seed | val loss | diff to seed "
                  f"{band['seeds'][0]} |", "|---|---|---|"]
        lines += [f"| {s} | {v:.4f} | {100 * (v - main) / main:+.2f}% |"
                  for s, v in band["final_val"].items()]
        lines += ["", f"Band: {band['min']:.4f} to {band['max']:.4f}, a spread of "
                  f"{band['spread_pct']:.2f}% of the seed-{band['seeds'][0]} baseline. A method "
                  "whose loss lies inside it is not distinguishable from the baseline by this "
                  "experiment."]
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


def _smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average (shorter at the ends), so curves of noisy differences read."""
    half = window // 2
    return [sum(values[max(0, i - half):i + half + 1]) / len(values[max(0, i - half):i + half + 1])
            for i in range(len(values))]


def plot(report: dict, path: Path, smooth: int = 5) -> None:
    """Training loss of every method, its difference to the baseline (smoothed over
    ``smooth`` logged points) against the seed band, and the final validation losses."""
    plt = pyplot("loss_compare.py")
    res, band = _results(report), report.get("noise")
    methods = list(res["final"])
    fig, (ax_loss, ax_diff, ax_val) = plt.subplots(1, 3, figsize=(13.5, 3.9), dpi=80)
    base = res["curves"].get("baseline")
    skip = 0.1  # the first tenth of training falls from ~10.7: it would flatten the rest
    for i, m in enumerate(methods):
        c = res["curves"][m]
        start = next(k for k, it in enumerate(c["iteration"]) if it >= skip * c["iteration"][-1])
        style = dict(color=f"C{i}", linewidth=1.6 if m in ("baseline", "SDP4Bit") else 0.9)
        ax_loss.plot(c["iteration"][start:], c["lm_loss"][start:], label=m, **style)
        if base and m != "baseline" and c["iteration"] == base["iteration"]:
            diff = [a - b for a, b in zip(c["lm_loss"], base["lm_loss"])]
            ax_diff.plot(c["iteration"][start:], _smooth(diff, smooth)[start:], label=m, **style)
    if band and base:
        seeds = [s for s in band["seeds"] if band["curves"][s]["iteration"] == base["iteration"]]
        its = base["iteration"]
        start = next(k for k, it in enumerate(its) if it >= skip * its[-1])
        diffs = [_smooth([a - b for a, b in zip(band["curves"][s]["lm_loss"], base["lm_loss"])],
                         smooth) for s in seeds]
        lo = [min(d[k] for d in diffs) for k in range(len(its))]
        hi = [max(d[k] for d in diffs) for k in range(len(its))]
        ax_diff.fill_between(its[start:], lo[start:], hi[start:], color="0.8",
                             label=f"baseline, seeds {', '.join(seeds)}")
        losses = [band["curves"][s]["lm_loss"] for s in seeds]
        ax_loss.fill_between(its[start:], [min(v) for v in zip(*losses)][start:],
                             [max(v) for v in zip(*losses)][start:], color="0.85", zorder=0,
                             label="baseline seed range")
    ax_diff.axhline(0.0, color="black", linewidth=0.8)
    ax_loss.set(xlabel="iteration", ylabel="training lm loss", title="training loss")
    ax_diff.set(xlabel="iteration", ylabel="loss - baseline loss",
                title=f"difference to the baseline ({smooth}-point moving average)")
    vals = [(m, res["final"][m]["val_loss"]) for m in methods if "val_loss" in res["final"][m]]
    ax_val.plot([v for _, v in vals], range(len(vals)), "o", color="black")
    for k, (m, v) in enumerate(vals):
        ax_val.plot([v], [k], "o", color=f"C{methods.index(m)}")
    ax_val.set_yticks(range(len(vals)), [m for m, _ in vals], fontsize=8)
    ax_val.invert_yaxis()
    if band:
        ax_val.axvspan(band["min"], band["max"], color="0.85",
                       label=f"baseline, {len(band['seeds'])} seeds")
        ax_val.legend(fontsize=7)
    it = next((res["final"][m].get("val_iteration") for m, _ in vals), None)
    ax_val.set(xlabel="validation lm loss", title=f"final validation loss (iteration {it})")
    for ax in (ax_loss, ax_diff):
        ax.legend(fontsize=7, ncol=2)
    for ax in (ax_loss, ax_diff, ax_val):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    save_small(fig, path)
    plt.close(fig)


def write_report(report: dict, out_dir: Path) -> str:
    """loss_curves.json, .md and .png in ``out_dir``; returns the markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "loss_curves.json").write_text(json.dumps(report, indent=1) + "\n")
    md = render_markdown(report)
    (out_dir / "loss_curves.md").write_text(md)
    plot(report, out_dir / "loss_curves.png")
    return md


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="methods to run, in this order (default: all)")
    parser.add_argument("--noise-seeds", nargs="+", type=int, default=[], metavar="SEED",
                        help="also train the baseline with each of these seeds: the band of "
                        "seed-to-seed noise every difference is read against")
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-iters", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--points", type=int, default=9,
                        help="training-loss columns in the report (default 9)")
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "loss_compare",
                        help="one subfolder per run (metrics.jsonl, train.log) and the report")
    parser.add_argument("--write-results", action="store_true",
                        help="also write the report to benchmarks/ (the recorded results)")
    parser.add_argument("--report-only", action="store_true",
                        help="do not train: rebuild the report from the runs in --run-dir")
    parser.add_argument("--from-json", type=Path, metavar="REPORT",
                        help="do not train nor read runs: redraw REPORT's markdown and picture "
                        "into --run-dir (e.g. benchmarks/loss_curves.json)")
    parser.add_argument("--note", default="", help="a line appended to the report")
    args = parser.parse_args(argv)
    if args.train_iters % args.eval_interval:
        parser.error(f"--train-iters {args.train_iters} is not a multiple of --eval-interval "
                     f"{args.eval_interval}: the final validation loss would not be at the end")
    if args.noise_seeds and "baseline" not in args.methods:
        parser.error("--noise-seeds needs the baseline among --methods")
    if args.seed in args.noise_seeds:
        parser.error(f"--noise-seeds: {args.seed} is --seed itself; pass other seeds")

    if args.from_json:
        report = json.loads(args.from_json.read_text())
    else:
        report = train_and_compare(args, argv, extra)
    md = write_report(report, args.run_dir)
    written = [args.run_dir]
    if args.write_results:
        write_report(report, ROOT / "benchmarks")
        written.append(ROOT / "benchmarks")
    print(md)
    print("report (loss_curves.md, .json, .png) in " + " and ".join(map(str, written)))
    return 0


def train_and_compare(args: argparse.Namespace, argv: list[str], extra: list[str]) -> dict:
    """Train (unless ``--report-only``) and build the report from the runs' metrics."""
    common = model_flags(args.train_iters, args.eval_interval, args.eval_iters, args.seed)
    data = data_flags()
    runs = [(m, command(m, args.run_dir / m / "metrics.jsonl", common + data, extra))
            for m in args.methods]
    for seed in args.noise_seeds:
        flags = model_flags(args.train_iters, args.eval_interval, args.eval_iters, seed) + data
        runs.append((noise_dir(seed), command("baseline", args.run_dir / noise_dir(seed) /
                                              "metrics.jsonl", flags, extra)))
    seconds: dict[str, float] = {}
    load = [os.getloadavg()[0]]
    if not args.report_only:
        for k, (name, cmd) in enumerate(runs, start=1):
            print(f"== run {k}/{len(runs)}, {name}: {' '.join(cmd)}", flush=True)
            seconds[name] = run_method(name, args.run_dir, cmd)
            print(f"   done in {seconds[name]:.0f} s", flush=True)
    load.append(os.getloadavg()[0])
    curves = {m: read_metrics(args.run_dir / m / "metrics.jsonl") for m in args.methods}
    shown = " ".join(["python tools/loss_compare.py", *argv, *(["--", *extra] if extra else [])])
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    prev = args.run_dir / "loss_curves.json"
    if args.report_only and prev.exists():
        # The report describes the runs, not this re-read: keep their command, date and timings.
        old = json.loads(prev.read_text())["meta"]
        shown, date, seconds = old["command"], old["date"], old.get("seconds", {})
        load = old.get("load")
    report = {
        "meta": {"command": shown, "example_run": " ".join(runs[0][1]).replace(
                     f"{ROOT}/", ""),  # paths relative to the repository in the report
                 "machine": machine(), "seconds": seconds, "load": load, "seed": args.seed,
                 "date": date, "methods": {m: METHODS[m] for m in args.methods}},
        "results": compare(curves, args.points),
        "note": args.note,
    }
    if args.noise_seeds:
        others = {s: read_metrics(args.run_dir / noise_dir(s) / "metrics.jsonl")
                  for s in args.noise_seeds}
        report["noise"] = noise_band(curves["baseline"], args.seed, others)
    return report


if __name__ == "__main__":
    sys.exit(main())
