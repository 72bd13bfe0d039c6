"""One handle for the collectives of all buckets of a bucket group."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from megatron.sdp4bit.comm import CollectiveWork


class BucketGroupWork:
    """What megatron-core stores in ``grad_reduce_handle`` / ``param_gather_handle``.

    megatron-core only calls ``wait()`` on it. Waiting completes the buckets in the order
    they were issued, then runs ``then`` (if given) once.
    """

    def __init__(self, works: Sequence[CollectiveWork],
                 then: Callable[[], None] | None = None) -> None:
        self._works = list(works)
        self._then = then

    def wait(self, timeout: object = None) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return True

    def is_completed(self) -> bool:
        return not self._works
