"""Bytes per counter, as a trainer reads them, and the names dashboards show them under.

:class:`ByteCounts` holds the byte counters of :class:`~megatron.sdp4bit.comm.stats.CommStats`
(and of their expert part) as plain numbers: the difference of two snapshots, their average
per iteration. :data:`BYTE_SCALARS` and :data:`EXPERT_BYTE_SCALARS` name them for TensorBoard,
W&B and Megatron-LM's log line, the same in both trainers (docs/observability.md lists them
and the names they replace): per iteration, the bytes one rank sent,
``sdp4bit/{params,grads}-bytes`` and per hop ``sdp4bit/{params,grads}-{intra,inter}-bytes``,
each next to ``...-unquantized``, what megatron-core's unquantized collectives send; a MoE
run adds the expert buckets' part per hop, ``sdp4bit/expert-{params,grads}-{intra,inter}-bytes``
(and ``-unquantized``). How the counters are fed: integration/accounting.py, [Note: one
byte-accounting path].
"""

from __future__ import annotations

import dataclasses

from megatron.sdp4bit.comm.stats import COUNTERS, CommStats


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
