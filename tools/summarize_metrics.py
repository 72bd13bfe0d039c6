#!/usr/bin/env python
"""Summarize a ``--metrics-jsonl`` file of ``pretrain_gpt.py``: loss, bytes on the wire, speed.

    python tools/summarize_metrics.py runs/quickstart/metrics.jsonl
    python tools/summarize_metrics.py runs/speed/1.3B/sdp4bit/16nodes/metrics.jsonl --warmup 20

Prints the first and the final logged training loss (and the last validation loss), the
bytes one rank sent per iteration in each collective next to what an ideal unquantized
collective sends (computed message sizes, see megatron.sdp4bit.comm.stats),
and the mean time per iteration and TFLOP/s per GPU over the iterations after ``--warmup``
(the paper's Table 2 is the mean of 10 iterations after 20 warm-up ones). The byte figures
are those of the last logged iteration: with ``--gradients-quantization-start-iteration``
the early iterations send unquantized gradients on purpose.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron.sdp4bit.training.observe.metrics_file import read_metrics

# (metrics key, label); the ideal unquantized equivalent is under "baseline_" + key.
COLLECTIVES = (
    ("comm_bytes_params_intra", "weights, to the node"),
    ("comm_bytes_params_inter", "weights, to other nodes"),
    ("comm_bytes_grads_intra", "gradients, intra-node hop"),
    ("comm_bytes_grads_inter", "gradients, inter-node hop"),
)


def _mb(n: float) -> str:
    return f"{n / 2**20:8.2f} MiB"  # 12 characters


def summarize(train: list[dict], val: list[dict], warmup: int = 0) -> str:
    first, last = train[0], train[-1]
    lines = [f"lm loss: {first['lm_loss']:.4f} at iteration {first['iteration']} -> "
             f"{last['lm_loss']:.4f} at iteration {last['iteration']}"]
    if val:
        lines.append(f"validation lm loss: {val[-1]['val_lm_loss']:.4f} at iteration "
                     f"{val[-1]['iteration']}")
    lines.append(f"{'bytes per iteration, one rank':31s} {'quantized':>12s} {'unquantized':>12s}"
                 f" {'reduction':>10s}   (iteration {last['iteration']})")
    rows = [(label, last[key], last["baseline_" + key]) for key, label in COLLECTIVES
            if key in last]
    rows.append(("total", sum(r[1] for r in rows), sum(r[2] for r in rows)))
    for label, q, b in rows:
        reduction = f"{b / q:9.2f}x" if q else f"{'-':>10s}"
        lines.append(f"  {label:29s} {_mb(q)} {_mb(b)} {reduction}")
    timed = [r for r in train if r["iteration"] > warmup]
    if timed:
        ms = sum(r["elapsed_ms"] for r in timed) / len(timed)
        speed = f"mean time per iteration after iteration {warmup}: {ms:.1f} ms"
        if all("tflops_per_gpu" in r for r in timed):
            tflops = sum(r["tflops_per_gpu"] for r in timed) / len(timed)
            speed += f", {tflops:.3g} TFLOP/s per GPU"
        lines.append(speed)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("metrics", type=Path, help="a --metrics-jsonl file")
    parser.add_argument("--warmup", type=int, default=0,
                        help="iterations left out of the mean time per iteration (default 0)")
    args = parser.parse_args(argv)
    try:
        train, val = read_metrics(args.metrics)
    except (OSError, ValueError) as err:
        print(f"summarize_metrics.py: error: {err}", file=sys.stderr)
        return 1
    print(summarize(train, val, args.warmup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
