"""The test session's fork server: where distributed and end-to-end tests get their ranks.

A fresh interpreter spends 3-5 s of CPU importing torch and megatron-core and 1-3 s tearing
them down at exit; a test that starts four ranks pays that four times, and the suite starts
a few hundred. ``context()`` is multiprocessing's ``forkserver`` start method with those
modules preloaded: the server imports them once (per pytest process, on the first start),
and every rank is a fork of it, ready in milliseconds, ending with ``os._exit`` (no
finalization). The server does nothing but import (no tensor work, no process group), so a
fork of it is as clean as a new interpreter. What a fork does not get from the test process
is state set after the server started (environment variables, ``sys.path`` entries): the
callers send the environment with every start.
"""

from __future__ import annotations

import multiprocessing as mp

# Imported by the server before it forks the first process.
PRELOAD = ["torch", "torch.distributed", "megatron.core"]


def context():
    """multiprocessing's forkserver context with :data:`PRELOAD` (read when the server
    starts, i.e. by the first process started through it)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
