"""Run the kernel-versus-reference checks of ``dev/kernel_checks.py`` on CUDA at
production-like sizes (groups of 2048 and 128, Hadamard block 32, several MB per call), and
at ragged sizes (groups of 96, odd group counts, chunks smaller than a group, 3 senders).

What the cases cover, per operation: both weight modes of qWD (the difference to the fp32
main weights, 'main'; the difference to the main weights rounded to the replica's dtype,
'rounded-main'; and qW's direct quantization without a replica); both gradient hops of
TLq-HS (the 8-bit intra-node hop and the 4-bit inter-node hop, with the 8 -> 4 bit
requantization between them, and each single-hop topology; the 2-bit inter-node hop too); the
Hadamard transform on and off; NaN/Inf inputs (the group's scale becomes NaN) and NaN groups
on the wire (the receivers propagate them).

[Note: covering the kernels' branches with few cases]
A fresh GPU compiles one kernel per combination of its compile-time settings, so a full
product of every setting costs minutes (tlq_sender's 122 cases took 80 s on an H200). The
two widest operations take a covering set instead: tlq_sender runs every layout with every
bit width and both Hadamard settings, and every combination of (bits, Hadamard, rounding,
dtype), in 30 cases; tlq_receiver every (senders, Hadamard, dtype) and every pair of those
with the scale-and-accumulate choice, in 17. ``tests/unit/test_gpu_check.py`` checks both
properties, so trimming further fails there.

Run as ``python -m dev.cuda_checks OP [OP ...]`` from the repository root with
``TRITON_INTERPRET`` unset, so that the kernels are compiled, not interpreted (Triton decides
when the kernel modules are imported). ``tests/gpu/test_kernels_cuda.py`` does that in a
subprocess, and ``benchmarks/gpu_check.py`` (the GPU check's kernels step) with ``--json``.
``--device cpu --tiny`` runs the same cases at tiny sizes in Triton's interpreter (the GPU
check's rehearsal on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Iterator

import torch

from dev import kernel_checks as kc

SEED = (0x9E3779B9 << 32) | 0x80000001
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
RAGGED_GROUP = 96  # not a power of two: no block size of a kernel divides it


def _size(tiny: bool, big: int, small: int) -> int:
    return small if tiny else big


def qwd_sender(tiny: bool = False) -> Iterator[dict]:
    numel = 2048 * _size(tiny, 1024, 2)
    for bits, stochastic, replica in itertools.product(
            (4, 8), (False, True), (torch.bfloat16, torch.float32, None)):
        # replica None: qW (direct); otherwise qWD's 'main' target
        yield dict(numel=numel, bits=bits, group=2048, replica_dtype=replica,
                   stochastic=stochastic, seed=SEED)
    for replica in (torch.bfloat16, torch.float16):  # qWD's 'rounded-main' target
        yield dict(numel=numel, bits=4, group=2048, replica_dtype=replica, stochastic=True,
                   seed=SEED, rounded_main=True)
    for bits in (4, 8):  # ragged: an odd number of groups of 96
        yield dict(numel=RAGGED_GROUP * _size(tiny, 1001, 3), bits=bits, group=RAGGED_GROUP,
                   replica_dtype=torch.bfloat16, stochastic=True, seed=SEED + bits)
    yield dict(numel=2048 * _size(tiny, 64, 2), bits=4, group=2048,
               replica_dtype=torch.bfloat16, stochastic=True, seed=SEED, nonfinite=True)


def qwd_receiver(tiny: bool = False) -> Iterator[dict]:
    for bits, dtype, accumulate in itertools.product((4, 8), DTYPES, (True, False)):
        yield dict(world=8, shard=2048 * _size(tiny, 128, 4), bits=bits, group=2048,
                   replica_dtype=dtype, accumulate=accumulate, seed=bits, nan_group=3)
    for bits in (4, 8):  # ragged: 3 ranks, odd group counts
        yield dict(world=3, shard=RAGGED_GROUP * _size(tiny, 333, 3), bits=bits,
                   group=RAGGED_GROUP, replica_dtype=torch.bfloat16, accumulate=True,
                   seed=bits, nan_group=1)


# (Hadamard block, stochastic rounding, dtype): four settings and their complements, so that
# a case and its complement differ in all three (the covering sets of [Note: covering the
# kernels' branches with few cases])
_SENDER_SETTINGS = ((32, True, torch.float32), (32, True, torch.bfloat16),
                    (32, False, torch.float32), (32, False, torch.bfloat16))


def _complement(setting: tuple) -> tuple:
    hadamard, stochastic, dtype = setting
    return (0 if hadamard else 32, not stochastic,
            torch.bfloat16 if dtype == torch.float32 else torch.float32)


def tlq_sender(tiny: bool = False) -> Iterator[dict]:
    # (blocks_per_dest M, num_dests N, slices P, chunk c): two hops, N=1 (inter only), M=1
    # (intra only), pipelined, and a chunk smaller than a group (groups span chunks).
    layouts = [(4, 8, 1, _size(tiny, 16384, 128)), (4, 8, 2, _size(tiny, 8192, 64)),
               (1, 8, 1, _size(tiny, 65536, 256)), (8, 1, 1, _size(tiny, 16384, 128)),
               (4, 2, 2, 64)]
    for b, bits in enumerate((8, 4, 2)):
        for l, layout in enumerate(layouts):
            # layout l at bit width b takes settings pair (l + b) mod 4: each bit width sees
            # all four pairs, so all eight (Hadamard, rounding, dtype) settings
            setting = _SENDER_SETTINGS[(l + b) % 4]
            for hadamard, stochastic, dtype in (setting, _complement(setting)):
                blocks, dests, slices, chunk = layout
                yield dict(blocks=blocks, dests=dests, slices=slices, chunk=chunk, bits=bits,
                           group=128, hadamard=hadamard, dtype=dtype, stochastic=stochastic,
                           seed=SEED, nonfinite=blocks == 4)
    for hadamard in (32, 8):  # ragged: 3 x 5 ranks, groups of 96; an 8-point transform too
        yield dict(blocks=3, dests=5, slices=2, chunk=_size(tiny, 192 * 64, 192), bits=8,
                   group=RAGGED_GROUP, hadamard=hadamard, dtype=torch.bfloat16,
                   stochastic=True, seed=SEED)


def tlq_middle(tiny: bool = False) -> Iterator[dict]:
    numel = 128 * _size(tiny, 8192, 8)
    for n_in, n_out, stochastic in itertools.product((8, 1), (4, 1), (True, False)):
        yield dict(n_in=n_in, numel=numel, bits_in=8, group_in=128, n_out=n_out,
                   bits_out=4, group_out=128, stochastic=stochastic, seed=SEED, nan_group=5)
    yield dict(n_in=4, numel=numel, bits_in=8, group_in=256, n_out=2, bits_out=4,
               group_out=128, stochastic=True, seed=SEED)
    for stochastic in (True, False):  # the 2-bit inter-node hop
        yield dict(n_in=8, numel=numel, bits_in=8, group_in=128, n_out=4, bits_out=2,
                   group_out=128, stochastic=stochastic, seed=SEED, nan_group=5)
    # ragged: 3 senders, groups of 96
    yield dict(n_in=3, numel=RAGGED_GROUP * 2 * _size(tiny, 501, 2), bits_in=8,
               group_in=RAGGED_GROUP, n_out=2, bits_out=4, group_out=RAGGED_GROUP,
               stochastic=True, seed=SEED, nan_group=1)


def tlq_receiver(tiny: bool = False) -> Iterator[dict]:
    numel = 128 * _size(tiny, 8192, 8)
    scale_acc = ((1 / 3, False), (1.0, False), (0.125, True))
    for (n, n_in), (h, hadamard), (d, dtype) in itertools.product(
            enumerate((4, 1)), enumerate((32, 0)), enumerate(DTYPES)):
        # the inter-node hop's receiver: 4-bit messages. The scale-and-accumulate choice
        # rotates with the other three, so that each of its values meets every dtype, both
        # sender counts and both Hadamard settings
        scale, acc = scale_acc[(n + h + d) % 3]
        yield dict(n_in=n_in, numel=numel, bits=4, group=128, hadamard=hadamard,
                   scale=scale, accumulate=acc, dtype=dtype, seed=n_in, nan_group=7)
    for hadamard in (32, 0):  # the 2-bit inter-node hop's receiver
        yield dict(n_in=4, numel=numel, bits=2, group=128, hadamard=hadamard, scale=0.125,
                   accumulate=True, dtype=torch.bfloat16, seed=2, nan_group=7)
    for hadamard in (32, 0):  # one node: the intra hop's receiver, 8-bit messages
        yield dict(n_in=8, numel=numel, bits=8, group=128, hadamard=hadamard, scale=0.125,
                   accumulate=False, dtype=torch.float32, seed=8, nan_group=2)
    yield dict(n_in=3, numel=RAGGED_GROUP * _size(tiny, 1000, 4), bits=4, group=RAGGED_GROUP,
               hadamard=32, scale=1 / 3, accumulate=True, dtype=torch.bfloat16, seed=3,
               nan_group=1)


CASES = {f.__name__: f for f in (qwd_sender, qwd_receiver, tlq_sender, tlq_middle,
                                 tlq_receiver)}


def _describe(case: dict) -> dict:
    return {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) or v is None
                else v) for k, v in case.items()}


def run_op(op: str, device: str, *, tiny: bool = False, limit: int | None = None) -> dict:
    """Every case of ``op`` (the first ``limit``): ``{op, cases, failures, seconds, failed}``."""
    check = getattr(kc, f"check_{op}")
    start, ran, failed = time.perf_counter(), 0, []
    for case in itertools.islice(CASES[op](tiny), limit):
        ran += 1
        try:
            check(device, **case)
        except Exception:  # noqa: BLE001 - a crash in one case is that case's failure
            failed.append({"case": _describe(case),
                           "error": traceback.format_exc(limit=1).strip()[-2000:]})
            print(f"FAILED {op} {_describe(case)}\n{failed[-1]['error']}", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    result = {"op": op, "cases": ran, "failures": len(failed),
              "seconds": round(time.perf_counter() - start, 2), "failed": failed}
    print(f"{op}: {ran} cases, {len(failed)} failures, {result['seconds']} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("ops", nargs="+", choices=[*CASES, "all"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: Triton's interpreter (set TRITON_INTERPRET=1)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the rehearsal)")
    parser.add_argument("--limit", type=int, help="run only the first LIMIT cases of each op")
    parser.add_argument("--json", type=Path,
                        help="write the results here, rewritten after each operation")
    args = parser.parse_args(argv)
    ops = list(CASES) if "all" in args.ops else args.ops
    results = []
    for op in ops:
        results.append(run_op(op, args.device, tiny=args.tiny, limit=args.limit))
        if args.json:
            args.json.write_text(json.dumps({"device": args.device, "tiny": args.tiny,
                                             "ops": results}, indent=1) + "\n")
    return 1 if any(r["failures"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
