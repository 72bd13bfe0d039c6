"""Our trainer's adapter to SDP4Bit's lifecycle (integration/lifecycle.py): install on the
built model and optimizer, uninstall, and the end-of-run summary."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.lifecycle import SDP4BitLifecycle
from megatron.sdp4bit.training.loop import TrainState


def install(config: SDP4BitConfig, state: TrainState, *,
            allow_untested_version: bool = False) -> SDP4BitLifecycle:
    """The run's lifecycle on ``state``: the quantized collectives installed when a
    quantization flag is on (otherwise megatron-core's collectives run unchanged and only
    their bytes are counted). Collective: every rank. ``allow_untested_version``:
    ``--allow-untested-megatron-core`` (refused or warned about before the run started,
    training/cli/installed.py)."""
    lifecycle = SDP4BitLifecycle(config)
    lifecycle.install(state.model, state.optimizer,
                      allow_untested_version=allow_untested_version,
                      timing=state.timers is not None)  # quantize / wait / dequantize phases
    state.lifecycle = lifecycle
    return lifecycle


def uninstall(args: argparse.Namespace, state: TrainState) -> None:
    """Back to megatron-core's collectives; an overlapped param gather lands first."""
    state.lifecycle.uninstall(finish_param_sync=args.overlap_param_gather)


def print_summary(args: argparse.Namespace, state: TrainState) -> None:
    """Collective: SDP4Bit's end line (with the replica check) and the training summary,
    printed by the last rank, once an iteration ran."""
    if state.first_loss is None:  # the same on every rank: no iteration ran
        return
    line = state.lifecycle.end_line()
    if line is not None:
        print(line, flush=True)
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    val = f", validation loss {state.last_val_loss:.4f}" if state.last_val_loss is not None else ""
    if state.last_test_loss is not None:
        val += f", test loss {state.last_test_loss:.4f}"
    print(f"training done: lm loss {state.first_loss:.4f} at iteration "
          f"{state.first_loss_iteration} -> {state.last_loss:.4f} at iteration "
          f"{state.iteration} (single iterations){val}", flush=True)
