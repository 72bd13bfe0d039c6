"""The handle that the quantized collectives return when ``async_op=True``."""

from __future__ import annotations

from typing import Callable


class CollectiveWork:
    """Handle of an asynchronous quantized collective: :meth:`wait` completes it.

    The part of the work that needs data from the network (dequantize, sum, requantize, the
    next hop) runs inside :meth:`wait`, on the caller's thread (and, on CUDA, stream).
    """

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: object = None) -> bool:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None
