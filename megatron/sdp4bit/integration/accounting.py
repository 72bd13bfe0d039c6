"""Megatron-core's own collectives in SDP4Bit's byte accounting.

[Note: one byte-accounting path]
Every counter only grows, from the install to the end of the run. SDP4Bit's collectives
count what they send into ``handle.stats`` (the expert buckets' part also into
``handle.expert_stats``); the collectives of megatron-core's that SDP4Bit does not replace
in an iteration (all of them when nothing is installed; the gradient reduction before
``--gradients-quantization-start-iteration``; the parameter all-gather without qWD) are
added once per iteration by :func:`add_unquantized_iteration`, by the same rule
(``comm/stats.py``). A reader takes the difference of two totals
(``comm/byte_counts.py``'s ``ByteCounts``): the plug-in every iteration, our trainer every
log line, the end line the totals themselves, so what the lines show adds up to what the
collectives counted (tests/distributed/test_integration_moe.py checks it over 10 iterations
with a log line in between). ``lifecycle.py`` does all of it for both trainers.
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.comm.stats import CommStats
from megatron.sdp4bit.integration.buckets import all_buffers, dense_buffers, expert_buffers
from megatron.sdp4bit.integration.topologies import ModelTopologies


def add_unquantized_iteration(stats: CommStats, model_chunks, topologies: ModelTopologies, *,
                              params: bool, grads: bool,
                              expert_stats: CommStats | None = None) -> None:
    """Add one iteration of megatron-core's own collectives to ``stats`` (sent = baseline):
    the parameter all-gather if ``params`` (distributed optimizer only), the gradient
    reduction if ``grads`` (a reduce-scatter with the distributed optimizer, else an
    all-reduce). The expert buffers' go to ``expert_stats``, a part of ``stats``
    (``CommStats.part``), on the expert group's topology."""
    for chunk in model_chunks:
        _add_buffers(stats, dense_buffers(chunk), topologies.dense, chunk.ddp_config, params,
                     grads)
        if topologies.expert is not None:
            _add_buffers(expert_stats, expert_buffers(chunk), topologies.expert,
                         chunk.ddp_config, params, grads)


def _add_buffers(stats: CommStats, buffers, topology, ddp_config, params: bool,
                 grads: bool) -> None:
    distributed = ddp_config.use_distributed_optimizer
    n, m = topology.ranks_per_node, topology.nodes
    for buffer in buffers:
        for bucket in buffer.buckets:
            shard = bucket.grad_data.numel() // topology.world
            if grads:
                stats.add_unquantized_grads(shard, bucket.grad_data.element_size(), n, m,
                                            all_reduce=not distributed)
            if distributed and params:
                element = torch.empty((), dtype=buffer.param_dtype).element_size()
                stats.add_unquantized_params(shard, element, topology.world, n)


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _dtype_names(dtypes) -> str:
    names = sorted({_DTYPE_NAMES.get(d, str(d).removeprefix("torch.")) for d in dtypes})
    return "+".join(names) or "-"


def references(model_chunks) -> dict[str, str]:
    """What the unquantized counts of ``model_chunks`` stand for, in words: megatron-core's
    parameter all-gather in the parameter buffers' dtype and its gradient reduction in the
    gradient buffers' dtype, the element sizes the counts are made of here and in the
    quantized collectives' baselines (``comm/stats.py``): ``{"params": "bf16 parameter
    all-gather", "grads": "fp32 gradient reduction"}`` with ``--bf16`` (``bf16 gradient
    reduction`` with ``--grad-reduce-in-bf16``, where megatron-core reduces in bf16 and a
    byte ratio against it is twice the one against fp32). Buffers of several dtypes name them
    all (``bf16+fp32``). Both trainers' start-up and end lines print them beside the ratios."""
    buffers = list(all_buffers(model_chunks))
    return {"params": f"{_dtype_names(b.param_dtype for b in buffers)} parameter all-gather",
            "grads": f"{_dtype_names(b.grad_dtype for b in buffers)} gradient reduction"}
