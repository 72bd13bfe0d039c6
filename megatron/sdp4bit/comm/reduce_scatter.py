"""TLq / TLq-HS: the two-level quantized gradient reduce-scatter (docs/design.md §4).

Drop-in for ``torch.distributed.reduce_scatter_tensor(output, input, op, group, async_op)``:
DP rank r ends with ``sum_k input_k[r*S:(r+1)*S]`` (or the mean) in ``output`` (S elements).

[Note: the two-hop schedule]
W = N x M; the input is viewed as ``[M, N, P, c]`` (shard ``m*N + n`` cut in P slices of c).

1. At call time: one fused sender call quantizes everything at the intra bits (after the
   Hadamard transform when enabled) into ``P * N`` messages, slice-major; message (p, n')
   holds the M chunks ``input[:, n', p, :]`` that local peer n' needs. Slice p's N messages
   are contiguous, so one ``all_to_all_single`` on the intra-node group moves slice p. All P
   are issued at once.
2. ``advance()`` of the returned work (or the start of ``wait()``): for each slice, wait for
   its intra hop, dequantize the N received messages, sum in fp32, requantize as M messages
   at the inter bits (still in the Hadamard domain: the transform is linear), and issue the
   slice's inter-node ``all_to_all_single`` without waiting for it.
3. The rest of ``wait()``: for each slice, wait for its inter hop, dequantize the M
   node-partial sums of this rank's slice, sum, inverse Hadamard, scale (1/W for AVG), write
   the slice of ``output``.

Intra and inter hops use different process groups, so slice p's inter hop is in flight
while slice p+1's intra hop still is (gloo runs each group's collectives on its own
threads; NCCL on its own communicator), and slice p is decoded while the inter hops of the
later slices are still in flight. A caller with several collectives in flight (gradient buckets issued
during backward) calls ``advance()`` on the earlier ones when it issues the next, so their
inter-node hops overlap the rest of backward instead of starting at ``wait()``; it must do
so in the same order on every rank, since ``advance()`` issues collectives. When
``advance()`` runs does not change a bit of the result (same messages, same seeds). With one
hop only (N = 1 or M = 1) the whole buffer goes in one all-to-all of W messages at that
hop's bits and group size, issued at call time: there is nothing to overlap, the pipeline
slices do not change the schedule, and ``advance()`` has nothing to do. With W = 1 the
rank's message goes to itself without a collective (still quantized: no silent unquantized
path).

Random streams: the sender uses ``derive_seed(seed, 0, 0, dp_rank)`` (one call for all
slices; the stream index separates them), slice p's requantization
``derive_seed(seed, 1, p, dp_rank)``. The caller derives ``seed`` from (user seed,
iteration, bucket), so every call draws fresh, reproducible noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from megatron.sdp4bit.comm.checks import check_float_buffers
from megatron.sdp4bit.comm.config import GradientQuantConfig
from megatron.sdp4bit.comm.error_feedback import ErrorFeedback, check_two_hops
from megatron.sdp4bit.comm.padding import check_padded, required_divisor
from megatron.sdp4bit.comm.stats import CommStats, grad_baseline_bytes, timed
from megatron.sdp4bit.comm.topology import DPTopology
from megatron.sdp4bit.comm.work import CollectiveWork
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.format import message_nbytes
from megatron.sdp4bit.quantization.rng import derive_seed

HOP_INTRA = 0
HOP_INTER = 1


def _validate(output: torch.Tensor, input: torch.Tensor, topology: DPTopology,
              config: GradientQuantConfig, op: ReduceOp) -> None:
    """Local checks only, identical on every rank given identical shapes: before any collective."""
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"op={op} is not supported: use ReduceOp.SUM or ReduceOp.AVG")
    check_float_buffers(input=input, output=output)
    if input.numel() != topology.world * output.numel():
        raise ValueError(
            f"output has {output.numel()} elements but input has {input.numel()} = DP size "
            f"{topology.world} x {input.numel() / topology.world:g}: output must hold "
            "input.numel() // DP size elements"
        )
    divisor = required_divisor(topology.world, **config.divisor_kwargs())
    check_padded(input.numel(), divisor, "the reduce-scatter input")


@dataclass(frozen=True)
class Hop:
    """One hop's all-to-alls of one call, as the collective sizes its wire buffers."""

    name: str
    """'intra' (the node's ranks) or 'inter' (the ranks with this local index)."""
    peers: int
    """Ranks in each all-to-all, this one included (one message per rank)."""
    collectives: int
    """All-to-alls per call: the pipeline slices P on the two-hop path, else 1."""
    message_numel: int
    """Values in one message."""
    message_nbytes: int
    """Bytes of one message (fp32 scales + packed codes)."""

    @property
    def buffer_nbytes(self) -> int:
        """Bytes of the send buffer of all the hop's all-to-alls (the receive buffer is as big)."""
        return self.collectives * self.peers * self.message_nbytes

    @property
    def sent_nbytes(self) -> int:
        """Bytes this rank sends to other ranks on this hop per call."""
        return self.collectives * (self.peers - 1) * self.message_nbytes


def hops(ranks_per_node: int, nodes: int, shard: int, config: GradientQuantConfig
         ) -> tuple[Hop, ...]:
    """The hops of one call with ``shard`` output elements on N x M DP ranks: two when both N
    and M exceed 1, else the single one (intra when M == 1, so also for W == 1). The one
    place that sizes the messages and wire buffers (see [Note: the two-hop schedule])."""
    n, m, p = ranks_per_node, nodes, config.pipeline_slices
    if n > 1 and m > 1:
        c = shard // p
        return (
            Hop("intra", n, p, m * c,
                message_nbytes(m * c, config.intra_bits, config.intra_group_size)),
            Hop("inter", m, p, c, message_nbytes(c, config.inter_bits, config.inter_group_size)),
        )
    if m == 1:  # one node (or one rank): the single hop is intra-node
        return (Hop("intra", n, 1, shard,
                    message_nbytes(shard, config.intra_bits, config.intra_group_size)),)
    return (Hop("inter", m, 1, shard,
                message_nbytes(shard, config.inter_bits, config.inter_group_size)),)


def record_bytes(stats: CommStats | None, ranks_per_node: int, nodes: int,
                 config: GradientQuantConfig, shard: int, elem: int) -> None:
    """Add to ``stats`` the bytes one call with ``shard`` output elements of ``elem`` bytes
    sends on N x M DP ranks, and what ``reduce_scatter_tensor`` would send (the baseline):
    the collective's own byte counter, which reads only N and M, so that a caller can count
    the bytes of a layout without running it (``benchmarks/scale.py``)."""
    if stats is None:
        return
    n, m = ranks_per_node, nodes
    sent = {"intra": 0, "inter": 0}
    for hop in hops(n, m, shard, config):
        sent["intra" if hop.name == "intra" else "inter"] += hop.sent_nbytes
    stats.add_grad_bytes(sent["intra"], sent["inter"], *grad_baseline_bytes(shard, elem, n, m))


def two_level_reduce_scatter(output: torch.Tensor, input: torch.Tensor, *,
                             topology: DPTopology, config: GradientQuantConfig,
                             op: ReduceOp = ReduceOp.SUM, async_op: bool = False, seed: int,
                             stats: CommStats | None = None,
                             error_feedback: ErrorFeedback | None = None
                             ) -> CollectiveWork | None:
    """Quantized reduce-scatter of ``input`` (W shards) into ``output`` (this rank's shard).

    ``input``: contiguous, fp32/bf16/fp16, ``input.numel()`` a multiple of
    :func:`~megatron.sdp4bit.comm.padding.required_divisor` for ``config``; ``output``:
    ``input.numel() // W`` elements, any of those dtypes (accumulation is fp32). ``op``: SUM or
    AVG. ``seed``: 64-bit seed of this call's rounding noise (derive it from the user seed,
    iteration and bucket). ``stats``: byte counters (and phase times) to add to. Returns a
    :class:`CollectiveWork` when ``async_op`` (``output`` must stay untouched until
    ``wait()``; ``advance()`` issues the inter-node hop early), else None. ``input`` is fully read (quantized) before this returns, so
    ``output`` may be this rank's shard of ``input`` itself (megatron-core's in-place call).
    ``error_feedback``: this bucket's inter-hop error state (two-hop path only; see
    :mod:`.error_feedback`). See [Note: the two-hop schedule].
    """
    _validate(output, input, topology, config, op)
    if error_feedback is not None:
        check_two_hops(topology.ranks_per_node, topology.nodes)
        if error_feedback.slices * error_feedback.slice_numel != topology.nodes * output.numel():
            raise ValueError("error_feedback was sized for another bucket: one state per "
                             "bucket")
        error_feedback.start_call()
    record_bytes(stats, topology.ranks_per_node, topology.nodes, config, output.numel(),
                 input.element_size())
    scale = 1.0 / topology.world if op == ReduceOp.AVG else 1.0
    inp = input.view(-1)
    out = output.view(-1)
    if topology.ranks_per_node > 1 and topology.nodes > 1:
        work = CollectiveWork(*_two_hops(out, inp, topology, config, scale, seed, stats,
                                         error_feedback))
    else:
        work = CollectiveWork(_one_hop(out, inp, topology, config, scale, seed, stats))
    if async_op:
        return work
    work.wait()
    return None


def _one_hop(out: torch.Tensor, inp: torch.Tensor, topo: DPTopology,
             config: GradientQuantConfig, scale: float, seed: int,
             stats: CommStats | None) -> Callable[[], None]:
    """N = 1 (inter hop only) or M = 1 (intra hop only): one all-to-all of W messages."""
    if topo.nodes == 1:
        group, bits, gsize = topo.intra_group, config.intra_bits, config.intra_group_size
    else:
        group, bits, gsize = topo.inter_group, config.inter_bits, config.inter_group_size
    w = topo.world
    (hop,) = hops(topo.ranks_per_node, topo.nodes, out.numel(), config)
    send = torch.empty(hop.buffer_nbytes, dtype=torch.uint8,
                       device=inp.device)  # 1D uint8: W messages of S values, by destination
    with timed(stats, "grads-quantize", inp.device):
        ops.tlq_sender(inp, send, num_dests=w, blocks_per_dest=1, slices=1, bits=bits,
                       group_size=gsize, hadamard_block=config.hadamard_block,
                       stochastic=config.stochastic,
                       seed=derive_seed(seed, HOP_INTRA, 0, topo.rank),
                       backend=config.kernel_backend)
    if w == 1:
        recv, handle = send, None
    else:
        recv = torch.empty_like(send)
        handle = dist.all_to_all_single(recv, send, group=group, async_op=True)

    def finish() -> None:
        if handle is not None:
            with timed(stats, "grads-wait", out.device):
                handle.wait()
        with timed(stats, "grads-dequantize", out.device):
            ops.tlq_receiver(recv, out, n_in=w, bits=bits, group_size=gsize,
                             hadamard_block=config.hadamard_block, scale=scale,
                             backend=config.kernel_backend)

    return finish


def _two_hops(out: torch.Tensor, inp: torch.Tensor, topo: DPTopology,
              config: GradientQuantConfig, scale: float, seed: int, stats: CommStats | None,
              error_feedback: ErrorFeedback | None = None
              ) -> tuple[Callable[[], None], Callable[[], None]]:
    """N > 1 and M > 1: see [Note: the two-hop schedule]. Issues the intra hops now; returns
    (finish, advance) for :class:`CollectiveWork`."""
    n, m, p = topo.ranks_per_node, topo.nodes, config.pipeline_slices
    c = out.numel() // p
    intra, inter = hops(n, m, out.numel(), config)
    intra_bytes = intra.peers * intra.message_nbytes  # one slice's N messages
    inter_bytes = inter.peers * inter.message_nbytes  # one slice's M messages
    send1 = torch.empty(p * intra_bytes, dtype=torch.uint8, device=inp.device)  # [P][N msgs]
    with timed(stats, "grads-quantize", inp.device):
        ops.tlq_sender(inp, send1, num_dests=n, blocks_per_dest=m, slices=p,
                       bits=config.intra_bits, group_size=config.intra_group_size,
                       hadamard_block=config.hadamard_block, stochastic=config.stochastic,
                       seed=derive_seed(seed, HOP_INTRA, 0, topo.rank),
                       backend=config.kernel_backend)
    recv1 = torch.empty_like(send1)
    intra_work = [
        dist.all_to_all_single(recv1[i * intra_bytes:(i + 1) * intra_bytes],
                               send1[i * intra_bytes:(i + 1) * intra_bytes],
                               group=topo.intra_group, async_op=True)
        for i in range(p)
    ]
    send2 = torch.empty(p * inter_bytes, dtype=torch.uint8, device=inp.device)  # [P][M msgs]
    recv2 = torch.empty_like(send2)
    inter_work: list[dist.Work] = []

    def advance() -> None:
        for i in range(p):
            with timed(stats, "grads-wait", inp.device):
                intra_work[i].wait()
            with timed(stats, "grads-requantize", inp.device):
                inter_seed = derive_seed(seed, HOP_INTER, i, topo.rank)
                if error_feedback is not None:
                    error_feedback.requantize(
                        recv1[i * intra_bytes:(i + 1) * intra_bytes],
                        send2[i * inter_bytes:(i + 1) * inter_bytes], i, grad_config=config,
                        ranks_per_node=n, nodes=m, seed=inter_seed)
                else:
                    ops.tlq_middle(recv1[i * intra_bytes:(i + 1) * intra_bytes],
                                   send2[i * inter_bytes:(i + 1) * inter_bytes],
                                   n_in=n, numel=m * c, bits_in=config.intra_bits,
                                   group_size_in=config.intra_group_size, n_out=m,
                                   bits_out=config.inter_bits,
                                   group_size_out=config.inter_group_size,
                                   stochastic=config.stochastic,
                                   seed=inter_seed, backend=config.kernel_backend)
            inter_work.append(dist.all_to_all_single(
                recv2[i * inter_bytes:(i + 1) * inter_bytes],
                send2[i * inter_bytes:(i + 1) * inter_bytes],
                group=topo.inter_group, async_op=True))

    def finish() -> None:
        for i in range(p):
            with timed(stats, "grads-wait", out.device):
                inter_work[i].wait()
            with timed(stats, "grads-dequantize", out.device):
                ops.tlq_receiver(recv2[i * inter_bytes:(i + 1) * inter_bytes],
                                 out[i * c:(i + 1) * c], n_in=m, bits=config.inter_bits,
                                 group_size=config.inter_group_size,
                                 hadamard_block=config.hadamard_block, scale=scale,
                                 backend=config.kernel_backend)

    return finish, advance
