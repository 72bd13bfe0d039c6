"""TLq / TLq-HS in megatron-core's gradient sync: the replaced ``start_grad_sync``.

megatron-core's ``_ParamAndGradBucketGroup.start_grad_sync`` (param_and_grad_buffer.py; the
same in 0.16.1 and 0.19.2 where SDP4Bit is concerned) issues, inside a
``_coalescing_manager``, one ``reduce_scatter_tensor(shard_r, grad_data)`` per bucket,
asynchronously with ``overlap_grad_reduce`` (then ``finish_grad_sync`` waits on the stored
``grad_reduce_handle``), synchronously otherwise (``finish_grad_sync`` calls it). It is
called from three places: the backward hook once every gradient of the group is ready
(``register_grad_ready``), ``finish_grad_sync`` (first batch, and always without overlap),
and ``DistributedDataParallel.start_grad_sync``.

[Note: the replaced start_grad_sync]
The replacement below is bound on each bucket-group instance (so all three callers reach
it) and keeps that contract: same early return in the first batch, same preparation of the
buckets (``releases.prepare_grads_for_sync``: 0.19.2's CUDA-graph events and fp32 local
accumulators), same NaN/large-gradient checks, same ``gradient_scaling_factor`` and SUM/AVG
choice, same handle semantics. Only the collective differs: ``two_level_reduce_scatter`` on
every bucket (not coalesced: each returns its own handle, and megatron-core's
``_coalescing_manager`` would not wait on ours).

[Note: advancing earlier buckets]
With ``overlap_grad_reduce`` the backward hook starts bucket groups one by one while
backward runs, and ``finish_grad_sync`` waits on them after backward. A two-hop
``two_level_reduce_scatter`` issues its intra-node hop at call time, but its inter-node hop
only in ``advance()`` (or ``wait()``), after the intra hop has landed and the node partial
sum was requantized (comm/reduce_scatter.py, [Note: the two-hop schedule]). Left to
``wait()``, the expensive inter-node hop of every bucket would start only after backward.
So each quantized ``start_grad_sync`` first calls ``advance()`` on every async
reduce-scatter started before it and not advanced yet (``RunState.pending_grad_works``, a
FIFO shared by all bucket groups of the install), then issues its own buckets: bucket k's
inter hop goes on the wire when bucket k+1 is ready, overlapping the rest of backward.

Deterministic by construction: ``advance()`` issues collectives, and the calls to
``start_grad_sync`` / ``finish_grad_sync`` come in the same order on every DP rank
(megatron-core already relies on that for its own collectives), so the inter hops are
issued in the same order everywhere. The bits do not change (same messages, same seeds,
only earlier). A waited group's works leave the queue, so it is empty whenever no gradient
collective is in flight (between iterations, and at ``uninstall()``, which refuses to run
with one in flight). One-hop topologies (N = 1 or M = 1) have nothing to advance.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from megatron.sdp4bit.comm import CollectiveWork, DPTopology, two_level_reduce_scatter
from megatron.sdp4bit.integration.releases import prepare_grads_for_sync
from megatron.sdp4bit.integration.state import KIND_GRAD, RunState
from megatron.sdp4bit.integration.work import BucketGroupWork


class _QueuedGroupWork(BucketGroupWork):
    """A bucket group's ``grad_reduce_handle`` that takes its works off the advance queue
    when waited (see [Note: advancing earlier buckets])."""

    def __init__(self, works: Sequence[CollectiveWork], state: RunState) -> None:
        super().__init__(works)
        self._ids = {id(work) for work in works}
        self._state = state

    def wait(self, timeout: object = None) -> bool:
        self._state.pending_grad_works = [
            entry for entry in self._state.pending_grad_works if id(entry[1]) not in self._ids]
        self._ids = set()
        return super().wait(timeout)


def advance_pending_grad_works(state: RunState) -> None:
    """``advance()`` every queued reduce-scatter, oldest first, and empty the queue."""
    pending, state.pending_grad_works = state.pending_grad_works, []
    for bucket_id, work in pending:
        if not work.is_advanced():
            work.advance()
            state.early_grad_advances[bucket_id] += 1


def make_start_grad_sync(bucket_group, *, bucket_ids: list[int], topology: DPTopology,
                         group_id: int, state: RunState):
    """A ``start_grad_sync`` for ``bucket_group`` (the engine binds it on the instance)."""
    original = type(bucket_group).start_grad_sync  # megatron-core's, for the warm-up iterations

    def start_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if force_all_reduce:
            raise NotImplementedError(
                "force_all_reduce asks megatron-core for an all-reduce of the gradients; "
                "SDP4Bit quantizes the distributed optimizer's reduce-scatter only: uninstall "
                "SDP4Bit (handle.uninstall()) for this call")
        # [Note: an iteration without set_iteration] (install.py)
        state.require_iteration("a gradient reduce-scatter")
        if not state.quantize_gradients_now:
            # gradients_quantization_start_iteration not reached: megatron-core's collective,
            # as configured (counted apart so the trainer can report it).
            for bucket_id in bucket_ids:
                state.unquantized_grad_calls[bucket_id] += 1
            state.grad_syncs_since_step += 1
            return original(self, force_all_reduce=force_all_reduce)
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return  # already dispatched in this first batch (megatron-core's rule)
        assert self.grad_reduce_handle is None, "grad sync issued twice without a wait"
        prepare_grads_for_sync(self)
        ddp_config = self.ddp_config
        if ddp_config.check_for_nan_in_grad or ddp_config.check_for_large_grads:
            self.check_grads(check_for_nan_or_inf=ddp_config.check_for_nan_in_grad,
                             check_for_large=ddp_config.check_for_large_grads)
        with torch.no_grad():  # buffer state, not part of any autograd graph
            for bucket in self.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        op = ReduceOp.AVG if ddp_config.average_in_collective else ReduceOp.SUM
        async_op = ddp_config.overlap_grad_reduce
        world, rank = topology.world, topology.rank
        if async_op:  # earlier buckets' inter hops first: [Note: advancing earlier buckets]
            advance_pending_grad_works(state)
        works = []
        for bucket, bucket_id in zip(self.buckets, bucket_ids):
            grad = bucket.grad_data  # 1D, the whole bucket (fp32 with grad_reduce_in_fp32)
            shard = grad.numel() // world
            output = grad[rank * shard:(rank + 1) * shard]  # this rank's shard, in place
            works.append(two_level_reduce_scatter(
                output, grad, topology=topology, config=state.grad_config, op=op,
                async_op=async_op, seed=state.seed(KIND_GRAD, bucket_id, group_id),
                stats=state.stats))
            state.grad_calls[bucket_id] += 1
        state.grad_syncs_since_step += 1
        if async_op:
            state.pending_grad_works.extend(zip(bucket_ids, works))
            self.grad_reduce_handle = _QueuedGroupWork(works, state)
        else:
            self.grad_reduce_handle = None

    return start_grad_sync

