"""``--check-replicas-interval`` with every overlap combination: a healthy run must pass.

With ``--overlap-param-gather`` the parameter all-gather of a step runs in the next forward
pass, so right after the step each rank's replica holds its own updated shard and the
others' old ones; the check must complete that gather first (the trainer's loop calls
``check_replicas`` exactly as below). One spawn of 2 gloo ranks ("2 nodes") runs the
baseline, TLq-HS and SDP4Bit, each with no overlap, overlapped gradient reduce, and both.
"""

from __future__ import annotations

import pytest

from tests.helpers.spawn import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # ~20 s of CPU, minutes when shared

METHODS = {
    "baseline": dict(),
    "TLq-HS": dict(quantized_gradients=True, hadamard_transform=True),
    "SDP4Bit": dict(quantized_weights=True, quantized_gradients=True, hadamard_transform=True),
}
OVERLAPS = [(False, False), (True, False), (True, True)]  # (grad reduce, param gather)


def _every_combination(rank: int, world_size: int) -> None:
    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.integration import install_sdp4bit
    from megatron.sdp4bit.training.guards.replicas import check_replicas, gather_pending

    T.init_parallel()
    for name, method in METHODS.items():
        cfg = SDP4BitConfig(gq_group_size_intra=128, dp_ranks_per_node=1, **method)
        for grad, param in OVERLAPS:
            setup = T.Setup(overlap_grad_reduce=grad, overlap_param_gather=param)
            ddp, optimizer = T.build(setup, padding_for=cfg)
            handle = install_sdp4bit([ddp], optimizer, cfg) if cfg.enabled else None
            for step in range(3):  # a check after every step, training goes on after it
                if handle is not None:
                    handle.set_iteration(step)
                T.train_step(ddp, optimizer, setup, step)
                check_replicas([ddp], step + 1, finish_gather=gather_pending(
                    param, cfg.quantized_weights))
            T.finish_param_sync(ddp)
            T.assert_replicas_identical(ddp)
            if handle is not None:
                handle.uninstall()


def test_the_replica_check_passes_healthy_runs_with_every_overlap():
    spawn(_every_combination, 2, timeout=300)
