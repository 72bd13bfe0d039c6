"""Every flag of Megatron-LM's own parser is answered by this trainer: honoured or accepted
(it is in ``pretrain_gpt.py``'s parser) or refused with a reason (the generated list of
``training/cli/megatron_lm_flag_list.py``), never argparse's bare "unrecognized arguments".

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
