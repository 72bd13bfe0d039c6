"""Where a megatron-core model's data-parallel groups run: the topology of the dense buffers'
group and, in a MoE model, of the expert-parallel buffers' group.

``install_sdp4bit`` quantizes each bucket on its group's topology and its handle exposes
them (``handle.topologies``); a trainer that installs nothing (a baseline run) counts
megatron-core's own collectives on the same topologies (``lifecycle.py``). Which ranks of
the expert group share a node follows from the dense layout: install.py, [Note:
expert-parallel buckets].
"""

from __future__ import annotations

import dataclasses

from megatron.sdp4bit.comm import DPTopology, build_topology
from megatron.sdp4bit.comm.topology import node_id
from megatron.sdp4bit.integration.buckets import dense_buffers, expert_buffers


@dataclasses.dataclass(frozen=True)
class ModelTopologies:
    """The two kinds of data-parallel group of a model's buffers."""

    dense: DPTopology | None
    """The group of the dense buffers (the data-parallel group, with context parallelism
    its product with the context-parallel group); None for a model without buffers."""
    expert: DPTopology | None = None
    """The expert data-parallel group of a MoE model's expert-parallel buffers; None
    without them."""


def expert_node(dp_ranks_per_node: int | None) -> str | None:
    """Where this rank runs, as the expert data-parallel group's topology sees it ([Note:
    expert-parallel buckets]): with ``dp_ranks_per_node`` N, the simulated node of the
    dense DP layout (its dense DP rank // N, on its real node); None: the real node."""
    if dp_ranks_per_node is None:
        return None
    from megatron.core import parallel_state

    dense_rank = parallel_state.get_data_parallel_rank()
    return f"{node_id()}/dp-node{dense_rank // dp_ranks_per_node}"


def _one_group(buffers: list, kind: str):
    groups = {id(buffer.data_parallel_group): buffer.data_parallel_group for buffer in buffers}
    assert len(groups) <= 1, f"the {kind} buffers of one rank run on {len(groups)} groups"
    return next(iter(groups.values()), None)


def model_topologies(model_chunks, dp_ranks_per_node: int | None) -> ModelTopologies:
    """The topologies of ``model_chunks``' (megatron-core DDP modules) buffers' groups.
    Collective over the world (``build_topology``): every rank calls it at the same point,
    and every rank has expert-parallel buffers or none does."""
    dense = _one_group([b for chunk in model_chunks for b in dense_buffers(chunk)], "dense")
    expert = _one_group([b for chunk in model_chunks for b in expert_buffers(chunk)], "expert")
    return ModelTopologies(
        dense=None if dense is None else build_topology(dense, dp_ranks_per_node),
        expert=None if expert is None else build_topology(
            expert, node=expert_node(dp_ranks_per_node)))
