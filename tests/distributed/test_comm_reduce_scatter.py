"""TLq / TLq-HS two-level reduce-scatter on real gloo ranks, every N x M topology in one spawn.

[Note: the error bounds these tests assert]
A b-bit group quantizer with scale ``s = absmax / qmax`` (``qmax = 2**(b-1) - 1``) makes a
per-element error ``|e| < s`` with stochastic rounding (``|e| <= s/2`` to nearest), and
stochastic rounding is unbiased with ``E[e^2] = s^2 f(1-f) <= s^2/4``.

Compose the hops for the element i of shard r (in the Hadamard domain when the transform is
on: it is orthonormal per block, so block 2-norms are preserved; the bound is then checked
per block of H values):

* intra hop: each of the W senders k quantizes its value with scale ``s1_k`` (its group of
  ``intra_group_size`` at ``intra_bits``): error ``e1_k``, ``|e1_k| < s1_k``;
* node m requantizes its partial sum ``y_m = p_m + sum_{k in m} e1_k`` (``p_m`` the exact
  partial) with scale ``s2_m = absmax_group(y_m) / qmax2 <= max_group(|p_m| + sum |e1_k|)
  / qmax2``: error ``|e2_m| < s2_m``;
* so ``|err_i| < B_i = sum_k s1_k + sum_m s2_m`` (rigorous; one hop only: ``sum_k s_k``),
  and, errors being zero-mean and uncorrelated, ``E||err||^2 <= V = sum_i (sum_k s1_k^2 +
  sum_m s2_m^2) / 4``. The statistical check asserts ``||err||^2 <= 2 V`` over >= 512
  elements (Hoeffding: a failure chance below e^-60 for correct code), tight enough to
  catch any routing mistake, which makes errors the size of the data.

AVG divides everything by W. fp32 arithmetic adds ~1e-6 relative (slack 1e-5 of
``sum_k |x_k|``); a bf16 output adds a rounding of at most ``2^-8 |value|``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from tests.helpers import rs_bounds as rsb
from tests.helpers.spawn import spawn
from megatron.sdp4bit.quantization.backend import triton_available

pytestmark = pytest.mark.distributed

G_INTRA, G_INTER, H = 64, 32, 32
SHARD = 512  # elements per rank's shard: a multiple of the divisor's per-shard unit at P=4


def _check_error(out: torch.Tensor, shards: torch.Tensor, n: int, m: int, cfg, avg: bool,
                 statistical: bool = True) -> float:
    """Assert the bounds of the module docstring; return the relative L2 error."""
    ref = shards.sum(0) / (n * m if avg else 1)
    err = out.double() - ref
    rho = 1.0 if cfg.stochastic else 0.5
    bound, var, mag = rsb.bounds(shards, n, m, cfg, avg, rho)
    out_round = 2.0**-8 * (ref.abs() + bound) if out.dtype == torch.bfloat16 else 0 * ref
    block = cfg.hadamard_block or 1
    # per element (no Hadamard) or per block 2-norm (Hadamard: orthonormal per block)
    e_blk = err.view(-1, block).norm(dim=1)
    limit = (bound * (1 + 1e-4) + 1e-5 * mag).view(-1, block).norm(dim=1) \
        + out_round.view(-1, block).norm(dim=1)
    worst = (e_blk / limit).max().item()
    assert worst <= 1.0, f"error exceeds the rigorous bound by {worst:.3f}x"
    if statistical:
        noise = err.norm() - out_round.norm() - 1e-5 * mag.norm()
        assert noise.item() ** 2 <= 2 * var.sum().item(), (
            f"||err||^2 = {noise.item() ** 2:.4g} > 2 V = {2 * var.sum().item():.4g}")
    return (err.norm() / ref.norm()).item()


def _data(rank: int, length: int, seed: int, outliers: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(length, generator=gen)
    if outliers:  # one large value in every 64: TLq-HS's motivating gradient shape
        pos = torch.arange(0, length, 64) + torch.randint(0, 64, (length // 64,), generator=gen)
        x[pos] = 60.0 * torch.sign(torch.randn(pos.numel(), generator=gen))
    return x


def _accuracy_cases(topo, world: int, rank: int) -> None:
    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter

    for case, (op, dtype, hadamard, async_op) in enumerate(
            [(op, dtype, hb, a) for op in (ReduceOp.SUM, ReduceOp.AVG)
             for dtype in (torch.float32, torch.bfloat16) for hb in (0, H)
             for a in (False, True)]):
        cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                                  hadamard_block=hadamard, pipeline_slices=2,
                                  kernel_backend="torch")
        # two buckets in flight at once when async: both must complete correctly
        xs = [_data(rank, world * SHARD, 10 * case + b).to(dtype) for b in range(2)]
        outs = [torch.full((SHARD,), float("nan"), dtype=dtype) for _ in xs]
        handles = [two_level_reduce_scatter(o, x, topology=topo, config=cfg, op=op,
                                            async_op=async_op, seed=case * 7 + b)
                   for b, (o, x) in enumerate(zip(outs, xs))]
        assert all((h is None) != async_op for h in handles)
        for h in handles:
            if h is not None:
                assert h.wait() and h.is_completed()
        for o, x in zip(outs, xs):
            shards = rsb.gather_shards(x, topo.group, world, rank)
            _check_error(o, shards, topo.ranks_per_node, topo.nodes, cfg, op == ReduceOp.AVG)
    # In place, as megatron-core calls it: the output is this rank's shard of the input.
    for async_op in (False, True):
        x = _data(rank, world * SHARD, 13)
        expected = torch.empty(SHARD)
        two_level_reduce_scatter(expected, x, topology=topo, config=cfg, seed=8)
        handle = two_level_reduce_scatter(x[rank * SHARD:(rank + 1) * SHARD], x, topology=topo,
                                          config=cfg, seed=8, async_op=async_op)
        if handle is not None:
            handle.wait()
        assert torch.equal(x[rank * SHARD:(rank + 1) * SHARD], expected)
    # Same data as torch's own reduce-scatter (reduce_scatter_single, the new name of
    # reduce_scatter_tensor; gloo supports it for fp32 SUM).
    cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                              hadamard_block=H, pipeline_slices=2, kernel_backend="torch")
    x = _data(rank, world * SHARD, 99)
    ours, theirs = torch.empty(SHARD), torch.empty(SHARD)
    two_level_reduce_scatter(ours, x, topology=topo, config=cfg, seed=3)
    dist.reduce_scatter_single(theirs, x.clone(), group=topo.group)
    shards = rsb.gather_shards(x, topo.group, world, rank)
    bound, _, mag = rsb.bounds(shards, topo.ranks_per_node, topo.nodes, cfg, False, 1.0)
    diff = rsb.hadamard64(ours.double() - theirs.double(), H)
    assert (diff.view(-1, H).norm(dim=1)
            <= (bound * 1.001 + 2e-5 * mag).view(-1, H).norm(dim=1)).all()


def _pipeline_and_variant_cases(topo, world: int, rank: int) -> None:
    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter

    n, m = topo.ranks_per_node, topo.nodes
    x = _data(rank, world * SHARD, 5)
    # Round to nearest: slicing only reorders messages, so P = 1, 2, 4 agree bit for bit.
    results = []
    for p in (1, 2, 4):
        cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                                  hadamard_block=H, pipeline_slices=p, stochastic=False,
                                  kernel_backend="torch")
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, x, topology=topo, config=cfg, seed=1)
        results.append(out)
    shards = rsb.gather_shards(x, topo.group, world, rank)
    _check_error(results[0], shards, n, m, cfg, False, statistical=False)
    for p, out in zip((2, 4), results[1:]):
        assert torch.equal(out, results[0]), f"P={p} differs from P=1 with nearest rounding"

    # Outlier-heavy gradients: the Hadamard transform lowers the error.
    xo = _data(rank, world * SHARD, 6, outliers=True)
    shards_o = rsb.gather_shards(xo, topo.group, world, rank)
    errs = {}
    for hb in (0, H):
        cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                                  hadamard_block=hb, kernel_backend="torch")
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, xo, topology=topo, config=cfg, seed=2)
        errs[hb] = _check_error(out, shards_o, n, m, cfg, False, statistical=False)
    assert errs[H] < 0.7 * errs[0], f"Hadamard did not help on outliers: {errs}"

    # ULq (4-bit on both hops) is worse than TLq (8-bit intra, 4-bit inter) where an intra
    # hop exists; with N = 1 the intra bit width is unused and both must agree exactly.
    errs = {}
    outs = {}
    for intra_bits in (8, 4):
        cfg = GradientQuantConfig(intra_bits=intra_bits, intra_group_size=G_INTRA,
                                  inter_group_size=G_INTER, kernel_backend="torch")
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, x, topology=topo, config=cfg, seed=4)
        errs[intra_bits] = _check_error(out, shards, n, m, cfg, False)
        outs[intra_bits] = out
    if n > 1:
        assert errs[4] > 1.2 * errs[8], f"ULq not worse than TLq: {errs}"
    else:
        assert torch.equal(outs[4], outs[8])


def _expected_bytes(numel: int, bits: int, group: int) -> int:
    """Wire size of one message, written out: fp32 scales + packed payload."""
    return 4 * math.ceil(numel / group) + numel * bits // 8


def _byte_cases(topo, world: int, rank: int) -> None:
    """The counters equal the formula and what actually went into the collectives."""
    from megatron.sdp4bit.comm import CommStats, GradientQuantConfig, two_level_reduce_scatter

    n, m = topo.ranks_per_node, topo.nodes
    sent = {"intra": 0, "inter": 0}
    original = dist.all_to_all_single

    def counting(output, input, *args, group=None, **kwargs):
        hop = "intra" if group is topo.intra_group else "inter"
        assert group is (topo.intra_group if hop == "intra" else topo.inter_group)
        k = dist.get_world_size(group)
        sent[hop] += input.numel() * input.element_size() * (k - 1) // k
        return original(output, input, *args, group=group, **kwargs)

    # Distinct bits and group sizes per hop: each flag must show on its own hop only.
    cfg = GradientQuantConfig(intra_bits=4, intra_group_size=128, inter_bits=8,
                              inter_group_size=32, pipeline_slices=4, kernel_backend="torch")
    stats = CommStats()
    dist.all_to_all_single = counting
    try:
        for dtype in (torch.float32, torch.bfloat16):
            two_level_reduce_scatter(torch.empty(SHARD, dtype=dtype),
                                     _data(rank, world * SHARD, 8).to(dtype),
                                     topology=topo, config=cfg, seed=0, stats=stats)
    finally:
        dist.all_to_all_single = original
    p, c = 4, SHARD // 4
    if n > 1 and m > 1:
        intra = 2 * (n - 1) * p * _expected_bytes(m * c, 4, 128)
        inter = 2 * (m - 1) * p * _expected_bytes(c, 8, 32)
    else:
        intra = 2 * (n - 1) * _expected_bytes(SHARD, 4, 128)
        inter = 2 * (m - 1) * _expected_bytes(SHARD, 8, 32)
    assert (stats.grad_intra_bytes, stats.grad_inter_bytes) == (intra, inter)
    assert (sent["intra"], sent["inter"]) == (intra, inter)
    per_elem = 4 + 2  # one fp32 call and one bf16 call
    assert stats.grad_intra_bytes_baseline == (n - 1) * m * SHARD * per_elem
    assert stats.grad_inter_bytes_baseline == (m - 1) * SHARD * per_elem
    assert stats.grad_bytes_baseline == (world - 1) * SHARD * per_elem  # = ring reduce-scatter
    snap = stats.snapshot()
    stats.reset()
    assert stats.snapshot() == dict.fromkeys(snap, 0) and snap["grad_intra_bytes"] == intra


def _advance_cases(topo, world: int, rank: int) -> None:
    """``advance()`` issues the inter-node hops before ``wait()`` and changes no bit.

    Counted by wrapping ``dist.all_to_all_single``: with two hops, the call issues the P intra
    hops only, ``advance()`` the P inter hops (twice: still P), ``wait()`` nothing more. With
    one hop the single all-to-all goes at call time and ``advance()`` issues nothing.
    """
    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter

    two_hops = topo.ranks_per_node > 1 and topo.nodes > 1
    issued = {"intra": 0, "inter": 0}
    original = dist.all_to_all_single

    def counting(output, input, *args, group=None, **kwargs):
        issued["intra" if group is topo.intra_group else "inter"] += 1
        return original(output, input, *args, group=group, **kwargs)

    xs = [_data(rank, world * SHARD, 20 + b) for b in range(2)]
    for p in (1, 2):
        for stochastic in (False, True):
            cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                                      hadamard_block=H, pipeline_slices=p,
                                      stochastic=stochastic, kernel_backend="torch")
            expected = []
            for b, x in enumerate(xs):  # synchronous: never advanced from outside
                expected.append(torch.empty(SHARD))
                two_level_reduce_scatter(expected[-1], x, topology=topo, config=cfg, seed=b)
            # Async, waited without advance(): the inter hops go out inside wait().
            plain = torch.empty(SHARD)
            two_level_reduce_scatter(plain, xs[0], topology=topo, config=cfg, seed=0,
                                     async_op=True).wait()
            assert torch.equal(plain, expected[0])
            # As the integration does it: bucket 0 is advanced before bucket 1 is issued.
            outs = [torch.empty(SHARD) for _ in xs]
            dist.all_to_all_single = counting
            try:
                issued.update(intra=0, inter=0)
                first = two_level_reduce_scatter(outs[0], xs[0], topology=topo, config=cfg,
                                                 seed=0, async_op=True)
                at_call = dict(issued)
                first.advance()
                after_advance = dict(issued)
                first.advance()  # idempotent
                assert issued == after_advance and first.is_advanced()
                assert not first.is_completed()
                second = two_level_reduce_scatter(outs[1], xs[1], topology=topo, config=cfg,
                                                  seed=1, async_op=True)
                first.wait()
                second.wait()
                first.advance()  # after wait: nothing left, nothing issued
                second.wait()
            finally:
                dist.all_to_all_single = original
            if two_hops:
                assert at_call == {"intra": p, "inter": 0}, at_call
                assert after_advance == {"intra": p, "inter": p}, after_advance
                assert issued == {"intra": 2 * p, "inter": 2 * p}, issued
            else:
                one = int(world > 1)
                assert at_call == after_advance == {
                    "intra": one if topo.nodes == 1 else 0,
                    "inter": one if topo.nodes > 1 else 0}, (at_call, after_advance)
            for out, exp in zip(outs, expected):
                assert torch.equal(out, exp), f"advance() changed bits (P={p}, {stochastic=})"


# The Triton kernels under the interpreter cost as much CPU as the rest of a phase: they run
# in two of the two-hop phases, which give the hops' receivers 2, 3 and 4 senders between
# them (4 x 2: 4 then 2; 2 x 3: 2 then 3); the torch and CPU backends run in every phase.
# Every kernel against its reference at more sizes: tests/unit/test_triton_kernels.py.
TRITON_PHASES = {(4, 2), (2, 3)}


def _backends(topo) -> tuple[str, ...]:
    triton = triton_available() and (topo.ranks_per_node, topo.nodes) in TRITON_PHASES
    return ("torch", "cpu") + (("triton",) if triton else ())


def _backend_cases(topo, world: int, rank: int) -> None:
    """The CPU kernels and the Triton kernels (interpreted on CPU) give the torch references'
    bits, here too."""
    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter

    x = _data(rank, world * SHARD, 12).to(torch.bfloat16)
    outs = []
    for backend in _backends(topo):
        cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                                  hadamard_block=H, pipeline_slices=2, kernel_backend=backend)
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, x, topology=topo, config=cfg, op=ReduceOp.AVG, seed=6)
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0]), "the backends disagree"


def _two_bit_cases(topo, world: int, rank: int) -> None:
    """The 2-bit inter-node hop (levels -s, 0, s with s = absmax): within the derived bound,
    beside torch's own reduce-scatter too; bytes per hop equal the formula; every backend
    gives the same bits; and the inter bit width really is what the inter hop uses."""
    from megatron.sdp4bit.comm import CommStats, GradientQuantConfig, two_level_reduce_scatter

    n, m = topo.ranks_per_node, topo.nodes
    x = _data(rank, world * SHARD, 21)
    shards = rsb.gather_shards(x, topo.group, world, rank)
    errs = {}
    for hadamard in (0, H):
        for bits in (2, 4):
            cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_bits=bits,
                                      inter_group_size=G_INTER, hadamard_block=hadamard,
                                      pipeline_slices=2, kernel_backend="torch")
            stats = CommStats()
            out = torch.empty(SHARD)
            two_level_reduce_scatter(out, x, topology=topo, config=cfg, seed=5, stats=stats)
            errs[hadamard, bits] = _check_error(out, shards, n, m, cfg, False)
            if bits == 2:
                c = SHARD // 2
                inter = ((m - 1) * 2 * _expected_bytes(c, 2, G_INTER) if n > 1
                         else (m - 1) * _expected_bytes(SHARD, 2, G_INTER))
                assert stats.grad_inter_bytes == inter
                assert stats.grad_inter_bytes_baseline == (m - 1) * SHARD * 4
                if m > 1:  # 32 / (2 + 32/32) at group 32; 14.2x at the default group 128
                    assert stats.grad_inter_bytes_baseline / inter == 32 / (2 + 32 / G_INTER)
                theirs = torch.empty(SHARD)
                dist.reduce_scatter_single(theirs, x.clone(), group=topo.group)
                bound, _, mag = rsb.bounds(shards, n, m, cfg, False, 1.0)
                diff = out.double() - theirs.double()
                if hadamard:
                    diff = rsb.hadamard64(diff, H)
                block = hadamard or 1
                assert (diff.view(-1, block).norm(dim=1)
                        <= (bound * 1.001 + 2e-5 * mag).view(-1, block).norm(dim=1)).all()
    if m > 1:  # the inter hop runs at the bits asked for: 3 levels lose more than 15
        assert errs[0, 2] > 1.5 * errs[0, 4], f"2-bit not worse than 4-bit: {errs}"
    else:  # no inter hop: the inter bit width is unused
        assert errs[0, 2] == errs[0, 4]
    if n > 1 and m > 1:
        xb = _data(rank, world * SHARD, 22).to(torch.bfloat16)
        outs = []
        for backend in _backends(topo):
            cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_bits=2,
                                      inter_group_size=G_INTER, hadamard_block=H,
                                      pipeline_slices=2, kernel_backend=backend)
            out = torch.empty(SHARD)
            two_level_reduce_scatter(out, xb, topology=topo, config=cfg, op=ReduceOp.AVG,
                                     seed=7)
            outs.append(out)
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), "the backends disagree at 2 bits"


def _bad_input_cases(topo, world: int, rank: int) -> None:
    """Every rank raises the same ValueError before any collective; the group stays usable."""
    from megatron.sdp4bit.comm import GradientQuantConfig, two_level_reduce_scatter

    cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_group_size=G_INTER,
                              pipeline_slices=2, kernel_backend="torch")
    x = torch.randn(world * SHARD)
    with pytest.raises(ValueError, match="output must hold input.numel"):
        two_level_reduce_scatter(torch.empty(SHARD + 1), x, topology=topo, config=cfg, seed=0)
    short = torch.randn(world * (SHARD - 64))  # shard 448 is not a multiple of 2 x 64
    with pytest.raises(ValueError, match=r"not a multiple of .*pad_numel"):
        two_level_reduce_scatter(torch.empty(SHARD - 64), short, topology=topo, config=cfg,
                                 seed=0)
    with pytest.raises(ValueError, match=r"intra_bits=2 is not supported: use one of \(4, 8\)"):
        GradientQuantConfig(intra_bits=2)
    with pytest.raises(ValueError, match=r"inter_bits=3 is not supported: use one of \(2, 4, 8\)"):
        GradientQuantConfig(inter_bits=3)
    with pytest.raises(ValueError, match="inter_group_size=6 must be a multiple of 4 at 2"):
        GradientQuantConfig(inter_bits=2, inter_group_size=6)
    with pytest.raises(ValueError, match="op=.* is not supported"):
        two_level_reduce_scatter(torch.empty(SHARD), x, topology=topo, config=cfg,
                                 op=ReduceOp.MAX, seed=0)
    with pytest.raises(ValueError, match="dtype torch.int32 is not supported"):
        two_level_reduce_scatter(torch.empty(SHARD, dtype=torch.int32), x, topology=topo,
                                 config=cfg, seed=0)
    dist.barrier(group=topo.group)  # nobody is stuck in a collective


def _topology_cases(topo, n: int, m: int, world: int, rank: int) -> None:
    from megatron.sdp4bit.comm import build_topology

    ranks = dist.get_process_group_ranks(topo.group)  # global ranks in DP-rank order
    assert (topo.world, topo.ranks_per_node, topo.nodes) == (world, n, m)
    assert (topo.rank, topo.node, topo.local) == (rank, rank // n, rank % n)
    if n > 1:
        assert dist.get_process_group_ranks(topo.intra_group) == ranks[
            topo.node * n:(topo.node + 1) * n]
    else:
        assert topo.intra_group is None
    if m > 1:
        assert dist.get_process_group_ranks(topo.inter_group) == ranks[topo.local::n]
    else:
        assert topo.inter_group is None
    group = None if topo.group is dist.group.WORLD else topo.group
    assert build_topology(group, ranks_per_node=n) == topo  # cached: no new groups
    with pytest.raises(ValueError, match="ranks_per_node=7 does not divide the DP size"):
        build_topology(group, ranks_per_node=7)  # same on every rank; divides no DP size
    # Detection from host names: every rank of this test runs on one host -> N = W, M = 1.
    detected = build_topology(group)
    assert (detected.ranks_per_node, detected.nodes) == (world, 1)
    dist.barrier()


# One spawn of 8 ranks serves every topology: process start-up (importing torch) costs far
# more than the collectives, so each phase carves the world into DP groups of W = N x M
# ranks. Strided groups are what TP x DP looks like (TP=4 x DP=2: DP groups {0, 4}, ...);
# every rank creates every DP group, as torch.distributed requires. No DP group appears in
# two phases with the same role, because build_topology's cache makes a repeated call
# collective-free: all ranks must repeat a call together or not at all.
WORLD = 8
PHASES = [  # (N, M, DP groups as global ranks)
    (2, 1, [[t, t + 4] for t in range(4)]),
    (1, 2, [[0, 3], [1, 2], [4, 7], [5, 6]]),  # not {6, 7}: the 2x3 phase builds that one
    (2, 2, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (1, 4, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (4, 1, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    (2, 3, [[0, 1, 2, 3, 4, 5], [6, 7]]),  # ranks 6 and 7 run a 2 x 1 beside it
    (4, 2, [list(range(WORLD))]),
    (2, 4, [list(range(WORLD))]),
]


def _phase(n: int, dp_groups: list[list[int]]) -> None:
    from megatron.sdp4bit.comm import build_topology

    handles = [None if len(g) == WORLD else dist.new_group(g) for g in dp_groups]
    me = dist.get_rank()
    index = next(i for i, g in enumerate(dp_groups) if me in g)
    topo = build_topology(handles[index], ranks_per_node=n)
    world, rank = len(dp_groups[index]), dp_groups[index].index(me)
    _topology_cases(topo, topo.ranks_per_node, topo.nodes, world, rank)
    _accuracy_cases(topo, world, rank)
    _pipeline_and_variant_cases(topo, world, rank)
    _byte_cases(topo, world, rank)
    _advance_cases(topo, world, rank)
    if topo.ranks_per_node > 1 and topo.nodes > 1:
        _backend_cases(topo, world, rank)
    _two_bit_cases(topo, world, rank)
    _bad_input_cases(topo, world, rank)


def _worker(rank: int, world: int) -> None:
    # CPU tensors reach the Triton kernels only through the interpreter; triton reads this
    # when it is imported, so set it before anything imports triton.
    os.environ["TRITON_INTERPRET"] = "1"
    for n, m, dp_groups in PHASES:
        try:
            _phase(n, dp_groups)
        except Exception as exc:
            raise AssertionError(f"topology {n}x{m} (DP groups {dp_groups}): {exc}") from exc
    # An override that differs between ranks, never built before: every rank fails alike.
    from megatron.sdp4bit.comm import build_topology

    with pytest.raises(ValueError, match="ranks_per_node differs between ranks"):
        build_topology(None, ranks_per_node=1 if rank == 0 else WORLD)
    dist.barrier()


def test_two_level_reduce_scatter_all_topologies() -> None:
    """Topologies N x M = 2x1, 1x2, 2x2, 1x4, 4x1, 2x3, 4x2, 2x4 (see PHASES)."""
    spawn(_worker, WORLD, timeout=180)
