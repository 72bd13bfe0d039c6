"""One handle for the collectives of all buckets of a bucket group."""

from __future__ import annotations

from collections.abc import Sequence

from megatron.sdp4bit.comm import CollectiveWork


class BucketGroupWork:
    """What megatron-core stores in ``grad_reduce_handle`` / ``param_gather_handle``.

    megatron-core only calls ``wait()`` on it. Waiting completes the buckets in the order
    they were issued.
    """

    def __init__(self, works: Sequence[CollectiveWork]) -> None:
        self._works = list(works)

    def wait(self, timeout: object = None) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return not self._works
