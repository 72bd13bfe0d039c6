"""Bytes this rank sent in the quantized collectives, and what the unquantized ones would send.

[Note: what counts as sent]
"Sent" = bytes that leave this rank for *other* ranks; the part of a collective that a rank
addresses to itself (its own message in an all-to-all or all-gather) never crosses a link and
is not counted. With ``K`` ranks in a collective and messages of ``B`` bytes:

* all-to-all: ``(K - 1) * B`` (one message to each peer);
* all-gather: ``(K - 1) * B`` as well: a ring all-gather forwards ``K - 1`` messages, a direct
  one sends its own message to ``K - 1`` peers; both leave the rank with the same bytes.

Quantized byte counts are exact wire sizes (fp32 scales + packed payload,
:func:`megatron.sdp4bit.quantization.format.message_nbytes`).

Baselines ("what the unquantized collective would have sent from this rank"):

* parameters: all-gather of the shard in the replica's dtype (bf16 in mixed precision):
  ``(W - 1) * S * replica.element_size()``;
* gradients: the same two-level all-to-all schedule with unquantized messages in the input's
  dtype (fp32 grads -> 4 bytes/element). Per rank that is
  intra ``(N - 1) * M * S * e`` and inter ``(M - 1) * S * e``; the total
  ``((N - 1) * M + M - 1) * S * e = (W - 1) * S * e`` equals what a ring reduce-scatter sends,
  so the baseline total is the standard one and the intra / inter split is that of the
  hierarchical schedule. (A flat ring over node-contiguous ranks would put the inter-node
  traffic on one rank per node; the hierarchical split spreads it evenly, like TLq does.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CommStats:
    """Byte counters, accumulated by every collective that is given this object."""

    param_bytes: int = 0
    """Parameter all-gather, bytes sent (quantized or not, whatever ran)."""
    param_bytes_baseline: int = 0
    """Parameter all-gather, what the unquantized all-gather in the replica dtype sends."""
    grad_intra_bytes: int = 0
    """Gradient reduce-scatter, intra-node hop, bytes sent."""
    grad_inter_bytes: int = 0
    """Gradient reduce-scatter, inter-node hop, bytes sent."""
    grad_intra_bytes_baseline: int = 0
    """Unquantized two-level schedule in the input dtype, intra-node hop."""
    grad_inter_bytes_baseline: int = 0
    """Unquantized two-level schedule in the input dtype, inter-node hop."""

    def reset(self) -> None:
        for name in asdict(self):
            setattr(self, name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters (e.g. to log and then :meth:`reset`)."""
        return asdict(self)

    @property
    def grad_bytes(self) -> int:
        return self.grad_intra_bytes + self.grad_inter_bytes

    @property
    def grad_bytes_baseline(self) -> int:
        return self.grad_intra_bytes_baseline + self.grad_inter_bytes_baseline
