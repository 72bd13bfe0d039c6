"""The README's flags table lists every SDP4Bit flag with the parser's default and choices."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from megatron.sdp4bit.config import SUPPORTED_BITS
from megatron.sdp4bit.training.cli.arguments import build_parser

README = Path(__file__).resolve().parents[4] / "README.md"


def readme_flag_rows() -> dict[str, list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## SDP4Bit flags\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(--[a-z0-9-]+)` \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [cell.strip() for cell in m.group(2).split("|")]
    return rows


def sdp4bit_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    (group,) = [g for g in parser._action_groups if g.title == "SDP4Bit"]
    actions = {a.option_strings[0]: a for a in group._group_actions}
    actions["--seed"] = next(a for a in parser._actions if "--seed" in a.option_strings)
    return actions


def test_every_sdp4bit_flag_is_documented_with_its_default_and_values():
    rows, actions = readme_flag_rows(), sdp4bit_actions()
    assert sorted(rows) == sorted(actions)
    for flag, action in actions.items():
        default, values, meaning = rows[flag]
        assert meaning, flag
        if isinstance(action, argparse._StoreTrueAction):
            assert (default, values) == ("off", "switch"), flag
        elif action.default is None:  # taken from where the ranks run, or from --seed
            assert default == ("`--seed`" if flag == "--rounding-seed" else "detected"), flag
        else:
            assert default == str(action.default), flag
        if action.choices:
            assert values == ", ".join(map(str, action.choices)), flag
        elif "bits" in flag:
            assert values == ", ".join(map(str, SUPPORTED_BITS)), flag
