"""Per-iteration communication bytes in our trainer's log line and ``--metrics-jsonl``.

The bytes come from SDP4Bit's lifecycle (``integration/lifecycle.py``): what SDP4Bit's
collectives sent, and megatron-core's own collectives counted by the same rule where
SDP4Bit does not replace them (every one of them in a baseline run), so both runs' fields
compare ([Note: one byte-accounting path], integration/accounting.py). All are computed,
ideal figures: gloo's ``reduce_scatter_tensor``, for one, sends about 3x what it counts
(an all-reduce). This module names them: the JSON-lines keys (:data:`FIELDS`), which the
tools under ``tools/`` read, and from those the TensorBoard names both trainers share
(:func:`scalars_of_record`).
"""

from __future__ import annotations

from typing import Any

from megatron.sdp4bit.comm.stats import COUNTERS
from megatron.sdp4bit.comm.byte_counts import ByteCounts

FIELDS = {
    "comm_bytes_params_intra": "param_intra_bytes",
    "baseline_comm_bytes_params_intra": "param_intra_bytes_baseline",
    "comm_bytes_params_inter": "param_inter_bytes",
    "baseline_comm_bytes_params_inter": "param_inter_bytes_baseline",
    "comm_bytes_grads_intra": "grad_intra_bytes",
    "baseline_comm_bytes_grads_intra": "grad_intra_bytes_baseline",
    "comm_bytes_grads_inter": "grad_inter_bytes",
    "baseline_comm_bytes_grads_inter": "grad_inter_bytes_baseline",
}
"""JSON-lines key -> counter (``comm/stats.py``); ``comm_bytes_params`` and its baseline
are the sums of the intra and inter fields."""
assert set(FIELDS.values()) == set(COUNTERS)

EXPERT_FIELDS = {key.replace("comm_bytes_", "comm_bytes_expert_"): counter
                 for key, counter in FIELDS.items()}
"""The part of the traffic sent for the expert-parallel buckets of a MoE model (on the expert
data-parallel group), per hop; also counted in the fields of :data:`FIELDS`."""


def log_fields(counts: ByteCounts) -> dict[str, int]:
    """The log line's and the JSON-lines record's fields of ``counts`` (per iteration)."""
    hops = {key: counts.whole[counter] for key, counter in FIELDS.items()}
    out = {prefix: hops[prefix + "_intra"] + hops[prefix + "_inter"]
           for prefix in ("comm_bytes_params", "baseline_comm_bytes_params")}
    out.update(hops)
    if counts.expert is not None:
        out.update({key: counts.expert[counter] for key, counter in EXPERT_FIELDS.items()})
    return out


def scalars_of_record(record: dict[str, Any]) -> dict[str, int]:
    """The TensorBoard (and W&B) values of a record's byte fields, under the names both
    trainers write (``comm/byte_counts.py``); nothing for a record without them."""
    if not all(key in record for key in FIELDS):
        return {}
    expert = None
    if all(key in record for key in EXPERT_FIELDS):
        expert = {counter: record[key] for key, counter in EXPERT_FIELDS.items()}
    return ByteCounts({counter: record[key] for key, counter in FIELDS.items()},
                      expert).scalars()
