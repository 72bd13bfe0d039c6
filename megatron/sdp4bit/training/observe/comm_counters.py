"""Per-iteration communication bytes for the log line.

With SDP4Bit installed, the integration's ``CommStats`` counts the bytes of the messages the
quantized collectives sent and what ideal unquantized collectives would send. Without it
(the baseline run), megatron-core's own collectives run; their bytes follow from the bucket
sizes, by the same accounting rule as ``megatron.sdp4bit.comm.stats`` (bytes leaving this
rank, split by destination node; the reduce-scatter split into the hops of the two-level
schedule), so both runs' fields compare. All are computed, ideal figures: gloo's
``reduce_scatter_tensor``, for one, sends about 3x what it counts here (an all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.sdp4bit.comm.stats import CommStats

FIELDS = {
    "comm_bytes_params": "param_bytes",
    "baseline_comm_bytes_params": "param_bytes_baseline",
    "comm_bytes_params_intra": "param_intra_bytes",
    "baseline_comm_bytes_params_intra": "param_intra_bytes_baseline",
    "comm_bytes_params_inter": "param_inter_bytes",
    "baseline_comm_bytes_params_inter": "param_inter_bytes_baseline",
    "comm_bytes_grads_intra": "grad_intra_bytes",
    "baseline_comm_bytes_grads_intra": "grad_intra_bytes_baseline",
    "comm_bytes_grads_inter": "grad_inter_bytes",
    "baseline_comm_bytes_grads_inter": "grad_inter_bytes_baseline",
}


EXPERT_FIELDS = {"comm_bytes_expert_" + key[len("comm_bytes_"):]: attr
                 for key, attr in FIELDS.items() if key.startswith("comm_bytes_")
                 and key.endswith(("_intra", "_inter"))}
EXPERT_FIELDS.update({"baseline_" + key: FIELDS["baseline_comm_bytes_" + key[len(
    "comm_bytes_expert_"):]] for key in list(EXPERT_FIELDS)})
"""The part of the traffic sent for the expert-parallel buckets of a MoE model (on the expert
data-parallel group), per hop; also counted in the fields of :data:`FIELDS`."""


@dataclass(frozen=True)
class ExpertLayout:
    """The expert data-parallel group as the byte accounting sees it."""

    stats: CommStats
    """The expert part of the run's counters (:meth:`CommStats.part`)."""
    dp_size: int
    ranks_per_node: int


def expert_layout(stats: CommStats, model_chunks, dp_ranks_per_node: int) -> ExpertLayout | None:
    """The :class:`ExpertLayout` of a MoE model (None for a dense one). Collective over the
    world (every rank's node, once): which ranks of the expert data-parallel group share a
    node follows from the dense layout (integration/install.py, [Note: expert-parallel
    buckets])."""
    if not any(getattr(chunk, "expert_parallel_buffers", None) for chunk in model_chunks):
        return None
    from megatron.core import parallel_state

    from megatron.sdp4bit.integration.install import expert_node

    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, expert_node(dp_ranks_per_node))
    group = parallel_state.get_expert_data_parallel_group()
    members = dist.get_process_group_ranks(group)
    mine = nodes[dist.get_rank()]
    return ExpertLayout(stats=stats.part(), dp_size=len(members),
                        ranks_per_node=sum(1 for g in members if nodes[g] == mine))


def add_unquantized_iteration(stats: CommStats, model_chunks, *, dp_size: int,
                              ranks_per_node: int, distributed_optimizer: bool,
                              params: bool = True, grads: bool = True,
                              expert: ExpertLayout | None = None) -> None:
    """Add one iteration of megatron-core's unquantized collectives to ``stats`` (as both the
    sent bytes and the baseline): the parameter all-gather if ``params``, the gradient
    reduction if ``grads`` (the parts SDP4Bit does not replace in this iteration). The
    expert-parallel buffers (``expert``: their group's layout) count into its part."""
    for chunk in model_chunks:
        _add_buffers(stats, chunk.buffers, dp_size, ranks_per_node, distributed_optimizer,
                     params, grads)
        if expert is not None:
            _add_buffers(expert.stats, chunk.expert_parallel_buffers, expert.dp_size,
                         expert.ranks_per_node, distributed_optimizer, params, grads)


def _add_buffers(stats: CommStats, buffers, dp_size: int, ranks_per_node: int,
                 distributed_optimizer: bool, params: bool, grads: bool) -> None:
    n, m = ranks_per_node, dp_size // ranks_per_node
    for buffer, bucket in ((buffer, bucket) for buffer in buffers for bucket in buffer.buckets):
        shard = bucket.grad_data.numel() // dp_size
        grad_elem = bucket.grad_data.element_size()
        # A reduce-scatter sends (W-1) shards; an all-reduce (ring) twice that.
        factor = 1 if distributed_optimizer else 2
        intra = factor * (n - 1) * m * shard * grad_elem
        inter = factor * (m - 1) * shard * grad_elem
        if grads:
            stats.add_grad_bytes(intra, inter, intra, inter)
        if distributed_optimizer and params:
            param_elem = torch.empty((), dtype=buffer.param_dtype).element_size()
            stats.add_param_bytes(shard * param_elem, shard * param_elem, dp_size, n)


def snapshot_fields(stats: CommStats, iterations: int,
                    expert: CommStats | None = None) -> dict[str, int]:
    """The log-line fields, averaged per iteration over ``iterations``; resets ``stats``
    (and ``expert``, its expert part, whose fields :data:`EXPERT_FIELDS` are added)."""
    it = max(iterations, 1)
    out = {key: getattr(stats, attr) // it for key, attr in FIELDS.items()}
    stats.reset()
    if expert is not None:
        out.update({key: getattr(expert, attr) // it for key, attr in EXPERT_FIELDS.items()})
        expert.reset()
    return out
