"""Several ranks on one CUDA device, gloo carrying the collectives: the flags and the log
lines that the GPU test (tests/gpu/test_training_cuda.py, on a real GPU) and its CUDA dry-run
twin (tests/e2e/test_cuda_dryrun.py, the same branch emulated on CPU) share.

4 ranks act as 2 "nodes" x 2 ranks (``--dp-ranks-per-node 2``), so that one device runs both
hops of TLq-HS (8-bit inside a node, 4-bit across) and the qWD all-gather between real
processes: a data-parallel world of 1 quantizes nothing. docs/gpu.md, "Several ranks on one
GPU".
"""

from __future__ import annotations

import re

RANKS = 4
MODE = ["--distributed-backend", "gloo", "--dp-ranks-per-node", "2"]
# Every SDP4Bit flag, with megatron-core's overlap of both collectives over several buckets and
# the two-slice all-to-all pipeline; the replica check after every iteration stops the run at
# the first bucket whose bf16 replicas differ between the data-parallel ranks.
SDP4BIT = ["--quantized-weights", "--quantized-gradients", "--hadamard-transform",
           "--gq-group-size-intra", "128", "--gradient-alltoall-pipeline", "2",
           "--overlap-grad-reduce", "--overlap-param-gather", "--check-replicas-interval", "1"]

SHARING = re.compile(r"^(\d+) ranks share (\d+) CUDA device\(s\) \(--distributed-backend gloo\)",
                     re.M)
INSTALLED = re.compile(r"SDP4Bit installed on (\d+) bucket\(s\)")
COUNTS = re.compile(r"SDP4Bit on this rank: (\d+) quantized gradient reduce-scatters, (\d+) "
                    r"quantized parameter all-gathers")


def expected_counts(buckets: int, iterations: int) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) one rank quantizes in a run of :data:`SDP4BIT`: one
    reduce-scatter per bucket and step; one all-gather per bucket and step, each step's update
    sent once (megatron-core's forward pre-hook with --overlap-param-gather dispatches it in
    the next iteration's forward pass; the last step's when SDP4Bit is uninstalled at the end
    of the run). The first iteration's forward pass has no update to send and sends nothing."""
    return buckets * iterations, buckets * iterations


def counts(stdout: str) -> tuple[int, int, int]:
    """(buckets, quantized reduce-scatters, quantized all-gathers) from a run's log."""
    installed, done = INSTALLED.search(stdout), COUNTS.search(stdout)
    assert installed and done, stdout[-3000:]
    return int(installed[1]), int(done[1]), int(done[2])
