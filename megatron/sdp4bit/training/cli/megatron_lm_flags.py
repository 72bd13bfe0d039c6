"""The answer to every other flag of Megatron-LM's own parser: the reason it is refused.

:mod:`megatron_flags` answers the Megatron-LM flags this trainer's parser knows (honoured,
refused, no-op). Megatron-LM's parser has some 850 flags; the rest (inference servers,
reinforcement learning, vision and retriever models, FSDP, fp8, MoE internals, ...) are
listed in :mod:`megatron_lm_flag_list`, generated from megatron-core 0.19.2's
``megatron/training/arguments.py`` (``python -m dev.gen_flag_docs --megatron-lm``), by the
title of the argument group Megatron-LM puts them in. A launch that passes one gets the reason
here, not argparse's bare "unrecognized arguments"; the 0.19.2 test pass checks that every
flag of that parser is in this trainer's parser or in that list.

:func:`flag_refusals` words them as refusals that parsing collects with validation's, so
that one launch tells the user everything to drop (errors.py, [Note: every refusal in one
message]).
"""

from __future__ import annotations

import re

from megatron.sdp4bit.training.cli.errors import Refusal, message_of
from megatron.sdp4bit.training.cli.megatron_lm_flag_list import MEGATRON_LM_FLAGS

__all__ = ["FLAG_REASONS", "GROUP_REASONS", "flag_refusals", "reason", "refusal_message",
           "unknown_flags"]

_NOT_GPT = "it is for {} models: this trainer builds decoder-only GPTs"
_NOT_HERE = "{} is not part of this trainer"

# Megatron-LM argument group title -> why its flags are refused here.
GROUP_REASONS: dict[str, str] = {
    "transformer configuration": "a model or kernel option that this trainer does not wire "
    "to megatron-core's GPTModel (docs/flags.md lists the model flags it honours)",
    "network size": "a model option that this trainer does not wire to megatron-core's "
    "GPTModel (docs/flags.md lists the model flags it honours)",
    "mixed precision": "a precision option that this trainer does not wire (--bf16/--fp16 "
    "and the loss-scale flags are honoured)",
    "Transformer-Engine": "fp8/fp4 parameter gathers are not supported (no fp8 training)",
    "distributed init": "a distributed-setup option that this trainer does not wire: data "
    "parallelism is megatron-core's DDP with the distributed optimizer, whose collectives "
    "SDP4Bit quantizes",
    "training": "a training-loop option of Megatron-LM that this trainer does not implement",
    "learning rate and weight decay": "a learning-rate option that this trainer does not "
    "implement (the WSD schedule, frozen layers)",
    "regularization": "an optimizer option that this trainer does not wire: its optimizers are "
    "Adam and SGD (--optimizer)",
    "checkpointing": "a checkpoint option that this trainer does not implement: checkpoints "
    "are torch_dist saves (asynchronous with --async-save) or torch saves, with a verified "
    "manifest (docs/checkpoints.md)",
    "data and dataloader": "a data option of Megatron-LM's other datasets or loaders: this "
    "trainer reads GPT data from --data-path or --train/valid/test-data-path",
    "tokenizer": "a tokenizer option that this trainer does not wire (docs/flags.md lists the "
    "tokenizer flags it honours)",
    "validation": "a validation option that this trainer does not implement: evaluation runs "
    "--eval-iters batches every --eval-interval",
    "logging": "a logging option that this trainer does not implement",
    "profiling": "a profiler option that this trainer does not implement",
    "experimental": "an experimental option of Megatron-LM that this trainer does not wire",
    "moe": "a mixture-of-experts option that this trainer does not implement (the MoE flags it "
    "honours are listed under 'Megatron-LM: mixture of experts')",
    "mla": "multi-latent attention is not built by this trainer",
    "experimental_attention_variant": "linear attention variants are not built by this trainer",
    "heterogeneous architecture": "heterogeneous layer configurations are not built by this "
    "trainer",
    "RNG and initialization": "the RNG tracker is megatron-core's default one here",
    "rerun engine": "the rerun state machine is not used (--rerun-mode disabled only)",
    "inference": "an inference or text-generation option: this trainer only trains",
    "rl": _NOT_HERE.format("reinforcement learning"),
    "sft": _NOT_HERE.format("supervised fine-tuning"),
    "Logits Distillation": _NOT_HERE.format("logits distillation"),
    "vision": _NOT_GPT.format("vision"),
    "biencoder": _NOT_GPT.format("BERT/ICT retriever"),
    "autoresume": "ADLR's autoresume service is not available",
    "one logger": _NOT_HERE.format("NVIDIA's one-logger telemetry"),
    "ft_package": _NOT_HERE.format("NVIDIA's fault-tolerance package") + " (it has "
    "--heartbeat-timeout-seconds for hangs)",
    "In-process restart": _NOT_HERE.format("in-process restart"),
    "straggler": _NOT_HERE.format("NVIDIA's straggler detector"),
    "fault injector": _NOT_HERE.format("Megatron-LM's fault injector"),
    "workload inspector": _NOT_HERE.format("NVIDIA's workload inspector server"),
    "msc": "the multi-storage client is not used: data and checkpoints are local files",
}

_FSDP = ("SDP4Bit quantizes the collectives of megatron-core's distributed optimizer, not "
         "FSDP's: use --use-distributed-optimizer")
# Flag -> a reason more precise than its group's.
FLAG_REASONS: dict[str, str] = {
    "--use-torch-fsdp2": _FSDP,
    "--torch-fsdp2-no-reshard-after-forward": _FSDP,
    "--use-megatron-fsdp": _FSDP,
    "--data-parallel-sharding-strategy": _FSDP,
    "--check-weight-hash-across-dp-replicas-interval": "use --check-replicas-interval N, this "
    "trainer's checksum of the model replicas",
    "--local-rank": "the local rank is read from torchrun's LOCAL_RANK",
    "--disable-log-loss-scale-to-tensorboard": "use --no-log-loss-scale-to-tensorboard",
    "--yaml-cfg": "pass the flags on the command line",
    "--step-batch-size-schedule": "a stepwise batch-size schedule is not wired: "
    "--rampup-batch-size START INCREMENT SAMPLES grows the batch (Megatron-LM's ramp-up, on "
    "either megatron-core release)",
}

_NUMBER = re.compile(r"-\.?[0-9]")


def reason(flag: str) -> str:
    """Why ``flag`` (one of :data:`MEGATRON_LM_FLAGS`) is refused."""
    return FLAG_REASONS.get(flag) or GROUP_REASONS[MEGATRON_LM_FLAGS[flag]]


def unknown_flags(extras: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Split what the parser did not know (``parse_known_args``'s extras) into refused
    Megatron-LM flags ``(flag, reason)`` and the rest, as typed (unknown flags and values)."""
    refused, other = [], []
    skip_values = False
    for token in extras:
        flag = token.split("=", 1)[0]
        if not token.startswith("-") or _NUMBER.match(token):
            if not skip_values:  # a value of a refused flag is not worth naming again
                other.append(token)
            continue
        skip_values = flag in MEGATRON_LM_FLAGS
        if skip_values:
            refused.append((flag, reason(flag)))
        else:
            other.append(token)
    return refused, other


def flag_refusals(refused: list[tuple[str, str]], unrecognized: list[str] = ()
                  ) -> list[Refusal]:
    """The refusals of flags: ``refused`` holds (what was given, why); ``unrecognized``
    what the parser does not know at all, as typed (one refusal for all of it)."""
    out = [Refusal(f"{given} is not supported by this trainer: {why}", f"{given}: {why}")
           for given, why in refused]
    if unrecognized:
        out.append(Refusal(f"unrecognized arguments: {' '.join(unrecognized)}"))
    return out


def refusal_message(refused: list[tuple[str, str]], unrecognized: list[str] = ()) -> str:
    """One line for every refusal at once. ``refused`` holds (what was given, why)."""
    return message_of(flag_refusals(refused, unrecognized))
