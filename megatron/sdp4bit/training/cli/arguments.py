"""Megatron-LM's command line for ``pretrain_gpt.py``, plus the SDP4Bit flags.

Flag names, defaults and meanings follow Megatron-LM's ``arguments.py`` so that existing
scripts run unchanged. The SDP4Bit flags are generated from ``SDP4BitConfig``
(:mod:`megatron.sdp4bit.config_flags`). Every error is a :class:`ArgumentsError`
carrying one line that names the flag and the fix, every refusal of a command line in the
same one (errors.py, [Note: every refusal in one message]); ``pretrain_gpt.py`` prints it
and exits 2.

The rest of Megatron-LM's flags (sample-based training, exit conditions, logging and
transformer switches, and those refused or accepted as no-ops) live in
:mod:`megatron.sdp4bit.training.cli.megatron_flags`.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from megatron.sdp4bit.config_flags import add_sdp4bit_flags, sdp4bit_config_from_args
from megatron.sdp4bit.training.cli.errors import ArgumentsError, Refusals
from megatron.sdp4bit.training.cli.installed import installed_steps
from megatron.sdp4bit.training.cli.megatron_flags import (NO_OP_FLAGS, add_megatron_flags,
                                                          refused_flags)
from megatron.sdp4bit.training.cli.megatron_lm_flags import flag_refusals, unknown_flags
from megatron.sdp4bit.training.cli.moe_flags import add_moe_flags
from megatron.sdp4bit.training.cli.observe_flags import add_observe_flags
from megatron.sdp4bit.training.cli.validate import validate_args
from megatron.sdp4bit.training.tokenizers import registry as tokenizer_registry

__all__ = ["ArgumentsError", "NO_OP_FLAGS", "TOKENIZER_TYPES", "build_parser", "parse_args",
           "sdp4bit_config_from_args"]

# The --tokenizer-type choices: the tokenizer registry's names.
TOKENIZER_TYPES = tokenizer_registry.names()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgumentsError(message)


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="default hidden / heads")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument(
        "--position-embedding-type", default="learned_absolute", choices=["learned_absolute", "rope"]
    )
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="norm_epsilon", type=float, default=1e-5)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GeLU's tanh approximation (OpenAI's GPT-2, Hugging Face's gelu_new) "
                   "instead of the exact erf one; not with --swiglu")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"],
                   help="layer spec: transformer_engine needs CUDA and Transformer Engine "
                   '(pip install -e ".[te]"); auto = Transformer Engine when importable with '
                   "CUDA, else megatron-core's local layers")
    g.add_argument("--allow-untested-megatron-core", action="store_true",
                   help="run SDP4Bit's quantized collectives on an untested megatron-core "
                   "release even where an attribute they replace changed its signature "
                   "(refused otherwise; a loud warning says it). An untested release whose "
                   "replaced attributes are unchanged runs without it, with one warning")


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default micro batch x data-parallel size (no accumulation); the "
                   "size a --rampup-batch-size grows to, and evaluation's batch")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="exit after the iteration that is a multiple of this (saving first)")
    g.add_argument("--seed", type=int, default=1234,
                   help="Megatron's seed (initialization, data order unless --train-data-seed, "
                   "held-out samples unless --eval-data-seed); also seeds SDP4Bit's "
                   "counter-based stochastic-rounding streams (with the iteration, bucket, rank "
                   "and hop), so a run and its resumption are reproducible")
    g.add_argument("--recompute-activations", action="store_true",
                   help="same as --recompute-granularity selective")
    g.add_argument("--recompute-granularity", default=None, choices=["full", "selective"])
    g.add_argument("--recompute-method", default=None, choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--optimizer", default="adam", choices=["adam", "sgd"])
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the learning rate of the input embedding and the output layer, on "
                   "the same schedule (megatron-core's decoupled_lr: their own parameter group)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="with --decoupled-lr: the floor of their learning rate (default "
                   "--min-lr)")
    g.add_argument("--lr-decay-style", default="linear",
                   choices=["constant", "linear", "cosine", "inverse-square-root"])
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", default="constant", choices=["constant", "linear", "cosine"])
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=10,
                   help="stop the run when this many iterations in a row are skipped for "
                   "non-finite gradients (with a dynamic fp16 loss scale: at --min-loss-scale); "
                   "0 = never stop")


def _add_precision(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixed precision")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale for --fp16; unset or 0 = dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16: keep the gradient buffers in bf16 and reduce them in bf16 "
                   "(megatron-core's grad_reduce_in_fp32=False) instead of fp32; with "
                   "--quantized-gradients the wire format stays SDP4Bit's and only the buffers "
                   "are bf16")


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (needs Transformer Engine's "
                   "attention; refused where it does not run)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline: layers per model chunk; each pipeline rank holds "
                   "(layers / PP) / this many chunks")
    g.add_argument("--num-virtual-stages-per-pipeline-rank",
                   "--virtual-pipeline-model-parallel-size", type=int, default=None,
                   dest="num_virtual_stages_per_pipeline_rank",
                   help="interleaved pipeline: model chunks per pipeline rank (instead of "
                   "--num-layers-per-virtual-pipeline-stage; the second spelling is "
                   "Megatron-LM's older name)")
    g.add_argument("--overlap-p2p-communication", dest="overlap_p2p_comm",
                   action="store_true", default=True,
                   help="interleaved pipeline: overlap the stages' sends and receives with "
                   "compute (the default, as in Megatron-LM)")
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm",
                   action="store_false",
                   help="interleaved pipeline: batched sends and receives, waited for at once "
                   "(needs --pipeline-model-parallel-size > 2)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--no-align-param-gather", dest="align_param_gather", action="store_false",
                   help="interleaved pipeline with --overlap-param-gather: each model chunk "
                   "gathers its parameters when its first forward needs them, instead of the "
                   "schedule starting the next chunk's gather ahead (the default)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket; default megatron-core's")
    g.add_argument("--ddp-reduce-scatter-with-fp32-accumulation", action="store_true",
                   help="with --use-distributed-optimizer: megatron-core's reduce-scatter that "
                   "sends the gradients in their buffer's dtype (an all-to-all) and sums them in "
                   "fp32; not with SDP4Bit's quantized gradients or --overlap-grad-reduce")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="the process groups' backend (default NCCL with CUDA, gloo without). "
                   "gloo on CUDA lets several ranks share a device, local rank r on "
                   "cuda:(r mod devices) when there are more local ranks than devices; NCCL "
                   "refuses that (training/cli/devices.py)")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10,
                   help="timeout of the process groups' collectives")
    g.add_argument("--heartbeat-timeout-seconds", type=float, default=120.0,
                   help="end the job when a rank sends no heartbeat for this long (a stopped "
                   "or frozen process) or the torchrun agent is gone; 0 = off")


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and tokenizer")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefixes of .bin/.idx files, optionally weighted: 'w1 p1 w2 p2'")
    g.add_argument("--split", default=None,
                   help="train, valid, test proportions of --data-path (default '969, 30, 1')")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="*", default=None,
                       help=f"the {split} split's own prefixes, optionally weighted, instead "
                       "of --data-path and --split" + (
                           "; evaluated once after the last iteration" if split == "test"
                           else ""))
    g.add_argument("--eval-data-seed", type=int, default=None,
                   help="shuffle the validation and test datasets with this seed instead of "
                   "--seed (not a Megatron-LM flag): runs that differ in --seed then evaluate "
                   "on the same samples (default: --seed, as Megatron-LM)")
    g.add_argument("--train-data-seed", type=int, default=None,
                   help="shuffle the training dataset with this seed instead of --seed (not a "
                   "Megatron-LM flag): runs that differ in --seed then read the same samples "
                   "in the same order, and runs that differ in it start from the same "
                   "initialization (default: --seed, as Megatron-LM)")
    g.add_argument("--mock-data", action="store_true", help="synthetic data")
    g.add_argument("--data-cache-path", default=None)
    g.add_argument("--tokenizer-type", default=None, choices=list(TOKENIZER_TYPES),
                   help=f"default {tokenizer_registry.DEFAULT}, or {tokenizer_registry.MOCK_DEFAULT} "
                   "with --mock-data and no vocab")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer's model file or, for HuggingFaceTokenizer, its local "
                   "folder (save_pretrained's output; nothing is downloaded): "
                   + ", ".join(tokenizer_registry.needing("--tokenizer-model")))
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer vocabulary size")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")


def _add_checkpoint_and_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true",
                   help="load the model weights only (the fp32 main params are taken from them)")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights of the checkpoint: start at iteration 0 "
                   "with a fresh optimizer, learning-rate schedule and RNG, reading this run's "
                   "data from its start (Megatron-LM's meaning; docs/checkpoints.md)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="when --load is not given or holds no checkpoint yet, start from this "
                   "folder's latest checkpoint as --finetune does (a restarted fine-tuning run "
                   "resumes its own --load instead)")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="delete the checkpoints of another run found in --save (otherwise "
                   "such a --save is refused unless it is also --load)")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, use this command line's learning-rate and weight-decay "
                   "schedule instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler",
                   "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's schedule whatever the command line says")
    g.add_argument("--ckpt-format", choices=["torch_dist", "torch"], default="torch_dist",
                   help="torch_dist: megatron-core's distributed checkpoint (the model once, "
                   "resumable on another data-parallel size); torch: one file per rank, "
                   "resumable on the same layout only (docs/checkpoints.md)")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="load a checkpoint of either format (saves still use --ckpt-format): "
                   "the way to convert a checkpoint")
    g.add_argument("--dist-ckpt-optim-fully-reshardable", action="store_true",
                   help="torch_dist: save the optimizer state per parameter, so that TP and PP "
                   "may change on resume too (gathers the state on each DP group's rank 0)")
    g.add_argument("--async-save", action="store_true",
                   help="torch_dist: write checkpoints in the background with megatron-core's "
                   "asynchronous writer while training goes on; a save is published (manifest, "
                   "folder renamed, tracker) once every rank's files are written, at the "
                   "start of a later iteration, before the next save or before the run exits "
                   "(docs/checkpoints.md)")
    g.add_argument("--async-save-timeout-seconds", type=float, default=None,
                   help="--async-save: the time a save's writer may take, plus 1 s per 10 MiB "
                   "its rank writes, counted from the save's iteration; a writer still running "
                   "then (stopped, or on a hung file system) ends the run with a line naming "
                   "the rank and the save, the previous checkpoint current (default 600; not "
                   "a Megatron-LM flag)")
    g.add_argument("--ckpt-fully-parallel-save", action="store_true",
                   help="torch_dist: spread the writing of replicated tensors over the "
                   "data-parallel ranks")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="torch_dist: every data-parallel rank reads a share and they exchange")
    g.add_argument("--allow-changed-sdp4bit-settings", action="store_true",
                   help="resume a checkpoint trained with other SDP4Bit flags (changes the "
                   "method mid-run)")
    g.add_argument("--allow-changed-data", action="store_true",
                   help="resume a checkpoint trained on another --data-path blend, --split or "
                   "--seed (the samples and their order change), or with another tokenizer")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load iter_N of --load instead of the iteration its tracker names")
    g.add_argument("--load-without-manifest", action="store_true",
                   help="load a checkpoint that has no manifest.json: nothing in it is verified "
                   "(checksums, layout, settings); a torch_dist one (e.g. Megatron-LM's) needs "
                   "--no-load-optim --no-load-rng too, or --finetune")
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true")
    g.add_argument("--wandb-project", default="")
    g.add_argument("--wandb-exp-name", default="")
    g.add_argument("--wandb-save-dir", default="")
    g.add_argument("--metrics-jsonl", default=None,
                   help="write one JSON object per logged iteration and per evaluation")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: iteration time only; 1: also forward-backward, gradient sync, "
                   "optimizer, parameter sync and SDP4Bit's quantize/wait/dequantize phases; "
                   "2: also per-micro-batch phases (adds synchronization)")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="timers across ranks: the max, (min, max), or every rank")
    g.add_argument("--no-barrier-with-level-1-timing", dest="barrier_with_L1_time",
                   action="store_false",
                   help="do not wait for all ranks around level-1 timers")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the timers (max across ranks) to TensorBoard")
    g.add_argument("--check-replicas-interval", type=int, default=0,
                   help="every N iterations compare a checksum of the model replica across "
                   "data-parallel ranks and stop on a difference; 0 = off")
    g.add_argument("--debug", action="store_true",
                   help="print the traceback of an error, not only its one-line message")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="GPT pretraining on megatron-core with SDP4Bit",
                allow_abbrev=False)
    for add in (_add_model, _add_training, _add_precision, _add_parallel, _add_data,
                _add_checkpoint_and_logging, add_megatron_flags, add_moe_flags,
                add_observe_flags):
        add(p)
    add_sdp4bit_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None, world_size: int | None = None, *,
               check_machine: bool = False) -> argparse.Namespace:
    """Parse and validate; ``world_size`` defaults to ``$WORLD_SIZE`` (1 if unset).
    ``check_machine``: also refuse what this machine cannot run (``installed.py``). Every
    refusal of the command line comes in one :class:`ArgumentsError` (errors.py, [Note:
    every refusal in one message])."""
    args, extras = build_parser().parse_known_args(argv)
    # Megatron-LM flags this parser lacks, refused flags and values; what it does not know
    # at all is named last
    unknown_refused, unrecognized = unknown_flags(extras)
    refusals = Refusals()
    refusals.add(flag_refusals(unknown_refused + refused_flags(args)))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args.world_size = world_size
    validate_args(args, refusals)
    if check_machine:
        for name, step, needs in installed_steps(
                args, lambda: sdp4bit_config_from_args(args).enabled):
            refusals.run(name, step, needs)
    refusals.add(flag_refusals([], unrecognized))
    refusals.raise_if_any()
    return args
