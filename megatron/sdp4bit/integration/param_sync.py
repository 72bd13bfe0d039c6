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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.sdp4bit.comm import weight_difference_all_gather
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
                          duplicates: TPDuplicates | None = None):
    """A ``start_param_sync`` for ``bucket_group`` (megatron-core's contract, qWD inside;
    ``post_param_sync`` where 0.19.2 runs its post-all-gather processing). With
    ``duplicates`` (TP > 1) the TP-duplicated weights take TP rank 0's values once a
    bucket's all-gather has landed ([Note: TP-duplicated weights] in tp_duplicates.py)."""
    tied_keys = [_tied_embedding_key(bucket) for bucket in bucket_group.buckets]

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
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        group = self.intra_distributed_optimizer_instance_group
        works = []
        for bucket, bucket_id, tied_key in zip(self.buckets, bucket_ids, tied_keys):
            shard = shards[bucket_id]
            with timed(state.stats, "params-quantize", bucket.param_data.device):
                main = shard.gather()
            call = state.next_param_call(bucket_id)  # fresh noise for extra gathers
            seed = (state.seed(KIND_PARAM, bucket_id, group_id, call) if tied_key is None
                    else state.seed(KIND_TIED_PARAM, 0, tied_key, call))
            works.append(weight_difference_all_gather(
                bucket.param_data, main, group=group, config=state.weight_config,
                seed=seed, stats=state.stats, ranks_per_node=ranks_per_node,
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


def make_copy_main_params_to_model_params(optimizer, *, qwd: bool,
                                          check_step: Callable[[], None] | None = None):
    """The optimizer's copy of the updated main weights into the model, which every step
    makes after its update: with qWD (``qwd``) the 16-bit groups are left to the qWD
    all-gather; without, megatron-core's own copy. First, ``check_step`` (install.py,
    [Note: an iteration without set_iteration], [Note: a loop that never reduces its
    gradients]).

    fp32 model parameters (``model_fp32_groups``) are views of the replica that the inner
    optimizer updated in place; install refuses qWD when there are any, so the copy has
    nothing left to do.
    """
    original = type(optimizer)._copy_main_params_to_model_params

    def _copy_main_params_to_model_params(self) -> None:
        if check_step is not None:
            check_step()
        if not qwd:
            return original(self)
        assert not any(self.model_fp32_groups), "qWD installed with fp32 model params"

    return _copy_main_params_to_model_params
