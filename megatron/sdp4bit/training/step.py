"""One training step and one evaluation: megatron-core's pipeline schedule, the optimizer,
and the skip of a step whose gradients are not finite.

[Note: non-finite gradients]
The quantized collectives carry NaN/Inf through by design (a group holding one dequantizes
to all NaN), so a bad gradient on any rank reaches the optimizer. With ``--fp16`` the
loss scaler of megatron-core's optimizer finds it (over every rank) and skips the step,
lowering the scale. Without a loss scaler (bf16, fp32) megatron-core would apply the step
and every weight would become NaN; here :func:`train_step` checks the gradient buffers
first, every rank learns the verdict through one all-reduce, and all ranks skip the step
together. A skipped step changes no weight, so the replicas stay bitwise identical. The
loop stops the run after ``--max-consecutive-skipped-iterations`` skips in a row (with a
dynamic fp16 scale only once the scale is at ``--min-loss-scale``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.sdp4bit.integration.buckets import all_buffers
from megatron.sdp4bit.training.guards import hooks
from megatron.sdp4bit.training.guards.finite import all_finite
from megatron.sdp4bit.training.guards.skips import has_loss_scaler


def _loss_func(loss_mask: torch.Tensor, iteration: int | None, output: torch.Tensor, *,
               per_token: bool = False):
    """``iteration``: the training iteration this micro-batch belongs to (None when
    evaluating), for the ``loss`` hook point (training/hooks.py)."""
    losses = output.float().view(-1)
    mask = loss_mask.view(-1).float()
    if per_token:
        # Megatron-LM's --calculate-per-token-loss: the sum over the micro-batch's tokens and
        # their count; megatron-core's schedule divides nothing, and finalize_model_grads
        # divides the gradients by the tokens of all micro-batches and data-parallel ranks.
        total = torch.sum(losses * mask)
        if iteration is not None:
            total = hooks.transform("loss", total, iteration)
        count = mask.sum()
        return total, count.to(torch.int), {"lm loss": torch.stack([total.detach(), count])}
    loss = torch.sum(losses * mask) / mask.sum().clamp(min=1.0)
    if iteration is not None:
        loss = hooks.transform("loss", loss, iteration)
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model, timers=None, iteration: int | None = None,
                  per_token: bool = False):
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    batch = next(data_iterator)
    if timers is not None:
        timers("batch-generator").stop()
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    output = model(tokens, position_ids, None, labels=labels)
    return output, partial(_loss_func, loss_mask, iteration, per_token=per_token)


def mean_loss(losses: list[dict], group) -> float:
    """Mean of the micro-batch losses over the DP group; NaN-preserving.

    The sum stays on the device: on a GPU run the DP group is NCCL, which refuses host
    tensors (the CUDA dry run, testing/cuda_dryrun.py, checks it on CPU)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if losses:
        value = torch.stack([d["lm loss"].float() for d in losses]).mean().reshape(1).to(device)
    else:  # not the last pipeline stage: contributes nothing
        value = torch.zeros(1, device=device)
    dist.all_reduce(value, group=group)
    return value.item() / dist.get_world_size(group)


def per_token_loss(losses: list[dict], group) -> float:
    """--calculate-per-token-loss: the summed token losses over the summed token counts of
    all micro-batches of the DP group (Megatron-LM's logged value); NaN-preserving."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    if losses:
        value = torch.stack([d["lm loss"].float() for d in losses]).sum(dim=0).to(device)
    else:  # not the last pipeline stage: contributes nothing
        value = torch.zeros(2, device=device)
    dist.all_reduce(value, group=group)
    return (value[0] / value[1].clamp(min=1.0)).item()


def _reported_loss(args, losses: list[dict], group) -> float:
    if args.calculate_per_token_loss:
        return per_token_loss(losses, group)
    return mean_loss(losses, group)


# --empty-unused-memory-level: the level from which Megatron-LM empties the CUDA caching
# allocator at each point (its training.py: after the forward-backward pass and each
# evaluation step from 1, after the optimizer step from 2).
_RELEASE_LEVEL = {"forward-backward": 1, "evaluation": 1, "optimizer": 2}


def release_unused_memory(args, after: str) -> None:
    """``torch.cuda.empty_cache()`` ``after`` a point of :data:`_RELEASE_LEVEL` when
    ``--empty-unused-memory-level`` reaches its level (nothing to release without CUDA)."""
    if args.empty_unused_memory_level >= _RELEASE_LEVEL[after]:
        torch.cuda.empty_cache()


def grads_finite(model_chunks) -> bool:
    """Collective over every rank: whether all gradient buffers of all ranks, dense and
    expert-parallel, are finite."""
    return all_finite(buffer.grad_data for buffer in all_buffers(model_chunks))


def train_step(args, state, data_iterator, num_microbatches: int,
               ) -> tuple[float, float, bool, float | None]:
    """One iteration of ``num_microbatches`` micro-batches per data-parallel rank (this
    iteration's: it grows with ``--rampup-batch-size``); returns (mean loss, grad norm,
    whether the weights were updated, the number of zero gradient entries with
    ``--log-num-zeros-in-grad`` when the optimizer stepped, else ``None``).

    megatron-core's schedule runs that many micro-batches and divides each one's loss by
    the same number (without ``--calculate-per-token-loss``; with it, finalize_model_grads
    divides by the tokens of the micro-batches run), so the gradient is the mean over this
    iteration's batch; the loop counts the same batch into the consumed samples and the
    learning-rate schedule here, so the data read, the schedules and a resume agree."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    timers = state.timers
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, timers=timers, iteration=state.iteration + 1,
                                  per_token=args.calculate_per_token_loss),
        data_iterator=data_iterator, model=state.model, num_microbatches=num_microbatches,
        seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
        forward_only=False)
    release_unused_memory(args, "forward-backward")
    loss = _reported_loss(args, losses, parallel_state.get_data_parallel_group())
    if not has_loss_scaler(state.optimizer) and not grads_finite(state.model):
        return loss, float("nan"), False, None  # see [Note: non-finite gradients]
    if timers is not None:
        timers("optimizer", log_level=1).start(barrier=args.barrier_with_L1_time)
    ok, grad_norm, num_zeros = state.optimizer.step()
    if timers is not None:
        timers("optimizer").stop(barrier=args.barrier_with_L1_time)
    release_unused_memory(args, "optimizer")
    if ok:  # the schedules count samples: this iteration's batch (Megatron-LM's increment)
        state.scheduler.step(
            increment=num_microbatches * args.micro_batch_size * args.data_parallel_size)
    return (loss, (grad_norm if grad_norm is not None else float("nan")), ok,
            num_zeros if args.log_num_zeros_in_grad else None)


@torch.no_grad()
def evaluate(args, state, iterator) -> float | None:
    """``--eval-iters`` batches of ``--global-batch-size`` (also during a batch-size
    ramp-up, as Megatron-LM evaluates)."""
    if iterator is None or args.eval_iters == 0:
        return None
    for chunk in state.model:
        chunk.eval()
    losses: list[dict] = []
    for _ in range(args.eval_iters):
        losses += get_forward_backward_func()(
            forward_step_func=partial(_forward_step, per_token=args.calculate_per_token_loss),
            data_iterator=iterator, model=state.model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=True)
        release_unused_memory(args, "evaluation")
    for chunk in state.model:
        chunk.train()
    return _reported_loss(args, losses, parallel_state.get_data_parallel_group())
