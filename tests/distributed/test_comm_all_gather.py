"""qWD weight-difference all-gather (and qW, and the plain one) on real gloo ranks.

[Note: the bounds these tests assert]
Step t: every rank adds an update ``u_t`` to its fp32 main shard ``w_t``; qWD sends
``Q(d_t)`` with ``d_t = w_t - w~_{t-1} = u_t - e_{t-1}`` (``e = w~ - w``, the replica's error).
With b bits and stochastic rounding, ``|e_t| < s_t = absmax_group(d_t) / qmax``
(``qmax = 7`` at 4 bits), and ``absmax(d_t) <= absmax(u_t) + absmax(e_{t-1})``. Checked at
every step. Hence with ``|u| <= U`` the error never exceeds ``e* = U / (qmax - 1)`` (the
fixed point of ``e = (U + e) / qmax``): it does not accumulate, and after 200 steps it is
no larger than ``(qmax / (qmax - 1))`` times the first step's bound (invariant I2). A bf16
replica adds one rounding per step, at most ``2^-8 |w~_t|`` (8-bit significand), to the
per-step bound. The direct mode (qW) has ``|e_t| < absmax_group(w_t) / qmax``, which is
what makes it much worse on weights that change slowly.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

GROUP = 64
SHARD = 256
STEPS = 200


def _group_absmax(v: torch.Tensor, g: int) -> torch.Tensor:
    return v.abs().view(-1, g).amax(1, keepdim=True).expand(-1, g).reshape(v.shape)


def _check_step(replica: torch.Tensor, values: list[float]) -> list[float]:
    """One collective per step: assert ``replica`` is bitwise identical on every rank (I1) and
    return the max over ranks of each of ``values``."""
    world = dist.get_world_size()
    raw = torch.cat([replica.contiguous().view(torch.uint8),
                     torch.tensor(values, dtype=torch.float64).view(torch.uint8)])
    everything = torch.empty(world * raw.numel(), dtype=torch.uint8)
    dist.all_gather_single(everything, raw)
    rows = everything.view(world, -1)
    nbytes = replica.numel() * replica.element_size()
    assert bool((rows[:, :nbytes] == raw[:nbytes]).all()), "replicas differ between ranks (I1)"
    return rows[:, nbytes:].contiguous().view(torch.float64).amax(0).tolist()


def _initial(world: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """The same weights on every rank (same generator seed)."""
    gen = torch.Generator().manual_seed(1234)
    return (scale * torch.randn(world * SHARD, generator=gen)).to(dtype)


def _run_steps(rank: int, world: int, dtype: torch.dtype, cfg, steps: int, update: float
               ) -> tuple[list[float], float]:
    """``steps`` optimizer-like steps, checking I1 and the per-step bound at each.

    Returns (max replica error after each step, the fixed-point bound ``e*``).
    """
    from megatron.sdp4bit.comm import weight_difference_all_gather
    from megatron.sdp4bit.quantization import derive_seed

    qmax = 2 ** (cfg.bits - 1) - 1
    replica = _initial(world, dtype, 1.0)
    own = slice(rank * SHARD, (rank + 1) * SHARD)
    main = replica[own].float().clone()
    err_prev = replica[own].float() - main  # zero: main starts from the replica
    gen = torch.Generator().manual_seed(77 + rank)
    errors, u_max, w_max = [], 0.0, 0.0
    rounding = 2.0**-8 * 1.01 if dtype == torch.bfloat16 else 0.0  # relative, per step
    for step in range(steps):
        u = update * torch.randn(SHARD, generator=gen)
        main += u
        weight_difference_all_gather(replica, main, group=None, config=cfg,
                                     seed=derive_seed(1234, step, 0))
        err = replica[own].float() - main
        source = main if cfg.mode == "direct" else u.abs() + err_prev.abs()
        limit = (_group_absmax(source, cfg.group_size) / qmax * (1 + 1e-5) + 1e-7
                 + rounding * replica[own].float().abs())
        assert (err.abs() <= limit).all(), f"step {step}: error above its bound"
        err_prev = err
        e_now, u_now, w_now = _check_step(replica, [err.abs().max().item(), u.abs().max().item(),
                                                    replica.float().abs().max().item()])
        errors.append(e_now)
        u_max, w_max = max(u_max, u_now), max(w_max, w_now)
    # fixed point of e = (U + e) / qmax + r:  e* = (U + qmax r) / (qmax - 1)
    return errors, (u_max + qmax * rounding * w_max) / (qmax - 1) * (1 + 1e-5)


def _qwd_cases(rank: int, world: int, steps: int) -> None:
    from megatron.sdp4bit.comm import WeightQuantConfig

    update = 1e-2
    cfg = WeightQuantConfig(group_size=GROUP, kernel_backend="torch")
    for dtype in (torch.float32, torch.bfloat16):
        errors, fixed_point = _run_steps(rank, world, dtype, cfg, steps, update)
        assert max(errors) <= fixed_point, (max(errors), fixed_point)  # I2: no accumulation
        if dtype == torch.float32:
            # and concretely: the last step is no worse than the first (a random walk would
            # grow ~sqrt(steps) = 14x over 200 steps)
            assert errors[-1] <= 2 * errors[0], f"error grew: {errors[0]:.3g} -> {errors[-1]:.3g}"
            errors32 = errors
    # 8 bits works the same way (shorter run), with a smaller error.
    cfg8 = WeightQuantConfig(bits=8, group_size=GROUP, kernel_backend="torch")
    errors8, fixed_point8 = _run_steps(rank, world, torch.float32, cfg8, 20, update)
    assert max(errors8) <= fixed_point8 and errors8[-1] < errors32[19]

    # qW (direct) on slowly changing weights: its error follows |w|, qWD's the update size.
    direct = WeightQuantConfig(group_size=GROUP, mode="direct", kernel_backend="torch")
    e_direct, _ = _run_steps(rank, world, torch.float32, direct, 20, 1e-3)
    e_diff, _ = _run_steps(rank, world, torch.float32, cfg, 20, 1e-3)
    assert e_direct[-1] > 20 * e_diff[-1], (e_direct[-1], e_diff[-1])


def _async_and_plain_cases(rank: int, world: int) -> None:
    from megatron.sdp4bit.comm import CommStats, WeightQuantConfig, unquantized_all_gather, \
        weight_difference_all_gather

    cfg = WeightQuantConfig(group_size=GROUP, kernel_backend="torch")
    own = slice(rank * SHARD, (rank + 1) * SHARD)
    for dtype in (torch.float32, torch.bfloat16):
        start = _initial(world, dtype, 1.0)
        main = start[own].float() + 1e-2 * torch.randn(SHARD)
        sync, later = start.clone(), start.clone()
        weight_difference_all_gather(sync, main, group=None, config=cfg, seed=9)
        handle = weight_difference_all_gather(later, main, group=None, config=cfg, seed=9,
                                              async_op=True)
        assert torch.equal(later, start), "async all-gather changed the replica before wait()"
        assert handle.wait() and handle.is_completed()
        assert torch.equal(later, sync), "async and sync results differ"

        # The plain path: the replica becomes every rank's main shard cast to its dtype.
        stats = CommStats()
        plain = start.clone()
        handle = unquantized_all_gather(plain, main, group=None, stats=stats, async_op=True)
        handle.wait()
        everything = torch.empty(world * SHARD)
        dist.all_gather_single(everything, main)
        assert torch.equal(plain, everything.to(dtype))
        sent = (world - 1) * SHARD * plain.element_size()
        assert (stats.param_bytes, stats.param_bytes_baseline) == (sent, sent)


def _backend_cases(rank: int, world: int) -> None:
    """The CPU kernels and the Triton kernels (interpreted on CPU) give the torch references'
    bits, here too, on differences that use every code: Gaussian steps, so each group's
    values spread over all 15 levels of a 4-bit code (not one constant difference, which
    quantizes every element of a group to the same code)."""
    from megatron.sdp4bit.comm import WeightQuantConfig, weight_difference_all_gather
    from megatron.sdp4bit.quantization.backend import triton_available

    from megatron.sdp4bit.quantization import format as fmt
    from megatron.sdp4bit.quantization import ops

    gen = torch.Generator().manual_seed(50 + rank)
    own = slice(rank * SHARD, (rank + 1) * SHARD)
    main = _initial(world, torch.bfloat16, 1.0)[own].float() + 0.01 * torch.randn(SHARD,
                                                                                  generator=gen)
    message = torch.empty(fmt.message_nbytes(SHARD, 4, GROUP), dtype=torch.uint8)
    ops.qwd_sender(main, _initial(world, torch.bfloat16, 1.0)[own], message, bits=4,
                   group_size=GROUP, stochastic=True, seed=5, backend="torch")
    codes = fmt.unpack_codes(fmt.split_message(message, SHARD, 4, GROUP)[1], 4)
    # 15 codes exist (-7..7); Gaussian differences reach nearly all of them in 256 values,
    # 13-15 depending on the groups' tails and the rounding draws (a constant difference
    # would give one code per group)
    assert torch.unique(codes).numel() >= 13, f"the data reach only codes {codes.unique()}"
    replicas = []
    for backend in ("torch", "cpu") + (("triton",) if triton_available() else ()):
        replica = _initial(world, torch.bfloat16, 1.0)
        weight_difference_all_gather(replica, main, group=None, seed=5,
                                     config=WeightQuantConfig(group_size=GROUP,
                                                              kernel_backend=backend))
        replicas.append((backend, replica))
    for backend, replica in replicas[1:]:
        assert torch.equal(replica, replicas[0][1]), f"{backend} and torch backends disagree"


def _rounded_target_cases(rank: int, world: int) -> None:
    """The 'rounded-main' target through the collective ([Note: what qWD sends]): where the
    main weight, rounded to bf16, equals the replica, the replica keeps its bits; with the
    'main' target many of those elements move (their sub-ulp residual is dithered). Replicas
    stay bitwise identical on every rank with either target (I1). Production kernels."""
    from megatron.sdp4bit.comm import WeightQuantConfig, weight_difference_all_gather

    own = slice(rank * SHARD, (rank + 1) * SHARD)
    moved = {}
    for target in ("rounded-main", "main"):
        cfg = WeightQuantConfig(group_size=GROUP, target=target)
        gen = torch.Generator().manual_seed(90 + rank)
        replica = _initial(world, torch.bfloat16, 1.0)
        main = replica[own].float().clone()
        moved[target] = 0
        for step in range(4):
            ulp = torch.exp2(torch.floor(torch.log2(main.abs())) - 7)
            tiny = (torch.arange(SHARD) + step) % 2 == 0
            main += torch.where(tiny, 0.2 * ulp, 1e-2) * torch.randn(SHARD, generator=gen)
            kept = main.to(torch.bfloat16) == replica[own]
            before = replica[own].clone()
            weight_difference_all_gather(replica, main, group=None, config=cfg,
                                         seed=1000 + step)
            changed = replica[own].view(torch.int16) != before.view(torch.int16)
            moved[target] += int((changed & kept).sum())
            assert int(kept.sum()) > SHARD // 4  # the residuals kept many bf16 values
            _check_step(replica, [])
    assert moved["rounded-main"] == 0, moved
    assert moved["main"] > 20, moved  # ~0.1 x 500 kept elements over the 4 steps


def _byte_cases(rank: int, world: int) -> None:
    from megatron.sdp4bit.comm import CommStats, WeightQuantConfig, weight_difference_all_gather

    counted = []
    original = dist.all_gather_single

    def counting(output, input, *args, **kwargs):
        # bytes leaving this rank: its message to each of the W - 1 others
        counted.append(input.numel() * input.element_size() * (world - 1))
        return original(output, input, *args, **kwargs)

    stats = CommStats()
    dist.all_gather_single = counting
    try:
        for bits, dtype in ((4, torch.bfloat16), (8, torch.float32)):
            cfg = WeightQuantConfig(bits=bits, group_size=GROUP, kernel_backend="torch")
            replica = _initial(world, dtype, 1.0)
            main = replica[rank * SHARD:(rank + 1) * SHARD].float()
            weight_difference_all_gather(replica, main, group=None, config=cfg, seed=0,
                                         stats=stats)
    finally:
        dist.all_gather_single = original
    expected = sum((world - 1) * (4 * math.ceil(SHARD / GROUP) + SHARD * bits // 8)
                   for bits in (4, 8))
    assert stats.param_bytes == expected == sum(counted)
    assert stats.param_bytes_baseline == (world - 1) * SHARD * (2 + 4)
    assert stats.grad_bytes == 0


def _bad_input_cases(rank: int, world: int) -> None:
    from megatron.sdp4bit.comm import WeightQuantConfig, weight_difference_all_gather

    cfg = WeightQuantConfig(group_size=GROUP, kernel_backend="torch")
    replica = _initial(world, torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match="main_shard must hold replica.numel"):
        weight_difference_all_gather(replica, torch.zeros(SHARD - 2), group=None, config=cfg,
                                     seed=0)
    short = torch.zeros(world * 96, dtype=torch.bfloat16)  # 96 is not a multiple of 64
    with pytest.raises(ValueError, match=r"parameter buffer of .* not a multiple of"):
        weight_difference_all_gather(short, torch.zeros(96), group=None, config=cfg, seed=0)
    with pytest.raises(ValueError, match="bits=3 is not supported"):
        WeightQuantConfig(bits=3)
    with pytest.raises(ValueError, match="mode='qw'"):
        WeightQuantConfig(mode="qw")
    dist.barrier()  # every rank raised before any collective: nobody is left waiting


def _worker(rank: int, world: int, steps: int) -> None:
    # CPU tensors reach the Triton kernels only through the interpreter; triton reads this
    # when it is imported, so set it before anything imports triton.
    os.environ["TRITON_INTERPRET"] = "1"
    _qwd_cases(rank, world, steps)
    _async_and_plain_cases(rank, world)
    _byte_cases(rank, world)
    _rounded_target_cases(rank, world)
    _backend_cases(rank, world)
    _bad_input_cases(rank, world)


# The 200-step run (the I1/I2 test) on 4 ranks; an odd world with a shorter run.
@pytest.mark.parametrize("world,steps", [(4, STEPS), (3, 30)], ids=["W4", "W3"])
def test_weight_difference_all_gather(world: int, steps: int) -> None:
    spawn(_worker, world, steps, timeout=240)
