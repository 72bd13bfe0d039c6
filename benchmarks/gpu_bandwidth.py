"""The GPU check's bandwidth step: each fused operation's achieved bandwidth at the paper's
bucket sizes, as a fraction of the device's copy bandwidth, beside the torch references.

The device's copy bandwidth is ``dst.copy_(src)`` of the largest fp32 buffer (torch runs it
as one device-to-device ``cudaMemcpyAsync``), counting bytes read plus bytes written, the
same way every operation's bytes are counted (``benchmarks/quantization.py``'s
``build_cases``: each input read once, each output written once). The goal: every Triton
kernel at >= 80% of that figure at the largest bucket, as the best published quantization
kernels reach. The torch references (``--kernel-backend torch``: a dozen full-size passes per
operation) are the plain-torch implementation the kernels replace.

Buckets (elements, padded up to a multiple of 16384 as SDP4Bit pads buckets for the
benchmark's shapes): megatron-core's default DDP bucket (40M elements, with
``--overlap-grad-reduce``), the default at DP 128 (max(40M, 1M x DP) = 128M), and GPT 1.3B's
whole gradient buffer in one bucket, as the paper's speed scripts lay it out (no
``--overlap-grad-reduce``; 1,414,463,488 elements read off megatron-core's model in
``benchmarks/scale.md``).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from benchmarks.quantization import build_cases, time_op

PAD = 16384  # qWD over 8 shards of groups of 2048; TLq N=4, M=2 in groups of 128
BUCKETS = [("default bucket (40M)", 40_000_000), ("default bucket at DP 128 (128M)",
                                                   128_000_000),
           ("GPT 1.3B, one bucket (1.41G)", 1_414_463_488)]
REHEARSAL_BUCKETS = [("rehearsal (16K)", 16384)]
GOAL = 0.80
# The references allocate several full-size temporaries (int64 random streams among them):
# at 1.41G elements they would not fit beside the buffers, and each call takes long.
TORCH_MAX_NUMEL = 128_000_000
TORCH_SKIP_REASON = "torch references timed up to 128M elements only (memory, time budget)"


def padded(numel: int) -> int:
    return -(-numel // PAD) * PAD


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure(buckets: list[tuple[str, int]], device: torch.device, plan: list[tuple[str, int, int]],
            save: Callable[[dict], None], log=print) -> dict:
    """Rows ``{bucket, numel, op, backend, ms, gb_per_s, vs_copy}`` (``vs_copy``: of the
    device's copy bandwidth, ``copy_gb_per_s``) and the buckets that did not fit, handed to
    ``save`` after each bucket and backend (so a step cut short keeps what it measured).
    ``plan``: ``(backend, warmup, iters)``; the first backend also times the copy."""
    result = dict(copy_gb_per_s=None, rows=[], skipped=[], goal=GOAL)
    copies = []
    for name, numel in buckets:
        n = padded(numel)
        for backend, warmup, iters in plan:
            if backend == "torch" and numel > TORCH_MAX_NUMEL:
                result["skipped"].append(dict(bucket=name, backend=backend,
                                              reason=TORCH_SKIP_REASON))
                continue
            try:
                for op, fn, nbytes in build_cases(n, device, backend):
                    if op.startswith("copy") and backend != plan[0][0]:
                        continue
                    seconds, _, _ = time_op(fn, device, warmup, iters)
                    gbs = nbytes / seconds / 1e9
                    if op.startswith("copy"):
                        copies.append(gbs)
                    result["rows"].append(dict(
                        bucket=name, numel=n, op=op,
                        backend="-" if op.startswith("copy") else backend,
                        ms=round(seconds * 1e3, 4), bytes=nbytes, gb_per_s=round(gbs, 2),
                        warmup=warmup, iters=iters))
                    log(f"{name:<32} {op:<20} {result['rows'][-1]['backend']:<7} "
                        f"{seconds * 1e3:10.3f} ms {gbs:9.1f} GB/s")
            except torch.cuda.OutOfMemoryError as err:
                result["skipped"].append(dict(
                    bucket=name, backend=backend,
                    reason=f"out of memory: {str(err).splitlines()[0]}"))
                log(f"{name}: {backend} out of memory, skipped")
            _release(device)
            copy = copies[-1] if copies else None  # the largest buffer's copy so far
            result["copy_gb_per_s"] = copy
            for row in result["rows"]:
                row["vs_copy"] = round(row["gb_per_s"] / copy, 4) if copy else None
            result["worst_triton_vs_copy"] = worst_kernel_fraction(result)
            save(result)
    return result


def worst_kernel_fraction(result: dict) -> float | None:
    """The lowest fraction of the copy bandwidth of a Triton kernel at the largest bucket
    measured (the figure the goal is about)."""
    triton = [r for r in result["rows"] if r["backend"] == "triton"]
    if not triton:
        return None
    largest = max(r["numel"] for r in triton)
    return min(r["vs_copy"] for r in triton if r["numel"] == largest)


def run(rehearse: bool, device: torch.device, save: Callable[[dict], None], log=print
        ) -> dict:
    start = time.perf_counter()
    buckets = REHEARSAL_BUCKETS if rehearse else BUCKETS
    plan = [("triton", 0, 1), ("torch", 0, 1)] if rehearse else [("triton", 3, 10),
                                                                  ("torch", 1, 3)]
    meta = dict(buckets=[dict(name=n, numel=padded(x)) for n, x in buckets],
                timing="median of the timed calls, "
                + ("CUDA events" if device.type == "cuda" else "wall clock"))

    def save_with_meta(result: dict) -> None:
        save({**result, **meta, "seconds": round(time.perf_counter() - start, 1)})

    result = measure(buckets, device, plan, save_with_meta, log)
    return {**result, **meta}
