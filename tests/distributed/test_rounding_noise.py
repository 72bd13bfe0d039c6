"""The rounding noise of the quantized collectives, on 4 gloo ranks: independent across
ranks, hops, slices, buckets, iterations and collectives, and unbiased end to end.

Every stochastic quantization a rank makes is recorded off the wire next to its input
(``tests/helpers/noise.py``); all ranks' records meet on every rank, and every pair must be
uncorrelated: a seed that misses the DP rank, the hop, the slice, the bucket or the iteration
makes two of them share their uniforms and their ``z`` jump to ~``sqrt(n) / 2`` (tens to
hundreds here). Within one call, the messages to different destinations and slices must be
uncorrelated too (one stream runs through them all). The pooled roundings must be unbiased per bin of ``f`` to 0.01 of a step.

End to end, the reduce-scatter's output error (in the Hadamard domain, where the roundings
happen) sums to ``Z = sum err / sqrt(V)`` with ``V`` the variance bound of
test_comm_reduce_scatter.py's [Note: the error bounds these tests assert]; unbiased hops give
``|Z| < 6``. At these sizes a bias of 0.01 step in every rounding would give ``|Z| >= 12``
(asserted from the data: the test has the power it claims). Both the default backend
(the CPU kernels) and the torch references run it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers import noise as _noise
from tests.helpers import rs_bounds as rsb
from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

SHARD = 1 << 13  # per rank; a bucket of 32k elements over 4 ranks
G_INTRA, G_INTER, H = 128, 128, 32


def _data(rank: int, it: int, bucket: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * it + 100 * bucket + rank)
    x = torch.randn(4 * SHARD, generator=gen)
    x[::61] *= 30.0  # gradient-like outliers
    return x


def _record_everything(topo, rank: int) -> list[_noise.Rounding]:
    """Two iterations x two buckets of TLq-HS (P = 2) and a qWD all-gather per iteration."""
    from megatron.sdp4bit.comm import (GradientQuantConfig, WeightQuantConfig,
                                       two_level_reduce_scatter, weight_difference_all_gather)
    from megatron.sdp4bit.quantization import derive_seed

    gcfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                               hadamard_block=H, pipeline_slices=2)
    wcfg = WeightQuantConfig(group_size=2048)
    replica = (0.02 * torch.randn(4 * SHARD, generator=torch.Generator().manual_seed(5))
               ).to(torch.bfloat16)  # the same everywhere
    main = replica[rank * SHARD:(rank + 1) * SHARD].float()
    recorder = _noise.Recorder()
    user_seed = 1234 + topo.ranks_per_node  # each topology stands for a run of its own
    with recorder.active():
        for it in range(2):
            for bucket in range(2):
                recorder.tag = f"{topo.ranks_per_node}x{topo.nodes}/it{it}/bucket{bucket}/"
                two_level_reduce_scatter(torch.empty(SHARD), _data(rank, it, bucket),
                                         topology=topo, config=gcfg,
                                         seed=derive_seed(user_seed, it, bucket))
            recorder.tag = f"{topo.ranks_per_node}x{topo.nodes}/it{it}/params/"
            main += 1e-3 * torch.randn(SHARD, generator=torch.Generator().manual_seed(it + rank))
            weight_difference_all_gather(replica, main, group=None, config=wcfg,
                                         seed=derive_seed(user_seed, it, 99))
    return recorder.roundings


def _end_to_end_bias(topo, rank: int, backend: str) -> None:
    """Z of the collective's summed output error, pooled over ranks and calls (see module)."""

    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter
    from megatron.sdp4bit.quantization import derive_seed

    cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                              hadamard_block=H, pipeline_slices=2, kernel_backend=backend)
    n, m = topo.ranks_per_node, topo.nodes
    totals = torch.zeros(3, dtype=torch.float64)  # sum err, V, sum of the roundings' steps
    for call in range(8):
        x = _data(rank, 10 + call, 0)
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, x, topology=topo, config=cfg, seed=derive_seed(7, call))
        shards = rsb.gather_shards(x, topo.group, topo.world, rank)  # [W, S] fp64
        err = rsb.hadamard64(out.double() - shards.sum(0), H)
        _, var, _ = rsb.bounds(shards, n, m, cfg, avg=False, rho=1.0)
        # the steps of both hops, to first order (hop 2 from the exact node partial sums)
        xh = rsb.hadamard64(shards, H)
        partial = xh.view(m, n, -1).sum(1)
        steps = (rsb.group_absmax(xh, G_INTRA).sum() / (2 ** (cfg.intra_bits - 1) - 1)
                 + rsb.group_absmax(partial, G_INTER).sum() / (2 ** (cfg.inter_bits - 1) - 1))
        totals += torch.tensor([err.sum().item(), var.sum().item(), steps.item()])
    dist.all_reduce(totals)
    total_err, v, steps = totals.tolist()
    # a bias of 0.01 step in every rounding would move Z by this much
    assert 0.01 * steps / v ** 0.5 >= 2 * _noise.Z_LIMIT, "too few samples to resolve 0.01 step"
    z = total_err / v ** 0.5
    assert abs(z) < _noise.Z_LIMIT, (f"{backend} {n}x{m}: the reduce-scatter's output error "
                                     f"is biased (Z = {z:.1f})")


def _worker(rank: int, world: int) -> None:
    from megatron.sdp4bit.comm import build_topology

    roundings = []
    for n in (2, 1, 4):  # 2 nodes x 2, then one inter-node hop, then one intra-node hop
        topo = build_topology(None, ranks_per_node=n)
        roundings += _record_everything(topo, rank)
        if n == 2:
            for backend in ("auto", "torch"):
                _end_to_end_bias(topo, rank, backend)
    # the messages of one call (one per destination and slice) draw distinct uniforms
    within = torch.tensor([_noise.assert_messages_independent(roundings, f"rank {rank}")])
    dist.all_reduce(within)
    assert within.item() >= world * 4 * 6, within.item()  # at least the 2x2 senders' 4 messages
    sums = _noise.bin_sums(roundings)
    dist.all_reduce(sums)
    _noise.assert_unbiased_sums(sums, "the collectives' roundings")
    everything = _noise.gather_roundings(roundings)
    # 2x2: per call 1 sender + 2 slices' requantizations; one hop: 1 sender; + qWD
    per_rank = (4 * 3 + 2) + (4 + 2) + (4 + 2)
    assert len(everything) == world * per_rank, len(everything)
    pairs = torch.tensor([_noise.assert_independent(everything, f"rank {rank}",
                                                    part=(rank, world))])
    dist.all_reduce(pairs)
    assert pairs.item() == len(everything) * (len(everything) - 1) // 2


def test_rounding_noise_is_independent_and_unbiased() -> None:
    spawn(_worker, 4, timeout=300)
