#!/usr/bin/env python
"""Draw ``--metrics-jsonl`` files of ``pretrain_gpt.py`` into one PNG, one colour per run.

    python tools/plot_metrics.py runs/quickstart/latest/metrics.jsonl -o quickstart.png
    python tools/plot_metrics.py runs/a=baseline runs/b=SDP4Bit --x tokens -o compare.png

Each run is a ``metrics.jsonl`` file or a folder holding one, optionally followed by
``=LABEL`` (default: the folder's name). Three panels:

* training loss (solid) and validation loss (dots) against iterations or tokens (``--x``);
* bytes one rank sends per iteration in each hop, at the last logged iteration: the
  weight all-gather to its own node and to other nodes, the gradient intra-node and
  inter-node hops; filled bars are what the run sent, outlined bars what an ideal
  unquantized collective sends (the computed message sizes the log line reports);
* time per iteration (mean over each logging interval).

Needs matplotlib (in requirements.txt).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.sdp4bit.training.observe.metrics_file import read_metrics
from megatron.sdp4bit.training.observe.plots import pyplot, save_small

# (metrics key, bar label); the ideal unquantized figure is under "baseline_" + key.
HOPS = (
    ("comm_bytes_params_intra", "weights,\nown node"),
    ("comm_bytes_params_inter", "weights,\nother nodes"),
    ("comm_bytes_grads_intra", "gradients,\nintra-node hop"),
    ("comm_bytes_grads_inter", "gradients,\ninter-node hop"),
)


class Run:
    """One run's records: ``train`` and ``val`` lists of dicts, and its label."""

    def __init__(self, spec: str) -> None:
        path, _, label = spec.partition("=")
        p = Path(path)
        if p.is_dir():
            p = p / "metrics.jsonl"
        if not p.is_file():
            raise ValueError(f"{path}: no such metrics file (pass a --metrics-jsonl file or the "
                             "folder holding metrics.jsonl)")
        self.path = p
        self.label = label or p.parent.name
        self.train, self.val = read_metrics(p)

    def tokens_per_iteration(self) -> float:
        last = self.train[-1]
        if "consumed_tokens" not in last:
            raise ValueError(f"{self.path}: no consumed_tokens in its records (written by an "
                             "older trainer): use --x iterations")
        return last["consumed_tokens"] / last["iteration"]

    def x(self, records: list[dict], axis: str) -> list[float]:
        """Each record's iteration, or its consumed tokens: a training record's own, a
        validation record's interpolated between the training records' by iteration (exact
        at a logged iteration; the tokens per iteration change with --rampup-batch-size)."""
        its = [r["iteration"] for r in records]
        if axis == "iterations":
            return its
        self.tokens_per_iteration()  # every training record has consumed_tokens
        known = sorted({0: 0, **{r["iteration"]: r["consumed_tokens"] for r in self.train}}
                       .items())
        return [r["consumed_tokens"] if "consumed_tokens" in r else
                _interpolate(known, r["iteration"]) for r in records]


def _interpolate(points: list[tuple[int, int]], at: int) -> float:
    """The piecewise-linear function through ``points`` (sorted) at ``at``, extended by its
    last piece beyond them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if at <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return float(points[-1][1])


def draw(runs: list[Run], path: Path, axis: str = "iterations",
         loss_ylim: tuple[float, float] | None = None, title: str | None = None) -> None:
    """The three panels of the module docstring, written to ``path`` (PNG)."""
    plt = pyplot("plot_metrics.py")
    fig, (ax_loss, ax_bytes, ax_time) = plt.subplots(1, 3, figsize=(13.5, 3.9), dpi=80)
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for run, c in zip(runs, colours):
        ax_loss.plot(run.x(run.train, axis), [r["lm_loss"] for r in run.train], "-", color=c,
                     linewidth=1.2, label=f"{run.label}: training")
        if run.val:
            ax_loss.plot(run.x(run.val, axis), [r["val_lm_loss"] for r in run.val], "o",
                         color=c, markersize=5, label=f"{run.label}: validation")
        ax_time.plot(run.x(run.train, axis), [r["elapsed_ms"] for r in run.train], "-", color=c,
                     linewidth=1.2, label=run.label)
    xlabel = "iteration" if axis == "iterations" else "tokens"
    ax_loss.set(xlabel=xlabel, ylabel="lm loss", title="loss")
    if loss_ylim:
        ax_loss.set_ylim(*loss_ylim)
    ax_loss.legend(fontsize=7)
    ax_time.set(xlabel=xlabel, ylabel="ms per iteration", title="time per iteration")
    ax_time.set_ylim(bottom=0)
    ax_time.legend(fontsize=7)

    hops = [(k, label) for k, label in HOPS if any(k in run.train[-1] for run in runs)]
    width = 0.8 / max(1, len(runs))
    for i, (run, c) in enumerate(zip(runs, colours)):
        last = run.train[-1]
        xs = [h + (i - (len(runs) - 1) / 2) * width for h in range(len(hops))]
        sent = [last.get(k, 0) / 2**20 for k, _ in hops]
        ideal = [last.get("baseline_" + k, 0) / 2**20 for k, _ in hops]
        ax_bytes.bar(xs, ideal, width * 0.9, fill=False, edgecolor=c, linewidth=1.0)
        ax_bytes.bar(xs, sent, width * 0.9, color=c,
                     label=f"{run.label} (iteration {last['iteration']})")
    ax_bytes.set_xticks(range(len(hops)), [label for _, label in hops], fontsize=7)
    ax_bytes.set(ylabel="MiB per iteration, one rank",
                 title="bytes sent (outline: ideal unquantized)")
    ax_bytes.legend(fontsize=7)
    for ax in (ax_loss, ax_bytes, ax_time):
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save_small(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("runs", nargs="+", metavar="METRICS[=LABEL]",
                        help="a --metrics-jsonl file, or a folder holding metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--x", choices=["iterations", "tokens"], default="iterations",
                        help="horizontal axis of the loss and time panels (default iterations)")
    parser.add_argument("--loss-ylim", type=float, nargs=2, metavar=("LOW", "HIGH"),
                        help="vertical range of the loss panel (default: every value)")
    parser.add_argument("--title", help="a title above the panels")
    args = parser.parse_args(argv)
    try:
        runs = [Run(spec) for spec in args.runs]
        if args.x == "tokens":
            for run in runs:
                run.tokens_per_iteration()
    except (OSError, ValueError) as err:
        print(f"plot_metrics.py: error: {err}", file=sys.stderr)
        return 1
    draw(runs, args.output, args.x, tuple(args.loss_ylim) if args.loss_ylim else None, args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
