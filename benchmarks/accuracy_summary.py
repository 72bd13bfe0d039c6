"""The accuracy study's runs read back, summarized and drawn (``benchmarks/accuracy_study.py``).

A study folder holds one folder per run, ``<method>/<label>/``, with the run's
``metrics.jsonl`` anywhere below it (the sample scripts nest it as
``accuracy/<model>/<script method>/metrics.jsonl``) or, for runs of another trainer, a
console log (``*.log`` / ``*.out``) with Megatron-LM's validation lines. The label says how
the run differs from the study's reference run:

* ``ref``: the study's ``--seed``, no rounding seed of its own (the baseline: it has no
  rounding noise);
* ``rs<R>``: the study's ``--seed`` with ``--rounding-seed R``: the same initialization and
  sample order, only the stochastic-rounding noise differs;
* ``seed<S>``: ``--seed S``: another initialization and sample order (context: the spread
  that the paper's single runs could not separate from a method's effect).

Per method, its ``ref`` and ``rs*`` runs give the mean and spread of the final validation
loss; its difference to the baseline is taken against the baseline's mean over its own
``ref`` and ``rs*`` runs (one run on CPU, where the baseline is deterministic), with the
standard error of both means combined. The baseline's ``ref`` and ``seed*`` runs give the
seed band.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from megatron.sdp4bit.training.observe.metrics_file import read_metrics
from megatron.sdp4bit.training.observe.plots import pyplot, save_small

LABEL = re.compile(r"^(ref|rs(\d+)|seed(\d+))$")
# Megatron-LM's (and pretrain_gpt.py's) validation line
VAL_LINE = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.eE+-]+)")


class StudyError(ValueError):
    """A study folder that cannot be summarized; the message names the path and the fix."""


def read_run(folder: Path, tokens_per_iteration: int | None = None) -> dict:
    """One run: ``{"val": {iteration: loss}, "tokens": {iteration: tokens}}``.

    From the single ``metrics.jsonl`` below ``folder`` (tokens from its ``consumed_tokens``),
    else from the single console log with validation lines (tokens = iteration x
    ``tokens_per_iteration``, which a log does not record).
    """
    metrics = sorted(folder.rglob("metrics.jsonl"))
    if len(metrics) > 1:
        raise StudyError(f"{folder}: {len(metrics)} metrics.jsonl files below it "
                         f"({', '.join(str(m.relative_to(folder)) for m in metrics)}): "
                         "keep one run per folder")
    if metrics:
        train, val = read_metrics(metrics[0])
        if not val:
            raise StudyError(f"{metrics[0]}: no validation loss was logged: run with "
                             "--eval-interval and --eval-iters")
        per_token = {r["iteration"]: r["consumed_tokens"] for r in train
                     if "consumed_tokens" in r}
        last = train[-1]
        rate = last["consumed_tokens"] / last["iteration"] if "consumed_tokens" in last else None
        losses = {r["iteration"]: r["val_lm_loss"] for r in val}
        tokens = {it: per_token.get(it, it * rate if rate else None) for it in losses}
        if None in tokens.values():
            raise StudyError(f"{metrics[0]}: no consumed_tokens in its training records")
        return {"val": losses, "tokens": tokens, "source": str(metrics[0])}
    logs = [p for p in sorted(folder.rglob("*")) if p.suffix in (".log", ".out")
            and VAL_LINE.search(p.read_text(errors="replace"))]
    if not logs:
        raise StudyError(f"{folder}: no metrics.jsonl and no log with validation lines below "
                         "it")
    if len(logs) > 1:
        raise StudyError(f"{folder}: {len(logs)} logs with validation lines below it: keep one")
    if tokens_per_iteration is None:
        raise StudyError(f"{logs[0]}: a console log does not record tokens: pass "
                         "--tokens-per-iteration (global batch x sequence length)")
    losses = {int(m.group(1)): float(m.group(2))
              for m in VAL_LINE.finditer(logs[0].read_text(errors="replace"))}
    return {"val": losses, "tokens": {it: it * tokens_per_iteration for it in losses},
            "source": str(logs[0])}


def read_study(root: Path, tokens_per_iteration: int | None = None) -> dict[str, dict]:
    """``{method: {label: run}}`` for every ``<method>/<label>/`` below ``root``."""
    if not root.is_dir():
        raise StudyError(f"{root}: no such folder")
    study: dict[str, dict] = {}
    for method_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for run_dir in sorted(p for p in method_dir.iterdir() if p.is_dir()):
            if not LABEL.match(run_dir.name):
                raise StudyError(f"{run_dir}: a run folder is named ref, rs<R> (rounding seed) "
                                 "or seed<S> (--seed)")
            study.setdefault(method_dir.name, {})[run_dir.name] = read_run(
                run_dir, tokens_per_iteration)
    if not study:
        raise StudyError(f"{root}: no <method>/<label>/ run folders in it")
    return study


def _stats(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"n": n, "mean": mean, "std": std, "stderr": std / math.sqrt(n),
            "min": min(values), "max": max(values)}


def summarize(study: dict[str, dict], baseline: str = "baseline") -> dict:
    """Means, spreads and differences to ``baseline`` of the final validation loss, and the
    per-evaluation curves (mean, min, max over a method's runs)."""
    if baseline not in study:
        raise StudyError(f"no {baseline}/ runs: the differences need the baseline")
    finals = {it for runs in study.values() for run in runs.values() for it in [max(run["val"])]}
    if len(finals) != 1:
        raise StudyError(f"the runs end their evaluations at different iterations "
                         f"{sorted(finals)}: train them to the same length")
    final_it = finals.pop()
    methods: dict[str, dict] = {}
    for name, runs in study.items():
        same_data = {k: r for k, r in runs.items() if not k.startswith("seed")}
        if not same_data:
            continue
        common = sorted(set.intersection(*(set(r["val"]) for r in same_data.values())))
        first = next(iter(same_data.values()))
        curve = []
        for it in common:
            s = _stats([r["val"][it] for r in same_data.values()])
            curve.append({"iteration": it, "tokens": first["tokens"][it], "mean": s["mean"],
                          "min": s["min"], "max": s["max"]})
        methods[name] = {"runs": {k: r["val"][final_it] for k, r in same_data.items()},
                         "final": _stats([r["val"][final_it] for r in same_data.values()]),
                         "curve": curve}
    if baseline not in methods:
        raise StudyError(f"{baseline}/ has only seed<S> runs: add its ref run (the study's "
                         "--seed) to take differences against")
    base = methods[baseline]["final"]
    for name, m in methods.items():
        f = m["final"]
        diff = f["mean"] - base["mean"]
        err = math.sqrt(f["stderr"] ** 2 + (base["stderr"] ** 2 if name != baseline else 0.0))
        m["diff"] = {"value": diff, "stderr": err, "pct": 100 * diff / base["mean"],
                     "pct_stderr": 100 * err / base["mean"]}
    seeds = {k: r["val"][final_it] for k, r in study[baseline].items()
             if k == "ref" or k.startswith("seed")}
    band = None
    if len(seeds) > 1:
        band = {"runs": seeds, **_stats(list(seeds.values()))}
        band["spread_pct"] = 100 * (band["max"] - band["min"]) / base["mean"]
        band["curves"] = {k: [{"iteration": it, "tokens": r["tokens"][it], "loss": v}
                              for it, v in sorted(r["val"].items())]
                          for k, r in study[baseline].items() if k in seeds}
    return {"final_iteration": final_it, "methods": methods, "baseline": baseline,
            "seed_band": band}


def render(summary: dict, header: list[str]) -> str:
    """The summary as markdown, after ``header`` (title, command, machine, ...)."""
    lines = list(header)
    lines += ["", f"## Final validation loss (iteration {summary['final_iteration']})", "",
              "Mean over a method's runs from the same initialization and sample order "
              "(`ref` and `--rounding-seed` runs); std = their standard deviation; the "
              "difference's +- is the standard error of the two means combined.", "",
              "| method | runs | mean | std | min | max | diff to baseline | diff % |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in summary["methods"].items():
        f, d = m["final"], m["diff"]
        lines.append(f"| {name} | {f['n']} | {f['mean']:.4f} | {f['std']:.4f} | "
                     f"{f['min']:.4f} | {f['max']:.4f} | {d['value']:+.4f} +- "
                     f"{d['stderr']:.4f} | {d['pct']:+.2f} +- {d['pct_stderr']:.2f} |")
    band = summary["seed_band"]
    if band:
        lines += ["", "## The baseline over --seed (other initialization and sample order)", "",
                  "| run | final validation loss |", "|---|---:|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in band["runs"].items()]
        lines += ["", f"Mean {band['mean']:.4f}, std {band['std']:.4f}, range "
                  f"{band['min']:.4f} to {band['max']:.4f} ({band['spread_pct']:.2f}% of the "
                  "baseline): the scale of a single-run comparison's noise."]
    its = [p["iteration"] for p in next(iter(summary["methods"].values()))["curve"]]
    lines += ["", "## Validation loss at each evaluation (mean over the runs)", "",
              "| method | " + " | ".join(f"it {it}" for it in its) + " |",
              "|---" * (len(its) + 1) + "|"]
    for name, m in summary["methods"].items():
        row = {p["iteration"]: p["mean"] for p in m["curve"]}
        lines.append(f"| {name} | " + " | ".join(
            f"{row[it]:.4f}" if it in row else "-" for it in its) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, loss_png: Path, diff_png: Path, skip: float = 0.2) -> None:
    """Validation loss against tokens (each method's min-max over its runs as a band, the
    baseline's --seed range in grey), and the final differences as bars with error bars
    (standard error); evaluations in the first ``skip`` of training are left out of the
    first picture (the early fall would flatten the rest)."""
    plt = pyplot("accuracy_study")
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=80)
    band = summary["seed_band"]
    last = summary["final_iteration"]
    if band:
        curves = list(band["curves"].values())
        its = sorted(set.intersection(*({p["iteration"] for p in c} for c in curves)))
        its = [it for it in its if it >= skip * last]
        at = [{p["iteration"]: p for p in c} for c in curves]
        ax.fill_between([at[0][it]["tokens"] for it in its],
                        [min(a[it]["loss"] for a in at) for it in its],
                        [max(a[it]["loss"] for a in at) for it in its], color="0.85",
                        label=f"baseline, {len(curves)} --seed values", zorder=0)
    for k, (name, m) in enumerate(summary["methods"].items()):
        pts = [p for p in m["curve"] if p["iteration"] >= skip * last]
        x = [p["tokens"] for p in pts]
        ax.plot(x, [p["mean"] for p in pts], color=f"C{k}", linewidth=1.2,
                label=f"{name} ({m['final']['n']} runs)")
        ax.fill_between(x, [p["min"] for p in pts], [p["max"] for p in pts], color=f"C{k}",
                        alpha=0.2, linewidth=0)
    ax.set(xlabel="tokens", ylabel="validation lm loss",
           title="validation loss (line: mean, band: min-max over rounding seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_small(fig, loss_png)
    plt.close(fig)

    names = [n for n in summary["methods"] if n != summary["baseline"]]
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=80)
    base = summary["methods"][summary["baseline"]]["final"]["mean"]
    if band:
        half = 100 * band["std"] / base
        ax.axhspan(-half, half, color="0.85", zorder=0, label="baseline +- 1 std over --seed")
    values = [summary["methods"][n]["diff"]["pct"] for n in names]
    errors = [summary["methods"][n]["diff"]["pct_stderr"] for n in names]
    ax.bar(range(len(names)), values, yerr=errors, capsize=4,
           color=[f"C{list(summary['methods']).index(n)}" for n in names])
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(ylabel="final validation loss - baseline (%)",
           title=f"difference to the baseline at iteration {last} (error bars: standard error)")
    ax.grid(True, axis="y", alpha=0.3)
    if band:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_small(fig, diff_png)
    plt.close(fig)
