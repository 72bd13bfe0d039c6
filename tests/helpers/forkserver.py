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

The server also imports the trainer's own modules (what ``pretrain_gpt.py`` imports on a run:
argument parsing, the build, the loop, the SDP4Bit install), which do nothing at import but
define: each rank of a test's launch would otherwise import about 110 of them (0.3-0.8 s of
CPU per rank), and the heavy packages some launches import in every rank
(:data:`PRELOAD_IF_INSTALLED`). The tests that check what an import does start fresh
interpreters.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp

# Imported by the server before it forks the first process.
PRELOAD = ["torch", "torch.distributed", "megatron.core",
           "megatron.sdp4bit.training.cli.arguments", "megatron.sdp4bit.training.build",
           "megatron.sdp4bit.training.loop", "megatron.sdp4bit.training.sdp4bit_setup",
           "megatron.sdp4bit.integration.install", "megatron.sdp4bit.integration.cpu_mode",
           "megatron.sdp4bit.integration.cuda_stubs", "megatron.sdp4bit.testing.cuda_dryrun",
           "megatron.core.datasets.helpers"]
# Imported too where the package is installed (package: its modules): Hugging Face's
# tokenizer classes, which every rank of a run with a Hugging Face tokenizer or checkpoint
# imports (2.4 s of CPU each), and Megatron-LM's trainer (megatron-core >= 0.17), which
# every rank of its tests imports (with Hugging Face's classes, 4 s of CPU).
PRELOAD_IF_INSTALLED = {
    "transformers": ["transformers.models.auto.tokenization_auto"],
    "megatron.training": ["megatron.training.training", "megatron.training.arguments",
                          "megatron.sdp4bit.integration.megatron_lm"],
}


def context():
    """multiprocessing's forkserver context with :data:`PRELOAD` (read when the server
    starts, i.e. by the first process started through it)."""
    # (the server skips a module it cannot import: a renamed one would only cost time)
    missing = [name for name in PRELOAD if importlib.util.find_spec(name) is None]
    assert not missing, f"tests/helpers/forkserver.py: no module {missing}"
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + [
        name for package, names in PRELOAD_IF_INSTALLED.items()
        if importlib.util.find_spec(package) is not None for name in names])
    return ctx
