"""Comm-layer configs and the topology layout rules (no processes needed)."""

from __future__ import annotations

import time

import pytest
import torch

from megatron.sdp4bit.comm import CommStats, GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.comm.stats import PHASES, timed
from megatron.sdp4bit.comm.topology import _resolve_n, node_id
from megatron.sdp4bit.config import SDP4BitConfig


def test_gradient_config_from_sdp4bit_maps_every_field() -> None:
    cfg = SDP4BitConfig(gradient_quantization_bits_intra=4, gq_group_size_intra=256,
                        gradient_quantization_bits_inter=8, gq_group_size_inter=64,
                        hadamard_transform=True, hadamard_block_size=16,
                        gradient_alltoall_pipeline=3, quantization_rounding="nearest",
                        kernel_backend="torch")
    assert GradientQuantConfig.from_sdp4bit(cfg) == GradientQuantConfig(
        intra_bits=4, intra_group_size=256, inter_bits=8, inter_group_size=64,
        hadamard_block=16, pipeline_slices=3, stochastic=False, kernel_backend="torch")
    # Hadamard off -> block 0, whatever the block size flag says
    assert GradientQuantConfig.from_sdp4bit(SDP4BitConfig()).hadamard_block == 0


def test_weight_config_from_sdp4bit() -> None:
    cfg = SDP4BitConfig(weight_quantization_bits=8, wq_group_size=512,
                        weight_quantization_mode="direct")
    assert WeightQuantConfig.from_sdp4bit(cfg) == WeightQuantConfig(
        bits=8, group_size=512, mode="direct", stochastic=True, kernel_backend="auto")
    rounded = SDP4BitConfig(quantized_weights=True, weight_difference_target="rounded-main")
    assert WeightQuantConfig.from_sdp4bit(rounded).target == "rounded-main"
    assert WeightQuantConfig.from_sdp4bit(SDP4BitConfig()).target == "main"
    # Only qWD sends a difference: the target is refused where it would be ignored.
    for off in (dict(), dict(quantized_weights=True, weight_quantization_mode="direct")):
        with pytest.raises(ValueError, match="weight_difference_target=rounded-main applies "
                           "to qWD only"):
            SDP4BitConfig(weight_difference_target="rounded-main", **off)


@pytest.mark.parametrize("kwargs,message", [
    (dict(intra_bits=2), r"intra_bits=2 is not supported: use one of \(4, 8\)"),
    (dict(inter_bits=3), r"inter_bits=3 is not supported: use one of \(2, 4, 8\)"),
    (dict(inter_bits=2, inter_group_size=130), "inter_group_size=130 must be a multiple of 4"),
    (dict(inter_bits=16), "inter_bits=16 is not supported"),
    (dict(intra_group_size=0), "intra_group_size=0 must be a positive even integer"),
    (dict(inter_group_size=33), "inter_group_size=33 must be a positive even integer"),
    (dict(hadamard_block=24), "hadamard_block=24 must be 0 .off. or a power of two"),
    (dict(hadamard_block=256), "intra_group_size=128 is not a multiple of hadamard_block=256"),
    (dict(pipeline_slices=0), "pipeline_slices=0 must be an integer >= 1"),
    (dict(kernel_backend="cuda"), "kernel_backend='cuda'"),
])
def test_gradient_config_rejects(kwargs: dict, message: str) -> None:
    base = dict(intra_group_size=128, inter_group_size=128)
    with pytest.raises(ValueError, match=message):
        GradientQuantConfig(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs,message", [
    (dict(bits=3), "bits=3 is not supported"),
    (dict(bits=2), r"bits=2 is not supported: use one of \(4, 8\)"),
    (dict(group_size=-2), "group_size=-2 must be a positive even integer"),
    (dict(mode="qw"), "mode='qw'"),
    (dict(target="bf16"), "target='bf16': use 'main' or 'rounded-main'"),
    (dict(mode="direct", target="rounded-main"), "target='rounded-main' applies to mode "
     "'diff' .qWD. only"),
])
def test_weight_config_rejects(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WeightQuantConfig(**kwargs)


def test_topology_from_host_names() -> None:
    ranks = tuple(range(6))
    assert _resolve_n(ranks, ["a", "a", "b", "b", "c", "c"], None) == 2
    assert _resolve_n(ranks, ["a"] * 6, None) == 6
    assert _resolve_n(ranks, list("abcdef"), None) == 1
    with pytest.raises(ValueError, match="not one contiguous block"):
        _resolve_n(ranks, ["a", "b", "a", "b", "c", "c"], None)
    with pytest.raises(ValueError, match="different numbers of DP ranks"):
        _resolve_n(ranks, ["a", "a", "a", "a", "b", "b"], None)
    # the override wins over the host names, and must divide the DP size
    assert _resolve_n(ranks, ["a"] * 6, 3) == 3
    with pytest.raises(ValueError, match="ranks_per_node=4 does not divide the DP size 6"):
        _resolve_n(ranks, ["a"] * 6, 4)


def test_an_override_may_split_nodes_but_never_join_them() -> None:
    """With ranks_per_node given, every block of N consecutive DP ranks must run on one node:
    splitting a real node simulates several, joining two sends the 8-bit hop across nodes."""
    ranks = (0, 1, 2, 3)
    assert _resolve_n(ranks, ["a"] * 4, 2) == 2  # one host as two nodes (the quickstart)
    assert _resolve_n(ranks, ["a", "a", "b", "b"], 2) == 2
    assert _resolve_n(ranks, ["a", "a", "b", "b"], 1) == 1
    assert _resolve_n(ranks, ["a", "b", "a", "b"], 1) == 1  # cyclic, every hop inter-node
    cyclic = (r"ranks_per_node=2 \(--dp-ranks-per-node\) makes global ranks \[0, 1\] of DP "
              r"group \[0, 1, 2, 3\] one node, but they run on different nodes \['a', 'b'\]: "
              r"place each node's ranks in one contiguous block \(e.g. srun "
              r"--distribution=block\), or use ranks_per_node=1 \(every hop inter-node\)$")
    with pytest.raises(ValueError, match=cyclic):  # srun --distribution=cyclic
        _resolve_n(ranks, ["a", "b", "a", "b"], 2)
    with pytest.raises(ValueError, match=r"global ranks \[0, 1, 2, 3\] .* \['a', 'b'\]"):
        _resolve_n(ranks, ["a", "a", "b", "b"], 4)
    with pytest.raises(ValueError, match=r"global ranks \[4, 6\]"):  # a strided DP group
        _resolve_n((0, 2, 4, 6), ["a", "a", "a", "b"], 2)


def test_node_id_tells_torchrun_agents_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert node_id() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_id() == socket.gethostname() + "/node1"
    # two agents of 2 ranks on one host: two nodes
    assert _resolve_n((0, 1, 2, 3), ["h/node0", "h/node0", "h/node1", "h/node1"], None) == 2


def test_stats_reset_and_totals() -> None:
    stats = CommStats(grad_intra_bytes=3, grad_inter_bytes=4, grad_intra_bytes_baseline=10,
                      grad_inter_bytes_baseline=20, param_intra_bytes=5)
    assert (stats.grad_bytes, stats.grad_bytes_baseline) == (7, 30)
    snap = stats.snapshot()
    stats.reset()
    assert snap["param_intra_bytes"] == 5 and stats.snapshot() == dict.fromkeys(snap, 0)


def test_param_bytes_split_by_destination_node() -> None:
    """An all-gather over W = 6 ranks, 2 per node: 1 message to the node peer, 4 to others."""
    stats = CommStats()
    stats.add_param_bytes(100, 400, world=6, ranks_per_node=2)
    assert (stats.param_intra_bytes, stats.param_inter_bytes) == (100, 400)
    assert (stats.param_intra_bytes_baseline, stats.param_inter_bytes_baseline) == (400, 1600)
    assert (stats.param_bytes, stats.param_bytes_baseline) == (500, 2000)


def test_phase_timing_is_off_by_default_and_cleared_when_taken() -> None:
    stats = CommStats()
    with timed(stats, "grads-wait", torch.device("cpu")):
        time.sleep(0.01)
    assert stats.take_seconds() == dict.fromkeys(PHASES, 0.0)
    stats.timing = True
    with timed(stats, "grads-wait", torch.device("cpu")):
        time.sleep(0.02)
    taken = stats.take_seconds()
    assert 0.02 <= taken["grads-wait"] < 1.0
    assert sum(taken.values()) == taken["grads-wait"]
    assert stats.take_seconds()["grads-wait"] == 0.0
