"""Tables, JSON and the plot of a ``simcluster`` run."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The model of a results file that does not name one (benchmarks/simcluster.json).
DENSE_MODEL = "GPT (2 layers, hidden 512, 8 heads, seq 64, global batch 4, bf16, 6.7M parameters)"
# The paper's methods, one table row per link; any other method (a peer) makes the report
# one row per link and method, each with its own bytes.
PAPER_METHODS = ["baseline", "SDP4Bit", "qWD", "TLq-HS"]
PEER_NOTES = {
    "SDP4Bit-2bit": "SDP4Bit with 2-bit inter-node gradients "
    "(`--gradient-quantization-bits-inter 2`)",
    "baseline-bf16": "the baseline with its gradients reduced in bf16 (`--grad-reduce-in-bf16`)",
    "baseline-bf16-a2a": "baseline-bf16 with megatron-core's reduce-scatter that sends bf16 "
    "in an all-to-all and sums in fp32 (`--ddp-reduce-scatter-with-fp32-accumulation`); "
    "without `--overlap-grad-reduce` and `--overlap-param-gather`: megatron-core overlaps it "
    "with a single gradient bucket only, and the trainer refuses the overlap with it",
}
# The inter-node gradient bytes of b-bit groups of 128 with an fp32 scale, against fp32.
GRAD_BITS_ACCOUNTING = {"SDP4Bit": 4, "SDP4Bit-2bit": 2}


def machine() -> dict:
    import torch

    try:
        from importlib.metadata import version

        mcore = version("megatron-core")
    except Exception:  # noqa: BLE001 - a report still helps without it
        mcore = "unknown"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"machine": f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB",
            "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "megatron_core": mcore}


def summarize(links: list[dict], runs: list[dict], methods: list[str]) -> dict:
    """Per link: each method's median s/iter over the rounds, speed-up, bytes, load."""
    rows = []
    for link in links:
        of_link = [r for r in runs if r["rate"] == link["rate"]]
        per_method = {}
        for method in methods:
            mine = [r for r in of_link if r["method"] == method]
            per_method[method] = {
                "s_per_iter": statistics.median(
                    statistics.median(r["ms_per_iter"]) / 1e3 for r in mine),
                "s_per_iter_rounds": [round(statistics.median(r["ms_per_iter"]) / 1e3, 4)
                                      for r in mine],
                "link_mb_per_iter": statistics.median(
                    statistics.mean(r["link_bytes_per_iter"]) for r in mine) / 1e6,
                "counted_mb_per_iter": statistics.median(
                    r["counted_inter_bytes_per_iter"] for r in mine) / 1e6,
                "counted_grad_mb_per_iter": statistics.median(
                    r["counted_grad_inter_bytes_per_iter"] for r in mine) / 1e6,
                "load_average": statistics.mean(r["load_average"] for r in mine),
                "timers_ms": {k: round(statistics.median(r["timers_ms"].get(k, 0.0)
                                                         for r in mine), 2)
                              for k in sorted(set().union(*(r["timers_ms"] for r in mine)))},
            }
        base = per_method["baseline"]
        for values in per_method.values():
            values["speedup"] = base["s_per_iter"] / values["s_per_iter"]
            values["wire_bound_speedup"] = base["link_mb_per_iter"] / values["link_mb_per_iter"]
        rows.append({**link, "methods": per_method,
                     "load_average": statistics.mean(r["load_average"] for r in of_link)})
    _add_bound(rows)
    return {"links": rows, "methods": methods}


def _add_bound(rows: list[dict]) -> None:
    """Two references for SDP4Bit's speed-up at each rate, from measured figures only:

    * ``wire_bound_speedup``: baseline link bytes over SDP4Bit's, the speed-up of a step
      that is all wire time (the limit as the link gets slower);
    * ``model_speedup``: each method's time on the fastest link (nearly no wire time) plus
      its link bytes at the measured rate, (t_b + B_b / R) / (t_q + B_q / R): what a step
      that does not overlap communication with computation would gain. Only when the run
      measured an unshaped link: a shaped link's time already holds wire time.
    """
    if not rows or "SDP4Bit" not in rows[0]["methods"]:
        return
    unshaped = [r for r in rows if r["configured_bits"] is None]
    fastest = max(unshaped, key=lambda r: r["measured_bits"])["methods"] if unshaped else None
    for row in rows:
        m = row["methods"]
        base, sdp = m["baseline"]["link_mb_per_iter"], m["SDP4Bit"]["link_mb_per_iter"]
        row["wire_bound_speedup"] = base / sdp
        if fastest is None:
            continue
        wire = 8e6 / row["measured_bits"]
        row["model_speedup"] = (fastest["baseline"]["s_per_iter"] + base * wire) / \
            (fastest["SDP4Bit"]["s_per_iter"] + sdp * wire)


def is_peers(methods: list[str]) -> bool:
    return bool(set(methods) - set(PAPER_METHODS))


def markdown(result: dict) -> str:
    methods = result["methods"]
    peers = is_peers(methods)
    title = "SDP4Bit and its peers" if peers else "SDP4Bit's speed"
    lines = [f"# Simulated two-node cluster: {title} on a slow link", "",
             "Two network namespaces of 2 ranks each (4 gloo processes on one machine), "
             "joined by a veth pair shaped with `tc tbf` at each rate; the same "
             f"{result.get('model', DENSE_MODEL)} for every method. s/iter: median over the "
             "rounds of each run's median "
             "iteration after warm-up; speed-up: baseline s/iter over the method's. Link "
             "MB/iter: bytes that crossed the link per iteration and direction, from the "
             "interface counters; counted: the trainer's own count of inter-node bytes "
             "(ideal collectives). Wire bound: the baseline's link bytes over "
             + ("the method's" if peers else "SDP4Bit's") + ", "
             "the speed-up of a step made of wire time only"
             + ("." if peers else "; no-overlap model: each "
                "method's time on the fastest link plus its link bytes at the measured rate."),
             ""]
    if peers:
        lines += [f"- {m}: {PEER_NOTES[m]}" for m in methods if m in PEER_NOTES] + [""]
    if "machine" in result:
        lines += [f"- machine: {result['machine']}; kernel {result['kernel']}",
                  f"- versions: python {result['python']}, torch {result['torch']}, "
                  f"megatron-core {result['megatron_core']}",
                  f"- command: `{result['command']}` ({result['minutes']} min)",
                  "- load average (1 min): during a run (column load) it counts the run's "
                  "own 4 ranks, 2 agents and their threads on 2 cores"
                  + (f"; before the benchmark: {result['load_before']:.1f}"
                     if "load_before" in result else ""),
                  f"- date: {result['date']}", ""]
    lines += _peer_table(result) if peers else _paper_table(result)
    lines += ["", "Where the time goes (ms per iteration, max over ranks, median of the "
              "rounds; `--timing-log-level 1`):", ""]
    for row in result["links"]:
        for method in methods:
            timers = row["methods"][method]["timers_ms"]
            if timers:
                lines.append(f"- {row['rate']}, {method}: " + ", ".join(
                    f"{k} {v:.0f}" for k, v in timers.items() if v >= 0.5))
    if "trainer_flags" in result:
        lines += ["", "Trainer flags per method:", ""]
        lines += [f"- {k}: `{' '.join(v)}`" for k, v in result["trainer_flags"].items()]
    return "\n".join(lines) + "\n"


def _paper_table(result: dict) -> list[str]:
    """One row per link, a column per method (benchmarks/simcluster.md)."""
    methods = result["methods"]
    head = "| link (configured) | measured | " + " | ".join(
        f"{m} s/iter" for m in methods) + " | " + " | ".join(
        f"{m} speed-up" for m in methods if m != "baseline") + \
        " | wire bound | no-overlap model | link MB/iter (baseline -> SDP4Bit) | " \
        "counted MB/iter | load |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["links"]:
        m = row["methods"]
        cells = [row["rate"], f"{row['measured_bits'] / 1e6:,.0f} Mbit/s"]
        cells += [f"{m[k]['s_per_iter']:.3f}" for k in methods]
        cells += [f"{m[k]['speedup']:.2f}x" for k in methods if k != "baseline"]
        for key in ("wire_bound_speedup", "model_speedup"):
            cells.append(f"{row[key]:.2f}x" if key in row else "-")
        sdp = m.get("SDP4Bit", m[methods[-1]])
        cells.append(f"{m['baseline']['link_mb_per_iter']:.1f} -> "
                     f"{sdp['link_mb_per_iter']:.1f}")
        cells.append(f"{m['baseline']['counted_mb_per_iter']:.1f} -> "
                     f"{sdp['counted_mb_per_iter']:.1f}")
        cells.append(f"{row['load_average']:.1f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _peer_table(result: dict) -> list[str]:
    """One row per link and method, each with its own bytes; then the counted inter-node
    bytes of the quantized methods against the baseline's and the accounting's ratio."""
    head = ("| link (configured) | measured | method | s/iter | s/iter per round | speed-up | "
            "wire bound | link MB/iter | counted MB/iter | counted grads MB/iter | load |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in result["links"]:
        for method in result["methods"]:
            v = row["methods"][method]
            lines.append("| " + " | ".join([
                row["rate"], f"{row['measured_bits'] / 1e6:,.0f} Mbit/s", method,
                f"{v['s_per_iter']:.3f}", " ".join(f"{t:.3f}" for t in v["s_per_iter_rounds"]),
                f"{v['speedup']:.2f}x", f"{v['wire_bound_speedup']:.2f}x",
                f"{v['link_mb_per_iter']:.1f}", f"{v['counted_mb_per_iter']:.2f}",
                f"{v['counted_grad_mb_per_iter']:.2f}", f"{v['load_average']:.1f}"]) + " |")
    lines += ["", "Counted inter-node bytes per node against the (fp32-gradient) baseline's, "
              "the same at every rate (a count, not a measurement):", ""]
    base = result["links"][0]["methods"]["baseline"]
    for method in result["methods"]:
        if method == "baseline":
            continue
        v = result["links"][0]["methods"][method]
        text = (f"- {method}: gradients {base['counted_grad_mb_per_iter']:.2f} -> "
                f"{v['counted_grad_mb_per_iter']:.2f} MB "
                f"({base['counted_grad_mb_per_iter'] / v['counted_grad_mb_per_iter']:.2f}x "
                "fewer")
        if method in GRAD_BITS_ACCOUNTING:
            bits = GRAD_BITS_ACCOUNTING[method]
            text += f"; the accounting 32 / ({bits} + 32/128) = {32 / (bits + 32 / 128):.1f}x"
        text += (f"), the whole step (parameters + gradients) {base['counted_mb_per_iter']:.2f}"
                 f" -> {v['counted_mb_per_iter']:.2f} MB "
                 f"({base['counted_mb_per_iter'] / v['counted_mb_per_iter']:.2f}x fewer)")
        lines.append(text)
    return lines


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("simcluster: the plot needs matplotlib: pip install matplotlib "
                         "(it is in requirements.txt)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["links"], key=lambda r: r["measured_bits"])
    x = [r["measured_bits"] / 1e6 for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for method, style in (("SDP4Bit", "o-"), ("TLq-HS", "s-"), ("qWD", "^-"),
                          ("SDP4Bit-2bit", "D-"), ("baseline-bf16", "v--"),
                          ("baseline-bf16-a2a", "x--")):
        if method in result["methods"]:
            ax.plot(x, [r["methods"][method]["speedup"] for r in rows], style, label=method)
    if all("wire_bound_speedup" in r for r in rows):
        ax.plot(x, [r["wire_bound_speedup"] for r in rows], "k--", linewidth=1,
                label="wire-time bound (link bytes, baseline / SDP4Bit)")
    if all("model_speedup" in r for r in rows):
        ax.plot(x, [r["model_speedup"] for r in rows], "k:", linewidth=1,
                label="SDP4Bit, no-overlap model (time on fastest link + bytes / rate)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{r['rate']}\n{xi:,.0f}" for r, xi in zip(rows, x)], fontsize=8)
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("link between the two nodes: configured rate, measured Mbit/s")
    ax.set_ylabel("speed-up over baseline (s/iter)")
    ax.set_title("Simulated 2 nodes x 2 ranks (CPU, gloo)"
                 + (", MoE" if "moe" in result.get("stem", "") else "")
                 + (": SDP4Bit and its peers" if is_peers(result["methods"]) else ""))
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(result: dict, out_dir: Path, stem: str = "simcluster") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(markdown(result))
    plot(result, paths[2])
    return paths
