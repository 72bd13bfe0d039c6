"""qWD: the weight-difference parameter all-gather (docs/design.md §4-5), qW, and the plain one.

[Note: why differences quantize well]
After an optimizer step the fp32 main shard ``w_r`` differs from the replica's shard ``w~_r``
by one update plus the previous step's quantization error: values orders of magnitude
smaller than the weights. A 4-bit quantizer's error scales with the group's absmax, so
quantizing the difference instead of the weights (qW) shrinks the error by that ratio. The
error does not accumulate: whatever step t got wrong is part of ``w_r - w~_r`` at step t+1,
so it is sent again. Per element, with ``u`` the largest update in a group and ``e`` the
previous error, ``e' < (u + e) / qmax`` (stochastic rounding), which stays below
``u / (qmax - 1)``.

[Note: what qWD sends]
With ``target`` 'main' (the default) the difference is ``w_r - w~_r``: the fp32 main weights
minus the 16-bit replica. Where the replica already holds the main weight rounded to 16
bits, the difference is that rounding's residual (below half a unit in the last place), and
it is sent again every step. Its group's step ``s`` is set by the group's largest
difference, so stochastic rounding sends a residual ``r`` as 0, or as one whole step with
probability ``r / s``: unbiased (the replica follows the fp32 weights on average), but an
element whose 16-bit value should not move is moved by a step now and then, a dither.
With 'rounded-main' the difference is ``round(w_r) - w~_r``, round() to the replica's
dtype, as the authors' code computes it (it writes the main weights into the 16-bit
parameter buffer before quantizing): exactly zero where the rounded weight equals the
replica, so such an element gets code 0 and is left alone. Both targets are pure functions
of (main, replica), which a checkpoint holds, so either resumes bit for bit; the all-gather
and the update below are the same for both.

Every rank, the owner included, applies the same dequantized messages to the same replica
with the same fp32 arithmetic and one rounding to the replica dtype, so replicas stay
bitwise identical on all ranks (invariant I1) without ever sending the full weights.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron.sdp4bit.comm.checks import check_float_buffers
from megatron.sdp4bit.comm.config import WeightQuantConfig
from megatron.sdp4bit.comm.padding import check_padded, required_divisor
from megatron.sdp4bit.comm.stats import CommStats, timed
from megatron.sdp4bit.comm.work import CollectiveWork
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.format import message_nbytes
from megatron.sdp4bit.quantization.rng import derive_seed

HOP_PARAM = 2  # distinct from the gradient hops' seeds


def _all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None
                ) -> dist.Work:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; the
    # same collective either way. Looked up per call so that tests can count what it sends.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=True)


def _validate(replica: torch.Tensor, main_shard: torch.Tensor, world: int) -> None:
    check_float_buffers(replica=replica, main_shard=main_shard)
    if replica.numel() != world * main_shard.numel():
        raise ValueError(
            f"main_shard has {main_shard.numel()} elements but the replica has "
            f"{replica.numel()} = DP size {world} x {replica.numel() / world:g}: main_shard "
            "must hold replica.numel() // DP size elements"
        )


def _finish_with(handle: dist.Work, then: Callable[[], None] | None, keep: tuple,
                 async_op: bool, stats: CommStats | None, device: torch.device
                 ) -> CollectiveWork | None:
    def finish() -> None:
        with timed(stats, "params-wait", device):
            handle.wait()
        del keep_alive[:]  # the wire buffers may go once the collective is done
        if then is not None:
            with timed(stats, "params-dequantize", device):
                then()

    keep_alive = list(keep)
    work = CollectiveWork(finish)
    if async_op:
        return work
    work.wait()
    return None


def weight_difference_all_gather(replica: torch.Tensor, main_shard: torch.Tensor, *,
                                 group: ProcessGroup | None, config: WeightQuantConfig,
                                 seed: int, stats: CommStats | None = None,
                                 ranks_per_node: int | None = None,
                                 async_op: bool = False) -> CollectiveWork | None:
    """Update the whole ``replica`` in place on every rank from every rank's ``main_shard``.

    ``replica``: the 1D parameter buffer (bf16/fp32/fp16), W equal shards, identical on all
    ranks of ``group`` and still holding the previous replica (shard r = this rank's
    ``replica[r*S:(r+1)*S]``). ``main_shard``: this rank's new fp32 (or any float) main
    weights, S elements. Mode 'diff' (qWD) sends ``Q(main_shard - replica shard)`` (with
    ``config.target`` 'rounded-main': ``Q(main_shard cast to the replica dtype - replica
    shard)``, [Note: what qWD sends]) and adds every rank's dequantized message to its
    shard; 'direct' (qW) sends ``Q(main_shard)`` and overwrites. ``S`` must be a multiple
    of :func:`~megatron.sdp4bit.comm.padding.required_divisor` ``(W, weight_group=...,
    weight_bits=...) / W``. ``stats``: byte counters (split by ``ranks_per_node``, the DP
    ranks per node; ``None`` = one node) and phase times.

    The message is quantized at call time; with ``async_op`` the returned
    :class:`CollectiveWork`'s ``wait()`` applies the update (leave ``replica`` untouched
    until then). See [Note: why differences quantize well].
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _validate(replica, main_shard, world)
    check_padded(replica.numel(),
                 required_divisor(world, **config.divisor_kwargs()),
                 "the parameter buffer")
    shard = main_shard.numel()
    nbytes = message_nbytes(shard, config.bits, config.group_size)
    if stats is not None:
        stats.add_param_bytes(nbytes, shard * replica.element_size(), world,
                              ranks_per_node or world)
    replica = replica.view(-1)
    diff = config.mode == "diff"
    message = torch.empty(nbytes, dtype=torch.uint8, device=replica.device)  # 1D uint8
    with timed(stats, "params-quantize", replica.device):
        target = main_shard.view(-1)
        if diff and config.target == "rounded-main":
            # Rounded here, once, so that every backend reads the same values: each kernel
            # widens its input to fp32 exactly. See [Note: what qWD sends].
            target = target.to(replica.dtype)
        ops.qwd_sender(target,
                       replica[rank * shard:(rank + 1) * shard] if diff else None,
                       message, bits=config.bits, group_size=config.group_size,
                       stochastic=config.stochastic, seed=derive_seed(seed, HOP_PARAM, 0, rank),
                       backend=config.kernel_backend)
    wire = torch.empty(world * nbytes, dtype=torch.uint8, device=replica.device)  # W messages
    handle = _all_gather(wire, message, group)

    def apply() -> None:
        ops.qwd_receiver(wire, replica, world=world, bits=config.bits,
                         group_size=config.group_size, accumulate=diff,
                         backend=config.kernel_backend)

    return _finish_with(handle, apply, (message,), async_op, stats, replica.device)


def unquantized_all_gather(replica: torch.Tensor, main_shard: torch.Tensor, *,
                           group: ProcessGroup | None, stats: CommStats | None = None,
                           ranks_per_node: int | None = None,
                           async_op: bool = False) -> CollectiveWork | None:
    """The baseline: all-gather ``main_shard`` cast to the replica dtype into ``replica``.

    Same calling convention and byte accounting as :func:`weight_difference_all_gather`
    (sent = baseline), so a trainer can switch between them and log the same counters.
    """
    world = dist.get_world_size(group)
    _validate(replica, main_shard, world)
    shard = main_shard.numel()
    if stats is not None:
        stats.add_unquantized_params(shard, replica.element_size(), world, ranks_per_node or world)
    send = main_shard.view(-1).to(replica.dtype, copy=True)  # a copy: the output overlaps it
    handle = _all_gather(replica.view(-1), send, group)
    return _finish_with(handle, None, (send,), async_op, stats, replica.device)
