"""Every optimizer step first checks that each of its gradient buckets was reduced.

[Note: a loop that never reduces its gradients]
megatron-core's DDP reduces the gradients when something calls its ``finish_grad_sync``:
megatron-core's pipeline schedules do, through ``config.finalize_model_grads_func`` (both
tested releases call it after the last micro-batch's backward when it is set, and skip it
when it is ``None``), and with ``overlap_grad_reduce`` the backward hooks only *start* the
reduce-scatters that it waits for. A loop of one's own that leaves the hook unset trains
with every rank stepping on its own unreduced gradients: the loss falls, nothing fails, and
no collective of SDP4Bit's (or megatron-core's) ever runs. A hook that reduces only some
buckets is worse: the replicas stay identical (each rank applies the same all-gathered
weights), so no replica check sees it. So ``install_sdp4bit`` refuses a model whose config
has no ``finalize_model_grads_func``, and every distributed optimizer, in
``_copy_model_grads_to_main_grads`` (the first thing its ``prepare_grads`` does, before the
gradient norm, the clipping and any update), raises if one of *its own* buckets saw no
gradient reduce-scatter *completed* since it last stepped (counted when the collective
returns, or, with ``overlap_grad_reduce``, when its handle is waited: the backward hooks start
every bucket's reduce-scatter, and a hook that waits only for some leaves the others'
gradients unreduced when the optimizer reads them). The count is per bucket, not per install:
megatron-core's chain of distributed optimizers (MoE: one over the dense buffers, one over
the expert-parallel buffers; ``overlap_param_gather_with_optimizer_step``: one per group of
model chunks) steps one optimizer after the other, each over its own buffers, and a hook
that reduced only some buckets is caught at the first step, before any weight changes.
With quantized weights only, SDP4Bit does not see megatron-core's own reduce-scatter, so
there the install-time refusal is the guard. With TP > 1 the same replacement then makes the
TP-duplicated gradients agree ([Note: TP-duplicated weights] in tp_duplicates.py).
"""

from __future__ import annotations

from megatron.sdp4bit.integration.buckets import Buckets
from megatron.sdp4bit.integration.state import RunState
from megatron.sdp4bit.integration.tp_duplicates import TPDuplicates


def optimizer_bucket_ids(optimizer, buckets: Buckets) -> list[int]:
    """The ids of the buckets of ``optimizer``'s buffers (its own share of the model)."""
    return [buckets.of(bucket).id for buffer in optimizer.buffers for bucket in buffer.buckets]


def check_reduced(state: RunState, bucket_ids: list[int]) -> None:
    """Raise ``RuntimeError`` (one line) if a bucket of ``bucket_ids`` saw no gradient
    reduce-scatter since the last check; then start counting again for them."""
    missing = [bucket_id for bucket_id in bucket_ids
               if state.grad_syncs_since_step[bucket_id] == 0]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise RuntimeError(
            f"SDP4Bit: the optimizer step at iteration {state.iteration} found {len(missing)} "
            f"of its {len(bucket_ids)} gradient bucket(s) (id {shown}) with no reduce-scatter "
            "since the previous step: their gradients were never reduced across data-parallel "
            "ranks, and no weight was updated. megatron-core's schedule reduces every bucket "
            "through config.finalize_model_grads_func (set it to "
            "megatron.core.distributed.finalize_model_grads); a loop without the schedule "
            "calls ddp.finish_grad_sync() before optimizer.step()")
    for bucket_id in bucket_ids:
        state.grad_syncs_since_step[bucket_id] = 0


def make_copy_model_grads_to_main_grads(optimizer, *, state: RunState, buckets: Buckets,
                                        check: bool, duplicates: TPDuplicates | None):
    """The optimizer's copy of the reduced gradients into its main gradients: first the
    check of its buckets (``check``: with quantized gradients), then, with TP > 1, the TP
    sync of the duplicated gradients ([Note: TP-duplicated weights] in tp_duplicates.py)."""
    original = type(optimizer)._copy_model_grads_to_main_grads
    bucket_ids = optimizer_bucket_ids(optimizer, buckets)
    shards = []
    if duplicates is not None:
        for buffer in optimizer.buffers:
            for bucket in buffer.buckets:
                info = buckets.of(bucket)
                shards.append((info.id, bucket.grad_data[info.shard_start:info.shard_end]))

    def _copy_model_grads_to_main_grads(self) -> None:
        if check:
            check_reduced(state, bucket_ids)
        if duplicates is not None:
            duplicates.sync_gradients(shards)
        original(self)

    return _copy_model_grads_to_main_grads
