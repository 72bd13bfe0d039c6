"""What the byte ratios of both trainers compare against (integration/accounting.py): the
words of the start-up and end lines name megatron-core's collectives in the dtypes the
unquantized counts are made of, so that a ratio against bf16 gradient reduction
(``--grad-reduce-in-bf16``) is never read as one against fp32.

The model chunks are stand-ins with megatron-core's buffer attributes (``param_dtype``,
``grad_dtype``, ``buckets`` with ``grad_data``; ``buffers`` and ``expert_parallel_buffers``
per chunk): the end lines themselves are checked in the launches
(tests/e2e/test_megatron_lm_trainer.py, tests/e2e/test_pretrain_gpt.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.sdp4bit.comm.stats import CommStats
from megatron.sdp4bit.integration.accounting import add_unquantized_iteration, references
from megatron.sdp4bit.integration.topologies import ModelTopologies

SHARD = 512  # elements per rank and bucket


def _buffer(param_dtype: torch.dtype, grad_dtype: torch.dtype, world: int = 4):
    bucket = SimpleNamespace(grad_data=torch.zeros(SHARD * world, dtype=grad_dtype))
    return SimpleNamespace(param_dtype=param_dtype, grad_dtype=grad_dtype, buckets=[bucket])


def _chunk(*buffers, experts=()):
    return SimpleNamespace(buffers=list(buffers), expert_parallel_buffers=list(experts),
                           ddp_config=SimpleNamespace(use_distributed_optimizer=True))


@pytest.mark.parametrize("param, grad, words", [
    (torch.bfloat16, torch.float32, ("bf16 parameter all-gather", "fp32 gradient reduction")),
    (torch.bfloat16, torch.bfloat16, ("bf16 parameter all-gather", "bf16 gradient reduction")),
    (torch.float16, torch.float32, ("fp16 parameter all-gather", "fp32 gradient reduction")),
    (torch.float32, torch.float32, ("fp32 parameter all-gather", "fp32 gradient reduction")),
], ids=["bf16", "grad-reduce-in-bf16", "fp16", "fp32"])
def test_the_reference_is_megatron_cores_collective_in_the_buffers_dtype(param, grad, words):
    got = references([_chunk(_buffer(param, grad))])
    assert (got["params"], got["grads"]) == words


def test_buffers_of_several_dtypes_name_them_all():
    """An expert buffer (MoE) counts too; a model whose buffers differ names every dtype."""
    chunk = _chunk(_buffer(torch.bfloat16, torch.bfloat16),
                   experts=[_buffer(torch.bfloat16, torch.float32)])
    assert references([chunk]) == {"params": "bf16 parameter all-gather",
                                   "grads": "bf16+fp32 gradient reduction"}


@pytest.mark.parametrize("grad, element", [(torch.float32, 4), (torch.bfloat16, 2)],
                         ids=["fp32", "bf16"])
def test_the_unquantized_count_is_made_of_the_named_dtype(grad, element):
    """megatron-core reduces the gradient buffers in their own dtype: the count behind the
    words is (W - 1) x shard x that element size (2 x 2 ranks: 3 shards per rank), so a
    ratio against bf16 gradient reduction is twice the one against fp32; the parameter
    all-gather sends the bf16 replica, 2 bytes per element."""
    stats = CommStats()
    topology = SimpleNamespace(world=4, ranks_per_node=2, nodes=2)  # DPTopology's numbers
    add_unquantized_iteration(stats, [_chunk(_buffer(torch.bfloat16, grad))],
                              ModelTopologies(dense=topology), params=True, grads=True)
    assert stats.grad_bytes == stats.grad_bytes_baseline == 3 * SHARD * element
    assert stats.param_bytes == stats.param_bytes_baseline == 3 * SHARD * 2
