"""The bytes a trainer logs for SDP4Bit: one accounting path, one set of names.

[Note: one byte-accounting path]
Every counter only grows, from the install to the end of the run. SDP4Bit's collectives
count what they send into ``handle.stats`` (the expert buckets' part also into
``handle.expert_stats``); the collectives of megatron-core's that SDP4Bit does not replace
in an iteration (all of them when nothing is installed; the gradient reduction before
``--gradients-quantization-start-iteration``; the parameter all-gather without qWD) are
added once per iteration by :func:`add_unquantized_iteration`, by the same rule
(``comm/stats.py``). A reader takes the difference of two totals (:class:`ByteCounts`): the
plug-in every iteration, our trainer every log line, the end line the totals themselves, so
what the lines show adds up to what the collectives counted (a test checks it over 10
iterations with a log line in between).

Names, the same in both trainers' TensorBoard (and W&B) and, for Megatron-LM's trainer, on
its log line (:data:`BYTE_SCALARS`): per iteration, the bytes one rank sent,
``sdp4bit/{params,grads}-bytes`` and per hop ``sdp4bit/{params,grads}-{intra,inter}-bytes``,
each next to ``...-unquantized``, what megatron-core's unquantized collectives send; a MoE
run adds the expert buckets' part per hop, ``sdp4bit/expert-{params,grads}-{intra,inter}-bytes``
(and ``-unquantized``). docs/observability.md lists them with the names they replace.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron.sdp4bit.comm.stats import COUNTERS, CommStats
from megatron.sdp4bit.integration.topologies import ModelTopologies


def _names(prefix: str, *, totals: bool) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for kind, counter in (("params", "param"), ("grads", "grad")):
        hops = {hop: (f"{counter}_{hop}_bytes",) for hop in ("intra", "inter")}
        named = ({f"{kind}-bytes": hops["intra"] + hops["inter"]} if totals else {})
        named.update({f"{kind}-{hop}-bytes": c for hop, c in hops.items()})
        for name, counters in named.items():
            out[f"sdp4bit/{prefix}{name}"] = counters
            out[f"sdp4bit/{prefix}{name}-unquantized"] = tuple(f"{c}_baseline" for c in counters)
    return out


BYTE_SCALARS: dict[str, tuple[str, ...]] = _names("", totals=True)
"""Name -> the counters (``comm/stats.py``) it sums, for all of this rank's traffic."""
EXPERT_BYTE_SCALARS: dict[str, tuple[str, ...]] = _names("expert-", totals=False)
"""The same for the part sent for a MoE model's expert buckets (their own group)."""


@dataclasses.dataclass(frozen=True)
class ByteCounts:
    """Bytes per counter (:data:`~megatron.sdp4bit.comm.stats.COUNTERS`): every collective's
    (``whole``) and the expert buckets' part (``expert``; None without expert buckets)."""

    whole: dict[str, int]
    expert: dict[str, int] | None = None

    @classmethod
    def zero(cls, expert: bool = False) -> "ByteCounts":
        return cls(dict.fromkeys(COUNTERS, 0), dict.fromkeys(COUNTERS, 0) if expert else None)

    @classmethod
    def of(cls, *stats: CommStats, expert: tuple[CommStats, ...] | None = None) -> "ByteCounts":
        """The sum of some counters' snapshots (and of their expert parts)."""
        def total(parts: tuple[CommStats, ...]) -> dict[str, int]:
            snaps = [part.snapshot() for part in parts]
            return {c: sum(snap[c] for snap in snaps) for c in COUNTERS}
        return cls(total(stats), None if expert is None else total(expert))

    def minus(self, earlier: "ByteCounts") -> "ByteCounts":
        """What was counted since ``earlier`` (a snapshot of the same counters)."""
        def diff(now: dict | None, then: dict | None) -> dict | None:
            if now is None:
                return None
            return {c: now[c] - (then or {}).get(c, 0) for c in COUNTERS}
        return ByteCounts(diff(self.whole, earlier.whole), diff(self.expert, earlier.expert))

    def per_iteration(self, iterations: int) -> "ByteCounts":
        """The average over ``iterations`` (whole bytes, rounded down)."""
        it = max(iterations, 1)

        def avg(counts: dict | None) -> dict | None:
            return None if counts is None else {c: v // it for c, v in counts.items()}
        return ByteCounts(avg(self.whole), avg(self.expert))

    def scalars(self) -> dict[str, int]:
        """The values under :data:`BYTE_SCALARS` (and, with expert buckets,
        :data:`EXPERT_BYTE_SCALARS`)."""
        out = {name: sum(self.whole[c] for c in counters)
               for name, counters in BYTE_SCALARS.items()}
        if self.expert is not None:
            out.update({name: sum(self.expert[c] for c in counters)
                        for name, counters in EXPERT_BYTE_SCALARS.items()})
        return out

    def ratio(self, kind: str) -> str:
        """Bytes sent over the unquantized baseline for ``params`` or ``grads`` (4 decimals),
        ``-`` when nothing was sent."""
        scalars = self.scalars()
        baseline = scalars[f"sdp4bit/{kind}-bytes-unquantized"]
        return f"{scalars[f'sdp4bit/{kind}-bytes'] / baseline:.4f}" if baseline else "-"


def add_unquantized_iteration(stats: CommStats, model_chunks, topologies: ModelTopologies, *,
                              params: bool, grads: bool,
                              expert_stats: CommStats | None = None) -> None:
    """Add one iteration of megatron-core's own collectives to ``stats`` (sent = baseline):
    the parameter all-gather if ``params`` (distributed optimizer only), the gradient
    reduction if ``grads`` (a reduce-scatter with the distributed optimizer, else an
    all-reduce). The expert buffers' go to ``expert_stats``, a part of ``stats``
    (``CommStats.part``), on the expert group's topology."""
    for chunk in model_chunks:
        _add_buffers(stats, chunk.buffers, topologies.dense, chunk.ddp_config, params, grads)
        if topologies.expert is not None:
            _add_buffers(expert_stats, chunk.expert_parallel_buffers, topologies.expert,
                         chunk.ddp_config, params, grads)


def _add_buffers(stats: CommStats, buffers, topology, ddp_config, params: bool,
                 grads: bool) -> None:
    distributed = ddp_config.use_distributed_optimizer
    n, m = topology.ranks_per_node, topology.nodes
    for buffer in buffers:
        for bucket in buffer.buckets:
            shard = bucket.grad_data.numel() // topology.world
            if grads:
                stats.add_unquantized_grads(shard, bucket.grad_data.element_size(), n, m,
                                            all_reduce=not distributed)
            if distributed and params:
                element = torch.empty((), dtype=buffer.param_dtype).element_size()
                stats.add_unquantized_params(shard, element, topology.world, n)
