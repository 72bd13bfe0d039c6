#!/usr/bin/env python
"""Run pretrain_gpt.py's CUDA branch on a CPU-only machine, with NCCL's rules on collectives.

    torchrun --nproc-per-node 2 tools/cuda_dryrun.py <pretrain_gpt.py flags>

Every rank believes it has a GPU (``torch.cuda.is_available()`` is True), computes on the
CPU for real, and talks gloo underneath; a collective that NCCL would refuse on a GPU run
(a host tensor, a non-contiguous one, sizes that do not fit the group) stops the run with
one line naming the collective, the group and the tensor (exit status 3). How it works and
what it does not see: docs/cuda_dryrun.md. Refused on a machine with a GPU.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.sdp4bit.integration.cuda_dryrun import CudaDryRunError, enable_cuda_dryrun  # noqa: E402


def run(argv: list[str] | None = None) -> int:
    """Switch this process to the dry run, then run the trainer's ``main``."""
    enable_cuda_dryrun()
    import pretrain_gpt

    try:
        return pretrain_gpt.main(argv)
    except CudaDryRunError as err:
        print(f"cuda_dryrun.py: error: {err}", file=sys.stderr, flush=True)
        return 3


if __name__ == "__main__":
    sys.exit(run())
