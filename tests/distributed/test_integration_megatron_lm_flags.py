"""Every flag of Megatron-LM's own parser is answered by this trainer: honoured or accepted
(it is in ``pretrain_gpt.py``'s parser) or refused with a reason (the generated list of
``training/cli/megatron_lm_flag_list.py``), never argparse's bare "unrecognized arguments".
SDP4Bit's lifecycle reads both parsers' arguments by Megatron-LM's names.

Marked ``megatron_lm``: only the megatron-core 0.19.2 pass runs it (that wheel ships
``megatron/training/arguments.py``; 0.16.1's does not), and the first pass deselects it
(tests/conftest.py).
"""

from __future__ import annotations

import pytest

from dev.megatron_lm_parser import megatron_lm_parser
from megatron.sdp4bit.training.cli import megatron_lm_flags as mlm
from megatron.sdp4bit.training.cli.arguments import ArgumentsError, build_parser, parse_args

pytestmark = pytest.mark.megatron_lm

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --train-iters 10").split()


def _options(parser) -> dict:
    return {flag: action for action in parser._actions for flag in action.option_strings}


def test_every_megatron_lm_flag_is_answered_at_once():
    theirs, ours = _options(megatron_lm_parser()), _options(build_parser())
    unanswered = sorted(f for f in theirs if f.startswith("--"))
    unanswered = [f for f in unanswered if f not in ours]
    assert unanswered == sorted(mlm.MEGATRON_LM_FLAGS), (
        "megatron_lm_flag_list.py is not this comparison's result: run "
        "python -m dev.gen_flag_docs --megatron-lm (megatron-core 0.19.2), then "
        "python -m dev.gen_flag_docs")
    # A flag of both parsers is a switch in both or takes values in both: otherwise a script's
    # next flag would be read as its value, or its value as a stray argument.
    for flag in set(theirs) & set(ours):
        assert (theirs[flag].nargs == 0) == (ours[flag].nargs == 0), flag
    # All of them on one command line (each switch-like; a value would only be skipped):
    # one message names every one with its reason, in command-line order.
    with pytest.raises(ArgumentsError) as info:
        parse_args(BASE + unanswered, world_size=1)
    parts = [f"({i}) {flag}: {mlm.reason(flag)}" for i, flag in enumerate(unanswered, 1)]
    assert str(info.value) == (f"{len(unanswered)} problems with this command line; drop or "
                               "replace each: " + "; ".join(parts))


# Megatron-LM flags -> the Setup field they turn on (each a setup SDP4Bit refuses or checks).
FLAG_FIELDS = [
    (["--use-distributed-optimizer"], "distributed_optimizer", True),
    (["--bf16"], "fp32_params", False),
    (["--fp16"], "fp32_params", False),
    (["--num-distributed-optimizer-instances", "2"], "distributed_optimizer_instances", 2),
    (["--ddp-reduce-scatter-with-fp32-accumulation"], "reduce_scatter_with_fp32_accumulation",
     True),
    (["--use-megatron-fsdp"], "megatron_fsdp", True),
    (["--use-torch-fsdp2"], "megatron_fsdp", True),
    (["--reuse-grad-buf-for-mxfp8-param-ag"], "reuse_grad_buf_for_mxfp8_param_ag", True),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"], "expert_tensor_parallel",
     True),
    # unset, Megatron-LM's expert TP is the TP size
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "expert_tensor_parallel", True),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2",
      "--expert-tensor-parallel-size", "1"], "expert_tensor_parallel", False),
    (["--fp8-param-gather"], "fp8_param_gather", True),
    (["--fp4-param-gather"], "fp4_param_gather", True),
    (["--use-precision-aware-optimizer"], "precision_aware_optimizer", True),
]


def test_the_lifecycle_reads_both_trainers_arguments_by_megatron_lms_names(monkeypatch):
    """SDP4Bit's lifecycle turns the parsed flags into the setup it checks, reading every
    Megatron-LM setting by its Megatron-LM name with no default (integration/lifecycle.py):
    Megatron-LM's parsed arguments and ours both have each one (a misspelled name fails
    here), each of Megatron-LM's flags reaches its field, and with the flags both trainers
    share, both give the same setup. Then Megatron-LM's validation with the plug-in on:
    the plug-in's run from the flags, and the names its checkpoints read."""
    import dataclasses
    import sys

    from megatron.sdp4bit.config_flags import add_sdp4bit_flags
    from megatron.sdp4bit.integration import megatron_lm
    from megatron.sdp4bit.integration.lifecycle import ARGS_READ, config_of_args, setup_of_args
    from megatron.sdp4bit.integration.megatron_lm_checkpoint import layout_of_args, save_refusal
    from megatron.sdp4bit.integration.support import Setup

    theirs = megatron_lm_parser()
    add_sdp4bit_flags(theirs)
    ours = build_parser()
    base = theirs.parse_args([])
    assert [name for name in ARGS_READ if not hasattr(base, name)] == []
    assert setup_of_args(base) == Setup(distributed_optimizer=False, fp32_params=True)
    for flags, name, value in FLAG_FIELDS:
        setup = setup_of_args(theirs.parse_args(flags))
        assert getattr(setup, name) == value, (flags, setup)
        others = {f.name: getattr(setup, f.name) for f in dataclasses.fields(Setup)
                  if f.name != name}
        assert others == {f.name: getattr(setup_of_args(base), f.name)
                          for f in dataclasses.fields(Setup) if f.name != name}, flags
    shared = ("--use-distributed-optimizer --bf16 --ddp-reduce-scatter-with-fp32-accumulation "
              "--num-experts 4 --expert-tensor-parallel-size 2").split()
    assert setup_of_args(ours.parse_args(BASE + shared)) == \
        setup_of_args(theirs.parse_args(BASE + shared))
    assert setup_of_args(parse_args(BASE, world_size=1)) == setup_of_args(theirs.parse_args(BASE))
    with pytest.raises(ValueError, match="^--ddp-reduce-scatter-with-fp32-accumulation "):
        config_of_args(theirs.parse_args(BASE + shared[:3] + ["--quantized-gradients"]))

    flags = BASE + ("--max-position-embeddings 32 --tokenizer-type NullTokenizer --vocab-size "
                    "128 --use-distributed-optimizer --bf16 --quantized-gradients "
                    "--dp-ranks-per-node 1 --gradient-error-feedback --save /tmp/unused "
                    "--save-interval 2").split()
    monkeypatch.setattr(sys, "argv", ["megatron_lm_gpt.py", *flags])
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    megatron_lm.enable()
    try:
        from megatron.training.arguments import parse_and_validate_args

        args = parse_and_validate_args()
        run = megatron_lm.lifecycle()
        assert run.config.quantized_gradients and run.config.gradient_error_feedback
        assert save_refusal(args) is None  # torch_dist, Megatron-LM's default
        assert layout_of_args(args)["data_parallel_size"] == 1
    finally:
        from megatron.training.global_vars import unset_global_variables

        unset_global_variables()  # Megatron-LM's globals (args, the micro-batch calculator)
        megatron_lm.disable()
    assert megatron_lm.lifecycle() is None
