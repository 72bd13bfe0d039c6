"""Run the kernel-versus-reference checks of ``tests/helpers/kernel_checks.py`` on CUDA at
production-like sizes (groups of 2048 and 128, Hadamard block 32, several MB per call).

Run as ``python -m tests.helpers.cuda_checks OP`` from the repository root with
``TRITON_INTERPRET`` unset, so that the kernels are compiled, not interpreted (Triton decides
when the kernel modules are imported). ``test_kernels_cuda.py`` does that in a subprocess.
"""

from __future__ import annotations

import itertools
import sys
import traceback

import torch

from tests.helpers import kernel_checks as kc

DEV = "cuda"
SEED = (0x9E3779B9 << 32) | 0x80000001
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def qwd_sender():
    for bits, stochastic, replica in itertools.product(
            (4, 8), (False, True), (torch.bfloat16, torch.float32, None)):
        yield dict(numel=2048 * 1024, bits=bits, group=2048, replica_dtype=replica,
                   stochastic=stochastic, seed=SEED)
    yield dict(numel=2048 * 64, bits=4, group=2048, replica_dtype=torch.bfloat16,
               stochastic=True, seed=SEED, nonfinite=True)


def qwd_receiver():
    for bits, dtype, accumulate in itertools.product((4, 8), DTYPES, (True, False)):
        yield dict(world=8, shard=2048 * 128, bits=bits, group=2048, replica_dtype=dtype,
                   accumulate=accumulate, seed=bits, nan_group=3)


def tlq_sender():
    layouts = [(4, 8, 1, 16384), (4, 8, 2, 8192), (1, 8, 1, 65536), (8, 1, 1, 16384),
               (4, 2, 2, 64)]
    for layout, bits, hadamard, stochastic, dtype in itertools.product(
            layouts, (4, 8), (0, 32), (False, True), (torch.float32, torch.bfloat16)):
        blocks, dests, slices, chunk = layout
        yield dict(blocks=blocks, dests=dests, slices=slices, chunk=chunk, bits=bits,
                   group=128, hadamard=hadamard, dtype=dtype, stochastic=stochastic,
                   seed=SEED, nonfinite=layout[0] == 4)


def tlq_middle():
    for n_in, n_out, stochastic in itertools.product((1, 8), (1, 4), (False, True)):
        yield dict(n_in=n_in, numel=128 * 8192, bits_in=8, group_in=128, n_out=n_out,
                   bits_out=4, group_out=128, stochastic=stochastic, seed=SEED, nan_group=5)
    yield dict(n_in=4, numel=128 * 8192, bits_in=8, group_in=256, n_out=2, bits_out=4,
               group_out=128, stochastic=True, seed=SEED)


def tlq_receiver():
    for n_in, hadamard, dtype, (scale, acc) in itertools.product(
            (1, 4), (0, 32), DTYPES, ((1.0, False), (0.125, True), (1 / 3, False))):
        yield dict(n_in=n_in, numel=128 * 8192, bits=4, group=128, hadamard=hadamard,
                   scale=scale, accumulate=acc, dtype=dtype, seed=n_in, nan_group=7)


CASES = {f.__name__: f for f in (qwd_sender, qwd_receiver, tlq_sender, tlq_middle,
                                 tlq_receiver)}


def main(op: str) -> int:
    check = getattr(kc, f"check_{op}")
    failures = 0
    for case in CASES[op]():
        try:
            check(DEV, **case)
        except AssertionError:
            failures += 1
            print(f"FAILED {op} {case}\n{traceback.format_exc(limit=1)}")
    print(f"{op}: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
