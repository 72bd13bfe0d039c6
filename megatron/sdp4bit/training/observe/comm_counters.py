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

import torch

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


def _buckets(model_chunks):
    for chunk in model_chunks:
        for buffer in list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", [])):
            for bucket in buffer.buckets:
                yield buffer, bucket


def add_unquantized_iteration(stats: CommStats, model_chunks, *, dp_size: int,
                              ranks_per_node: int, distributed_optimizer: bool,
                              params: bool = True, grads: bool = True) -> None:
    """Add one iteration of megatron-core's unquantized collectives to ``stats`` (as both the
    sent bytes and the baseline): the parameter all-gather if ``params``, the gradient
    reduction if ``grads`` (the parts SDP4Bit does not replace in this iteration)."""
    n, m = ranks_per_node, dp_size // ranks_per_node
    for buffer, bucket in _buckets(model_chunks):
        shard = bucket.grad_data.numel() // dp_size
        grad_elem = bucket.grad_data.element_size()
        # A reduce-scatter sends (W-1) shards; an all-reduce (ring) twice that.
        factor = 1 if distributed_optimizer else 2
        intra = factor * (n - 1) * m * shard * grad_elem
        inter = factor * (m - 1) * shard * grad_elem
        if grads:
            stats.grad_intra_bytes += intra
            stats.grad_intra_bytes_baseline += intra
            stats.grad_inter_bytes += inter
            stats.grad_inter_bytes_baseline += inter
        if distributed_optimizer and params:
            param_elem = torch.empty((), dtype=buffer.param_dtype).element_size()
            stats.add_param_bytes(shard * param_elem, shard * param_elem, dp_size, n)


def snapshot_fields(stats: CommStats, iterations: int) -> dict[str, int]:
    """The log-line fields, averaged per iteration over ``iterations``; resets ``stats``."""
    snap = {attr: getattr(stats, attr) for attr in FIELDS.values()}
    stats.reset()
    it = max(iterations, 1)
    return {key: snap[attr] // it for key, attr in FIELDS.items()}
