"""Megatron-LM's own ``pretrain_gpt.py`` parser, built from the installed megatron-core wheel.

megatron-core 0.19.2's wheel ships ``megatron/training/arguments.py`` (0.16.1's does not).
Only the flag comparison of the 0.19.2 test pass and ``python -m dev.gen_flag_docs
--megatron-lm`` read it; nothing at run time does.

On Python 3.11 ``megatron.training`` needs Python 3.12's ``typing.override``, which the test
environment's interpreters get at start-up (integration/megatron_lm_bridges.py, [Note: the
Python 3.12 bridge in every process]).
"""

from __future__ import annotations

import argparse
import warnings


def megatron_lm_parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser (``add_megatron_arguments``), as ``pretrain_gpt.py``
    builds it; ImportError where the wheel has no ``megatron.training``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        from megatron.training.arguments import add_megatron_arguments

        parser = argparse.ArgumentParser(allow_abbrev=False)
        return add_megatron_arguments(parser)


def megatron_lm_flags() -> dict[str, str]:
    """Every option string of Megatron-LM's parser -> the title of its argument group."""
    out: dict[str, str] = {}
    for group in megatron_lm_parser()._action_groups:
        for action in group._group_actions:
            for flag in action.option_strings:
                if flag.startswith("--"):
                    out[flag] = group.title
    return out
