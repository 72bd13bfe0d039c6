"""Quantized collectives over torch.distributed: flat 1D buffers and process groups in.

Public API::

    build_topology(group=None, ranks_per_node=None) -> DPTopology
    two_level_reduce_scatter(output, input, *, topology, config, op=ReduceOp.SUM,
                             async_op=False, seed, stats=None) -> CollectiveWork | None
    weight_difference_all_gather(replica, main_shard, *, group, config, seed, stats=None,
                                 async_op=False) -> CollectiveWork | None
    unquantized_all_gather(replica, main_shard, *, group, stats=None, async_op=False)
    GradientQuantConfig, WeightQuantConfig      # .from_sdp4bit(SDP4BitConfig)
    required_divisor(dp_size, ...), divisor_from_config(config, dp_size), pad_numel(numel, d)
    CommStats                                   # bytes sent (cumulative: .snapshot()), phase times

No megatron-core import here (dependency direction: integration -> comm -> quantization).
See docs/comm.md.
"""

from megatron.sdp4bit.comm.all_gather import unquantized_all_gather, weight_difference_all_gather
from megatron.sdp4bit.comm.config import GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.comm.error_feedback import ErrorFeedback, ErrorFeedbackConfig
from megatron.sdp4bit.comm.padding import (
    check_padded,
    divisor_from_config,
    pad_numel,
    required_divisor,
)
from megatron.sdp4bit.comm.reduce_scatter import two_level_reduce_scatter
from megatron.sdp4bit.comm.stats import CommStats
from megatron.sdp4bit.comm.topology import DPTopology, build_topology
from megatron.sdp4bit.comm.work import CollectiveWork

__all__ = [
    "ErrorFeedback",
    "ErrorFeedbackConfig",
    "CollectiveWork",
    "CommStats",
    "DPTopology",
    "GradientQuantConfig",
    "WeightQuantConfig",
    "build_topology",
    "check_padded",
    "divisor_from_config",
    "pad_numel",
    "required_divisor",
    "two_level_reduce_scatter",
    "unquantized_all_gather",
    "weight_difference_all_gather",
]
