"""SDP4Bit on a mixture-of-experts GPT: the expert-parallel buckets on their expert DP group.

4 gloo ranks as 2 nodes x 2 (``dp_ranks_per_node=2``), expert parallelism 2, 4 experts,
top-2, each token dispatcher: the dense buckets run on the DP group of 4 (2 x 2, both hops),
the expert buckets on an expert DP group of 2 with one rank per node (the inter-node hop
alone). Checked per dispatcher in one spawn: replicas bitwise identical for dense weights on
the DP group and expert weights on the expert DP group after every step; megatron-core's
chain of two distributed optimizers steps without a false "never reduced" error and gathers
every bucket exactly once per step; the trainer's finite check and replica check read the
expert buffers too (a NaN only in rank 1's expert gradients is seen on every rank); bytes
per hop and per group equal the wire formula; with the allgather dispatcher, driven by
SDP4Bit's lifecycle (as both trainers drive it) for 10 iterations, gradients quantized from
iteration 5: the trainer's per-iteration bytes of its two log lines add up to the handle's
totals since the install, megatron-core's unquantized reduce-scatters count the quantized
one's baseline, and the end line finds the replicas identical (expert weights differ across
the expert-parallel ranks by design) and names an expert bucket when one rank's copy is
changed; then a gradient hook that reduces only the dense buckets is refused at the first
step with no weight (replica or fp32 main) changed, as is one that reduces only the first of
a dense model's bucket groups; and the chain ``overlap_param_gather_with_optimizer_step``
builds (two model chunks) reduces and gathers every bucket once per step. 8 ranks as 2 nodes
x 4: the expert DP group of 4 spans both nodes with 2 ranks on each, so expert gradients take
both hops, the inter one at 4 bits.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.wire_bytes import expected_bytes as _expected_bytes
from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

STEPS = 3
LIFECYCLE_STEPS, LOG_INTERVAL = 10, 5  # the trainer's log lines after iterations 5 and 10
COUNTERS_ALL = ("param_intra_bytes", "param_inter_bytes", "param_intra_bytes_baseline",
                "param_inter_bytes_baseline", "grad_intra_bytes", "grad_inter_bytes",
                "grad_intra_bytes_baseline", "grad_inter_bytes_baseline")
COUNTERS = ("param_intra_bytes", "param_inter_bytes", "grad_intra_bytes", "grad_inter_bytes",
            "grad_intra_bytes_baseline", "grad_inter_bytes_baseline")


def _config(dp_ranks_per_node: int):
    from megatron.sdp4bit.config import SDP4BitConfig

    return SDP4BitConfig(quantized_weights=True, quantized_gradients=True,
                         hadamard_transform=True, gq_group_size_intra=128,
                         dp_ranks_per_node=dp_ranks_per_node)


def _expected(cfg, buckets, n: int, m: int) -> dict[str, int]:
    total = dict.fromkeys(COUNTERS, 0)
    for info in buckets:
        for name, value in _expected_bytes(cfg, info.numel, n, m).items():
            if name in total:
                total[name] += value
    return total


def _snapshot(stats) -> dict[str, int]:
    return {name: getattr(stats, name) for name in COUNTERS}


def _train(dispatcher: str, cfg, ep: int):
    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.integration import install_sdp4bit

    T.init_parallel(ep=ep)
    setup = T.Setup(moe_dispatcher=dispatcher)
    ddp, optimizer = T.build(setup, padding_for=cfg)
    assert len(optimizer.chained_optimizers) == 2, "megatron-core built no chain"
    handle = install_sdp4bit([ddp], optimizer, cfg)
    losses = T.train_checking_replicas(ddp, optimizer, setup, STEPS,
                                       before_step=handle.set_iteration)
    assert all(loss == loss for loss in losses), losses
    return ddp, optimizer, handle, setup


def _train_with_lifecycle(cfg):
    """The allgather dispatcher, EP 2, driven as our trainer drives SDP4Bit: the lifecycle
    hears of every iteration and a log line takes the bytes every LOG_INTERVAL iterations.
    Returns the lifecycle, the model, the optimizer, the setup and the log lines' fields,
    each with its number of iterations."""
    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.integration.lifecycle import SDP4BitLifecycle
    from megatron.sdp4bit.training.observe.comm_counters import log_fields

    T.init_parallel(ep=2)
    setup = T.Setup(moe_dispatcher="allgather")
    ddp, optimizer = T.build(setup, padding_for=cfg)
    lifecycle = SDP4BitLifecycle(cfg.replace(gradients_quantization_start_iteration=LOG_INTERVAL))
    lifecycle.install([ddp], optimizer)
    lines = []

    def log_line() -> None:  # what the loop logs: per iteration, averaged over the interval
        lines.append((log_fields(lifecycle.take_bytes().per_iteration(LOG_INTERVAL)),
                      LOG_INTERVAL))

    def before_step(step: int) -> None:
        if step:
            lifecycle.finish_iteration()
            if step % LOG_INTERVAL == 0:
                log_line()
        lifecycle.start_iteration(step)

    losses = T.train_checking_replicas(ddp, optimizer, setup, LIFECYCLE_STEPS,
                                       before_step=before_step)
    lifecycle.finish_iteration()
    log_line()
    assert all(loss == loss for loss in losses), losses
    return lifecycle, ddp, optimizer, setup, lines


def _check_log_lines_add_up(lifecycle, lines) -> None:
    """The log lines' per-iteration bytes, times their iterations, against the handle's
    totals since the install (a log line resets nothing), dense and expert parts: the
    weights' all-gathers of both lines are the handle's; the gradients of the first line
    went through megatron-core's reduce-scatter (sent = its ideal bytes, the same as the
    quantized one's baseline), those of the second are the handle's."""
    from megatron.sdp4bit.training.observe.comm_counters import EXPERT_FIELDS, FIELDS

    handle = lifecycle.handle
    assert len(lines) == 2 and lifecycle.iterations == LIFECYCLE_STEPS
    for fields, stats in ((FIELDS, handle.stats), (EXPERT_FIELDS, handle.expert_stats)):
        total = stats.snapshot()
        first, second = ({counter: line[key] * n for key, counter in fields.items()}
                         for line, n in lines)
        for counter in COUNTERS_ALL:
            if counter.startswith("param"):
                assert first[counter] == second[counter], counter  # qWD in both lines
                assert first[counter] + second[counter] == total[counter], counter
            else:
                assert second[counter] == total[counter], counter
                baseline = counter if counter.endswith("_baseline") else counter + "_baseline"
                assert first[counter] == second[baseline], counter
    assert total["param_inter_bytes"] > 0 and total["grad_inter_bytes"] > 0


def _check_counts_and_bytes(handle, cfg, dense_nm, expert_nm, grad_steps: int = STEPS,
                            param_steps: int = STEPS) -> None:
    s = handle.state
    # one reduce-scatter and one all-gather per bucket and step, for both optimizers' buckets
    # (without the per-bucket step check the chain's second optimizer raises; without the
    # one-gather rule each step gathers every bucket twice)
    assert dict(s.grad_calls) == {info.id: grad_steps for info in handle.buckets}, \
        dict(s.grad_calls)
    assert dict(s.param_calls) == {info.id: param_steps for info in handle.buckets}, \
        dict(s.param_calls)
    expert_ids = {info.id for info in handle.expert_buckets}
    dense = [info for info in handle.buckets if info.id not in expert_ids]
    want_expert = _expected(cfg, handle.expert_buckets, *expert_nm)
    want_dense = _expected(cfg, dense, *dense_nm)
    got_expert = _snapshot(handle.expert_stats)
    got_total = _snapshot(handle.stats)
    def times(want: dict) -> dict:
        return {k: (param_steps if k.startswith("param") else grad_steps) * v
                for k, v in want.items()}
    assert got_expert == times(want_expert), (got_expert, want_expert)
    got_dense = {k: got_total[k] - got_expert[k] for k in COUNTERS}
    assert got_dense == times(want_dense), (got_dense, want_dense)


def _check_partial_hook_refused(ddp, optimizer, setup, handle) -> None:
    """A finalize hook that reduces the dense buckets only: the expert optimizer's check
    stops the step before anything is updated."""
    from tests.helpers import tiny_gpt as T

    from megatron.core.utils import get_model_config

    config = get_model_config(ddp)

    def dense_only(model, *args, **kwargs):
        for bucket_group in ddp.bucket_groups:
            bucket_group.finish_grad_sync()

    config.finalize_model_grads_func = dense_only
    replica = T.replica_snapshot(ddp)
    main = [m.detach().clone() for opt in optimizer.chained_optimizers
            for group in opt.shard_fp32_from_float16_groups for m in group]
    handle.set_iteration(LIFECYCLE_STEPS)
    with pytest.raises(RuntimeError, match=r"found 1 of its 1 gradient bucket\(s\) \(id \d+\) "
                                           r"with no reduce-scatter since the previous step"):
        T.train_step(ddp, optimizer, setup, STEPS)
    after = [m.detach() for opt in optimizer.chained_optimizers
             for group in opt.shard_fp32_from_float16_groups for m in group]
    assert all(torch.equal(a, b) for a, b in zip(main, after)), "a main weight changed"
    assert all(torch.equal(a, b) for a, b in zip(replica, T.replica_snapshot(ddp))), \
        "the replica changed"


def _check_first_bucket_only_hook_refused(cfg) -> None:
    """A dense model with several bucket groups (``overlap_grad_reduce``: the backward hooks
    start every group's reduce-scatter) and a hook that waits for the first only: the step
    stops, counting the others, before any weight changes."""
    from megatron.core.utils import get_model_config

    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.integration import install_sdp4bit

    T.init_parallel()
    setup = T.Setup(overlap_grad_reduce=True, bucket_size=12_000)
    ddp, optimizer = T.build(setup, padding_for=cfg)
    groups = len(ddp.bucket_groups)
    assert groups >= 3, groups
    handle = install_sdp4bit([ddp], optimizer, cfg)
    handle.set_iteration(0)
    get_model_config(ddp).finalize_model_grads_func = (
        lambda *args, **kwargs: ddp.bucket_groups[0].finish_grad_sync())
    replica = T.replica_snapshot(ddp)
    with pytest.raises(RuntimeError, match=rf"optimizer step at iteration 0 found {groups - 1} "
                                           rf"of its {groups} gradient bucket\(s\)"):
        T.train_step(ddp, optimizer, setup, 0)
    assert all(torch.equal(a, b) for a, b in zip(replica, T.replica_snapshot(ddp)))


def _check_chain_overlapping_gather_with_step(cfg) -> None:
    """``overlap_param_gather_with_optimizer_step``: megatron-core chains one distributed
    optimizer per group of model chunks (here two chunks, two optimizers) and dispatches the
    first chunk's all-gathers right after the first optimizer's step. Each optimizer checks
    its own buckets (no false "never reduced"), and each bucket is gathered once per step:
    chunk 0's after the step, chunk 1's in the next forward pre-hook (at iteration 0, before
    any step, nothing is due)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.integration import install_sdp4bit

    T.init_parallel()
    setup = T.Setup(overlap_grad_reduce=True, overlap_param_gather=True)
    chunks = [T.build(setup, seed=seed, padding_for=cfg)[0] for seed in (1, 2)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=3e-3, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0,
        use_distributed_optimizer=True, overlap_param_gather_with_optimizer_step=True), chunks)
    assert len(optimizer.chained_optimizers) == 2
    handle = install_sdp4bit(chunks, optimizer, cfg)
    first = {info.id for info in handle.buckets if info.bucket in
             [b for bg in chunks[0].bucket_groups for b in bg.buckets]}
    dp_rank = parallel_state.get_data_parallel_rank()
    for step in range(STEPS):
        handle.set_iteration(step)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        data = T.batch(step, 0, dp_rank)
        loss = sum(chunk(data["tokens"], data["position_ids"], attention_mask=None,
                         labels=data["labels"]).float().mean() for chunk in chunks)
        loss.backward()
        finalize_model_grads(chunks)
        ok, _, _ = optimizer.step()
        assert ok
        for chunk in chunks:
            T.assert_replicas_identical(chunk)
        s = handle.state
        assert all(s.grad_calls[info.id] == step + 1 for info in handle.buckets)
        assert all(s.param_calls[info.id] == step + (1 if info.id in first else 0)
                   for info in handle.buckets), dict(s.param_calls)


def _check_replica_guard_sees_expert_weights(lifecycle, ddp, iteration: int) -> None:
    """The trainer's --check-replicas-interval check and both trainers' end line compare
    the expert buckets on the expert DP group: identical after training (expert weights
    differ across the expert-parallel ranks by design); one changed expert weight on one
    rank stops the check, naming an expert bucket, and the end line (the last rank's, not
    in that group) says DIFFERENT with the same words."""
    import torch.distributed as dist

    from megatron.sdp4bit.training.guards.replicas import ReplicaMismatch, check_replicas

    check_replicas([ddp], iteration)  # identical: passes
    line = lifecycle.end_line()
    assert (line is None) == (dist.get_rank() != 3)
    if line is not None:  # 2 buckets (a dense one, an expert one), qWD from iteration 0
        quantized = iteration - LOG_INTERVAL
        assert re.fullmatch(
            rf"SDP4Bit on this rank: {2 * quantized} quantized gradient reduce-scatters, "
            rf"{2 * iteration} quantized parameter all-gathers, {2 * LOG_INTERVAL} unquantized "
            rf"\(before --gradients-quantization-start-iteration\) in {iteration} iterations; "
            r"bytes sent / unquantized: params 0\.2510 against bf16 parameter all-gather, "
            r"grads 0\.\d{4} against fp32 gradient reduction; model replicas on the 4 "
            r"data-parallel ranks: bitwise identical, checksum [0-9a-f]{16}", line), line
    expert = ddp.expert_parallel_buffers[0].param_data
    saved = expert[0].clone()
    if dist.get_rank() == 2:  # expert DP group {0, 2}
        expert[0] += 1.0
    try:
        if dist.get_rank() in (0, 2):
            with pytest.raises(ReplicaMismatch, match=r"differ across expert data-parallel "
                                                      r"ranks .* expert bucket 0 "):
                check_replicas([ddp], iteration)
        else:
            check_replicas([ddp], iteration)
        line = lifecycle.end_line()
        if line is not None:
            numel = ddp.expert_parallel_buffers[0].buckets[0].param_data.numel()
            assert re.search(rf"model replicas on the 4 data-parallel ranks: DIFFERENT \(expert "
                             rf"bucket 0 \({numel} elements: .*, \.\.\.\) differs between "
                             r"expert DP ranks 0 and 1\), checksum [0-9a-f]{16}$", line), line
    finally:
        expert[0] = saved


def _check_finite_check_sees_expert_gradients(ddp) -> None:
    """The trainer's finite check before the optimizer (bf16/fp32 runs) reads the
    expert-parallel gradient buffers too: a NaN in rank 1's expert gradients alone makes every
    rank skip the step (it read only the dense buffers, so the step was applied)."""
    import torch.distributed as dist

    from megatron.sdp4bit.training.step import grads_finite

    assert grads_finite([ddp])  # the last step's gradients: finite everywhere
    for buffers in (ddp.expert_parallel_buffers, ddp.buffers):
        grad = buffers[0].grad_data
        saved = grad[-1].clone()
        if dist.get_rank() == 1:
            grad[-1] = float("nan")
        try:
            assert not grads_finite([ddp]), "a NaN gradient was not seen on every rank"
        finally:
            grad[-1] = saved
    assert grads_finite([ddp])


def _check_expert_group_of_one(cfg) -> None:
    """EP = DP (4): every rank holds its own experts, the expert DP group has one rank:
    nothing is sent or quantized for them, and the step check still counts them."""
    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.integration import install_sdp4bit

    T.init_parallel(ep=4)
    setup = T.Setup(moe_dispatcher="alltoall")
    ddp, optimizer = T.build(setup, padding_for=cfg)
    handle = install_sdp4bit([ddp], optimizer, cfg)
    assert handle.expert_data_parallel_size == 1
    losses = T.train_checking_replicas(ddp, optimizer, setup, 2, before_step=handle.set_iteration)
    assert all(loss == loss for loss in losses)
    assert all(value == 0 for value in _snapshot(handle.expert_stats).values())
    experts = {info.id for info in handle.expert_buckets}
    assert experts and not experts & (set(handle.state.grad_calls) | set(handle.state.param_calls))
    handle.uninstall()


def _four_rank_worker(rank: int, world_size: int) -> None:
    cfg = _config(dp_ranks_per_node=2)
    for dispatcher in ("alltoall", "allgather"):
        if dispatcher == "alltoall":
            ddp, optimizer, handle, setup = _train(dispatcher, cfg, ep=2)
            _check_counts_and_bytes(handle, cfg, dense_nm=(2, 2), expert_nm=(1, 2))
        else:
            lifecycle, ddp, optimizer, setup, lines = _train_with_lifecycle(cfg)
            handle = lifecycle.handle
            _check_counts_and_bytes(handle, cfg, dense_nm=(2, 2), expert_nm=(1, 2),
                                    grad_steps=LIFECYCLE_STEPS - LOG_INTERVAL,
                                    param_steps=LIFECYCLE_STEPS)
            _check_log_lines_add_up(lifecycle, lines)
        assert handle.expert_data_parallel_size == 2
        got = _snapshot(handle.expert_stats)
        assert got["grad_intra_bytes"] == 0 < got["grad_inter_bytes"], got  # inter hop alone
        if dispatcher == "allgather":
            _check_finite_check_sees_expert_gradients(ddp)
            _check_replica_guard_sees_expert_weights(lifecycle, ddp, LIFECYCLE_STEPS)
            _check_partial_hook_refused(ddp, optimizer, setup, handle)
        handle.uninstall()
    _check_first_bucket_only_hook_refused(cfg)
    _check_expert_group_of_one(cfg)
    _check_chain_overlapping_gather_with_step(cfg)


def _eight_rank_worker(rank: int, world_size: int) -> None:
    cfg = _config(dp_ranks_per_node=4)
    _, _, handle, _ = _train("alltoall", cfg, ep=2)
    _check_counts_and_bytes(handle, cfg, dense_nm=(4, 2), expert_nm=(2, 2))
    # the expert gradients' inter-node hop carries 4-bit messages
    assert cfg.gradient_quantization_bits_inter == 4
    got = handle.expert_stats.grad_inter_bytes
    assert got == STEPS * sum(
        (2 - 1) * (info.shard_numel // 2 + 4 * (info.shard_numel // cfg.gq_group_size_inter))
        for info in handle.expert_buckets), got
    handle.uninstall()


def test_moe_four_ranks_both_dispatchers() -> None:
    spawn(_four_rank_worker, 4, timeout=600)


def test_moe_expert_group_across_two_nodes_eight_ranks() -> None:
    spawn(_eight_rank_worker, 8, timeout=600)
