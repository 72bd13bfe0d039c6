"""megatron-core trains on CPU/gloo in CPU mode: DDP + distributed optimizer at DP 4.

Baseline only (no SDP4Bit): it proves the CPU-mode compatibility layer is enough for the
code paths SDP4Bit hooks into (bucketed reduce-scatter, parameter all-gather, their
overlap variants). One spawn; sub-cases loop inside. The baseline under TP 2 and PP 2 (the
pipeline schedules) runs in test_integration_sdp4bit.py, as each method's reference.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

STEPS = 30
# The synthetic rule is learnable: 30 Adam steps at lr 3e-3 take the loss from ln(128) =
# 4.85 to about 2.8. Requiring a 25% drop fails if any collective is wrong
# (e.g. unsynchronised gradients) yet leaves a wide margin for CPU numerics.
MIN_RELATIVE_DROP = 0.25


def _train_and_check(setup) -> list[float]:
    from tests.helpers import tiny_gpt as T

    ddp, optimizer = T.build(setup)
    # megatron-core buckets only with overlap_grad_reduce.
    if setup.bucket_size is not None:
        n_buckets = sum(len(b.buckets) for b in ddp.buffers)
        assert n_buckets >= 3, n_buckets
    return T.train_checking_replicas(ddp, optimizer, setup, STEPS)


def _assert_trains(losses: list[float], what: str) -> None:
    first, last = losses[0], sum(losses[-3:]) / 3
    assert torch.isfinite(torch.tensor(losses)).all(), f"{what}: {losses}"
    assert last < (1 - MIN_RELATIVE_DROP) * first, f"{what}: loss {first:.3f} -> {last:.3f}"


def _worker(rank: int, world_size: int, setups: list) -> None:
    from tests.helpers import tiny_gpt as T

    T.init_parallel(1, 1)
    for setup in setups:
        _assert_trains(_train_and_check(setup), f"dp4 {setup}")


def test_baseline_trains_with_identical_replicas() -> None:
    """DP 4, with and without overlapped collectives, and in fp32. Under TP 2 and PP 2 the
    baseline runs in test_integration_sdp4bit.py's spawns, as each method's reference
    (checked the same way: identical replicas at every step, the loss down by 25%)."""
    from tests.helpers.tiny_gpt import Setup

    overlap = dict(overlap_grad_reduce=True, bucket_size=12_000)
    setups = [Setup(overlap_param_gather=True, **overlap), Setup(),
              Setup(bf16=False, **overlap)]
    spawn(_worker, 4, setups, timeout=240)


def _refusal_worker(rank: int, world_size: int) -> None:
    from megatron.sdp4bit.integration import cpu_mode

    assert not cpu_mode.cpu_mode_active()
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # pretend a GPU is present
    try:
        with pytest.raises(RuntimeError, match="CUDA is available"):
            cpu_mode.enable_cpu_mode()
        assert not cpu_mode.cpu_mode_active()
    finally:
        torch.cuda.is_available = real
    cpu_mode.enable_cpu_mode()
    cpu_mode.enable_cpu_mode()  # idempotent
    assert cpu_mode.cpu_mode_active()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.cuda.current_device() == 0
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1, dtype=torch.int64).type() == "torch.LongTensor"


def test_cpu_mode_refuses_with_cuda_and_is_idempotent() -> None:
    # In a child process: CPU mode changes process-wide state that pytest must not inherit.
    spawn(_refusal_worker, 1, timeout=120)
