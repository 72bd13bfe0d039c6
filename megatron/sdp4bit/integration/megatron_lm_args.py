"""The plug-in's reading of Megatron-LM's parsed flags (``megatron_lm.py`` calls it from
``validate_args``): the run's SDP4Bit settings, and the one-line refusal that stops every rank.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.lifecycle import config_of_args
from megatron.sdp4bit.integration.megatron_lm_checkpoint import async_save_refusal, save_refusal

__all__ = ["config_of_megatron_lm_args", "refuse"]


def config_of_megatron_lm_args(args) -> SDP4BitConfig:
    """The run's SDP4Bit settings from Megatron-LM's parsed flags: the lifecycle's check
    (``config_of_args``, as in our trainer), then what Megatron-LM's trainer adds: no
    training with the quantization flags (``--skip-train``), ``--gradient-error-feedback``'s
    state in the checkpoint format, the asynchronous save's writer. ``ValueError`` with one
    line for the first refusal (docs/megatron_lm.md's support table lists them)."""
    config = config_of_args(args)
    reason = None
    if config.enabled and args.skip_train:
        reason = ("the SDP4Bit flags quantize the training collectives, and this run does not "
                  "train (--skip-train): drop --quantized-weights/--quantized-gradients")
    elif config.gradient_error_feedback and args.save:
        reason = save_refusal(args)
    reason = reason or async_save_refusal(args)
    if reason:
        raise ValueError(reason)
    return config


def refuse(message: str) -> None:
    """Stop every rank with one line (rank 0 prints it), as argparse does: exit status 2."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f"{os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
