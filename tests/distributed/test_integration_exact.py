"""SDP4Bit inside megatron-core, checked against megatron-core itself, step by step.

4 gloo ranks as 2 nodes x 2, the tiny GPT with DDP and the distributed optimizer, SDP4Bit
(qWD + TLq-HS). Instead of comparing losses, every step checks:

* **Gradients.** Each bucket's input to the reduce-scatter is captured as it is dispatched;
  after backward, megatron-core's own ``start_grad_sync`` (its scaling factor, its SUM, its
  reduce-scatter) runs on the same gradients, and this rank's SDP4Bit shard must equal its
  result within the bound of test_comm_reduce_scatter.py's [Note: the error bounds these
  tests assert], computed from the scaled inputs of every rank: per element (per Hadamard
  block) rigorous, and ``||err||^2 <= 2 V`` in total. With ``average_in_collective`` (AVG in
  the collective, which gloo lacks) the reference is the fp32 reduce-scatter divided by DP.
* **Weights.** After the parameter sync the replica shard equals the fp32 main weights
  (placed by megatron-core's own range maps) within one qWD step of the difference sent:
  ``|w~_t - w_t| <= absmax_group(w_t - w~_{t-1}) / 7 + 2^-8 |w~_t|`` (the last term the bf16
  rounding); padding stays zero; replicas are bitwise identical on all DP ranks.
* **Noise.** Every rounding of the run is recorded (``tests/helpers/noise.py``): no two are
  correlated (ranks, hops, slices, buckets, iterations, gradients vs weights, and the
  all-gathers an evaluation's forward runs with ``overlap_param_gather``), and they are
  unbiased.
* **Syncs without a step.** A forced parameter sync after an evaluation and at the end of
  training, with no optimizer step since the last all-gather, sends no byte and leaves every
  replica bitwise unchanged.

A second test runs PP2 x DP2 with tied embeddings: the first and last stages' copies of the
shared word embedding must stay bitwise equal under qWD.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.helpers import noise as _noise
from tests.helpers import rs_bounds as rsb
from tests.helpers.spawn import spawn

pytestmark = pytest.mark.distributed

BASE = dict(gq_group_size_intra=128, quantized_weights=True, quantized_gradients=True,
            hadamard_transform=True, gradient_alltoall_pipeline=2)


class GradProbe:
    """Captures every bucket's gradient buffer when its reduce-scatter is dispatched."""

    def __init__(self, ddp) -> None:
        self.inputs: dict[int, torch.Tensor] = {}
        self.ddp = ddp
        for bg in ddp.bucket_groups:
            installed = bg.start_grad_sync

            def start_grad_sync(*args, _bg=bg, _installed=installed, **kwargs):
                if _bg.grad_reduce_handle is None:  # a dispatching call (not the no-op repeat)
                    for bucket in _bg.buckets:
                        self.inputs[id(bucket)] = bucket.grad_data.clone()
                return _installed(*args, **kwargs)

            bg.start_grad_sync = start_grad_sync

    def check(self, cfg, average: bool) -> None:
        """This rank's synced shards against megatron-core's reduce-scatter (module doc)."""

        from megatron.sdp4bit.comm import GradientQuantConfig

        gcfg = GradientQuantConfig.from_sdp4bit(cfg)
        n = cfg.dp_ranks_per_node
        for bg in self.ddp.bucket_groups:
            group = bg.intra_distributed_optimizer_instance_group
            world, rank = bg.intra_distributed_optimizer_instance_size, dist.get_rank(group)
            synced = {id(b): b.grad_data.clone() for b in bg.buckets}
            for bucket in bg.buckets:
                bucket.grad_data.copy_(self.inputs.pop(id(bucket)))
            scaled = {id(b): b.grad_data * b.gradient_scaling_factor for b in bg.buckets}
            if average:  # gloo has no AVG: the fp32 sum, divided
                theirs = {}
                for b in bg.buckets:
                    out = torch.empty(b.grad_data.numel() // world)
                    dist.reduce_scatter_single(out, scaled[id(b)].clone(), group=group)
                    theirs[id(b)] = out / world
            else:  # megatron-core's own method, on the instance (ours is bound over it)
                type(bg).start_grad_sync(bg)
                if bg.grad_reduce_handle is not None:
                    bg.grad_reduce_handle.wait()
                    bg.grad_reduce_handle = None
                theirs = {}
                for b in bg.buckets:
                    s = b.grad_data.numel() // world
                    theirs[id(b)] = b.grad_data[rank * s:(rank + 1) * s].clone()
            for b in bg.buckets:
                b.grad_data.copy_(synced[id(b)])
                s = b.grad_data.numel() // world
                ours = b.grad_data[rank * s:(rank + 1) * s].double()
                shards = rsb.gather_shards(scaled[id(b)], group, world, rank)
                bound, var, mag = rsb.bounds(shards, n, world // n, gcfg, average, 1.0)
                block = gcfg.hadamard_block or 1
                diff = rsb.hadamard64(ours - theirs[id(b)].double(), block) if block > 1 else \
                    ours - theirs[id(b)].double()
                limit = (bound * (1 + 1e-4) + 2e-5 * mag).view(-1, block).norm(dim=1)
                worst = (diff.view(-1, block).norm(dim=1) / limit.clamp_min(1e-30)).max().item()
                assert worst <= 1.0, (f"bucket of {b.grad_data.numel()}: the synced gradient "
                                      f"is {worst:.2f}x the quantization bound away from "
                                      "megatron-core's reduce-scatter")
                excess = max(diff.norm().item() - 2e-5 * mag.norm().item(), 0.0)
                assert excess ** 2 <= 2 * var.sum().item(), "error above 2 V"
        assert not self.inputs, "a bucket was captured but not checked"


def _main_weights(optimizer) -> dict[int, torch.Tensor]:
    """id(bucket) -> fp32 main weights at their place in the bucket (NaN elsewhere), placed
    as megatron-core's own main-to-model copy places them."""
    out: dict[int, torch.Tensor] = {}
    for opt in optimizer.chained_optimizers:
        for main_group, model_group in zip(opt.shard_fp32_from_float16_groups,
                                           opt.model_float16_groups):
            for main, param in zip(main_group, model_group):
                where = opt._get_model_param_range_map(param)["gbuf_world_in_bucket"]
                gbuf, _, index = opt.model_param_gbuf_map[param]
                bucket = opt.buffers[gbuf].buckets[index]
                buf = out.setdefault(id(bucket), torch.full((bucket.param_data.numel(),),
                                                            float("nan")))
                buf[where.start:where.end] = main.detach().view(-1)
    return out


def _check_replica(ddp, optimizer, before: dict[int, torch.Tensor], cfg) -> None:
    """The qWD bound of the module docstring on this rank's shard of every bucket."""
    qmax = 2 ** (cfg.weight_quantization_bits - 1) - 1
    mains = _main_weights(optimizer)
    for bg in ddp.bucket_groups:
        world, rank = (bg.intra_distributed_optimizer_instance_size,
                       bg.intra_distributed_optimizer_instance_rank)
        for b in bg.buckets:
            s = b.param_data.numel() // world
            own = slice(rank * s, (rank + 1) * s)
            main = mains[id(b)][own]
            prev = before[id(b)][own].float()
            now = b.param_data[own].float()
            has_main = ~torch.isnan(main)
            assert torch.equal(now[~has_main], prev[~has_main]), "padding of the replica moved"
            sent = torch.where(has_main, main - prev, torch.zeros_like(prev))
            step = sent.abs().view(-1, cfg.wq_group_size).amax(1).repeat_interleave(
                cfg.wq_group_size) / qmax
            bound = step * (1 + 1e-5) + 2.0**-8 * 1.01 * now.abs() + 1e-12
            err = torch.where(has_main, (now - main).abs(), torch.zeros_like(now))
            worst = (err / bound).max().item()
            assert worst <= 1.0, (f"replica {worst:.2f}x the qWD bound away from the main "
                                  "weights after the parameter sync")


def _train(setup, cfg, steps: int, *, probe: bool, replica: bool, evaluate: bool = False,
           recorder: _noise.Recorder | None = None):
    from tests.helpers import tiny_gpt as T
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.sdp4bit.integration import install_sdp4bit

    ddp, optimizer = T.build(setup, padding_for=cfg)
    handle = install_sdp4bit([ddp], optimizer, cfg)
    grad_probe = GradProbe(ddp) if probe else None
    before: dict[int, torch.Tensor] = {}

    def before_update() -> None:
        T.assert_replicas_identical(ddp)
        if grad_probe is not None:
            grad_probe.check(cfg, setup.average_in_collective)
        before.clear()
        before.update({id(b): b.param_data.clone() for bg in ddp.bucket_groups
                       for b in bg.buckets})

    for step in range(steps):
        handle.set_iteration(step)
        if recorder is not None:
            recorder.tag = f"it{step}/"
        T.train_step(ddp, optimizer, setup, step, before_update=before_update)
        if replica:
            _check_replica(ddp, optimizer, before, cfg)
        if evaluate:  # as the trainer evaluates: a forward pass, which gathers the step's
            # difference, then a save's (Megatron-LM's evaluation's) forced sync
            if recorder is not None:
                recorder.tag = f"it{step}/eval/"
            from megatron.core import parallel_state

            data = iter([T.batch(1000 + step, 0, parallel_state.get_data_parallel_rank())])
            get_forward_backward_func()(
                forward_step_func=T._forward_step, data_iterator=data, model=[ddp],
                num_microbatches=1, seq_length=T.SEQ, micro_batch_size=T.MICRO_BATCH,
                forward_only=True)
            _assert_sync_sends_nothing(ddp, handle, f"after step {step}'s evaluation")
            assert all(handle.state.param_calls[b] == step + 1 for b in handle.bucket_numels)
    if recorder is not None:
        recorder.tag = "final/"
    T.finish_param_sync(ddp)
    _assert_sync_sends_nothing(ddp, handle, "at the end")
    T.assert_replicas_identical(ddp)
    handle.uninstall()
    return handle


def _assert_sync_sends_nothing(ddp, handle, when: str) -> None:
    """A forced parameter sync with no optimizer step since the last one sends nothing and
    leaves every replica bitwise as it was ([Note: a parameter sync sends each step once])."""
    from tests.helpers import tiny_gpt as T

    before, sent, calls = T.replica_snapshot(ddp), handle.stats.snapshot(), \
        dict(handle.state.param_calls)
    ddp.start_param_sync(force_sync=True)
    assert handle.stats.snapshot() == sent, f"{when}: a sync without a step sent bytes"
    assert dict(handle.state.param_calls) == calls, when
    for old, new in zip(before, T.replica_snapshot(ddp)):
        assert torch.equal(old.view(torch.uint8), new.view(torch.uint8)), \
            f"{when}: a sync without a step changed the replica"


def _check_noise(recorder: _noise.Recorder, what: str) -> int:
    sums = _noise.bin_sums(recorder.roundings)
    dist.all_reduce(sums)
    _noise.assert_unbiased_sums(sums, what)
    everything = _noise.gather_roundings(recorder.roundings)
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = torch.tensor([_noise.assert_independent(everything, what, part=(rank, world))])
    dist.all_reduce(pairs)
    return int(pairs.item())


def _dp_worker(rank: int, world: int) -> None:
    from tests.helpers import tiny_gpt as T
    from megatron.sdp4bit.config import SDP4BitConfig

    T.init_parallel(1, 1)
    cfg = SDP4BitConfig(**BASE, dp_ranks_per_node=2)
    # SUM with megatron-core's 1/DP scaling factor, overlapped, several buckets; 5 steps of
    # exact checks, with every rounding recorded.
    recorder = _noise.Recorder()
    with recorder.active():
        _train(T.Setup(overlap_grad_reduce=True, bucket_size=40_000), cfg, 5, probe=True,
               replica=True, recorder=recorder)
    assert _check_noise(recorder, "SUM, overlapped grads") > 1000
    # AVG in the collective, one bucket.
    _train(T.Setup(average_in_collective=True), cfg, 2, probe=True, replica=True)
    # overlap_param_gather with an evaluation after every step (its forward gathers the
    # step's difference) and forced syncs after it and at the end, which send nothing.
    recorder = _noise.Recorder()
    with recorder.active():
        _train(T.Setup(overlap_grad_reduce=True, overlap_param_gather=True,
                       bucket_size=40_000), dataclasses.replace(cfg), 3, probe=False,
               replica=False, evaluate=True, recorder=recorder)
    _check_noise(recorder, "overlap_param_gather with evaluations")


def test_synced_gradients_and_replicas_match_megatron_core() -> None:
    spawn(_dp_worker, 4, timeout=600)


def _tied_worker(rank: int, world: int) -> None:
    from tests.helpers import tiny_gpt as T
    from megatron.core import parallel_state

    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.integration import install_sdp4bit

    T.init_parallel(1, 2)
    cfg = SDP4BitConfig(**BASE, dp_ranks_per_node=2)
    setup = T.Setup(tied_embeddings=True, num_microbatches=2)
    ddp, optimizer = T.build(setup, padding_for=cfg)
    handle = install_sdp4bit([ddp], optimizer, cfg)
    model = ddp.module.module  # Float16Module -> GPTModel
    weight = model.shared_embedding_or_output_weight()
    group = parallel_state.get_embedding_group()

    def assert_tied(when: str) -> None:
        bits = weight.detach().contiguous().view(torch.uint8).view(-1)
        both = [torch.empty_like(bits) for _ in range(2)]
        dist.all_gather(both, bits, group=group)
        differ = int((both[0] != both[1]).sum())
        assert differ == 0, f"{when}: the stages' copies of the tied embedding differ in " \
                            f"{differ} bytes"

    assert_tied("at start")
    for step in range(4):
        handle.set_iteration(step)
        T.train_step(ddp, optimizer, setup, step)
        T.assert_replicas_identical(ddp)
        assert_tied(f"after step {step}")
    assert handle.state.param_calls and handle.stats.param_bytes > 0


def test_tied_embeddings_stay_bitwise_tied_under_pp() -> None:
    """PP2 x DP2, tied input/output embeddings, qWD: both stages' copies stay identical."""
    spawn(_tied_worker, 4, timeout=400)
