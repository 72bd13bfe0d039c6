"""Every refusal of a command line in one message (training/cli/errors.py, [Note: every
refusal in one message]): flag-level and combination-level refusals, what this machine
lacks, and the steps that need a refused one left out; Megatron-LM's warning when
--sequence-parallel has nothing to split."""

from __future__ import annotations

import pytest
import torch

from megatron.sdp4bit.training.cli import installed
from megatron.sdp4bit.training.cli import megatron_flags as mf
from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --mock-data --train-iters 10").split()
LR = ["--lr", "3e-4"]
# A Llama-3 recipe of Megatron-LM's shape: the flags it passes that this trainer once refused
# one launch at a time.
RECIPE = ("--decoupled-lr 1.5e-4 --decoupled-min-lr 1.5e-5 --apply-layernorm-1p "
          "--empty-unused-memory-level=1 --sequence-parallel").split()
PROFILE = ("--profile without --use-pytorch-profiler starts nsys's capture range "
           "(cudaProfilerStart), which needs CUDA: add --use-pytorch-profiler on CPU")
FUSED = ("--attention-backend fused (or --use-flash-attn) runs Transformer Engine's CUDA "
         "kernels and there is no CUDA device here: drop the flag")
SP_WARNING = ("warning: Disabling sequence parallelism because tensor model parallelism is "
              "disabled")


@pytest.fixture
def no_cuda(monkeypatch):
    """This machine as a CPU one, whatever it has (the refusals' words depend on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def refused(argv: list[str], world_size: int = 4) -> str:
    with pytest.raises(ArgumentsError) as info:
        parse_args(argv, world_size=world_size, check_machine=True)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_a_recipe_learns_everything_to_change_in_one_launch(no_cuda, capsys):
    """The recipe's flags are accepted; what cannot run (a profiler that needs CUDA, a
    Transformer Engine kernel) is named in the same message as the rest."""
    got = refused(BASE + LR + RECIPE + ["--profile", "--attention-backend", "fused"])
    assert got == ("2 problems with this command line; drop or replace each: "
                   f"(1) {PROFILE}; (2) {FUSED}")
    args = parse_args(BASE + LR + RECIPE, world_size=4, check_machine=True)
    assert (args.decoupled_lr, args.decoupled_min_lr, args.apply_layernorm_1p,
            args.empty_unused_memory_level) == (1.5e-4, 1.5e-5, True, 1)
    assert not args.sequence_parallel  # TP 1: nothing to split, as Megatron-LM says
    assert capsys.readouterr().err.count(SP_WARNING) == 2  # once per parse


def test_flag_combination_and_machine_refusals_together(no_cuda):
    """A refused flag, a Megatron-LM flag this parser lacks, a contradiction, a bad value
    validated late (after the model's defaults), what this machine lacks and a misspelt flag:
    each named once, in the order of the checks, the unknown argument last."""
    got = refused(BASE + LR + "--no-save-optim --fp16 --bf16 --freeze-all-layers "
                  "--hidden-size 65 --profile --lr-warmup-iter 3".split())
    assert got == (
        "6 problems with this command line; drop or replace each: "
        "(1) --freeze-all-layers: a learning-rate option that this trainer does not implement "
        "(the WSD schedule, frozen layers); "
        f"(2) --no-save-optim: {mf.REFUSED_FLAGS['--no-save-optim'][1]}; "
        "(3) --hidden-size=65 is not divisible by --num-attention-heads=4; "
        "(4) --fp16 and --bf16 are mutually exclusive: pass one; "
        f"(5) {PROFILE}; (6) unrecognized arguments: --lr-warmup-iter 3")


def test_a_step_that_needs_a_refused_one_is_left_out(no_cuda, monkeypatch):
    """Without --lr the schedule's checks (which compare --min-lr with it) do not run, and
    do not fail on the missing value; the independent ones still do. A machine check that
    needs a refused step is left out too."""
    assert refused(BASE + ["--fp16", "--bf16"]) == (
        "2 problems with this command line; drop or replace each: "
        "(1) missing required flag(s): --lr; (2) --fp16 and --bf16 are mutually exclusive: "
        "pass one")
    # --train-samples with --train-iters: no iteration count to check the rest against
    assert refused(BASE + LR + ["--train-samples", "64", "--lr-warmup-iters", "100"]) == (
        "--train-iters and --train-samples are mutually exclusive: pass one")
    seen = []
    monkeypatch.setattr(installed, "_check_transformer_engine", seen.append)
    parse_args(BASE + LR, world_size=4, check_machine=True)
    assert len(seen) == 1  # the machine's check runs on a good command line...
    refused(BASE + LR + ["--use-flash-attn", "--attention-backend", "fused"])
    assert len(seen) == 1  # ...not after the switches it reads were refused


def test_one_refusal_reads_as_it_always_did(no_cuda):
    assert refused(BASE + LR + ["--no-save-optim"]) == (
        f"--no-save-optim is not supported by this trainer: "
        f"{mf.REFUSED_FLAGS['--no-save-optim'][1]}")
    assert refused(BASE + LR + ["--attention-backend", "fused"]) == FUSED


def test_sequence_parallel_warns_only_where_it_is_dropped(capsys):
    args = parse_args(BASE + LR + ["--sequence-parallel"], world_size=2)
    assert not args.sequence_parallel
    assert capsys.readouterr().err.splitlines() == [SP_WARNING]
    args = parse_args(BASE + LR + ["--sequence-parallel", "--tensor-model-parallel-size", "2"],
                      world_size=2)
    assert args.sequence_parallel
    assert SP_WARNING not in capsys.readouterr().err
