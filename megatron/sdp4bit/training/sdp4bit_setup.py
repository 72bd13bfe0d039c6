"""Installing SDP4Bit into the built model/optimizer, and the end-of-run summary."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch.distributed as dist

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.training.loop import TrainState
from megatron.sdp4bit.training.observe.comm_counters import expert_layout


def install(config: SDP4BitConfig, state: TrainState, transformer_config, *,
            allow_untested_version: bool = False) -> object | None:
    """Install the quantized collectives when a quantization flag is on; ``None`` otherwise
    (the run then uses megatron-core's collectives unchanged). ``allow_untested_version``:
    ``--allow-untested-megatron-core`` (refused or warned about before the run started,
    training/cli/installed.py)."""
    # MoE: the expert buckets' bytes are counted apart too (collective: every rank)
    state.expert_layout = expert_layout(state.comm_stats, state.model, state.ranks_per_node)
    if not config.enabled:
        return None
    from megatron.sdp4bit.integration import install_sdp4bit

    handle = install_sdp4bit(state.model, state.optimizer, config,
                             allow_untested_version=allow_untested_version)
    handle.stats.timing = state.timers is not None  # quantize / wait / dequantize phases
    state.comm_stats = handle.stats
    if state.expert_layout is not None:
        state.expert_layout = dataclasses.replace(state.expert_layout, stats=handle.expert_stats)
    state.sdp4bit = config
    state.sdp4bit_handle = handle
    if dist.get_rank() == 0:
        print(f"SDP4Bit installed on {len(handle.bucket_numels)} bucket(s): "
              f"{config.describe()}{describe_experts(handle)}", flush=True)
        if config.gradient_error_feedback:
            print(f"SDP4Bit error feedback on the inter-node hop: "
                  f"{handle.error_feedback_nbytes / 2**20:.2f} MiB of error state on this "
                  f"rank ({config.gradient_error_feedback_storage}, 1/N of the gradient "
                  "buckets)", flush=True)
    return handle


def describe_experts(handle) -> str:
    """The start-up line's words on the expert-parallel buckets (MoE), or nothing."""
    size = handle.expert_data_parallel_size
    if size is None:
        return ""
    count = len(handle.expert_buckets)
    if size == 1:
        return (f" | {count} expert bucket(s) on an expert data-parallel group of 1 rank "
                "(expert parallelism = data parallelism): nothing to send, nothing quantized "
                "there")
    return f" | {count} of them expert bucket(s), on the expert data-parallel group of {size}"


def uninstall(args: argparse.Namespace, state: TrainState, handle) -> None:
    """Back to megatron-core's collectives; an overlapped param gather must land first."""
    if handle is None:
        return
    if args.overlap_param_gather:
        for chunk in state.model:
            chunk.start_param_sync(force_sync=True)
    handle.uninstall()


def iteration_hook(handle) -> Callable[[int], None] | None:
    """Tell the integration which iteration starts (stochastic-rounding streams and
    ``--gradients-quantization-start-iteration`` depend on it)."""
    if handle is None:
        return None
    return handle.set_iteration


def print_summary(args: argparse.Namespace, state: TrainState, handle=None) -> None:
    if dist.get_rank() != dist.get_world_size() - 1 or state.first_loss is None:
        return
    if handle is not None:
        s = handle.state
        print(f"SDP4Bit on this rank: {sum(s.grad_calls.values())} quantized gradient "
              f"reduce-scatters, {sum(s.param_calls.values())} quantized parameter all-gathers, "
              f"{sum(s.unquantized_grad_calls.values())} unquantized (before "
              "--gradients-quantization-start-iteration)", flush=True)
    val = f", validation loss {state.last_val_loss:.4f}" if state.last_val_loss is not None else ""
    if state.last_test_loss is not None:
        val += f", test loss {state.last_test_loss:.4f}"
    print(f"training done: lm loss {state.first_loss:.4f} at iteration "
          f"{state.first_loss_iteration} -> {state.last_loss:.4f} at iteration "
          f"{state.iteration} (single iterations){val}", flush=True)
