"""megatron-core 0.16.1 trains on CPU/gloo in CPU mode: DDP + distributed optimizer, TP/PP/DP.

Baseline only (no SDP4Bit): it proves the CPU-mode compatibility layer is enough for the
code paths SDP4Bit hooks into (bucketed reduce-scatter, parameter all-gather, their
overlap variants, pipeline schedules). One spawn per topology; sub-cases loop inside.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

STEPS = 30
# The synthetic rule is learnable: 30 Adam steps at lr 3e-3 take the loss from ln(128) =
# 4.85 to about 2.8 (DP) / 3.3 (TP). Requiring a 25% drop fails if any collective is wrong
# (e.g. unsynchronised gradients) yet leaves a wide margin for CPU numerics.
MIN_RELATIVE_DROP = 0.25


def _train_and_check(setup) -> list[float | None]:
    from tests.helpers import tiny_gpt as T

    from megatron.core import parallel_state

    ddp, optimizer = T.build(setup)
    # megatron-core buckets only with overlap_grad_reduce, and only on the first PP stage.
    if setup.bucket_size is not None and parallel_state.is_pipeline_first_stage():
        n_buckets = sum(len(b.buckets) for b in ddp.buffers)
        assert n_buckets >= 3, n_buckets
    return T.train_checking_replicas(ddp, optimizer, setup, STEPS)


def _assert_trains(losses: list[float | None], what: str) -> None:
    if losses[0] is None:  # not the last pipeline stage
        return
    first, last = losses[0], sum(losses[-3:]) / 3
    assert torch.isfinite(torch.tensor(losses)).all(), f"{what}: {losses}"
    assert last < (1 - MIN_RELATIVE_DROP) * first, f"{what}: loss {first:.3f} -> {last:.3f}"


def _worker(rank: int, world_size: int, tp: int, pp: int, setups: list) -> None:
    from tests.helpers import tiny_gpt as T

    T.init_parallel(tp, pp)
    for setup in setups:
        _assert_trains(_train_and_check(setup), f"tp{tp} pp{pp} {setup}")


def _setups(*, pp: int):
    from tests.helpers.tiny_gpt import Setup

    overlap = Setup(overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=12_000,
                    num_microbatches=2 if pp > 1 else 1)
    return overlap, Setup(num_microbatches=overlap.num_microbatches)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp4", "tp2xdp2", "pp2xdp2"])
def test_baseline_trains_with_identical_replicas(tp: int, pp: int) -> None:
    from tests.helpers.tiny_gpt import Setup

    setups = list(_setups(pp=pp))
    if tp == pp == 1:
        setups.append(Setup(bf16=False, overlap_grad_reduce=True, bucket_size=12_000))
    spawn(_worker, 4, tp, pp, setups, timeout=240)


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
