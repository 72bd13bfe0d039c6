"""A mixture-of-experts GPT through ``pretrain_gpt.py`` with SDP4Bit: Megatron-LM's MoE flags.

One 4-rank run (2 simulated nodes x 2, expert parallelism 2, 4 experts, top-2, the alltoall
dispatcher, load-balancing and z losses, ``--check-replicas-interval 1`` over dense and
expert weights) saves a torch_dist checkpoint at iteration 4; a second run resumes from it
and must repeat iterations 5-8 bitwise (losses, gradient norm, bytes, auxiliary losses). The
log line carries the expert part of the bytes (the expert data-parallel group of 2 has one
rank per node: the inter-node hop alone) and the auxiliary losses under Megatron-LM's names.
The refusals of the flags are one line each, before anything starts.
"""

from __future__ import annotations

import shutil

import pytest

from benchmarks.noise_spread import BASE  # the resume tests' run: tiny GPT, SDP4Bit
from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.cli.errors import ArgumentsError

from tests.helpers.trainer import torchrun, train_lines


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--dp-ranks-per-node", "2"]
SAVED_AT = 4


@pytest.mark.slow
def test_moe_trains_checks_replicas_and_resumes_bit_exact(tmp_path, data_prefix) -> None:
    full = tmp_path / "full"
    res = torchrun(BASE + data_prefix + MOE + ["--check-replicas-interval", "1", "--save",
                                                str(full), "--save-interval", str(SAVED_AT)])
    assert "1 of them expert bucket(s), on the expert data-parallel group of 2" in res.stdout
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == list(range(1, 9))
    for m in lines:
        # expert DP group {0, 2} / {1, 3}: one rank per node, so no intra-node hop
        assert m["comm_bytes_expert_grads_intra"] == m["comm_bytes_expert_params_intra"] == 0
        assert 0 < m["comm_bytes_expert_grads_inter"] < m["comm_bytes_grads_inter"]
        assert 0 < m["comm_bytes_expert_params_inter"] < m["comm_bytes_params_inter"]
        # 4-bit messages: well under a quarter of the fp32 reduce-scatter's bytes
        assert m["comm_bytes_expert_grads_inter"] < m["baseline_comm_bytes_expert_grads_inter"] / 6
        assert 0.5 < m["load_balancing_loss"] < 4 and m["z_loss"] > 0
    assert lines[-1]["lm_loss"] < lines[0]["lm_loss"]

    at4 = tmp_path / "at4"
    at4.mkdir()
    shutil.copytree(full / f"iter_{SAVED_AT:07d}", at4 / f"iter_{SAVED_AT:07d}")
    (at4 / "latest_checkpointed_iteration.txt").write_text(f"{SAVED_AT}\n")
    res = torchrun(BASE + data_prefix + MOE + ["--check-replicas-interval", "1", "--load",
                                                str(at4)])
    assert f"loaded checkpoint from {at4} at iteration {SAVED_AT}" in res.stdout
    resumed = train_lines(res.stdout)
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(lines[SAVED_AT:], resumed):
        for key in ("lm_loss", "grad_norm", "learning_rate", "load_balancing_loss", "z_loss",
                    "comm_bytes_expert_grads_inter", "comm_bytes_params"):
            assert a[key] == b[key], (key, a, b)


BAD = [
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"],
     "--moe-token-dispatcher-type flex runs DeepEP or HybridEP kernels"),
    (["--num-experts", "4", "--moe-grouped-gemm"],
     "--moe-grouped-gemm needs Transformer Engine's grouped GEMM"),
    (["--num-experts", "4", "--moe-permute-fusion"], "--moe-permute-fusion needs"),
    (["--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size configures mixture-of-experts layers: add --num-experts"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"],
     "--num-experts=3 is not divisible by --expert-model-parallel-size=2"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk=5 exceeds"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"],
     "pass --moe-router-topk 1"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"],
     "--moe-shared-expert-intermediate-size needs --disable-bias-linear"),
    (["--num-experts", "4", "--moe-layer-freq", "[1]*3"],
     "--moe-layer-freq gives 3 layers, but --num-layers is 2"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2",
      "--expert-model-parallel-size", "2"], "needs --sequence-parallel"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     "SDP4Bit does not support --expert-tensor-parallel-size > 1: use 1"),
]


@pytest.mark.release_independent
def test_moe_flag_refusals_are_one_line(data_prefix) -> None:
    for extra, words in BAD:
        with pytest.raises(ArgumentsError, match=".*") as err:
            parse_args(BASE[:] + data_prefix + extra, world_size=4)
        assert words in str(err.value), (extra, str(err.value))
    args = parse_args(BASE + data_prefix + ["--num-experts", "4", "--moe-layer-freq",
                                            "([1]+[0])"], world_size=4)
    assert args.moe_layer_freq == [1, 0] and args.moe_ffn_hidden_size == args.ffn_hidden_size
    assert args.moe_router_topk == 2 and args.moe_token_dispatcher_type == "allgather"
    assert args.expert_tensor_parallel_size == 1 and args.moe_aux_loss_coeff == 0.0


@pytest.mark.release_independent
def test_start_up_line_names_the_expert_group() -> None:
    from types import SimpleNamespace

    from megatron.sdp4bit.training.sdp4bit_setup import describe_experts

    def handle(size, buckets):
        return SimpleNamespace(expert_data_parallel_size=size, expert_buckets=(None,) * buckets)

    assert describe_experts(handle(None, 0)) == ""
    assert describe_experts(handle(1, 2)) == (
        " | 2 expert bucket(s) on an expert data-parallel group of 1 rank (expert parallelism "
        "= data parallelism): nothing to send, nothing quantized there")
    assert describe_experts(handle(4, 1)) == (
        " | 1 of them expert bucket(s), on the expert data-parallel group of 4")
