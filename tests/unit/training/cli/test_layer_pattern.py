"""``--moe-layer-freq``: Megatron-LM's integer or list pattern, read by a bounded grammar.

The patterns Megatron-LM's documentation gives parse to the lists Python gives them; what the
grammar leaves out (a power, a call, a tuple, a nested list) and what exceeds its bounds (a
count above 65,536 layers, deep brackets, long text) is one line, answered at once: before,
the value was evaluated, so ``[1]*10**8`` built a 1.2 GB list (8 s) and ``[1]*9**9**9`` never
finished.
"""

from __future__ import annotations

import argparse
import time

import pytest

from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args
from megatron.sdp4bit.training.cli.layer_pattern import MAX_LAYERS, parse_layer_pattern
from megatron.sdp4bit.training.cli.moe_flags import parse_moe_layer_freq

BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --num-experts 4").split()


def _refusal(freq: str) -> str:
    start = time.perf_counter()
    try:  # the flag's own reading: answered at once, nothing built (microseconds here)
        parse_moe_layer_freq(freq)
    except argparse.ArgumentTypeError:
        pass
    assert time.perf_counter() - start < 0.5, freq
    with pytest.raises(ArgumentsError) as err:
        parse_args(BASE + ["--moe-layer-freq", freq], world_size=1)
    return str(err.value)


def test_unbounded_arithmetic_is_refused_at_once():
    # the two values first: on the evaluating parser the first took 8 s and 1.2 GB
    # and was refused for its length only, the second never returned
    assert _refusal("[1]*10**8") == (
        "argument --moe-layer-freq: '[1]*10**8' is not a layer pattern: '**' (a power) is not "
        "accepted: write the count out")
    assert "'**' (a power) is not accepted" in _refusal("[1]*9**9**9")
    assert _refusal("[1]*100000000").endswith(f"the number 100000000 exceeds {MAX_LAYERS}")
    assert _refusal("[1]*65536*65536").endswith(
        f"it gives 4294967296 (layers or a count), more than {MAX_LAYERS}")
    assert _refusal("[1]*" + "(" * 40 + "1" + ")" * 40).endswith("more than 32 nested brackets")
    assert _refusal("[" + "1," * 3000 + "]").endswith(
        "it is 6002 characters long, more than 4096")
    # the largest list the grammar builds, then --num-layers refuses it
    assert _refusal(f"[1]*{MAX_LAYERS}") == (
        f"--moe-layer-freq gives {MAX_LAYERS} layers, but --num-layers is 4")


@pytest.mark.parametrize("text, why", [
    ("__import__('os').system('true')", "neither an integer nor a list pattern"),
    ("[1]*(lambda:4)()", "'l' is not part of a pattern (digits and [ ] ( ) , + * only)"),
    ("[1]*-1", "'-' is not part of a pattern"),
    ("(1,0)", "neither an integer nor a list pattern"),
    ("[(1,0)]", "a ',' inside '( )' makes a tuple: use '[ ]' for a list"),
    ("[[1],[0]]", "a list inside a list: the pattern is one flat list"),
    ("[1]*[2]", "'*' repeats a list by a number, not by a list"),
    ("[1]+1", "'+' joins two lists or two numbers, not a list and a number"),
    ("[2,0,1,1]", "its items must be 0 (a dense layer) or 1 (a MoE layer)"),
    ("[1,0", "it ends too early"),
    ("[1,0])", "')' after the end of the expression"),
    ("[1 2]", "',' expected where 2 is"),
    ("[1]2", "2 after the end of the expression"),
], ids=lambda x: x[:12])
def test_outside_the_grammar_is_one_line(text, why):
    message = _refusal(text)
    assert message.startswith("argument --moe-layer-freq: ") and why in message, message


@pytest.mark.parametrize("text, pattern", [
    ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3),  # Megatron-LM's help examples
    ("([0]+[1]*23)", [0] + [1] * 23),
    ("([1]*3+[0]*2)*2", ([1] * 3 + [0] * 2) * 2),
    ("[1,0,1,]", [1, 0, 1]),
    (" 2 * [0, 1] ", [0, 1, 0, 1]),
    ("[1]*(1+1)*2+[0]*0", [1, 1, 1, 1]),
    ("[0+1,1*0]", [1, 0]),
])
def test_megatron_lm_patterns_give_pythons_lists(text, pattern):
    assert parse_layer_pattern(text) == pattern == eval(text)  # noqa: S307 - the oracle


def test_an_integer_and_a_pattern_checked_against_the_layers():
    assert parse_args(BASE + ["--moe-layer-freq", "2"], world_size=1).moe_layer_freq == 2
    assert parse_args(BASE + ["--moe-layer-freq", "[1,0]*2"],
                      world_size=1).moe_layer_freq == [1, 0, 1, 0]
    assert _refusal("0") == "argument --moe-layer-freq: 0 must be >= 1"
    assert _refusal("[1,0]*3") == "--moe-layer-freq gives 6 layers, but --num-layers is 4"
