"""Process setup and the objects a run needs: distributed init, seeds, model, optimizer,
schedule, datasets, checkpoint restore."""

from __future__ import annotations

import argparse
import logging
import os
import random
from datetime import timedelta

import numpy
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.sdp4bit.comm.topology import node_id
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration import sdp4bit_padding
from megatron.sdp4bit.training.checkpoint import formats as checkpoint_formats
from megatron.sdp4bit.training.checkpoint import files as checkpoint_files
from megatron.sdp4bit.training.checkpoint.files import CheckpointError, SaveDirLock
from megatron.sdp4bit.training.checkpoint.settings import run_settings
from megatron.sdp4bit.training.data import build_datasets, describe_data
from megatron.sdp4bit.training.loop import TrainingStopped, TrainState
from megatron.sdp4bit.training.cli import devices
from megatron.sdp4bit.training.cli.megatron_flags import scheduler_steps
from megatron.sdp4bit.training.guards.preflight import InputError
from megatron.sdp4bit.training.guards.replicas import ReplicaMismatch
from megatron.sdp4bit.training.guards.watchdog import Watchdog, launcher_store
from megatron.sdp4bit.training.model import (
    build_model_chunks,
    build_optimizer,
    transformer_config_from_args,
    wrap_ddp,
)
from megatron.sdp4bit.training.observe.logging import format_parameter_count
from megatron.sdp4bit.training.observe.noise import announce
from megatron.sdp4bit.training.observe.timers import Timers
from megatron.sdp4bit.training.tokenizers import build_tokenizer, padded_vocab_size
from megatron.sdp4bit.training.tokenizers import registry as tokenizer_registry


# What stops a run with one line instead of a traceback: bad input found by a check, and the
# ValueErrors with which SDP4Bit and megatron-core refuse a configuration.
USER_ERRORS = (InputError, CheckpointError, TrainingStopped, ReplicaMismatch, ValueError)


def init_distributed(args: argparse.Namespace) -> None:
    """torchrun's environment -> process group + megatron-core's parallel state.

    The backend is ``--distributed-backend`` (NCCL on CUDA, gloo without by default), the
    CUDA device the local rank's, or shared when there are more local ranks than devices
    (gloo only): training/cli/devices.py. Without CUDA, megatron-core is switched to CPU
    mode. A plain ``python pretrain_gpt.py`` (no torchrun) runs as a world of one.
    """
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    devices.check_backend(args, cuda, count)  # done before, by check_installed; tools skip it
    backend = args.distributed_backend
    if cuda:
        torch.cuda.set_device(devices.local_device(count))
        note = devices.sharing_note(count)
        if note and os.environ.get("RANK", "0") == "0":
            print(note, flush=True)
    else:
        from megatron.sdp4bit.integration.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
        # In CPU mode megatron-core's "CUDA" RNG is the CPU generator, so its tracker warns on
        # every dropout that the CPU state moved; that is expected here, not a problem.
        logging.getLogger("megatron.core.tensor_parallel.random").setLevel(logging.ERROR)
    try:
        dist.init_process_group(backend,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    except (RuntimeError, dist.DistError) as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
            raise InputError(f"port {os.environ['MASTER_PORT']} on "
                             f"{os.environ['MASTER_ADDR']} is in use (another run?): set "
                             "MASTER_PORT to a free port (torchrun: --master-port, or "
                             "--rdzv-endpoint host:port)") from None
        raise
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size)
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def start_watchdog(args: argparse.Namespace) -> Watchdog | None:
    """Heartbeats through torchrun's store, so that a stopped rank or a killed agent ends
    the job (training/guards/watchdog.py); None for a world of one or a timeout of 0.
    Give the watchdog to :func:`teardown`, which stops it before the process exits."""
    if args.heartbeat_timeout_seconds <= 0 or dist.get_world_size() == 1:
        return None
    timeout = args.heartbeat_timeout_seconds
    store = launcher_store(timeout)
    if store is None:
        return None
    dog = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeout=timeout,
                   interval=min(5.0, timeout / 4), connect=lambda: launcher_store(timeout))
    dog.start()
    return dog


def claim_save_dir(args: argparse.Namespace) -> SaveDirLock | None:
    """Rank 0 locks ``--save`` for this run, refuses another run's checkpoints there (unless
    resumed or ``--overwrite-checkpoints``) and moves aside the folder of a first save that
    never finished (saying so); every rank learns the verdict."""
    if not args.save:
        return None
    lock, verdict = None, [None]
    if dist.get_rank() == 0:
        resuming = bool(args.load) and os.path.realpath(args.load) == os.path.realpath(args.save)
        try:
            lock = checkpoint_files.claim_save_dir(args.save, resuming_here=resuming,
                                                   overwrite=args.overwrite_checkpoints)
            note = checkpoint_files.set_aside_interrupted_saves(args.save)
            if note is not None:
                print(note, flush=True)
        except CheckpointError as err:
            if lock is not None:
                lock.release()
                lock = None
            verdict[0] = str(err)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    return lock


def detect_dp_ranks_per_node() -> int:
    """N = DP ranks sharing this rank's node, where a node is what the comm layer's
    :func:`~megatron.sdp4bit.comm.topology.node_id` says (host plus torchrun node rank, so
    several ``torchrun --nnodes`` launches on one machine count as separate nodes)."""
    group = parallel_state.get_data_parallel_group()
    key = node_id()
    keys: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(keys, key, group=group)
    counts = {k: keys.count(k) for k in keys}
    if len(set(counts.values())) != 1:
        raise ValueError(f"data-parallel ranks are spread unevenly over nodes {counts}: "
                         "pass --dp-ranks-per-node N")
    return counts[key]


def print_topology(args: argparse.Namespace, ranks_per_node: int) -> None:
    if dist.get_rank() == 0:
        vpp = args.virtual_pipeline_model_parallel_size
        chunks = f" x {vpp} model chunks" if vpp else ""
        dp = args.data_parallel_size
        steps = f"{args.num_microbatches} micro-batches per step"
        if args.rampup_batch_size is not None:
            first = args.rampup_batch_size[0] // (args.micro_batch_size * dp)
            steps = f"{first} micro-batches per step rising to {args.num_microbatches}"
        print(f"data-parallel topology: {dp} ranks = {ranks_per_node} per node x "
              f"{dp // ranks_per_node} nodes (TP {args.tensor_model_parallel_size}, "
              f"PP {args.pipeline_model_parallel_size}{chunks}, {steps})", flush=True)


def teardown(watchdog: Watchdog | None = None) -> None:
    """Shut down in order: the watchdog's threads first (a thread left inside a store call
    at interpreter exit aborts the process, [Note: watchdog shutdown]), then megatron-core's
    groups, then the default group."""
    if watchdog is not None:
        watchdog.stop()
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _scheduler(args: argparse.Namespace, optimizer) -> OptimizerParamScheduler:
    # Megatron-LM counts schedule steps in samples (iteration- or sample-based training).
    warmup, decay, wd_incr = scheduler_steps(args)
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr, wd_incr_style=args.weight_decay_incr_style,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler)


def set_schedule_hooks(args: argparse.Namespace, config, model: list) -> None:
    """Megatron-LM's hooks for megatron-core's schedules: finalize (DP grad sync, embedding
    tying), gradient-sync control, and with the interleaved pipeline one function per model
    chunk, which the schedule calls in its order: each chunk's gradient reduce-scatter once
    its last backward is done, and (``--overlap-param-gather`` with the default
    ``align_param_gather``) the next chunk's parameter all-gather ahead of its first
    forward."""
    config.finalize_model_grads_func = finalize_model_grads
    if len(model) == 1:
        config.no_sync_func = model[0].no_sync
        if args.overlap_grad_reduce:
            config.grad_sync_func = model[0].start_grad_sync
        if args.overlap_param_gather:
            config.param_sync_func = model[0].start_param_sync
        return
    config.no_sync_func = [chunk.no_sync for chunk in model]
    if args.overlap_grad_reduce:
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = [chunk.start_param_sync for chunk in model]


def build_state(args: argparse.Namespace, sdp4bit_config: SDP4BitConfig,
                ) -> tuple[TrainState, object]:
    """Model, optimizer, schedule and data; returns (state, transformer config). DDP's
    buckets are padded for SDP4Bit's groups when a quantization flag is on."""
    tokenizer = build_tokenizer(args)
    vocab = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                              args.tensor_model_parallel_size)
    timers = Timers(args.timing_log_level, args.timing_log_option) \
        if args.timing_log_level else None
    config = transformer_config_from_args(args, timers)
    with sdp4bit_padding(sdp4bit_config):
        chunks = build_model_chunks(args, config, vocab)
        if parallel_state.get_data_parallel_rank() == 0:  # Megatron-LM's line, one per TP x PP
            print(format_parameter_count(parallel_state.get_tensor_model_parallel_rank(),
                                         parallel_state.get_pipeline_model_parallel_rank(),
                                         sum(p.nelement() for c in chunks
                                             for p in c.parameters())),
                  flush=True)
        model = [wrap_ddp(args, config, gpt, i) for i, gpt in enumerate(chunks)]
    set_schedule_hooks(args, config, model)
    optimizer = build_optimizer(args, model, timers)
    # megatron-core's schedules scale the loss with this before backward (fp16 loss scaling;
    # 1.0 otherwise), as Megatron-LM sets it.
    config.grad_scale_func = optimizer.scale_loss
    scheduler = _scheduler(args, optimizer)
    announce(f"data: {describe_data(args)}")
    datasets = build_datasets(args, tokenizer)
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler,
                       datasets=datasets, vocab_size=vocab, timers=timers,
                       settings=run_settings(args, sdp4bit_config, vocab,
                                             tokenizer.vocab_size,
                                             tokenizer_registry.record(args, tokenizer)))
    return state, config


def restore(args: argparse.Namespace, state: TrainState) -> None:
    """``--load``: continue from the latest checkpoint there (a fresh start if it has none);
    ``--finetune`` / ``--pretrained-checkpoint``: start from a checkpoint's model weights at
    iteration 0 (training/checkpoint/weights_only.py)."""
    if not (args.load or args.pretrained_checkpoint):
        return
    loaded = checkpoint_formats.load(args, state.model, state.optimizer, state.scheduler,
                                     state.settings, sdp4bit=state.lifecycle)
    state.iteration, state.consumed_samples = loaded.iteration, loaded.consumed_samples
    if dist.get_rank() != 0:
        return
    if loaded.source is None:
        where = " or ".join(p for p in (args.load, args.pretrained_checkpoint) if p)
        print(f"no checkpoint in {where}: starting from scratch", flush=True)
    elif loaded.weights_only:
        print(f"loaded the model weights of {loaded.source}: starting at iteration 0 with a "
              "fresh optimizer, learning-rate schedule and RNG (fine-tuning)", flush=True)
    else:
        print(f"loaded checkpoint from {args.load} at iteration {loaded.iteration}", flush=True)
