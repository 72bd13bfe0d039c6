"""Bytes this rank sent in the quantized collectives, and what the unquantized ones would send.

[Note: what counts as sent]
"Sent" = bytes that leave this rank for *other* ranks; the part of a collective that a rank
addresses to itself (its own message in an all-to-all or all-gather) never crosses a link and
is not counted. With ``K`` ranks in a collective and messages of ``B`` bytes:

* all-to-all: ``(K - 1) * B`` (one message to each peer);
* all-gather: ``(K - 1) * B`` as well: a ring all-gather forwards ``K - 1`` messages, a direct
  one sends its own message to ``K - 1`` peers; both leave the rank with the same bytes.
  Split by destination: ``(N - 1) * B`` to the other ranks of its node (intra) and
  ``(W - N) * B`` to the ranks of other nodes (inter), with N DP ranks per node.

Quantized byte counts are exact wire sizes (fp32 scales + packed payload,
:func:`megatron.sdp4bit.quantization.format.message_nbytes`).

These are *computed* figures: the sizes of the messages handed to the collectives. What a
backend puts on a link can differ (gloo's ``reduce_scatter_tensor`` runs a whole all-reduce,
about 3x an ideal reduce-scatter; a ring moves the messages of other ranks too); the
cluster benchmark (``dev/simcluster``) measures the interface counters next to them.

Baselines ("what an ideal unquantized collective sends from this rank"):

* parameters: all-gather of the shard in the replica's dtype (bf16 in mixed precision):
  ``(W - 1) * S * replica.element_size()``;
* gradients: the same two-level all-to-all schedule with unquantized messages in the input's
  dtype (fp32 grads -> 4 bytes/element). Per rank that is
  intra ``(N - 1) * M * S * e`` and inter ``(M - 1) * S * e``; the total
  ``((N - 1) * M + M - 1) * S * e = (W - 1) * S * e`` equals what a ring reduce-scatter sends,
  so the baseline total is the standard one and the intra / inter split is that of the
  hierarchical schedule. (A flat ring over node-contiguous ranks would put the inter-node
  traffic on one rank per node; the hierarchical split spreads it evenly, like TLq does.)

The same rules count megatron-core's own (unquantized) collectives, where SDP4Bit does not
replace them (:meth:`CommStats.add_unquantized_grads`, :meth:`CommStats.add_unquantized_params`):
sent = baseline there; without the distributed optimizer the gradients take an all-reduce,
which a ring sends twice the reduce-scatter's bytes for.

The counters only grow: a reader takes differences of :meth:`CommStats.snapshot`\ s (the
bytes of an iteration, of a log interval), so that every reader sees the totals since the
counters were made.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

COUNTERS = (
    "param_intra_bytes", "param_inter_bytes",
    "param_intra_bytes_baseline", "param_inter_bytes_baseline",
    "grad_intra_bytes", "grad_inter_bytes",
    "grad_intra_bytes_baseline", "grad_inter_bytes_baseline",
)

PHASES = ("grads-quantize", "grads-requantize", "grads-wait", "grads-dequantize",
          "params-quantize", "params-wait", "params-dequantize")
"""What the collectives time when ``CommStats.timing`` is on: quantizing (the sender of the
first hop; the gradient reduce-scatter's requantization between its hops apart), waiting on
the wire (blocked in a collective's ``wait``), and dequantizing into the output."""


@dataclass
class CommStats:
    """Byte counters (and, with ``timing``, phase times) accumulated by every collective
    that is given this object."""

    param_intra_bytes: int = 0
    """Parameter all-gather, bytes sent to ranks of the same node."""
    param_inter_bytes: int = 0
    """Parameter all-gather, bytes sent to ranks of other nodes."""
    param_intra_bytes_baseline: int = 0
    """The unquantized all-gather in the replica dtype, to ranks of the same node."""
    param_inter_bytes_baseline: int = 0
    """The unquantized all-gather in the replica dtype, to ranks of other nodes."""
    grad_intra_bytes: int = 0
    """Gradient reduce-scatter, intra-node hop, bytes sent."""
    grad_inter_bytes: int = 0
    """Gradient reduce-scatter, inter-node hop, bytes sent."""
    grad_intra_bytes_baseline: int = 0
    """Unquantized two-level schedule in the input dtype, intra-node hop."""
    grad_inter_bytes_baseline: int = 0
    """Unquantized two-level schedule in the input dtype, inter-node hop."""
    timing: bool = False
    """Time the phases of every collective (:data:`PHASES`) into :attr:`seconds`. Off by
    default: on CUDA it synchronizes the device around each phase."""
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Wall seconds per phase since the last :meth:`take_seconds`."""
    parent: "CommStats | None" = field(default=None, repr=False, compare=False)
    """A part's whole (:meth:`part`): every byte counted here is counted there too."""

    def part(self) -> "CommStats":
        """Counters for a part of this record's traffic (e.g. the expert-parallel buckets'):
        the bytes a collective adds to the part also go to this whole, and its phase times
        go to this whole's :attr:`seconds` (timing follows this whole's :attr:`timing`)."""
        return CommStats(seconds=self.seconds, parent=self)

    def _timing(self) -> bool:
        return self.timing if self.parent is None else self.parent._timing()

    def reset(self) -> None:
        """Zero the byte counters (tests; readers take differences of snapshots instead)."""
        for name in COUNTERS:
            setattr(self, name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of the byte counters (the difference of two is what was sent between)."""
        return {name: getattr(self, name) for name in COUNTERS}

    def take_seconds(self) -> dict[str, float]:
        """The phase times accumulated so far (every phase, 0.0 if it did not run); clears
        them."""
        taken = {phase: self.seconds.get(phase, 0.0) for phase in PHASES}
        self.seconds.clear()
        return taken

    def add_param_bytes(self, message_bytes: int, baseline_bytes: int, world: int,
                        ranks_per_node: int) -> None:
        """Count one all-gather of ``world`` ranks, ``ranks_per_node`` per node, in which this
        rank's message has ``message_bytes`` (``baseline_bytes`` unquantized)."""
        intra, inter = ranks_per_node - 1, world - ranks_per_node
        self.param_intra_bytes += intra * message_bytes
        self.param_inter_bytes += inter * message_bytes
        self.param_intra_bytes_baseline += intra * baseline_bytes
        self.param_inter_bytes_baseline += inter * baseline_bytes
        if self.parent is not None:
            self.parent.add_param_bytes(message_bytes, baseline_bytes, world, ranks_per_node)

    def add_grad_bytes(self, intra: int, inter: int, intra_baseline: int,
                       inter_baseline: int) -> None:
        """Count one reduce-scatter: bytes sent on each hop, and its unquantized baseline."""
        self.grad_intra_bytes += intra
        self.grad_inter_bytes += inter
        self.grad_intra_bytes_baseline += intra_baseline
        self.grad_inter_bytes_baseline += inter_baseline
        if self.parent is not None:
            self.parent.add_grad_bytes(intra, inter, intra_baseline, inter_baseline)

    def add_unquantized_grads(self, shard: int, element_size: int, ranks_per_node: int,
                              nodes: int, *, all_reduce: bool = False) -> None:
        """Count one unquantized gradient reduction of shards of ``shard`` elements of
        ``element_size`` bytes (sent = baseline); ``all_reduce``: a ring all-reduce instead of
        a reduce-scatter (no distributed optimizer), twice the bytes."""
        intra, inter = grad_baseline_bytes(shard, element_size, ranks_per_node, nodes)
        factor = 2 if all_reduce else 1
        self.add_grad_bytes(factor * intra, factor * inter, factor * intra, factor * inter)

    def add_unquantized_params(self, shard: int, element_size: int, world: int,
                               ranks_per_node: int) -> None:
        """Count one unquantized all-gather of shards of ``shard`` elements of
        ``element_size`` bytes (sent = baseline)."""
        self.add_param_bytes(shard * element_size, shard * element_size, world, ranks_per_node)

    @property
    def param_bytes(self) -> int:
        return self.param_intra_bytes + self.param_inter_bytes

    @property
    def param_bytes_baseline(self) -> int:
        return self.param_intra_bytes_baseline + self.param_inter_bytes_baseline

    @property
    def grad_bytes(self) -> int:
        return self.grad_intra_bytes + self.grad_inter_bytes

    @property
    def grad_bytes_baseline(self) -> int:
        return self.grad_intra_bytes_baseline + self.grad_inter_bytes_baseline


def grad_baseline_bytes(shard: int, element_size: int, ranks_per_node: int,
                        nodes: int) -> tuple[int, int]:
    """(intra, inter): the bytes one rank sends in the unquantized two-level schedule of a
    reduce-scatter with ``shard`` elements per rank of ``element_size`` bytes, on
    ``ranks_per_node`` x ``nodes`` ranks (the gradients' baseline of the module docstring)."""
    return ((ranks_per_node - 1) * nodes * shard * element_size,
            (nodes - 1) * shard * element_size)


@contextmanager
def timed(stats: CommStats | None, phase: str, device: torch.device) -> Iterator[None]:
    """Add the wall time of the ``with`` block to ``stats.seconds[phase]`` when timing is
    on (a CUDA device is synchronized at both ends, so that the kernels are inside)."""
    if stats is None or not stats._timing():
        yield
        return
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        if cuda:
            torch.cuda.synchronize(device)
        stats.seconds[phase] += time.perf_counter() - start
