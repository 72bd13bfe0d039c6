"""qWD in megatron-core's parameter sync: main-shard views, the replaced copy and all-gather.

megatron-core 0.16.1 and 0.19.2 alike, bf16/fp16 parameters with the distributed optimizer:
``DistributedOptimizer.step_with_ready_grads`` runs the inner Adam step on the fp32 main
shards, then ``_copy_main_params_to_model_params`` writes each main shard, cast to bf16,
into *this rank's shard of the bucket's* ``param_data`` (the replica), then, without
``overlap_param_gather``, ``start_param_sync`` all-gathers every bucket's ``param_data``
from those shards (0.19.2: through ``DDP._start_bucket_group_param_sync``, which calls the
bucket group's ``start_param_sync``). With ``overlap_param_gather`` the all-gathers are
issued later, bucket by bucket, from the forward pre-hooks of the next iteration.

[Note: qWD keeps the replica until the all-gather]
Between the Adam step and the all-gather, the replica shard still holds the previous
replica *unless the copy has run*. The installed copy therefore skips the 16-bit groups:
the replica shard keeps the old values (no extra copy of the weights is needed to take the
difference), and the replaced ``start_param_sync`` sends ``Q(main - replica shard)`` and
applies every rank's dequantized difference on every rank (the owner too), which both
updates the replica and keeps it bitwise identical across DP ranks.

The main shard of a bucket is not contiguous in the optimizer (one fp32 tensor per
parameter piece), so each all-gather first gathers this rank's pieces into a shard-sized
fp32 scratch buffer (1/W of the bucket), zero where the shard holds padding.

[Note: tied embeddings]
With pipeline parallelism and tied input/output embeddings, the first and the last stage
each hold a copy of the word embedding (megatron-core marks both ``shared_embedding``). The
copies start equal (an all-reduce at construction), get the same gradient (an all-reduce
over the embedding group after the DP reduce-scatter) and so the same fp32 main weights,
and megatron-core 0.16.1 gives that parameter a bucket of its own on both stages with the
distributed optimizer (``_does_param_require_new_bucket``), starting at offset 0 and padded
alike. The two stages' DP groups therefore send the same qWD differences; drawn with the same
noise they give the same replica updates, and the copies stay bitwise tied. So the tied
bucket's seed depends neither on the stage's bucket numbering nor on its DP group but on the
rank's embedding group (the same for the pair of stages, distinct across TP ranks); the comm
layer still folds in the DP rank.

[Note: a parameter sync sends each step once]
A qWD all-gather sends ``Q(main - replica)`` with fresh rounding noise and adds it to the
replica. After it, ``main - replica`` is not zero but that quantization's residual, so a
second all-gather with no optimizer step in between would send the residual again and move
every replica by new noise: changing when the syncs run would change training. megatron-core
asks for such syncs between steps: with ``overlap_param_gather`` a trainer forces one
(``start_param_sync(force_sync=True)``, Megatron-LM's ``disable_forward_pre_hook``) before
every evaluation, every checkpoint save and at the end of training, and an evaluation's
forward pre-hooks start one too (``finish_grad_sync`` cleared ``param_gather_dispatched``).
A chain of distributed optimizers (``ChainedOptimizer``: a MoE model's dense and
expert-parallel buffers, ``overlap_param_gather_with_optimizer_step``) ends every
optimizer's step with ``start_param_sync()`` on *all* model chunks, so each bucket would be
gathered once per optimizer of the chain.

So a sync sends what an optimizer step changed, once. :attr:`RunState.params_due` maps each
bucket that an optimizer step updated since its last all-gather to the iteration of that
step: the optimizer's copy (``_copy_main_params_to_model_params``, which every successful
step runs after its update and a step skipped for non-finite gradients never reaches) marks
its own buckets due, an all-gather takes its buckets out, and a ``start_param_sync`` of a
bucket group none of whose buckets is due, forced or not, sends nothing and changes no
replica. megatron-core's protocol holds around it: a forced sync still waits for an
all-gather in flight (the handle), and a skipped group is left not dispatched, so the
forward pre-hook of the next iteration, or of an evaluation, dispatches it once its optimizer
has stepped. Each all-gather draws the noise of the step it sends (seeded with that step's
iteration, not the one in progress): whether the evaluation's forward, a checkpoint's forced
sync or the next iteration's forward runs it, the replica gets the same bits, so a run's
training does not depend on ``--eval-interval`` or on where it saves.

Nothing is due at install. A new model's main weights are its 16-bit weights widened to
fp32 (the difference is zero); a checkpoint holds a synced replica, because the trainers
force the pending all-gather before they save (Megatron-LM's trainer does, and so does this
project's, ``training/checkpoint_policy.py``), and a load without the optimizer state takes
the main weights from the loaded replica. So the first sync after a load sends nothing, as
the uninterrupted run sends nothing there, and a resume is bit-exact. (A checkpoint that an
older release saved between a step and its overlapped all-gather resumes with that step's
difference still pending: the first iteration sees the weights before it, and the next
all-gather sends both steps' difference, which qWD does for any residual.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.sdp4bit.comm import CommStats, weight_difference_all_gather
from megatron.sdp4bit.comm.stats import timed
from megatron.sdp4bit.integration.buckets import Buckets
from megatron.sdp4bit.integration.releases import post_param_sync
from megatron.sdp4bit.integration.state import KIND_PARAM, KIND_TIED_PARAM, RunState
from megatron.sdp4bit.integration.tp_duplicates import TPDuplicates
from megatron.sdp4bit.integration.work import BucketGroupWork


@dataclass
class MainShard:
    """This rank's fp32 main weights of one bucket, as (offset in the shard, tensor) pieces."""

    numel: int
    device: torch.device
    pieces: list[tuple[int, torch.Tensor]]  # (start in the local shard, 1D fp32 main param)
    scratch: torch.Tensor | None = None  # 1D fp32, numel; allocated on first use

    def gather(self) -> torch.Tensor:
        if self.scratch is None:  # zeros stay where the shard holds padding
            self.scratch = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for start, main in self.pieces:
            self.scratch[start:start + main.numel()].copy_(main.view(-1))
        return self.scratch


def main_shards(optimizers, buckets: Buckets) -> dict[int, MainShard]:
    """Bucket id -> :class:`MainShard` for every bucket of ``buckets``, read from every
    ``DistributedOptimizer``'s range maps (a bucket with no 16-bit main piece on this rank
    gets an empty one: its shard is all padding or fp32).

    Uses ``model_float16_groups`` / ``shard_fp32_from_float16_groups`` (parallel lists of
    model params and their fp32 main shards), ``model_param_gbuf_map`` (param -> buffer,
    bucket) and the range map's ``gbuf_world_in_bucket`` (the piece's place in the bucket).
    """
    shards: dict[int, MainShard] = {}
    for opt in optimizers:
        for model_group, main_group in zip(opt.model_float16_groups,
                                           opt.shard_fp32_from_float16_groups):
            for model_param, main in zip(model_group, main_group):
                gbuf_index, _, bucket_index = opt.model_param_gbuf_map[model_param]
                info = buckets.of(opt.buffers[gbuf_index].buckets[bucket_index])
                shard = info.shard_numel
                world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                start = world_range.start - info.shard_start
                assert 0 <= start and start + main.numel() <= shard, "piece outside the shard"
                entry = shards.setdefault(
                    info.id, MainShard(shard, info.bucket.param_data.device, []))
                entry.pieces.append((start, main))
    for info in buckets:
        shards.setdefault(info.id, MainShard(info.shard_numel, info.bucket.param_data.device, []))
    return shards


def _tied_embedding_key(bucket) -> int | None:
    """For the bucket holding a pipeline-shared word embedding, a key the same on the first
    and last stage (the lowest global rank of this rank's embedding group); else None.
    See [Note: tied embeddings]."""
    if not any(getattr(param, "shared_embedding", False) for param in bucket.params):
        return None
    from megatron.core import parallel_state

    group = parallel_state.get_embedding_group(check_initialized=False)
    if group is None:
        return None
    return min(torch.distributed.get_process_group_ranks(group))


def make_start_param_sync(bucket_group, *, bucket_ids: list[int], shards: dict[int, MainShard],
                          group_id: int, ranks_per_node: int, state: RunState,
                          stats: CommStats | None = None,
                          duplicates: TPDuplicates | None = None):
    """A ``start_param_sync`` for ``bucket_group`` (megatron-core's contract, qWD inside;
    ``post_param_sync`` where 0.19.2 runs its post-all-gather processing). With
    ``duplicates`` (TP > 1) the TP-duplicated weights take TP rank 0's values once a
    bucket's all-gather has landed ([Note: TP-duplicated weights] in tp_duplicates.py)."""
    tied_keys = [_tied_embedding_key(bucket) for bucket in bucket_group.buckets]
    stats = state.stats if stats is None else stats  # the install's, or its expert part

    def sync_duplicates() -> None:
        for bucket, bucket_id in zip(bucket_group.buckets, bucket_ids):
            duplicates.sync_weights(bucket_id, bucket.param_data)

    def start_param_sync(self, force_sync: bool = False) -> None:
        assert self.ddp_config.use_distributed_optimizer
        if force_sync:
            if self.param_gather_handle is not None:
                self.param_gather_handle.wait()
                self.param_gather_handle = None
                post_param_sync(self)
                return
        else:
            assert self.param_gather_handle is None
        due = [state.params_due.pop(bucket_id) for bucket_id in bucket_ids
               if bucket_id in state.params_due]
        if not due:
            return  # [Note: a parameter sync sends each step once]
        step = max(due)  # one optimizer owns the group: the same step for all its buckets
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        group = self.intra_distributed_optimizer_instance_group
        works = []
        for bucket, bucket_id, tied_key in zip(self.buckets, bucket_ids, tied_keys):
            shard = shards[bucket_id]
            with timed(stats, "params-quantize", bucket.param_data.device):
                main = shard.gather()
            seed = (state.seed(KIND_PARAM, bucket_id, group_id, step) if tied_key is None
                    else state.seed(KIND_TIED_PARAM, 0, tied_key, step))
            works.append(weight_difference_all_gather(
                bucket.param_data, main, group=group, config=state.weight_config,
                seed=seed, stats=stats, ranks_per_node=ranks_per_node,
                async_op=async_op))
            state.param_calls[bucket_id] += 1
        then = sync_duplicates if duplicates is not None else None
        if async_op:
            self.param_gather_handle = BucketGroupWork(works, then)
        else:
            self.param_gather_handle = None
            if then is not None:
                then()
        if force_sync and self.ddp_config.overlap_param_gather:
            post_param_sync(self)
        self.param_gather_dispatched = True

    return start_param_sync


def make_copy_main_params_to_model_params(optimizer, *, state: RunState, bucket_ids: list[int],
                                          qwd: bool, check_step: Callable[[], None]):
    """The optimizer's copy of the updated main weights into the model, which every step
    makes after its update. First ``check_step`` (install.py, [Note: an iteration without
    set_iteration]). With qWD (``qwd``) the 16-bit groups are left to the qWD all-gather,
    which the optimizer's buckets (``bucket_ids``) are now due, with this step's iteration
    ([Note: a parameter sync sends each step once]); without, megatron-core's own copy.

    fp32 model parameters (``model_fp32_groups``) are views of the replica that the inner
    optimizer updated in place; install refuses qWD when there are any, so the copy has
    nothing left to do.
    """
    original = type(optimizer)._copy_main_params_to_model_params

    def _copy_main_params_to_model_params(self) -> None:
        check_step()
        if not qwd:
            return original(self)
        assert not any(self.model_fp32_groups), "qWD installed with fp32 model params"
        state.params_due.update(dict.fromkeys(bucket_ids, state.iteration))

    return _copy_main_params_to_model_params
