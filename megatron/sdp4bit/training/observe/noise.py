"""Console noise: megatron-core's messages about choices this trainer makes on purpose are
dropped, rank 0 speaks, the other ranks only on errors.

Call :func:`quiet_megatron_core` once per process, before megatron-core is imported (its
first warnings fire on import). What it drops, each matched by its exact text:

=====================================================  ========================================
megatron-core says                                     why it is noise here
=====================================================  ========================================
"Transformer Engine and Apex are not installed ..."    without CUDA this trainer never uses
"Apex is not installed. Falling back to Torch Norm"    either; with CUDA one line of ours says
                                                       it instead of one per call site and rank
                                                       (for Transformer Engine the argument
                                                       check's, which knows --transformer-impl)
"full scope is deprecated ..." (``cuda_graph_scope``)  megatron-core's own default, not an
                                                       option this trainer sets; no CUDA graphs
"MimoModelConfig is experimental ..." (0.19.2)         fired on import; no MIMO model is built
"`torch.distributed.reduce_scatter_tensor` is          megatron-core 0.16 calls torch's old
deprecated" (and ``all_gather_into_tensor``)           names; nothing a user can change
"Unable to save MockGPTDataset indexes ..."            ``--mock-data`` has nothing to cache
"Implicit initialization of Rerun State Machine!",     the trainer does not use the rerun state
"RerunStateMachine initialized in mode ..."            machine; it stays disabled
"GPTModel IS DEPRECATED ..." (0.19.2)                  the trainer builds GPTModel on purpose
                                                       (the model both tested releases share);
                                                       a user has nothing to change
"DistributedDataParallel: full_param_layout not        DDP computes the same layout itself
provided ..." (0.19.2)                                 (inside ``sdp4bit_padding``, padded)
"MCore's async save is deprecated ..." (0.19.2)        ``--async-save`` asks for megatron-core's
                                                       own writer on purpose: the one it
                                                       advises, nvidia-resiliency-ext's, is not
                                                       a requirement here
=====================================================  ========================================

Every other warning still shows on rank 0, once per place it comes from (Python's default).
On the other ranks Python warnings are off and megatron's loggers pass errors only, so a
message that every rank would repeat appears once; an exception still prints on every rank,
and so do the warnings of ``EVERY_RANK_WARNINGS`` (a rank that runs slower says so itself).
A user's own ``-W`` / ``PYTHONWARNINGS`` choice is kept on every rank.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
import warnings

# Python warnings: (message regex, origin-module regex, category).
NOISE_WARNINGS: tuple[tuple[str, str, type[Warning]], ...] = (
    (r"Transformer Engine and Apex are not installed", r"megatron\.core", UserWarning),
    (r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core", UserWarning),
    (r"full scope is deprecated\. Use empty cuda_graph_(scope|modules)", r"megatron\.core",
     UserWarning),
    (r"MimoModelConfig is experimental", r"megatron\.core", UserWarning),
    (r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
     r"torch\.distributed", FutureWarning),
)
# Python warnings every rank shows (message regex, category): each names a state of its own
# process, such as the CPU kernels' fallback to the 20-50x slower references.
EVERY_RANK_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"SDP4Bit CPU kernels unavailable", RuntimeWarning),
)
# Patterns only one tested megatron-core release prints (-> that release); the others are
# printed by both.
RELEASE_SPECIFIC: dict[str, str] = {
    r"MimoModelConfig is experimental": "0.19.2",
    r"GPTModel IS DEPRECATED": "0.19.2",
    r"DistributedDataParallel: full_param_layout not provided": "0.19.2",
    r"MCore's async save is deprecated": "0.19.2",
}
# logging records: logger name -> message regexes.
NOISE_LOGS: dict[str, tuple[str, ...]] = {
    "megatron.core.datasets.gpt_dataset": (
        r"Unable to save MockGPTDataset indexes because path_to_cache is None",),
    "megatron.core.rerun_state_machine": (
        r"Implicit initialization of Rerun State Machine!",
        r"RerunStateMachine initialized in mode"),
    "megatron.core.models.gpt.gpt_model": (r"GPTModel IS DEPRECATED",),
    "megatron.core.distributed.distributed_data_parallel": (
        r"DistributedDataParallel: full_param_layout not provided",),
    "megatron.core.dist_checkpointing.strategies.torch": (r"MCore's async save is deprecated",),
}


class DropMessages(logging.Filter):
    """Drops the records of one logger whose message matches one of ``patterns``."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def quiet_megatron_core(rank: int | None = None, cuda: bool | None = None) -> None:
    """Install the filters of the module docstring in this process (idempotent).

    ``rank`` defaults to torchrun's ``$RANK`` (0 when absent); ``cuda`` to whether CUDA is
    available.
    """
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    cuda = _cuda_available() if cuda is None else cuda
    for message, module, category in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    # Said once here instead of by four megatron-core modules on every rank. A missing
    # Transformer Engine is said by training/cli/installed.py, and only where it matters
    # (--transformer-impl auto: the run falls back to the local layers).
    if cuda and rank == 0 and importlib.util.find_spec("apex") is None:
        print("note: apex not installed: megatron-core uses torch's optimizers, norms and "
              "kernels instead (correct, slower on GPU)", file=sys.stderr, flush=True)
    for name, patterns in NOISE_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(patterns))
    if rank != 0:
        if not sys.warnoptions:  # the user's -W / PYTHONWARNINGS wins
            warnings.simplefilter("ignore")
            for message, category in EVERY_RANK_WARNINGS:  # inserted first: they win
                warnings.filterwarnings("default", message=message, category=category)
        logging.getLogger("megatron").setLevel(logging.ERROR)


_START = time.monotonic()


def announce(message: str) -> None:
    """One progress line from rank 0, with the seconds since this process started, so a
    user watching a slow start sees which phase it is in."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[{time.monotonic() - _START:7.1f} s] {message}", flush=True)
