"""docs/flags.md: its generated tables are what the parser says, and the SDP4Bit table lists
every SDP4Bit flag with the parser's default and choices.

The first test compares the committed page with ``dev.gen_flag_docs``'s output, so a flag
added, removed or changed without ``python -m dev.gen_flag_docs`` fails here. The others read
the committed page on their own (not through the generator), so a generator that dropped a
flag or printed a wrong default would fail them too.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from dev import gen_flag_docs as gen
from megatron.sdp4bit.config import ACCEPTED_BITS
from megatron.sdp4bit.training.cli import megatron_flags as mf
from megatron.sdp4bit.training.cli.arguments import build_parser

PAGE = Path(__file__).resolve().parents[4] / "docs" / "flags.md"


def region(name: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    return text.split(f"<!-- gen:{name}:begin -->", 1)[1].split(f"<!-- gen:{name}:end -->", 1)[0]


def rows(name: str) -> dict[str, list[str]]:
    """First cell's flags -> the other cells, for every table row of a generated region."""
    out = {}
    for line in region(name).splitlines():
        m = re.match(r"\| (`--[^|]*`) \|(.*)\|\s*$", line)
        if m:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", m.group(2))]
            for flag in re.findall(r"`(--[A-Za-z0-9_-]+)`", m.group(1)):
                assert flag not in out, f"{flag} listed twice"
                out[flag] = cells
    return out


def sdp4bit_actions() -> dict[str, argparse.Action]:
    parser = build_parser()
    (group,) = [g for g in parser._action_groups if g.title == "SDP4Bit"]
    actions = {a.option_strings[0]: a for a in group._group_actions}
    actions["--seed"] = next(a for a in parser._actions if "--seed" in a.option_strings)
    return actions


def test_the_committed_page_is_what_the_parser_generates():
    committed = PAGE.read_text(encoding="utf-8")
    assert gen.update(committed, gen.render()) == committed, (
        "docs/flags.md differs from the parser: run python -m dev.gen_flag_docs")


def test_every_sdp4bit_flag_is_documented_with_its_default_and_values():
    documented, actions = rows("sdp4bit"), sdp4bit_actions()
    assert sorted(documented) == sorted(actions)
    for flag, action in actions.items():
        default, values, meaning = documented[flag]
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
            assert values == ", ".join(map(str, ACCEPTED_BITS[action.dest])), flag


def test_every_flag_of_the_parser_is_on_the_page_once():
    """Each spelling of each flag in exactly one generated table (SDP4Bit's --seed is also
    in Megatron's), and the no-op and refused tables hold exactly their dictionaries."""
    tables = {name: rows(name) for name in ("sdp4bit", "megatron", "no-op", "refused")}
    listed = [flag for name, table in tables.items() for flag in table]
    parser_flags = [s for a in build_parser()._actions for s in a.option_strings
                    if s not in ("-h", "--help")]
    assert sorted(listed) == sorted(parser_flags + ["--seed"])  # --seed: in both tables
    assert sorted(tables["no-op"]) == sorted(mf.NO_OP_FLAGS)
    assert sorted(tables["refused"]) == sorted(mf.REFUSED_FLAGS)
    for flag, (_, why) in mf.REFUSED_FLAGS.items():
        assert tables["refused"][flag] == [why.replace("|", "\\|")], flag


def test_a_new_integer_flag_needs_its_accepted_values():
    """The generator stops rather than print a blank for a flag it cannot describe."""
    parser = build_parser()
    (group,) = [g for g in parser._action_groups if g.title == "SDP4Bit"]
    group.add_argument("--new-group-size", type=int, default=64, help="a new knob")
    with pytest.raises(KeyError, match="--new-group-size"):
        gen.sdp4bit_table(parser)


def test_update_needs_each_marker_once():
    with pytest.raises(ValueError, match="gen:x:begin"):
        gen.update("no markers here", {"x": "table"})
    page = "a\n<!-- gen:x:begin -->\nold\n<!-- gen:x:end -->\nb\n"
    assert gen.update(page, {"x": "new"}) == "a\n<!-- gen:x:begin -->\nnew\n<!-- gen:x:end -->\nb\n"
