"""Error feedback on the inter-node hop, on real gloo ranks: 2x2 (twice, 4 ranks each) and
4x2 (8 ranks), in one spawn; and the ranks' agreement on a non-finite saved error state.

[Note: the two-step bound with error feedback]
With decay 0 and fp32 storage, node m's inter messages for this rank's shard carry, at call
t, ``sent_t = v_t - e_t`` with ``v_t = t_t + e_(t-1)`` (``t_t`` the node's requantized sum,
``e_0 = 0``). Over two calls ``sent_1 + sent_2 = t_1 + t_2 - e_2``: the first call's inter
error is paid back, and only ``e_2`` remains, ``|e_2| < s(v_2)`` with
``s(v_2) = absmax_group(v_2) / qmax`` and ``|v_2| <= |p_2| + sum_k s1_k,2 + s(v_1)``
(``p`` the node's exact partial, ``s1`` the intra scales, as in
tests/distributed/test_comm_reduce_scatter.py). So the two-step error is below
``sum_t sum_k s1_k,t + sum_m s(v_2)_m``: one inter error instead of two. Without feedback it
is ``sum_t (sum_k s1_k,t + sum_m s2_m,t)``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers import rs_bounds as rsb
from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

G_INTRA, G_INTER = 64, 32
SHARD = 256


def _data(rank: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(length, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def _cases(topo, world: int, rank: int) -> None:
    from megatron.sdp4bit.comm import (ErrorFeedback, ErrorFeedbackConfig, GradientQuantConfig,
                                       two_level_reduce_scatter)
    from megatron.sdp4bit.quantization.format import message_nbytes

    n, m = topo.ranks_per_node, topo.nodes
    cfg = GradientQuantConfig(intra_group_size=G_INTRA, inter_bits=2, inter_group_size=G_INTER,
                              pipeline_slices=2, kernel_backend="torch")
    fp32 = ErrorFeedbackConfig(storage="fp32")
    xs = [_data(rank, world * SHARD, s) for s in (1, 2)]

    def run(x, seed, ef=None, config=cfg):
        out = torch.empty(SHARD)
        two_level_reduce_scatter(out, x, topology=topo, config=config, seed=seed,
                                 error_feedback=ef)
        return out

    # Memory: M x S values per bucket (what the rank sends on the inter hop), 1/N of it.
    ef = ErrorFeedback(world * SHARD, n, m, cfg, fp32)
    assert ef.nbytes == m * SHARD * 4 == world * SHARD * 4 // n
    int8 = ErrorFeedback(world * SHARD, n, m, cfg, ErrorFeedbackConfig())
    assert int8.nbytes == 2 * message_nbytes(m * SHARD // 2, 8, G_INTER)

    # A zero error changes no bit: the first call equals the call without feedback.
    for hadamard, storage in ((0, "fp32"), (32, "int8")):
        c = dataclasses.replace(cfg, hadamard_block=hadamard)
        fresh = ErrorFeedback(world * SHARD, n, m, c, ErrorFeedbackConfig(storage=storage))
        assert torch.equal(run(xs[0], 5, fresh, c), run(xs[0], 5, None, c))

    # Two steps: the sum is within the derived bound; at 4 bits it is closer to the exact
    # sum than without feedback (one inter error left instead of two: about 1/sqrt(2)).
    shards = [rsb.gather_shards(x, topo.group, world, rank) for x in xs]
    exact = shards[0].sum(0) + shards[1].sum(0)
    mag = sum(sh.abs().sum(0) for sh in shards)
    for bits in (4, 2):
        c = dataclasses.replace(cfg, inter_bits=bits)
        state = ErrorFeedback(world * SHARD, n, m, c, fp32)
        outs_ef = [run(x, 10 + t, state, c) for t, x in enumerate(xs)]
        outs_plain = [run(x, 10 + t, None, c) for t, x in enumerate(xs)]
        err_ef = outs_ef[0].double() + outs_ef[1].double() - exact
        err_plain = outs_plain[0].double() + outs_plain[1].double() - exact
        intra, s_prev = 0.0, 0.0
        for sh in shards:
            s1 = rsb.group_absmax(sh, G_INTRA) / rsb.qmax(c.intra_bits)  # [W, S]
            partial = sh.view(m, n, -1).sum(1)
            e1_node = s1.view(m, n, -1).sum(1)
            s_v = rsb.group_absmax(partial.abs() + e1_node + s_prev, G_INTER) / rsb.qmax(bits)
            intra, s_prev = intra + s1.sum(0), s_v
        bound = intra + s_prev.sum(0)
        assert (err_ef.abs() <= bound * (1 + 1e-4) + 1e-5 * mag).all(), \
            f"{bits} bits: two-step error exceeds the bound by {(err_ef.abs() / bound).max():.3f}x"
        if bits == 4:
            assert err_ef.norm() < 0.85 * err_plain.norm(), \
                f"feedback did not help: {err_ef.norm():.4g} vs {err_plain.norm():.4g}"
        # the first step has a zero error: the one-step bound of the plain hop
        bound1, _, mag1 = rsb.bounds(shards[0], n, m, c, False, 1.0)
        assert ((outs_ef[0].double() - shards[0].sum(0)).abs()
                <= bound1 * (1 + 1e-4) + 1e-5 * mag1).all()

    # Resume: the state dict of step 1, loaded into a fresh state, gives step 2's bits.
    for storage in ("fp32", "int8"):
        ef_cfg = ErrorFeedbackConfig(storage=storage, decay=0.5, reset_interval=3)
        a = ErrorFeedback(world * SHARD, n, m, cfg, ef_cfg)
        run(xs[0], 20, a)
        saved = a.state_dict()
        second = run(xs[1], 21, a)
        b = ErrorFeedback(world * SHARD, n, m, cfg, ef_cfg)
        b.load_state_dict(saved)
        assert torch.equal(run(xs[1], 21, b), second), storage
        assert b.calls == a.calls == 2
        with pytest.raises(ValueError, match="does not fit this bucket"):
            ErrorFeedback(2 * world * SHARD, n, m, cfg, ef_cfg).load_state_dict(saved)

    # Reset every call: the error is zeroed before each use, so every call is plain.
    every = ErrorFeedback(world * SHARD, n, m, cfg, ErrorFeedbackConfig(reset_interval=1,
                                                                       storage="fp32"))
    for t, x in enumerate(xs):
        assert torch.equal(run(x, 30 + t, every), run(x, 30 + t))
    # Decay: a nonzero decay gives other bits on the second call than decay 0.
    d0 = ErrorFeedback(world * SHARD, n, m, cfg, fp32)
    d5 = ErrorFeedback(world * SHARD, n, m, cfg, ErrorFeedbackConfig(decay=0.5, storage="fp32"))
    for t, x in enumerate(xs):
        o0, o5 = run(x, 40 + t, d0), run(x, 40 + t, d5)
    assert not torch.equal(o0, o5)

    # A non-finite gradient leaves the error as it was (the optimizer skips that step).
    guard = ErrorFeedback(world * SHARD, n, m, cfg, fp32)
    run(xs[0], 50, guard)
    before = guard.state.clone()
    bad = xs[1].clone()
    bad[::7] = float("nan")
    run(bad, 51, guard)
    assert torch.isfinite(guard.state).all()
    assert torch.equal(guard.state, before)  # every group saw a NaN: nothing changed

    # Backends: the CPU kernels give the torch references' bits with feedback too.
    outs = []
    for backend in ("torch", "cpu"):
        c = dataclasses.replace(cfg, kernel_backend=backend, hadamard_block=32)
        state = ErrorFeedback(world * SHARD, n, m, c, ErrorFeedbackConfig())
        outs.append([run(x, 60 + t, state, c) for t, x in enumerate(xs)])
    assert all(torch.equal(a, b) for a, b in zip(*outs)), "the backends disagree"
    dist.barrier(group=topo.group)


def _refusals(topo) -> None:
    from megatron.sdp4bit.comm import ErrorFeedback, ErrorFeedbackConfig, GradientQuantConfig

    cfg = GradientQuantConfig()
    for n, m in ((1, 4), (4, 1)):
        with pytest.raises(ValueError, match=r"--gradient-error-feedback applies to the "
                           rf"inter-node hop .* \(here {n} x {m}\)"):
            ErrorFeedback(4096, n, m, cfg, ErrorFeedbackConfig())
    with pytest.raises(ValueError, match=r"decay=1.0 must be in \[0, 1\)"):
        ErrorFeedbackConfig(decay=1.0)


def _damaged_state_agreed(rank: int, world: int) -> None:
    """A non-finite saved error on some ranks: every rank learns the first such rank and its
    bucket, so all of them start from zero and say the same ([Note: a non-finite saved
    error]); none: every rank learns that."""
    from megatron.sdp4bit.comm.error_feedback import first_damaged

    assert first_damaged(None, "cpu") is None
    bad = {5: 3, 6: 0}  # rank -> its first non-finite bucket
    assert first_damaged(bad.get(rank), "cpu") == (5, 3)


PHASES = [  # (N, M, DP groups as global ranks)
    (2, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (4, 2, [list(range(8))]),
]


def _worker(rank: int, world: int) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from megatron.sdp4bit.comm import build_topology

    for n, m, dp_groups in PHASES:
        handles = [None if len(g) == world else dist.new_group(g) for g in dp_groups]
        index = next(i for i, g in enumerate(dp_groups) if rank in g)
        topo = build_topology(handles[index], ranks_per_node=n)
        try:
            _cases(topo, len(dp_groups[index]), dp_groups[index].index(rank))
        except Exception as exc:
            raise AssertionError(f"topology {n}x{m}: {exc}") from exc
    _refusals(topo)
    _damaged_state_agreed(rank, world)


def test_error_feedback_on_the_inter_hop() -> None:
    spawn(_worker, 8, timeout=180)
