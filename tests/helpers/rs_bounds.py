"""The reduce-scatter tests' oracle: the error bound of the two-level quantized reduce-scatter.

Shared by the collective's tests (tests/distributed/test_comm_reduce_scatter.py), the
integration's exactness tests and the rounding-noise tests. ``bounds`` is the rigorous
per-element bound (and the variance terms) in the Hadamard domain; ``gather_shards`` every
rank's input for this rank's shard.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def group_absmax(v: torch.Tensor, g: int) -> torch.Tensor:
    """Per-element absmax of the aligned group of g holding it; v [..., S]."""
    shape = v.shape
    return v.abs().reshape(*shape[:-1], -1, g).amax(-1, keepdim=True).expand(
        *shape[:-1], shape[-1] // g, g).reshape(shape)


def hadamard64(v: torch.Tensor, block: int) -> torch.Tensor:
    from megatron.sdp4bit.quantization.hadamard import hadamard_matrix

    h = hadamard_matrix(block).double()
    return (v.reshape(-1, block) @ h).reshape(v.shape)


def bounds(shards: torch.Tensor, n: int, m: int, cfg, avg: bool, rho: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B [S] rigorous, per-element; V-terms [S]; sum_k |x_k| [S]) in the transform domain.

    ``shards`` [W, S] fp64: every rank's input for this rank's shard. ``rho`` = 1 for
    stochastic rounding, 1/2 for nearest.
    """
    x = hadamard64(shards, cfg.hadamard_block) if cfg.hadamard_block else shards
    w = n * m
    if n > 1 and m > 1:
        s1 = group_absmax(x, cfg.intra_group_size) / qmax(cfg.intra_bits)  # [W, S]
        partial = x.view(m, n, -1).sum(1)
        e1_node = (rho * s1).view(m, n, -1).sum(1)
        s2 = group_absmax(partial.abs() + e1_node, cfg.inter_group_size) / qmax(cfg.inter_bits)
        bound = rho * (s1.sum(0) + s2.sum(0))
        var = (s1.square().sum(0) + s2.square().sum(0)) / 4
    else:
        bits, g = ((cfg.intra_bits, cfg.intra_group_size) if m == 1
                   else (cfg.inter_bits, cfg.inter_group_size))
        s = group_absmax(x, g) / qmax(bits)
        bound, var = rho * s.sum(0), s.square().sum(0) / 4
    scale = 1.0 / w if avg else 1.0
    return bound * scale, var * scale**2, x.abs().sum(0) * scale


def gather_shards(x: torch.Tensor, group, world: int, rank: int) -> torch.Tensor:
    """[W, S] fp64: every rank's input values for this rank's shard."""
    everything = torch.empty(world * x.numel(), dtype=torch.float64)
    dist.all_gather_single(everything, x.double(), group=group)
    s = x.numel() // world
    return everything.view(world, world, s)[:, rank, :]
