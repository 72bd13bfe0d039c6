"""Rank placement on real gloo ranks: a cyclic placement (``srun --distribution=cyclic``:
consecutive ranks on different nodes) is refused on every rank, also when N is given or
detected by the trainer, instead of sending the 8-bit intra-node hop across nodes.

The 4 ranks run on one host; torchrun's ``GROUP_RANK`` (which :func:`node_id` reads) is set
per rank to place them: rank r on node ``r % 2`` (cyclic) or ``r // 2`` (blocks).
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.comm import build_topology
    from megatron.sdp4bit.training.build import detect_dp_ranks_per_node

    T.init_parallel(1, 1)
    os.environ["GROUP_RANK"] = str(rank % 2)  # cyclic: ranks 0, 2 on node 0; 1, 3 on node 1
    # The trainer: detect N (2 ranks per node), then install with it as ranks_per_node.
    n = detect_dp_ranks_per_node()
    assert n == 2
    with pytest.raises(ValueError, match=r"makes global ranks \[0, 1\] .* run on different "
                                         r"nodes \[.*/node0', '.*/node1'\]"):
        build_topology(None, ranks_per_node=n)
    with pytest.raises(ValueError, match="not one contiguous block"):
        build_topology(None)
    one = build_topology(None, ranks_per_node=1)  # every hop inter-node: correct here
    assert (one.ranks_per_node, one.nodes) == (1, 4)

    os.environ["GROUP_RANK"] = str(rank // 2)  # blocks: ranks 0, 1 on node 0
    assert detect_dp_ranks_per_node() == 2
    topo = build_topology(None, ranks_per_node=2)
    assert (topo.ranks_per_node, topo.nodes, topo.node) == (2, 2, rank // 2)
    with pytest.raises(ValueError, match=r"makes global ranks \[0, 1, 2, 3\] .* different"):
        build_topology(None, ranks_per_node=4)  # would join the two nodes into one
    dist.barrier()  # every rank raised alike: nobody waits in a collective


def test_cyclic_placement_is_refused_with_or_without_ranks_per_node() -> None:
    spawn(_worker, 4, timeout=240)
