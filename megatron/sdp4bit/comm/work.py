"""The handle that the quantized collectives return when ``async_op=True``."""

from __future__ import annotations

from typing import Callable


class CollectiveWork:
    """Handle of an asynchronous quantized collective: :meth:`wait` completes it.

    The part of the work that needs data from the network (dequantize, sum, requantize, the
    next hop) runs on the caller's thread (and, on CUDA, stream), in two stages:

    * ``advance`` (optional): wait for the first hop, run the local step between the hops and
      *issue* the next hop, without waiting for it. :meth:`advance` runs it once.
    * ``finish``: wait for the last hop and write the output. :meth:`wait` runs
      :meth:`advance` first (a no-op if it already ran), then ``finish``.

    Calling :meth:`advance` early (e.g. when the next bucket is issued) puts the next hop on
    the wire sooner; the bits of the result do not depend on when it is called. Every rank
    of a group must call :meth:`advance` / :meth:`wait` of its collectives in the same order,
    since they issue collectives.
    """

    def __init__(self, finish: Callable[[], None],
                 advance: Callable[[], None] | None = None) -> None:
        self._advance: Callable[[], None] | None = advance
        self._finish: Callable[[], None] | None = finish

    def advance(self) -> None:
        """Issue the next hop (see the class docstring). Idempotent; a no-op for one hop."""
        if self._advance is not None:
            advance, self._advance = self._advance, None
            advance()

    def is_advanced(self) -> bool:
        """True once nothing is left to issue: only waiting and decoding remain."""
        return self._advance is None

    def wait(self, timeout: object = None) -> bool:
        self.advance()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None
