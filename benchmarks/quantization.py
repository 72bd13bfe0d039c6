"""Throughput of the fused quantization operations next to a plain device-to-device copy.

For every size (the fp32 size of the buffer an operation works on) it times each fused
operation and ``dst.copy_(src)`` of the same fp32 buffer in the same run, and reports GB/s
moved = (bytes read + bytes written) / time, and that figure as a share of the copy's.
Goals: on an H100/H200, every operation at >= 80% of the copy bandwidth at >= 256 MB and
the Hadamard transform costing <= 10% over the same kernel without it; on CPU (the compiled
CPU kernels, one thread, next to a one-thread copy), every operation at >= 20% of the copy.

The table is printed; with ``--write-results`` it also goes to
``benchmarks/quantization.json`` (one entry per device kind and backend, so CPU, reference
and GPU runs coexist) and ``benchmarks/quantization.md`` (regenerated from the JSON).

    python -m benchmarks.quantization                      # CUDA if present, else CPU
    python -m benchmarks.quantization --device cpu --threads 1 --backend torch
    python -m benchmarks.quantization --device cpu --threads 1 --write-results

On CUDA run it without ``TRITON_INTERPRET=1`` (the kernels would be interpreted).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]

from megatron.sdp4bit.quantization import format as fmt  # noqa: E402
from megatron.sdp4bit.quantization import ops  # noqa: E402
from megatron.sdp4bit.quantization.backend import KernelBackend, resolve_backend  # noqa: E402

MB = 1 << 20
GPU_SIZES_MB = [8, 32, 128, 256, 512, 1024, 2048]
CPU_SIZES_MB = [8, 16, 32, 64]
# Configuration of the paper (docs/design.md): qWD 4-bit groups of 2048 over 8 DP ranks; TLq-HS
# 8-bit inside a node (N=4 ranks per node, M=2 nodes), 4-bit across, groups of 128, H=32.
QWD_BITS, QWD_GROUP, QWD_WORLD = 4, 2048, 8
TLQ_INTRA_BITS, TLQ_INTER_BITS, TLQ_GROUP, TLQ_H = 8, 4, 128, 32
NODES, LOCAL = 2, 4


def random_wire(count: int, numel: int, bits: int, group: int, device) -> torch.Tensor:
    """A wire buffer of ``count`` valid messages of ``numel`` values (random codes, small
    positive scales): what a collective receives, for timing the operations that read it."""
    wire = torch.randint(0, 256, (count * fmt.message_nbytes(numel, bits, group),),
                         dtype=torch.uint8, device=device)
    scales, _ = fmt.split_messages(wire, count, numel, bits, group)
    scales.copy_(torch.rand(scales.shape, device=device) * 1e-3)
    return wire


def build_cases(n: int, device, backend: str) -> list[tuple[str, Callable[[], None], int]]:
    """``(name, run, bytes moved)`` for every operation on ``n`` elements."""
    cases = []
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    cases.append(("copy (fp32)", lambda: dst.copy_(src), 2 * 4 * n))

    replica = (src + 1e-3).to(torch.bfloat16)
    msg = torch.empty(fmt.message_nbytes(n, QWD_BITS, QWD_GROUP), dtype=torch.uint8,
                      device=device)
    cases.append(("qwd_sender", lambda: ops.qwd_sender(
        src, replica, msg, bits=QWD_BITS, group_size=QWD_GROUP, stochastic=True, seed=1,
        backend=backend), 4 * n + 2 * n + msg.numel()))

    shard = n // QWD_WORLD
    gathered = random_wire(QWD_WORLD, shard, QWD_BITS, QWD_GROUP, device)
    cases.append(("qwd_receiver", lambda: ops.qwd_receiver(
        gathered, replica, world=QWD_WORLD, bits=QWD_BITS, group_size=QWD_GROUP,
        backend=backend), gathered.numel() + 2 * 2 * n))

    intra = torch.empty(fmt.message_nbytes(n, TLQ_INTRA_BITS, TLQ_GROUP), dtype=torch.uint8,
                        device=device)
    for h in (0, TLQ_H):
        cases.append((f"tlq_sender H={h}", lambda h=h: ops.tlq_sender(
            src, intra, num_dests=LOCAL, blocks_per_dest=NODES, slices=1,
            bits=TLQ_INTRA_BITS, group_size=TLQ_GROUP, hadamard_block=h, stochastic=True,
            seed=2, backend=backend), 4 * n + intra.numel()))

    # Middle: the N intra-node messages a rank receives (n values in all) -> M messages.
    m_numel = n // LOCAL
    received = random_wire(LOCAL, m_numel, TLQ_INTRA_BITS, TLQ_GROUP, device)
    inter = torch.empty(fmt.message_nbytes(m_numel, TLQ_INTER_BITS, TLQ_GROUP),
                        dtype=torch.uint8, device=device)
    cases.append(("tlq_middle", lambda: ops.tlq_middle(
        received, inter, n_in=LOCAL, numel=m_numel, bits_in=TLQ_INTRA_BITS,
        group_size_in=TLQ_GROUP, n_out=NODES, bits_out=TLQ_INTER_BITS,
        group_size_out=TLQ_GROUP, stochastic=True, seed=3, backend=backend),
        received.numel() + inter.numel()))

    # Receiver: the M inter-node messages of an n-element shard -> fp32 mean.
    last = random_wire(NODES, n, TLQ_INTER_BITS, TLQ_GROUP, device)
    for h in (0, TLQ_H):
        cases.append((f"tlq_receiver H={h}", lambda h=h: ops.tlq_receiver(
            last, dst, n_in=NODES, bits=TLQ_INTER_BITS, group_size=TLQ_GROUP,
            hadamard_block=h, scale=1.0 / (NODES * LOCAL), backend=backend),
            last.numel() + 4 * n))
    return cases


def time_op(fn: Callable[[], None], device, warmup: int, iters: int
            ) -> tuple[float, float, float | None]:
    """(median, min) wall seconds per call, and on CPU the median process CPU seconds (all
    threads: robust to other jobs sharing the cores, which inflate wall time)."""
    for _ in range(warmup):
        fn()
    times, cpu_times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    cpu = statistics.median(cpu_times) if cpu_times else None
    return statistics.median(times), min(times), cpu


def run(sizes_mb: list[int], device, backend: str, warmup: int, iters: int) -> list[dict]:
    rows = []
    for size in sizes_mb:
        n = size * MB // 4
        copy_gbs = None
        for name, fn, nbytes in build_cases(n, device, backend):
            seconds, fastest, cpu = time_op(fn, device, warmup, iters)
            gbs = nbytes / seconds / 1e9
            copy_gbs = gbs if copy_gbs is None else copy_gbs
            rows.append(dict(size_mb=size, op=name, ms=seconds * 1e3, min_ms=fastest * 1e3,
                             cpu_ms=None if cpu is None else cpu * 1e3, bytes=nbytes,
                             gb_per_s=gbs, vs_copy=gbs / copy_gbs))
            print(f"{size:>6} MB  {name:<20} {seconds * 1e3:9.3f} ms  {gbs:8.2f} GB/s  "
                  f"{gbs / copy_gbs:6.1%} of copy", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, torch threads: " \
           f"{torch.get_num_threads()}, cores: {os.cpu_count()}"


def _versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return {"torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version()}


def write_results(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "quantization.json"
    runs = json.loads(json_path.read_text())["runs"] if json_path.exists() else {}
    runs[f"{result['device_kind']}-{result['backend']}"] = result
    json_path.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    (out_dir / "quantization.md").write_text(render_markdown(runs))


def render_markdown(runs: dict) -> str:
    lines = ["# Quantization kernels: throughput", "",
             "GB/s moved = (bytes read + bytes written) / time, median of the timed calls; "
             "\"vs copy\" divides by `dst.copy_(src)` of the same fp32 buffer measured in the "
             "same run. Size = fp32 size of the buffer each operation works on (see "
             "`build_cases` in `benchmarks/quantization.py` for the exact shapes: qWD 4-bit "
             f"groups of {QWD_GROUP} over {QWD_WORLD} shards; TLq N={LOCAL}, M={NODES}, "
             f"{TLQ_INTRA_BITS}-bit then {TLQ_INTER_BITS}-bit, groups of {TLQ_GROUP}, "
             "Hadamard block 32 where H=32; senders use stochastic rounding).", "",
             "Goals: on an H100/H200 (Triton kernels), every operation >= 80% of the copy "
             "bandwidth at >= 256 MB and tlq_sender H=32 within 10% of H=0; on CPU (the "
             "compiled CPU kernels, one thread, next to a one-thread copy), every operation "
             ">= 20% of the copy. Every backend produces the same bytes.", ""]
    if not any(kind.startswith("cuda") for kind in runs):
        lines += ["**GPU figures are not in this file**: no GPU was available when it was "
                  "written. The first GPU figures of the same kernels (one H200, `bash "
                  "dev/gpu_check.sh`'s bandwidth step at megatron-core's bucket sizes) are in "
                  "[gpu_h200_2026-11-28](gpu_h200_2026-11-28/README.md); `python -m "
                  "benchmarks.quantization` on a CUDA machine (Triton backend) adds this "
                  "file's table for a GPU.", ""]
    for kind in sorted(runs):
        r = runs[kind]
        lines += [f"## {r['device_kind'].upper()}, {r['backend']} backend: {r['device']}", "",
                  f"- command: `{r['command']}`",
                  f"- backend: {r['backend']}; warmup {r['warmup']}, timed calls {r['iters']}",
                  f"- versions: torch {r['versions']['torch']}, triton "
                  f"{r['versions']['triton']}, python {r['versions']['python']}",
                  f"- date: {r['date']}", ""]
        if r.get("note"):
            lines += [r["note"], ""]
        if r.get("load_average"):
            lines += [f"- load average (1 min) before / after: {r['load_average'][0]:.1f} / "
                      f"{r['load_average'][1]:.1f} on {os.cpu_count()} cores", ""]
        cpu = r["rows"] and r["rows"][0].get("cpu_ms") is not None
        lines += ["| size (MB) | operation | median (ms) | min (ms) | "
                  + ("CPU time (ms) | " if cpu else "") + "GB/s (median) | vs copy |",
                  "|---:|---|---:|---:|" + ("---:|" if cpu else "") + "---:|---:|"]
        for row in r["rows"]:
            cpu_cell = f"{row['cpu_ms']:.3f} | " if cpu else ""
            lines.append(f"| {row['size_mb']} | {row['op']} | {row['ms']:.3f} | "
                         f"{row['min_ms']:.3f} | {cpu_cell}{row['gb_per_s']:.2f} | "
                         f"{row['vs_copy']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--backend", default="auto", choices=[b.value for b in KernelBackend],
                        help="auto = Triton on CUDA, the CPU kernels on CPU")
    parser.add_argument("--sizes-mb", type=int, nargs="+",
                        help=f"fp32 buffer sizes in MB (default GPU {GPU_SIZES_MB}, "
                             f"CPU {CPU_SIZES_MB})")
    parser.add_argument("--warmup", type=int, help="untimed calls (default GPU 5, CPU 1)")
    parser.add_argument("--iters", type=int, help="timed calls (default GPU 20, CPU 2)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks")
    parser.add_argument("--write-results", action="store_true",
                        help="also write benchmarks/quantization.{md,json} (else print only)")
    parser.add_argument("--note", default="", help="a line added to the results section")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    cli = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(cli)

    kind = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(kind)
    if kind == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: on CUDA the kernels must be compiled")
    gpu = kind == "cuda"
    sizes = args.sizes_mb or (GPU_SIZES_MB if gpu else CPU_SIZES_MB)
    if any(s <= 0 for s in sizes):  # whole MB always splits into whole groups and shards
        raise SystemExit("--sizes-mb must be positive")
    warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    iters = args.iters if args.iters is not None else (20 if gpu else 2)
    backend = resolve_backend(args.backend, torch.empty(0, device=device)).value

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device {device_name(device)}, backend {backend}")
    load_before = os.getloadavg()[0]
    rows = run(sizes, device, backend, warmup, iters)
    load = None if gpu else [load_before, os.getloadavg()[0]]
    result = dict(device_kind=kind, device=device_name(device), backend=backend,
                  command="python " + shlex.join([os.path.relpath(__file__, ROOT)] + cli),
                  versions=_versions(), warmup=warmup, iters=iters, note=args.note,
                  load_average=load,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"), rows=rows)
    if args.write_results:
        write_results(result, args.out_dir)
        print(f"wrote {args.out_dir / 'quantization.md'}")


if __name__ == "__main__":
    main()
