"""``--check-replicas-interval N``: qWD's invariant checked in production, cheaply.

Every N iterations the ranks compare checksums of their model replicas (the data-parallel
ranks every bucket's parameters, the expert data-parallel ranks the expert buckets', the
tensor-parallel ranks the weights TP does not split: ``integration/replicas.py``, the same
comparison both trainers' end lines print), and the first difference stops the run with one
line naming the bucket, its first parameters and two ranks that disagree.
"""

from __future__ import annotations

from megatron.sdp4bit.integration.replicas import compare_replicas


class ReplicaMismatch(RuntimeError):
    """The replicas of the data-parallel ranks differ; the message names the bucket."""


_GROUPS = {"DP": "data-parallel ranks", "expert DP": "expert data-parallel ranks"}
_STOPS = "the run stops (a bug or a hardware fault: resume from the last checkpoint)"


def gather_pending(overlap_param_gather: bool, quantized_weights: bool) -> bool:
    """Whether the parameter all-gather of the last step is still to come when the step
    returns. With ``--overlap-param-gather`` megatron-core's optimizer writes each rank's
    own shard into the replica and leaves the all-gather to the next forward pass: until
    then the replicas differ by design. qWD's optimizer leaves the replica alone (its
    all-gather applies the weight difference), so there it stays identical meanwhile and the
    check needs no all-gather."""
    return overlap_param_gather and not quantized_weights


def check_replicas(model_chunks, iteration: int, *, finish_gather: bool = False) -> None:
    """Collective over the data-parallel group; raises :class:`ReplicaMismatch`.
    ``finish_gather`` (see :func:`gather_pending`) first completes the parameter all-gather
    of the step, as megatron-core does before a checkpoint."""
    if finish_gather:
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)
    found = compare_replicas(model_chunks).difference
    if found is None:
        return
    if found.group == "TP":
        raise ReplicaMismatch(
            f"the tensor-parallel ranks' copies of {found.what} (a weight TP does not split) "
            f"differ at iteration {iteration}: TP ranks 0 and {found.other}; {_STOPS}")
    raise ReplicaMismatch(
        f"model replicas differ across {_GROUPS[found.group]} at iteration {iteration}: "
        f"{found.what} differs between {found.group} ranks 0 and {found.other}; {_STOPS}")
