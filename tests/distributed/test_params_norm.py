"""``--log-params-norm``'s norm (integration/params_norm.py) on 4 gloo ranks, TP 2 x DP 2,
distributed optimizer: the norm of the whole model, each tensor-parallel shard counted once
and each weight tensor parallelism leaves whole (layer norms, biases of row-parallel layers,
position embeddings) once, whatever the data-parallel sharding of the main parameters.
With --bf16 the norm is the fp32 main parameters' (within bf16 rounding of the model's)."""

from __future__ import annotations

import math

import pytest

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed


def _whole_model_norm(ddp) -> float:
    """Independent reference: every TP rank's squares per parameter, gathered, split ones
    summed over the TP ranks, duplicated ones taken once."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    mine = {name: (bool(getattr(p, "tensor_model_parallel", False)),
                   float(p.detach().double().pow(2).sum()))
            for name, p in ddp.named_parameters()}
    group = ps.get_tensor_model_parallel_group()
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    total = 0.0
    for name, (split, sq) in every[0].items():
        total += sum(ranks[name][1] for ranks in every) if split else sq
    return math.sqrt(total)


def _worker(rank: int, world_size: int) -> None:
    from tests.helpers import tiny_gpt as T

    from megatron.sdp4bit.integration.params_norm import params_l2_norm

    T.init_parallel(tp=2)
    for bf16 in (False, True):
        setup = T.Setup(bf16=bf16)
        ddp, optimizer = T.build(setup)
        for step in range(2):
            T.train_step(ddp, optimizer, setup, step)
        got, want = params_l2_norm([ddp], bf16=bf16), _whole_model_norm(ddp)
        # fp32: the very values; bf16: fp32 main weights against their bf16 copies, each
        # rounded to within 2^-9 of itself
        bound = 2.0 ** -9 * want if bf16 else 1e-6 * want
        assert abs(got - want) <= bound, (bf16, got, want)
        # the layer norms' ones dominate the sum: a duplicate counted twice is far off
        assert want > 10, want


def test_params_norm_counts_each_weight_once():
    spawn(_worker, 4)
