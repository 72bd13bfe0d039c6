"""Megatron-LM's ``pretrain_gpt.py`` flags beyond the core set: each is honoured, refused
with one line, or accepted as a documented no-op.

Existing Megatron-LM scripts must either run unchanged or be told in one line which flag
this trainer does not support. Three kinds, all in this module:

* honoured: sample-based training (``--train-samples``, ``--lr-decay-samples``,
  ``--lr-warmup-samples``), the batch-size ramp-up (``--rampup-batch-size``:
  :mod:`.rampup_flags`), ``--exit-duration-in-mins``, ``--distributed-timeout-minutes``,
  ``--distributed-backend`` (defined in ``arguments.py``, checked in :mod:`.devices`),
  the scheduler's checkpoint override, the TensorBoard logging switches, the transformer
  switches of :func:`transformer_config_overrides` (``--apply-layernorm-1p`` among them),
  ``--empty-unused-memory-level`` (training/step.py), ``--exit-signal-handler`` and
  ``--exit-signal`` (training/guards/exit_signal.py), the logging and profiling flags of
  :mod:`.observe_flags`, and flags whose one accepted value is
  what this trainer does (:data:`ONLY_VALUE`; other values are refused);
* :data:`REFUSED_FLAGS`: parsed so that the error names the flag and says why (argparse
  would only say "unrecognized");
* :data:`NO_OP_FLAGS`: accepted and ignored, each where doing nothing is harmless (the same
  results, only speed or I/O timing could differ), with the reason; docs/flags.md lists them.

:func:`add_megatron_flags` adds them to the parser; :func:`refused_flags` lists the refused
ones for the parse's one message; :func:`resolve_training_length` and :func:`check_switches`
are steps of validation (``validate.py``).
"""

from __future__ import annotations

import argparse

from megatron.sdp4bit.training.cli.errors import ArgumentsError
from megatron.sdp4bit.training.cli.rampup_flags import check_rampup_values, rampup_iterations
from megatron.sdp4bit.training.guards.exit_signal import EXIT_SIGNALS

__all__ = ["FIXED_SETTINGS", "NO_OP_FLAGS", "ONLY_VALUE", "REFUSED_FLAGS", "add_megatron_flags",
           "check_switches", "refused_flags", "resolve_training_length", "scheduler_steps",
           "transformer_config_overrides"]

# Flag -> why doing nothing is harmless here. Switches unless listed in _NO_OP_VALUES.
NO_OP_FLAGS: dict[str, str] = {
    "--no-async-tensor-model-parallel-allreduce": "megatron-core decides the overlap of the "
    "tensor-parallel all-reduce itself; the flag only toggled an overlap, never the math",
    "--log-throughput": "throughput (TFLOP/s/GPU) is always part of the log line",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced in fp32 with --bf16 unless "
    "--grad-reduce-in-bf16, as in Megatron-LM; with --fp16 and fp32 parameters too",
    "--use-mcore-models": "the trainer always builds megatron-core's GPTModel",
    "--num-workers": "batches are read in the training process from the memory-mapped "
    "dataset; loader workers would change only how fast, never which samples",
    "--num-dataset-builder-threads": "only how fast the dataset index is built",
    "--no-mmap-bin-files": "only how the .bin file is read; the tokens are the same",
    "--no-create-attention-mask-in-dataloader": "no mask is ever built in the data loader: "
    "attention is causal by construction",
    "--tensorboard-queue-size": "only how many TensorBoard events wait before a flush",
    "--attention-softmax-in-fp32": "softmax is always computed in fp32 here (megatron-core's "
    "default)",
    "--no-persist-layer-norm": "the persistent layer-norm kernel is never used here",
    "--no-gradient-accumulation-fusion": "gradient-accumulation fusion is never used here",
    "--no-rope-fusion": "RoPE fusion is never used here",
    "--no-delay-grad-reduce": "a knob of older megatron-core DDP; only when gradient "
    "reduction starts, which --overlap-grad-reduce decides here",
    "--delay-param-gather": "a knob of older megatron-core DDP; only when the parameter "
    "gather starts, which --overlap-param-gather decides here",
    "--manual-gc": "Python's garbage collector runs automatically; the flag only moves its "
    "pauses",
    "--manual-gc-interval": "see --manual-gc",
    "--no-manual-gc-eval": "see --manual-gc",
    "--fp16-lm-cross-entropy": "megatron-core computes the cross entropy from fp32 logits "
    "whatever this flag says",
    "--log-batch-size-to-tensorboard": "the batch size is always written to TensorBoard (tag "
    "batch-size), as Megatron-LM does since it dropped this flag",
    "--use-persistent-ckpt-worker": "--async-save's writer is a process forked per save "
    "(megatron-core's temporal caller); a persistent worker would change only how the writer "
    "process starts, not what a checkpoint holds or when it is published (Megatron-LM 0.19 "
    "needs this flag for --async-save; here --async-save alone is asynchronous)",
}
# No-op flags that take a value: flag -> argparse keywords.
_NO_OP_VALUES: dict[str, dict] = {
    "--num-workers": {"type": int},
    "--num-dataset-builder-threads": {"type": int},
    "--tensorboard-queue-size": {"type": int},
    "--manual-gc-interval": {"type": int},
}

# Flag -> (number of values: 0 for a switch, or an argparse nargs, why and what to do).
REFUSED_FLAGS: dict[str, tuple[int | str, str]] = {
    "--decrease-batch-size-if-needed": (0, "batch sizes are never rounded down here (no "
                                        "sample is dropped): give a --global-batch-size and "
                                        "--rampup-batch-size sizes that --micro-batch-size x "
                                        "data-parallel size divides"),
    "--batch-size": (1, "it is Megatron-LM's removed name: use --micro-batch-size"),
    "--checkpoint-activations": (0, "it is Megatron-LM's removed name: use "
                                 "--recompute-activations or --recompute-granularity"),
    "--warmup": (1, "it is Megatron-LM's removed name: use --lr-warmup-iters, "
                 "--lr-warmup-samples or --lr-warmup-fraction"),
    "--encoder-num-layers": (1, "this trainer builds decoder-only GPTs: use --num-layers"),
    "--exit-on-missing-checkpoint": (0, "with --load and no checkpoint the trainer starts from "
                                     "scratch and says so in its first lines"),
    "--no-save-optim": (0, "checkpoints always hold the optimizer state: a resumed run repeats "
                        "the uninterrupted one only with it"),
    "--no-save-rng": (0, "checkpoints always hold the RNG states: a resumed run repeats the "
                      "uninterrupted one only with them"),
    "--use-checkpoint-args": (0, "pass the model flags on the command line"),
    "--use-dist-ckpt": (0, "it is Megatron-LM's removed name: --ckpt-format torch_dist is "
                        "the default"),
    "--skip-train": (0, "evaluation runs every --eval-interval during training"),
    "--log-progress": (0, "--metrics-jsonl records every logged iteration instead"),
    "--tp-comm-overlap": (0, "Transformer Engine's userbuffer overlap is not wired up"),
    "--pipeline-model-parallel-split-rank": (1, "encoder-decoder pipelines are not supported"),
    "--standalone-embedding-stage": (0, "the embedding lives in the first pipeline stage"),
    "--use-ring-exchange-p2p": (0, "pipeline stages talk with torch.distributed send/recv"),
    "--vocab-extra-ids": (1, "it is for T5 models"),
    "--tiktoken-pattern": (1, "TikTokenizer is not supported (it needs the tiktoken package)"),
    "--tiktoken-num-special-tokens": (1, "see --tiktoken-pattern"),
    "--tokenizer-special-tokens": ("+", "see --tiktoken-pattern"),
    "--trust-remote-code": (0, "HuggingFaceTokenizer never runs code of a tokenizer folder"),
    "--data-parallel-random-init": (0, "every data-parallel replica starts from rank 0's "
                                    "initialization (SDP4Bit's replicas must stay identical)"),
    "--init-method-xavier-uniform": (0, "initialization is normal with --init-method-std"),
    "--fp8-format": (1, "fp8 training is not supported"),
    "--apply-residual-connection-post-layernorm": (0, "not wired to the layer spec"),
    "--squared-relu": (0, "the activation is GeLU (--openai-gelu: its tanh approximation), "
                       "or SwiGLU with --swiglu"),
    "--rotary-seq-len-interpolation-factor": (1, "not wired to the model"),
    "--no-check-for-nan-in-loss-and-grad": (0, "the NaN check stays on: SDP4Bit's quantizer "
                                            "keeps NaN visible to it on purpose"),
    "--spec": ("+", "the layer spec follows --transformer-impl"),
    "--adlr-autoresume": (0, "ADLR's autoresume service is not available"),
    "--nccl-communicator-config-path": (1, "NCCL communicators use their defaults"),
}

# Flags whose one accepted value is what this trainer does: flag -> (type, value, reason).
ONLY_VALUE: dict[str, tuple[type, object, str]] = {
    "--dataloader-type": (str, "single", "the training data is read once, in order"),
    "--rerun-mode": (str, "disabled", "the rerun state machine is not used"),
    "--async-strategy": (str, "mcore", "--async-save uses megatron-core's own asynchronous "
                         "writer; nvidia-resiliency-ext's is not a requirement here"),
}

ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")

# Megatron-LM settings this trainer has no flag for (their flags are refused:
# megatron_lm_flags.py), at Megatron-LM's defaults: SDP4Bit's lifecycle reads them by
# Megatron-LM's names, the same function in both trainers (integration/lifecycle.py).
FIXED_SETTINGS: dict[str, object] = {
    "num_distributed_optimizer_instances": 1,
    "use_megatron_fsdp": False,
    "use_torch_fsdp2": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "fp8_param_gather": False,
    "fp4_param_gather": False,
    "use_precision_aware_optimizer": False,
}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Add the honoured, refused and no-op flags of this module to ``parser``, and the
    settings of :data:`FIXED_SETTINGS`."""
    parser.set_defaults(**FIXED_SETTINGS)
    g = parser.add_argument_group("Megatron-LM: training length, exits, logging switches")
    g.add_argument("--train-samples", type=int, default=None,
                   help="train on this many samples: --train-iters = samples // global batch "
                   "(instead of --train-iters)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="with --train-samples: decay the learning rate over this many samples "
                   "(default --train-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="with --train-samples: warm the learning rate up over this many samples")
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: the global batch size starts at START and grows "
                   "by INCREMENT up to --global-batch-size over SAMPLES consumed samples "
                   "(Megatron-LM's ramp-up, on megatron-core's calculator); the micro-batches "
                   "per iteration, the schedules and the log follow it; evaluation uses "
                   "--global-batch-size")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="after the iteration that ends more than this many minutes after start, "
                   "save (with --save) and exit; all ranks agree on the iteration")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on the --exit-signal, finish the current iteration, save a checkpoint "
                   "there (with --save) and exit 0; all ranks agree on the iteration")
    g.add_argument("--exit-signal", default=None, metavar="|".join(EXIT_SIGNALS),
                   help="the signal --exit-signal-handler catches (default SIGTERM)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--no-log-learnig-rate-to-tensorboard", "--no-log-learning-rate-to-tensorboard",
                   dest="log_learning_rate_to_tensorboard", action="store_false",
                   help="(Megatron-LM's spelling, and the corrected one)")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false")
    g = parser.add_argument_group("Megatron-LM: transformer switches")
    g.add_argument("--use-cpu-initialization", action="store_true",
                   help="initialize weights on the host (always so without CUDA)")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion",
                   action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true")
    g.add_argument("--fp32-residual-connection", action="store_true")
    g.add_argument("--no-clone-scatter-output-in-embedding",
                   dest="clone_scatter_output_in_embedding", action="store_false")
    g.add_argument("--distribute-saved-activations", action="store_true",
                   help="with --recompute-granularity full and tensor parallelism")
    g.add_argument("--recompute-modules", nargs="*", default=None,
                   help="with --recompute-granularity selective (default core_attn)")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKENDS),
                   help="flash, fused and unfused choose Transformer Engine's attention kernel "
                   "(CUDA and transformer_engine needed)")
    g.add_argument("--use-flash-attn", action="store_true", help="= --attention-backend flash")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="= --position-embedding-type rope")
    g.add_argument("--no-position-embedding", dest="add_position_embedding",
                   action="store_false",
                   help="no learned absolute position embedding (e.g. with rope)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="the loss is the sum of the token losses over the number of tokens of "
                   "all micro-batches and data-parallel ranks (megatron-core's "
                   "calculate_per_token_loss), not the mean of per-micro-batch means")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy (its native "
                   "implementation, which runs on CPU too) instead of the unfused one; its "
                   "backward rounds the logits' gradient to bf16, as in Megatron-LM")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalize queries and keys per head before attention (megatron-core's "
                   "qk_layernorm, with --normalization's kind)")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.x's RoPE frequency scaling (megatron-core's rope_scaling: "
                   "low/high frequency factors 1 and 4, original context 8192); needs "
                   "--position-embedding-type rope")
    g.add_argument("--rope-scaling-factor", type=float, default=None,
                   help="with --use-rope-scaling: the scaling factor (default 8.0, "
                   "Megatron-LM's)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred layer norms: each norm's weight starts at 0 and scales "
                   "by 1 + weight (megatron-core's layernorm_zero_centered_gamma; weight decay "
                   "then pulls the scale towards 1); LayerNorm and RMSNorm alike")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="release the CUDA caching allocator's unused blocks "
                   "(torch.cuda.empty_cache()): 1 after each forward-backward pass and each "
                   "evaluation step, 2 also after each optimizer step, as Megatron-LM; less "
                   "fragmentation, slower; nothing to release on CPU")
    for flag, (kind, value, why) in ONLY_VALUE.items():
        g.add_argument(flag, type=kind, default=value, help=f"only {value}: {why}")

    g = parser.add_argument_group("accepted for compatibility, no effect here")
    for flag, why in NO_OP_FLAGS.items():
        if flag in _NO_OP_VALUES:
            g.add_argument(flag, default=None, help=why, **_NO_OP_VALUES[flag])
        else:
            g.add_argument(flag, action="store_true", help=why)
    g = parser.add_argument_group("Megatron-LM flags refused with a reason")
    for flag, (nargs, why) in REFUSED_FLAGS.items():
        kwargs = ({"action": "store_const", "const": True} if nargs == 0
                  else {"nargs": nargs})
        g.add_argument(flag, dest="refused_" + _dest(flag), default=None,
                       help=f"not supported: {why}", **kwargs)


def _fail(message: str) -> None:
    raise ArgumentsError(message)


def refused_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(the flag as given, why) for every refused flag or refused value on ``args``."""
    out = []
    for flag, (_, why) in REFUSED_FLAGS.items():
        if getattr(args, "refused_" + _dest(flag)) is not None:
            out.append((flag, why))
    for flag, (_, value, why) in ONLY_VALUE.items():
        given = getattr(args, _dest(flag))
        if given != value:
            out.append((f"{flag}={given}", f"only {value} ({why})"))
    return out


def resolve_training_length(args: argparse.Namespace) -> None:
    """Megatron-LM's rules: iteration- or sample-based, never a mix; with
    ``--train-samples``, ``args.train_iters`` from it (the first step of validation: the
    required-flag check needs it)."""
    if args.train_samples is None:
        if args.rampup_batch_size is not None:
            check_rampup_values(args)  # refused: it needs --train-samples
        for flag in ("--lr-decay-samples", "--lr-warmup-samples"):
            if getattr(args, _dest(flag)):
                _fail(f"{flag} needs --train-samples (sample-based training); with "
                      f"--train-iters use {flag.replace('samples', 'iters')}")
        return
    if args.train_iters is not None:
        _fail("--train-iters and --train-samples are mutually exclusive: pass one")
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        flag = "--lr-decay-iters" if args.lr_decay_iters is not None else "--lr-warmup-iters"
        _fail(f"{flag} counts iterations; with --train-samples use "
              f"{flag.replace('iters', 'samples')}")
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        _fail("--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive: pass one")
    for flag in ("--train-samples", "--lr-decay-samples", "--lr-warmup-samples"):
        value = getattr(args, _dest(flag))
        if value is not None and value < (0 if flag == "--lr-warmup-samples" else 1):
            _fail(f"{flag}={value} must be >= {0 if flag == '--lr-warmup-samples' else 1}")
    if args.micro_batch_size is None:
        _fail("missing required flag(s): --micro-batch-size")
    gbs = args.global_batch_size
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    data_parallel = max(1, args.world_size // model_parallel)  # validation checks it next
    if gbs is None:  # Megatron-LM's default, as validation derives it next
        gbs = args.micro_batch_size * data_parallel
    if args.rampup_batch_size is not None:
        args.global_batch_size = gbs
        args.train_iters = rampup_iterations(args, data_parallel)
        return
    if args.train_samples < gbs:
        _fail(f"--train-samples={args.train_samples} is less than one global batch ({gbs})")
    args.train_iters = args.train_samples // gbs  # a fixed batch per iteration


def check_switches(args: argparse.Namespace) -> None:
    """The transformer and exit switches: contradictions refused, aliases resolved."""
    if args.use_flash_attn:
        if args.attention_backend not in ("auto", "flash"):
            _fail(f"--use-flash-attn and --attention-backend {args.attention_backend} "
                  "contradict each other: pass one")
        args.attention_backend = "flash"
    if args.attention_backend in ("flash", "fused", "unfused") and \
            args.transformer_impl == "local":
        # Whether this machine has CUDA and Transformer Engine is cli/installed.py's question.
        _fail(f"--attention-backend {args.attention_backend} (or --use-flash-attn) chooses "
              "Transformer Engine's attention kernel, and --transformer-impl local does not use "
              "it: drop the flag")
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding:
        if args.position_embedding_type == "learned_absolute":
            args.position_embedding_type = "none"
    granularity = args.recompute_granularity or (
        "selective" if args.recompute_activations else None)
    if args.distribute_saved_activations and (granularity != "full" or args.sequence_parallel):
        _fail("--distribute-saved-activations needs --recompute-granularity full and no "
              "--sequence-parallel")
    if args.recompute_modules is not None and granularity != "selective":
        _fail("--recompute-modules needs --recompute-granularity selective "
              "(or --recompute-activations)")
    if args.use_rope_scaling and args.position_embedding_type != "rope":
        _fail("--use-rope-scaling scales RoPE's frequencies: it needs --position-embedding-type "
              "rope (or --use-rotary-position-embeddings)")
    if args.rope_scaling_factor is not None:
        if not args.use_rope_scaling:
            _fail("--rope-scaling-factor needs --use-rope-scaling (without it RoPE is not "
                  "scaled)")
        if not args.rope_scaling_factor >= 1:  # also refuses NaN
            _fail(f"--rope-scaling-factor={args.rope_scaling_factor} must be >= 1 (Llama 3.x "
                  "stretches the low frequencies by it)")
    else:
        args.rope_scaling_factor = 8.0  # Megatron-LM's default, recorded in checkpoints
    if args.log_world_size_to_tensorboard and not args.tensorboard_dir:
        _fail("--log-world-size-to-tensorboard needs --tensorboard-dir")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        _fail(f"--exit-duration-in-mins={args.exit_duration_in_mins} must be > 0")
    _check_exit_signal(args)


def _check_exit_signal(args: argparse.Namespace) -> None:
    """``args.exit_signal``: the signal's name with --exit-signal-handler, else None."""
    if args.exit_signal is not None and args.exit_signal not in EXIT_SIGNALS:
        _fail(f"--exit-signal {args.exit_signal} is not supported: use SIGTERM (the default), "
              f"{', '.join(EXIT_SIGNALS[1:-1])} or {EXIT_SIGNALS[-1]}")
    if not args.exit_signal_handler:
        if args.exit_signal is not None:
            _fail(f"--exit-signal {args.exit_signal} needs --exit-signal-handler (without it "
                  "no signal is caught)")
        return
    args.exit_signal = args.exit_signal or "SIGTERM"  # Megatron-LM's default


def scheduler_steps(args: argparse.Namespace) -> tuple[int, int, int]:
    """(warm-up, decay, weight-decay increment) lengths of the schedule in samples, which is
    how megatron-core's scheduler counts (``step(increment=global batch)``)."""
    gbs = args.global_batch_size
    if args.train_samples is not None:
        decay = args.lr_decay_samples or args.train_samples
        warmup = args.lr_warmup_samples
        wd_incr = args.train_samples
    else:
        decay = args.lr_decay_iters * gbs
        warmup = args.lr_warmup_iters * gbs
        wd_incr = args.train_iters * gbs
    if args.lr_warmup_fraction is not None:
        warmup = int(args.lr_warmup_fraction * decay)
    return warmup, decay, wd_incr


def transformer_config_overrides(args: argparse.Namespace) -> dict:
    """TransformerConfig fields set by the switches of this module (only those given)."""
    out: dict = {}
    if args.use_cpu_initialization:
        out["use_cpu_initialization"] = True
    if not args.masked_softmax_fusion:
        out["masked_softmax_fusion"] = False
    if not (args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion):
        out["bias_activation_fusion"] = False
    if not args.bias_dropout_fusion:
        out["bias_dropout_fusion"] = False
    for name in ("apply_query_key_layer_scaling", "fp32_residual_connection",
                 "distribute_saved_activations", "qk_layernorm", "cross_entropy_loss_fusion",
                 "calculate_per_token_loss"):
        if getattr(args, name):
            out[name] = True
    if not args.clone_scatter_output_in_embedding:
        out["clone_scatter_output_in_embedding"] = False
    if args.recompute_modules is not None:
        out["recompute_modules"] = list(args.recompute_modules)
    if args.apply_layernorm_1p:
        out["layernorm_zero_centered_gamma"] = True
    if args.attention_backend != "auto":
        from megatron.core.transformer.enums import AttnBackend

        out["attention_backend"] = AttnBackend[args.attention_backend]
    return out

