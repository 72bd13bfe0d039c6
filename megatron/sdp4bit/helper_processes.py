"""Helper processes that end with the process that started them.

A ``multiprocessing`` manager's server (the results queue of ``--async-save``'s writer,
``integration/async_save.py``) serves until it is shut down: a training process that is
killed, or ends with ``os._exit``, would leave it running. :func:`exit_with_parent` is its
initializer. This module imports nothing heavy: a ``spawn`` child imports it to find the
function.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading


def exit_with_parent() -> None:
    """In a ``spawn`` or ``fork`` child of ``multiprocessing``: a daemon thread that ends the
    process when its parent ends (the parent's sentinel becomes readable)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
