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
  that the paper's single runs could not separate from a method's effect);
* ``init<S>``: ``--seed S`` with the study's seed as ``--train-data-seed``: another
  initialization (and dropout masks: ``--seed`` seeds the torch generator), the same sample
  order;
* ``order<S>``: ``--train-data-seed S``: the same initialization, another sample order.

Per method, its ``ref`` and ``rs*`` runs give the mean and spread of the final validation
loss; its difference to the baseline is taken against the baseline's mean over its own
``ref`` and ``rs*`` runs (one run on CPU, where the baseline is deterministic), with the
standard error of both means combined. The baseline's ``ref`` and ``seed*`` runs give the
seed band; its ``ref`` with its ``init*`` runs, and with its ``order*`` runs, split that band
into what the initialization and what the sample order move.

Rows of an earlier record (``carry``: its ``accuracy_study.json``) join the summary when
this study has no runs of that method or baseline label, provided this study's baseline
``ref`` run reproduces the record's bit for bit (final loss and every evaluation): the same
code path, data and initialization, so the rows share the reference they were measured
against.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

from megatron.sdp4bit.training.observe.metrics_file import read_metrics
from megatron.sdp4bit.training.observe.plots import pyplot, save_small

LABEL = re.compile(r"^(ref|rs(\d+)|seed(\d+)|init(\d+)|order(\d+))$")
SAME_DATA = re.compile(r"^(ref|rs\d+)$")  # the study's initialization and sample order
# the baseline's bands: label prefix -> what its runs vary
BANDS = {"seed": "initialization, dropout and sample order (--seed)",
         "init": "initialization and dropout (--seed, the same --train-data-seed)",
         "order": "sample order alone (--train-data-seed, the same --seed)"}
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
                raise StudyError(f"{run_dir}: a run folder is named ref, rs<R> (rounding seed), "
                                 "seed<S> (--seed), init<S> (--seed, the study's "
                                 "--train-data-seed) or order<S> (--train-data-seed)")
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


def _band(runs: dict[str, dict], prefix: str, base_mean: float) -> dict | None:
    """The ``ref`` run with the ``<prefix><S>`` runs of ``runs`` (``{label: {"final",
    "curve"}}``): their finals' statistics, range in % of ``base_mean``, and curves; None
    without a second run."""
    picked = {k: r for k, r in sorted(runs.items(), key=lambda kv: kv[0] != "ref")
              if k == "ref" or re.fullmatch(prefix + r"\d+", k)}  # ref first
    if "ref" not in picked or len(picked) < 2:
        return None
    finals = {k: r["final"] for k, r in picked.items()}
    band = {"runs": finals, **_stats(list(finals.values()))}
    band["spread_pct"] = 100 * (band["max"] - band["min"]) / base_mean
    band["curves"] = {k: r["curve"] for k, r in picked.items()}
    return band


def _carry(methods: dict, base_runs: dict, prior: dict, final_it: int, baseline: str
           ) -> list[str]:
    """Adds the rows and baseline runs of the earlier record ``prior`` that this study lacks
    (see the module docstring); returns the names carried over (``method`` or
    ``baseline/<label>``)."""
    old = prior["summary"]
    where = f"the carried record ({prior.get('date', 'undated')})"
    if old["final_iteration"] != final_it:
        raise StudyError(f"{where} ends at iteration {old['final_iteration']}, this study at "
                         f"{final_it}: carry rows of the same length only")
    ref = base_runs.get("ref")
    old_ref = (old.get("seed_band") or {}).get("curves", {}).get("ref")
    if ref is None or old_ref is None:
        raise StudyError(f"{where} and this study both need the baseline's ref run (its "
                         "curve) to carry rows over")
    now = [(p["iteration"], p["loss"]) for p in ref["curve"]]
    then = [(p["iteration"], p["loss"]) for p in old_ref]
    if now != then:
        here, there = next((a, b) for a, b in itertools.zip_longest(now, then) if a != b)
        raise StudyError(f"{where}: this study's baseline ref run does not reproduce the "
                         f"record's (iteration, loss) {there} (here {here}): another code "
                         "path, data or machine; rerun the rows instead of carrying them")
    carried = []
    for name, m in old["methods"].items():
        if name not in methods:
            methods[name] = {k: m[k] for k in ("runs", "final", "curve")}
            carried.append(name)
    for prefix in BANDS:  # the baseline's other runs, whichever band they make
        band = old.get(f"{prefix}_band") or {}
        for label, final in band.get("runs", {}).items():
            if label not in base_runs:
                base_runs[label] = {"final": final, "curve": band["curves"][label]}
                carried.append(f"{baseline}/{label}")
    return carried


def old_carried(record: dict) -> dict | None:
    """The provenance of the rows ``record`` itself carried over (None if it carried none)."""
    return (record.get("summary") or {}).get("carried")


def summarize(study: dict[str, dict], baseline: str = "baseline",
              carry: dict | None = None) -> dict:
    """Means, spreads and differences to ``baseline`` of the final validation loss, and the
    per-evaluation curves (mean, min, max over a method's runs); ``carry``: an earlier
    record whose rows join (module docstring)."""
    if baseline not in study:
        raise StudyError(f"no {baseline}/ runs: the differences need the baseline")
    finals = {it for runs in study.values() for run in runs.values() for it in [max(run["val"])]}
    if len(finals) != 1:
        raise StudyError(f"the runs end their evaluations at different iterations "
                         f"{sorted(finals)}: train them to the same length")
    final_it = finals.pop()
    methods: dict[str, dict] = {}
    for name, runs in study.items():
        same_data = {k: r for k, r in runs.items() if SAME_DATA.match(k)}
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
        raise StudyError(f"{baseline}/ has only seed<S>, init<S> or order<S> runs: add its "
                         "ref run (the study's --seed) to take differences against")
    base_runs = {k: {"final": r["val"][final_it],
                     "curve": [{"iteration": it, "tokens": r["tokens"][it], "loss": v}
                               for it, v in sorted(r["val"].items())]}
                 for k, r in study[baseline].items()}
    carried = _carry(methods, base_runs, carry, final_it, baseline) if carry else []
    methods = dict(sorted(methods.items()))
    base = methods[baseline]["final"]
    for name, m in methods.items():
        f = m["final"]
        diff = f["mean"] - base["mean"]
        err = math.sqrt(f["stderr"] ** 2 + (base["stderr"] ** 2 if name != baseline else 0.0))
        m["diff"] = {"value": diff, "stderr": err, "pct": 100 * diff / base["mean"],
                     "pct_stderr": 100 * err / base["mean"]}
    out = {"final_iteration": final_it, "methods": methods, "baseline": baseline,
           **{f"{prefix}_band": _band(base_runs, prefix, base["mean"]) for prefix in BANDS}}
    if carry:
        out["carried"] = {"names": carried, "date": carry.get("date"),
                          "command": carry.get("command"), "machine": carry.get("machine"),
                          "load_average": carry.get("load_average"),
                          # where the record's own carried rows came from, and so on
                          "earlier": old_carried(carry)}
    return out


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
    lines += render_bands(summary)
    its = [p["iteration"] for p in next(iter(summary["methods"].values()))["curve"]]
    lines += ["", "## Validation loss at each evaluation (mean over the runs)", "",
              "| method | " + " | ".join(f"it {it}" for it in its) + " |",
              "|---" * (len(its) + 1) + "|"]
    for name, m in summary["methods"].items():
        row = {p["iteration"]: p["mean"] for p in m["curve"]}
        lines.append(f"| {name} | " + " | ".join(
            f"{row[it]:.4f}" if it in row else "-" for it in its) + " |")
    return "\n".join(lines) + "\n"


def render_bands(summary: dict) -> list[str]:
    """The section that splits the baseline's --seed band into initialization and sample
    order (empty without init<S> or order<S> runs)."""
    bands = {p: summary.get(f"{p}_band") for p in BANDS}
    if not (bands["init"] or bands["order"]):
        return []
    lines = ["", "## What moves the baseline: initialization or sample order", "",
             "The baseline's final validation loss over runs that vary one thing from the "
             "`ref` run (`--seed` sets the initialization, the dropout masks and, without "
             "`--train-data-seed`, the training order; every run has the same held-out "
             "samples, `--eval-data-seed`).", "",
             "| what varies | runs | final validation loss of each | mean | std | range % |",
             "|---|---:|---|---:|---:|---:|"]
    for prefix, what in BANDS.items():
        b = bands[prefix]
        if b:
            each = ", ".join(f"{k} {v:.4f}" for k, v in b["runs"].items())
            lines.append(f"| {what} | {b['n']} | {each} | {b['mean']:.4f} | {b['std']:.4f} | "
                         f"{b['spread_pct']:.2f} |")
    if bands["init"] and bands["order"]:
        both = f" ({bands['seed']['std']:.4f} over both, --seed)" if bands["seed"] else ""
        lines += ["", f"With the held-out samples fixed, the standard deviation of the final "
                  f"loss is {bands['init']['std']:.4f} over initializations and "
                  f"{bands['order']['std']:.4f} over sample orders{both}."]
    return lines


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
                linestyle="-" if k < 10 else "--",  # C<k> repeats after 10 colours
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
    ax.set_xticks(range(len(names)), names, fontsize=8, rotation=25, ha="right")
    ax.set(ylabel="final validation loss - baseline (%)",
           title=f"difference to the baseline at iteration {last} (error bars: standard error)")
    ax.grid(True, axis="y", alpha=0.3)
    if band:
        ax.legend(fontsize=7)
    fig.tight_layout()
    save_small(fig, diff_png)
    plt.close(fig)
