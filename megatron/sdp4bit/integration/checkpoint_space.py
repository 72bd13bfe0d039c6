"""How many bytes a megatron-core sharded state dict puts on disk from this rank.

megatron-core's ``dist_checkpointing.save`` writes every ``ShardedTensor`` once, from the
rank that holds its main replica (``replica_id`` all zeros), and the optimizer's flattened
shards as their local slices; the factories (SwiGLU's ``linear_fc1``) save what they build.
The sum over the ranks of :func:`written_bytes` is the size of the ``.distcp`` files, short
of the small objects (RNG states, ``common.pt``) and the metadata, which the caller adds.
"""

from __future__ import annotations

from typing import Any

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)


def written_bytes(state: Any) -> int:
    """Bytes of the tensors this rank writes for ``state`` (a sharded state dict)."""
    total = 0
    values = nested_values(state) if isinstance(state, (dict, list)) else [state]
    for value in values:
        if isinstance(value, ShardedTensorFactory):
            total += written_bytes(value.build())
        elif isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
            data = value.data
            if data is not None:
                total += data.numel() * data.element_size()
    return total
