"""Validation and derived values of the parsed command line (Megatron-LM's rules), as named
steps whose refusals are collected into one message (:data:`STEPS`; errors.py, [Note: every
refusal in one message])."""

from __future__ import annotations

import argparse
import math
import os
import re
import time

from megatron.sdp4bit.training.cli.errors import ArgumentsError, Refusals, warn
from megatron.sdp4bit.training.cli.installed import uses_transformer_engine
from megatron.sdp4bit.training.cli.megatron_flags import (check_switches,
                                                          resolve_training_length,
                                                          scheduler_steps)
from megatron.sdp4bit.training.cli.moe_flags import check_moe_flags
from megatron.sdp4bit.training.cli.observe_flags import check_observe_flags
from megatron.sdp4bit.training.cli.rampup_flags import check_rampup_sizes
from megatron.sdp4bit.training.guards import faults
from megatron.sdp4bit.training.tokenizers import registry as tokenizer_registry

FP32_TINY, FP32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38
WEEK_SECONDS = 7 * 24 * 3600  # longest timeout accepted: beyond it a hang is never noticed
ASYNC_SAVE_TIMEOUT_S = 600.0  # --async-save-timeout-seconds' default (its help says it too)
REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
            "micro_batch_size", "train_iters", "lr")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _fail(message: str) -> None:
    raise ArgumentsError(message)


def _check_required(args: argparse.Namespace) -> None:
    missing = [_flag(d) for d in REQUIRED if getattr(args, d) is None]
    if missing:
        _fail(f"missing required flag(s): {' '.join(missing)}")
    for dest in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "micro_batch_size", "train_iters", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "context_parallel_size", "log_interval",
                 "eval_interval"):
        if getattr(args, dest) < 1:
            _fail(f"{_flag(dest)}={getattr(args, dest)} must be >= 1")
    for dest in ("distributed_timeout_minutes",):
        if getattr(args, dest) < 1:
            _fail(f"{_flag(dest)}={getattr(args, dest)} must be >= 1")
    if not math.isfinite(args.heartbeat_timeout_seconds):
        _fail(f"--heartbeat-timeout-seconds={args.heartbeat_timeout_seconds} is not a number of "
              "seconds: give one >= 2, or 0 = off")
    for dest in ("heartbeat_timeout_seconds", "max_consecutive_skipped_iterations",
                 "check_replicas_interval"):
        if getattr(args, dest) < 0:
            _fail(f"{_flag(dest)}={getattr(args, dest)} must be >= 0 (0 = off)")
    for dest, seconds in (("heartbeat_timeout_seconds", args.heartbeat_timeout_seconds),
                          ("distributed_timeout_minutes", args.distributed_timeout_minutes * 60)):
        if seconds > WEEK_SECONDS:
            _fail(f"{_flag(dest)}={getattr(args, dest):g} is longer than a week: a stopped rank "
                  "would hold the job that long; use a shorter timeout")
    if not 0 <= args.seed < 2 ** 32:
        _fail(f"--seed={args.seed} must be in 0 .. 2**32 - 1 (NumPy's seed range)")
    for dest in ("eval_data_seed", "train_data_seed"):
        value = getattr(args, dest)
        if value is not None and not 0 <= value < 2 ** 32:
            _fail(f"{_flag(dest)}={value} must be in 0 .. 2**32 - 1 (NumPy's seed range)")
    if args.rounding_seed is not None and not 0 <= args.rounding_seed < 2 ** 64:
        _fail(f"--rounding-seed={args.rounding_seed} must be in 0 .. 2**64 - 1")
    for dest in ("kv_channels", "ffn_hidden_size", "num_query_groups"):
        value = getattr(args, dest)
        if value is not None and value < 1:
            _fail(f"{_flag(dest)}={value} must be >= 1")
    try:
        faults.parse_env()
    except ValueError as err:
        _fail(str(err))
    if 0 < args.heartbeat_timeout_seconds < 2:
        _fail(f"--heartbeat-timeout-seconds={args.heartbeat_timeout_seconds:g} is too short to "
              "tell a busy rank from a stopped one: use >= 2 (or 0 = off)")
    for dest in ("global_batch_size", "exit_interval", "save_interval", "lr_decay_iters",
                 "eval_iters"):
        value = getattr(args, dest)
        if value is not None and value < (0 if dest == "eval_iters" else 1):
            _fail(f"{_flag(dest)}={value} must be >= {0 if dest == 'eval_iters' else 1}")


def _check_model(args: argparse.Namespace) -> None:
    if args.hidden_size % args.num_attention_heads:
        _fail(f"--hidden-size={args.hidden_size} is not divisible by "
              f"--num-attention-heads={args.num_attention_heads}")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if (args.position_embedding_type == "learned_absolute"
            and args.seq_length > args.max_position_embeddings):
        _fail(f"--seq-length={args.seq_length} exceeds --max-position-embeddings="
              f"{args.max_position_embeddings}: raise --max-position-embeddings")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    if args.swiglu and args.openai_gelu:
        _fail("--openai-gelu and --swiglu contradict each other: --swiglu's activation is SiLU; "
              "pass one")
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups:
        _fail(f"--num-query-groups={args.num_query_groups} does not divide "
              f"--num-attention-heads={args.num_attention_heads}: every group needs the same "
              "number of heads")
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            _fail("--recompute-activations means --recompute-granularity selective; "
                  "drop one of the two")
        args.recompute_granularity = "selective"
    if args.recompute_granularity == "full" and args.recompute_method is None:
        _fail("--recompute-granularity full needs --recompute-method uniform|block")


def _check_parallel(args: argparse.Namespace) -> None:
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % model_parallel:
        _fail(f"world size {args.world_size} is not divisible by --tensor-model-parallel-size x "
              f"--pipeline-model-parallel-size = {model_parallel}")
    args.data_parallel_size = args.world_size // model_parallel
    if args.pipeline_model_parallel_size > 1 and args.num_layers % args.pipeline_model_parallel_size:
        _fail(f"--num-layers={args.num_layers} is not divisible by "
              f"--pipeline-model-parallel-size={args.pipeline_model_parallel_size}")
    tp = args.tensor_model_parallel_size
    if args.num_attention_heads % tp:
        _fail(f"--num-attention-heads={args.num_attention_heads} is not divisible by "
              f"--tensor-model-parallel-size={tp}")
    if args.group_query_attention and args.num_query_groups % tp:
        _fail(f"--num-query-groups={args.num_query_groups} is not divisible by "
              f"--tensor-model-parallel-size={tp}")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        # Megatron-LM's words and rule: nothing to split, and the numerics stay TP 1's
        warn("Disabling sequence parallelism because tensor model parallelism is disabled")
        args.sequence_parallel = False
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        _fail(f"--global-batch-size={args.global_batch_size} is not divisible by "
              f"--micro-batch-size x data-parallel size = {args.micro_batch_size} x "
              f"{args.data_parallel_size} = {per_step}")
    # At --global-batch-size: evaluation's, and training's after a --rampup-batch-size (the
    # loop asks megatron-core's calculator for each iteration's).
    args.num_microbatches = args.global_batch_size // per_step
    if args.ddp_reduce_scatter_with_fp32_accumulation:
        if not args.use_distributed_optimizer:
            _fail("--ddp-reduce-scatter-with-fp32-accumulation replaces the distributed "
                  "optimizer's reduce-scatter: it needs --use-distributed-optimizer")
        if args.overlap_grad_reduce:
            _fail("--ddp-reduce-scatter-with-fp32-accumulation with --overlap-grad-reduce runs "
                  "in megatron-core on a single gradient bucket only: drop --overlap-grad-reduce")
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        _fail("--overlap-param-gather requires --use-distributed-optimizer")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        _fail("--overlap-param-gather requires --overlap-grad-reduce")
    _check_virtual_pipeline(args)
    check_rampup_sizes(args)  # the ramp-up's batch sizes, as the one above


def _check_virtual_pipeline(args: argparse.Namespace) -> None:
    """Megatron-LM's rules: ``args.virtual_pipeline_model_parallel_size`` is the number of
    model chunks per pipeline rank, None without the interleaved schedule (a size of 1 is
    none); without it there is no p2p overlap and no aligned param gather to speak of.
    See [Note: batched p2p at PP 2] in training/model.py for the PP 2 rule."""
    layers, chunks = args.num_layers_per_virtual_pipeline_stage, \
        args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    if layers is not None and chunks is not None:
        _fail("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-"
              "rank (--virtual-pipeline-model-parallel-size) both set the interleaved "
              "pipeline's chunks: pass one")
    for flag, value in (("--num-layers-per-virtual-pipeline-stage", layers),
                        ("--num-virtual-stages-per-pipeline-rank", chunks)):
        if value is not None and value < 1:
            _fail(f"{flag}={value} must be >= 1")
    vpp = None
    if layers is not None:
        per_stage = args.num_layers // pp  # divisibility by PP was checked above
        if per_stage % layers:
            _fail(f"--num-layers-per-virtual-pipeline-stage={layers} does not divide the "
                  f"{per_stage} layers of each pipeline stage (--num-layers {args.num_layers} "
                  f"/ --pipeline-model-parallel-size {pp})")
        vpp = per_stage // layers
    elif chunks is not None:
        if args.num_layers % (pp * chunks):
            _fail(f"--num-layers={args.num_layers} is not divisible by "
                  f"--pipeline-model-parallel-size x --num-virtual-stages-per-pipeline-rank = "
                  f"{pp} x {chunks}: every model chunk needs the same number of layers")
        vpp = chunks
    args.virtual_pipeline_model_parallel_size = vpp if vpp is not None and vpp > 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False
        args.align_param_gather = False
        return
    if pp == 1:
        _fail("the interleaved pipeline (--num-layers-per-virtual-pipeline-stage / "
              "--num-virtual-stages-per-pipeline-rank) needs --pipeline-model-parallel-size > 1")
    if not args.overlap_p2p_comm and pp == 2:
        _fail("--no-overlap-p2p-communication with the interleaved pipeline needs "
              "--pipeline-model-parallel-size > 2: at 2 the batched sends and receives go "
              "both ways between the same two ranks and are matched in the wrong order "
              "(Megatron-LM refuses it too); drop --no-overlap-p2p-communication")
    if args.num_microbatches % pp:
        _fail(f"the interleaved pipeline needs the number of micro-batches per step "
              f"({args.num_microbatches} = --global-batch-size / (--micro-batch-size x "
              f"data-parallel size)) to be a multiple of --pipeline-model-parallel-size={pp}")


def _check_precision(args: argparse.Namespace) -> None:
    """Precision, loss scale and what a resume keeps; needs no other step."""
    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 are mutually exclusive: pass one")
    if args.loss_scale == 0:
        args.loss_scale = None  # Megatron-LM: 0 means dynamic loss scaling
    for flag, value in (("--loss-scale", args.loss_scale),
                        ("--initial-loss-scale", args.initial_loss_scale),
                        ("--min-loss-scale", args.min_loss_scale)):
        if value is not None and not FP32_TINY <= value <= FP32_MAX:
            _fail(f"{flag}={value:g} is not a positive normal fp32 number "
                  f"({FP32_TINY:.3g} to {FP32_MAX:.3g}): the gradients would be unscaled by "
                  "Inf or 0")
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.grad_reduce_in_bf16 and not args.bf16:
        _fail("--grad-reduce-in-bf16 needs --bf16: it keeps the gradients in the bf16 "
              "parameters' dtype (with --fp16 or fp32 parameters they are reduced in fp32)")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
              "contradict each other: pass one")
    if args.finetune and not (args.load or args.pretrained_checkpoint):
        _fail("--finetune needs --load (the checkpoint whose weights to start from) or "
              "--pretrained-checkpoint")
    if (args.finetune or args.pretrained_checkpoint) and args.use_checkpoint_opt_param_scheduler:
        _fail("--use-checkpoint-opt_param-scheduler contradicts --finetune / "
              "--pretrained-checkpoint, which start a fresh learning-rate schedule: drop it")


def _check_schedule(args: argparse.Namespace) -> None:
    """The learning-rate and weight-decay schedule (reads --lr, the iterations and the
    global batch)."""
    if args.lr_warmup_fraction is not None and args.lr_warmup_iters:
        _fail("--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive: pass one")
    if args.min_lr > args.lr:
        _fail(f"--min-lr={args.min_lr} exceeds --lr={args.lr}")
    _check_decoupled_lr(args)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.start_weight_decay is None:
        args.start_weight_decay = args.weight_decay
    if args.end_weight_decay is None:
        args.end_weight_decay = args.weight_decay
    warmup, decay, _ = scheduler_steps(args)
    if warmup >= decay:  # megatron-core's scheduler asserts it
        _fail(f"the learning-rate warm-up ({warmup} samples) is not shorter than the decay "
              f"({decay} samples, --lr-decay-iters or --train-iters x global batch): lower "
              "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction")


def _check_decoupled_lr(args: argparse.Namespace) -> None:
    """``--decoupled-lr`` / ``--decoupled-min-lr``: the embedding's and output layer's own
    learning rate and floor (megatron-core's ``decoupled_lr``, training/model.py)."""
    lr, floor = args.decoupled_lr, args.decoupled_min_lr
    if floor is not None and lr is None:
        _fail("--decoupled-min-lr needs --decoupled-lr (without it the embedding and output "
              "layer follow --lr and --min-lr)")
    if lr is None:
        return
    if not lr >= 0:  # also refuses NaN
        _fail(f"--decoupled-lr={lr} must be >= 0")
    low = args.min_lr if floor is None else floor
    if not 0 <= low <= lr:
        _fail(f"--decoupled-min-lr={low} must be in 0 .. --decoupled-lr={lr}" if floor is not None
              else f"--decoupled-lr={lr} is below --min-lr={low}, which the embedding and "
              "output layer keep as their floor: pass --decoupled-min-lr too")


PER_SPLIT_FLAGS = ("--train-data-path", "--valid-data-path", "--test-data-path")


def _check_blend(flag: str, values: list[str]) -> None:
    """``values`` is one PREFIX or 'WEIGHT PREFIX' pairs."""
    if len(values) > 1:
        if len(values) % 2:
            _fail(f"weighted {flag} needs pairs 'WEIGHT PREFIX ...'; got an odd count")
        for weight in values[0::2]:
            try:
                value = float(weight)
            except ValueError:
                _fail(f"{flag}: {weight!r} is not a weight; use 'WEIGHT PREFIX' pairs "
                      "or a single PREFIX")
            if not (math.isfinite(value) and value > 0):
                _fail(f"{flag}: weight {weight} must be a positive number (drop a prefix "
                      "instead of weighting it 0)")


def _check_data(args: argparse.Namespace) -> None:
    per_split = [f for f in PER_SPLIT_FLAGS if getattr(args, f[2:].replace("-", "_"))]
    if per_split:
        # Megatron-LM's per-split data: each split reads its own files, --split has no role.
        if args.mock_data:
            _fail(f"--mock-data makes up its data: drop it or drop {', '.join(per_split)}")
        if args.data_path:
            _fail(f"--data-path and {', '.join(per_split)} both name the data: pass "
                  "--data-path (divided by --split) or --train-data-path/--valid-data-path/"
                  "--test-data-path (one set of files per split)")
        if args.split is not None:
            _fail(f"--split divides --data-path; with {', '.join(per_split)} each split has "
                  "its own files: drop --split")
        if not args.train_data_path:
            _fail(f"{', '.join(per_split)} without --train-data-path: pass the training data "
                  "with --train-data-path")
        for flag in per_split:
            _check_blend(flag, getattr(args, flag[2:].replace("-", "_")))
        args.split_vector = None  # each split has its own files
    else:
        if not args.mock_data and not args.data_path:
            _fail("pass --data-path PREFIX [PREFIX ...] (preprocessed .bin/.idx), "
                  "--train-data-path (with --valid-data-path/--test-data-path) or --mock-data")
        if args.split is None:
            args.split = "969, 30, 1"
        args.split_vector = parse_split(args.split)
        if args.data_path and not args.mock_data:
            _check_blend("--data-path", args.data_path)
    if args.tokenizer_type is None:
        has_vocab = args.vocab_file is not None
        args.tokenizer_type = (tokenizer_registry.MOCK_DEFAULT if args.mock_data and not has_vocab
                               else tokenizer_registry.DEFAULT)
    spec = tokenizer_registry.REGISTRY[args.tokenizer_type]
    if args.mock_data:
        for dest, value in spec.mock_defaults.items():
            if getattr(args, dest) is None:
                vars(args)[dest] = value  # an argparse namespace, not a replaced attribute
    problem = spec.missing(args)
    if problem:
        _fail(problem)


def parse_split(text: str) -> list[float]:
    """``--split`` 'A,B,C' (or 'A/B/C') -> normalized train/valid/test fractions."""
    parts = [x.strip() for x in re.split(r"[,/]", text)]
    # Plain decimals only: megatron-core reads the numbers with the pattern [.0-9]+, so
    # '-10' or '1e2' would silently mean something else there.
    plain = all(re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", x) for x in parts)
    values = [float(x) for x in parts] if plain else []
    if not 1 <= len(values) <= 3 or sum(values) <= 0:
        _fail(f"--split {text!r} must be up to three non-negative numbers with a positive sum, "
              "e.g. 969,30,1 (train, valid, test)")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse a model whose 16-bit weights alone (before gradients and optimizer state)
    exceed this machine's memory: it could never be built."""
    need = _parameters_per_rank(args) * (2 if args.params_dtype != "fp32" else 4)
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        _fail(f"the model's weights alone need {need / 2**30:,.0f} GiB per rank (--hidden-size "
              f"{args.hidden_size}, --num-layers {args.num_layers}, --ffn-hidden-size "
              f"{args.ffn_hidden_size}), more than this machine's {have / 2**30:,.0f} GiB: "
              "choose a smaller model or more model parallelism")


def _check_sdp4bit(args: argparse.Namespace) -> None:
    target = getattr(args, "weight_difference_target", "main")
    if target != "main" and not args.quantized_weights:
        _fail(f"--weight-difference-target {target} needs --quantized-weights: it changes "
              "what qWD sends")
    if target != "main" and args.weight_quantization_mode != "diff":
        _fail(f"--weight-difference-target {target} applies to qWD only, not to "
              f"--weight-quantization-mode {args.weight_quantization_mode} (qW sends the weights)")
    # The flags to SDP4Bit's settings, checked as in Megatron-LM's trainer through the
    # plug-in (install_sdp4bit checks again on the built model), worded with the flags.
    from megatron.sdp4bit.integration.lifecycle import config_of_args

    problem = None
    try:
        config = config_of_args(args)
    except ValueError as err:
        problem = str(err)
    if problem is not None:
        _fail(problem)
    _check_padding_fits(args, config)
    if config.dp_ranks_per_node is not None and args.data_parallel_size % config.dp_ranks_per_node:
        _fail(f"--dp-ranks-per-node={config.dp_ranks_per_node} does not divide the data-parallel "
              f"size {args.data_parallel_size}")


def _parameters_per_rank(args: argparse.Namespace) -> int:
    """A rough count of the parameters one rank's DDP buckets hold (GPT: embeddings plus
    L layers of attention and MLP), enough to tell a sane padding from an absurd one."""
    h, f, layers = args.hidden_size, args.ffn_hidden_size, args.num_layers
    vocab = args.vocab_size or 50257
    mlp = (3 if args.swiglu else 2) * h * f
    total = vocab * h * (2 if args.untie_embeddings_and_output_weights else 1) + \
        args.max_position_embeddings * h + layers * (4 * h * h + mlp)
    return total // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)


def _check_padding_fits(args: argparse.Namespace, config) -> None:
    """Every bucket is padded to a multiple of the quantizers' divisor: refuse settings
    (huge --gradient-alltoall-pipeline or group sizes) that would pad a bucket beyond the
    size of the model itself."""
    if not config.enabled:
        return
    from megatron.sdp4bit.comm.padding import divisor_from_config

    limit = _parameters_per_rank(args)
    divisor = divisor_from_config(config, args.data_parallel_size)
    if divisor <= limit:
        return
    best = 1
    while best < config.gradient_alltoall_pipeline and divisor_from_config(
            config.replace(gradient_alltoall_pipeline=best + 1), args.data_parallel_size) <= limit:
        best += 1
    hint = (f"use --gradient-alltoall-pipeline {best} or less"
            if config.quantized_gradients and config.gradient_alltoall_pipeline > best
            else "use smaller group sizes")
    _fail(f"these SDP4Bit settings pad every bucket to a multiple of {divisor:,} elements, more "
          f"than the ~{limit:,} parameters a rank holds (the padding would outweigh the model): "
          f"{hint}")


def _check_logging(args: argparse.Namespace) -> None:
    if args.log_timers_to_tensorboard and not (args.tensorboard_dir and args.timing_log_level):
        _fail("--log-timers-to-tensorboard needs --tensorboard-dir and --timing-log-level 1 "
              "or 2 (there are no timers at level 0)")


def _check_checkpoint(args: argparse.Namespace) -> None:
    if args.async_save and args.ckpt_format != "torch_dist":
        _fail(f"--async-save needs --ckpt-format torch_dist (the {args.ckpt_format} format is "
              "saved synchronously, as in Megatron-LM)")
    if args.async_save and not args.save:
        _fail("--async-save needs --save (the folder its checkpoints are written to)")
    timeout = args.async_save_timeout_seconds
    if timeout is None:
        args.async_save_timeout_seconds = ASYNC_SAVE_TIMEOUT_S
    elif not args.async_save:
        _fail("--async-save-timeout-seconds bounds --async-save's writer: pass --async-save "
              "too, or drop it")
    elif not (math.isfinite(timeout) and 0 < timeout <= WEEK_SECONDS):
        _fail(f"--async-save-timeout-seconds={timeout:g} must be a number of seconds above 0 "
              "and at most a week")
    if args.ckpt_step is not None:
        if not args.load:
            _fail(f"--ckpt-step {args.ckpt_step} needs --load (the folder holding iter_"
                  f"{args.ckpt_step:07d})")
        if args.ckpt_step < 0:
            _fail(f"--ckpt-step={args.ckpt_step} must be an iteration number >= 0")


# The validation steps, in order: (name, check, the steps whose values it reads). A refused
# step leaves out the steps that need it (errors.py, [Note: every refusal in one message]).
STEPS = (
    ("training length", resolve_training_length, ()),  # --train-samples sets train_iters
    ("switches", check_switches, ()),
    ("required", _check_required, ("training length",)),
    ("model", _check_model, ("required",)),
    ("parallel", _check_parallel, ("required", "model")),
    ("moe", lambda a: check_moe_flags(
        a, transformer_engine=uses_transformer_engine(a.transformer_impl)), ("parallel",)),
    ("precision", _check_precision, ()),
    ("schedule", _check_schedule, ("required", "parallel")),
    ("data", _check_data, ()),
    ("memory", _check_memory, ("model", "precision")),
    ("sdp4bit", _check_sdp4bit, ("moe", "precision")),
    ("logging", _check_logging, ()),
    ("observe", check_observe_flags, ()),
    ("checkpoint", _check_checkpoint, ()),
)


def validate_args(args: argparse.Namespace, refusals: Refusals | None = None) -> None:
    """Check ``args`` in place and fill derived values. Every refusal goes to ``refusals``;
    without one, they are raised together as one :class:`ArgumentsError`."""
    args.start_time = time.time()  # --exit-duration-in-mins counts from here
    collect = Refusals() if refusals is None else refusals
    for name, step, needs in STEPS:
        collect.run(name, lambda step=step: step(args), needs)
    if refusals is None:
        collect.raise_if_any()
