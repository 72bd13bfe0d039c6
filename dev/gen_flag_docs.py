"""Write the flag tables of docs/flags.md from ``pretrain_gpt.py``'s parser.

``python -m dev.gen_flag_docs`` rewrites each generated region of docs/flags.md (between
``<!-- gen:NAME:begin -->`` and ``<!-- gen:NAME:end -->``) and leaves the hand-written text
around them alone; ``--check`` only says whether the file is current (exit status 1 if not). ``--megatron-lm``
(in the megatron-core 0.19.2 environment, whose wheel ships Megatron-LM's ``arguments.py``)
first rewrites ``training/cli/megatron_lm_flag_list.py``: every flag of Megatron-LM's own
parser that this trainer's parser lacks, by Megatron-LM's argument group; the page's
"megatron-lm" region lists them with the reason each is refused
(``training/cli/megatron_lm_flags.py``).
``tests/unit/training/cli/test_flag_docs.py`` fails when the committed page differs from
what this writes, so a flag added, removed or changed without regenerating fails CI.

[Note: what is generated and what is not]
The parser is the source of every flag's name, aliases, default, choices and help; the
SDP4Bit flags' help is the docstring of their ``SDP4BitConfig`` field, and the no-op and
refused flags' reasons are the dictionaries of ``megatron_flags.py`` that build the parser.
Two things a parser does not say are kept here, each keyed by flag so that a new flag
without an entry stops the generator instead of printing a blank: the accepted range of an
SDP4Bit integer flag (``ACCEPTED``; validation lives in ``SDP4BitConfig.__post_init__`` and
``training/cli/validate.py``) and what a ``None`` default means (``NONE_DEFAULTS``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from megatron.sdp4bit.config import ACCEPTED_BITS
from megatron.sdp4bit.training.cli import megatron_flags as mf
from megatron.sdp4bit.training.cli import megatron_lm_flags as mlm
from megatron.sdp4bit.training.cli.megatron_lm_flag_list import MEGATRON_LM_FLAGS
from megatron.sdp4bit.training.cli.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "flags.md"
FLAG_LIST = ROOT / "megatron" / "sdp4bit" / "training" / "cli" / "megatron_lm_flag_list.py"

SDP4BIT_GROUP = "SDP4Bit"
NO_OP_GROUP = "accepted for compatibility, no effect here"
REFUSED_GROUP = "Megatron-LM flags refused with a reason"
# Megatron's flag that SDP4Bit shares (its field ``seed``): listed with the SDP4Bit flags too.
SHARED = ("--seed",)

# Accepted values of the SDP4Bit flags that take an integer without choices.
_GROUP_SIZE = "positive even integer"
ACCEPTED: dict[str, str] = {
    "--wq-group-size": _GROUP_SIZE,
    "--gq-group-size-intra": _GROUP_SIZE + " (a multiple of the Hadamard block with "
    "`--hadamard-transform`; it and `--gq-group-size-inter` divide one another)",
    "--gq-group-size-inter": _GROUP_SIZE + " (a multiple of the Hadamard block with "
    "`--hadamard-transform`; it and `--gq-group-size-intra` divide one another; a multiple "
    "of 4 at 2 bits)",
    "--hadamard-block-size": "power of two dividing both gradient group sizes",
    "--gradient-alltoall-pipeline": "integer >= 1",
    "--gradient-error-feedback-decay": "number in [0, 1)",
    "--gradient-error-feedback-reset-interval": "integer >= 0 (0 = never)",
    "--gradients-quantization-start-iteration": "integer >= 0",
    "--dp-ranks-per-node": "integer >= 1 dividing the data-parallel size",
    "--seed": "integer",
    "--rounding-seed": "integer >= 0",
}
# What a default of ``None`` means, for the SDP4Bit flags that have one.
NONE_DEFAULTS: dict[str, str] = {
    "--dp-ranks-per-node": "detected",
    "--rounding-seed": "`--seed`",
}

_DEFAULT_SUFFIX = re.compile(r"\s*\(default: [^()]*\)")


def _cell(text: str) -> str:
    """Markdown table cell: RST literals as code, pipes escaped, one line."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    return text.replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    """The help text without the ``(default: X)`` the SDP4Bit flags append (the table has a
    column for it)."""
    return _cell(_DEFAULT_SUFFIX.sub("", action.help or "").rstrip())


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _names(action: argparse.Action) -> str:
    return ", ".join(f"`{name}`" for name in action.option_strings)


def _groups(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    return {g.title: list(g._group_actions) for g in parser._action_groups
            if g._group_actions and g.title not in ("options", "positional arguments")}


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def sdp4bit_table(parser: argparse.ArgumentParser) -> str:
    """flag | default | accepted values | meaning, for every SDP4Bit flag and ``--seed``."""
    actions = _groups(parser)[SDP4BIT_GROUP] + [_action(parser, f) for f in SHARED]
    rows = ["| flag | default | accepted values | meaning |", "|---|---|---|---|"]
    for action in actions:
        flag = action.option_strings[0]
        if _is_switch(action):
            default, values = "off", "switch"
        else:
            default = NONE_DEFAULTS[flag] if action.default is None else str(action.default)
            if action.choices:
                values = ", ".join(map(str, action.choices))
            elif action.dest in ACCEPTED_BITS:
                values = ", ".join(map(str, ACCEPTED_BITS[action.dest]))
            else:
                values = ACCEPTED[flag]
        rows.append(f"| `{flag}` | {default} | {values} | {_help(action)} |")
    return "\n".join(rows)


def _takes(action: argparse.Action) -> str:
    if _is_switch(action):
        return "switch"
    if action.choices:
        return ", ".join(map(str, action.choices))
    kind = getattr(action.type, "__name__", "str")
    if isinstance(action.nargs, int) and action.nargs > 1:  # e.g. --rampup-batch-size
        names = action.metavar if isinstance(action.metavar, tuple) else [kind] * action.nargs
        return " ".join(f"{kind} {name}" if name != kind else kind for name in names)
    return f"{kind} ..." if action.nargs in ("*", "+") else kind


def _default(action: argparse.Action) -> str:
    if _is_switch(action):
        return ""  # a switch is off until given
    if action.default is None or action.default == "":
        return ""
    return f"`{action.default}`"


def megatron_tables(parser: argparse.ArgumentParser) -> str:
    """One table per argument group of the Megatron-LM part of the parser: flag (and its
    other spellings), what it takes, its default and its help."""
    out = []
    for title, actions in _groups(parser).items():
        if title in (SDP4BIT_GROUP, NO_OP_GROUP, REFUSED_GROUP):
            continue
        out += [f"### {title[0].upper()}{title[1:]}", "",
                "| flag | takes | default | meaning |", "|---|---|---|---|"]
        out += [f"| {_names(a)} | {_takes(a)} | {_default(a)} | {_help(a)} |" for a in actions]
        out.append("")
    return "\n".join(out).rstrip()


def no_op_table(parser: argparse.ArgumentParser) -> str:
    """flag | why nothing is lost, for every flag of the no-op group."""
    rows = ["| flag | why nothing is lost |", "|---|---|"]
    for action in _groups(parser)[NO_OP_GROUP]:
        flag = action.option_strings[0]
        rows.append(f"| `{flag}` | {_cell(mf.NO_OP_FLAGS[flag])} |")
    return "\n".join(rows)


def refused_table(parser: argparse.ArgumentParser) -> str:
    """flag | why, and what to do instead, for every refused flag."""
    rows = ["| flag | why, and what to do instead |", "|---|---|"]
    for action in _groups(parser)[REFUSED_GROUP]:
        flag = action.option_strings[0]
        rows.append(f"| `{flag}` | {_cell(mf.REFUSED_FLAGS[flag][1])} |")
    return "\n".join(rows)


def megatron_lm_table() -> str:
    """Megatron-LM group | why refused | its flags that this trainer's parser lacks."""
    by_group: dict[str, list[str]] = {}
    for flag, group in MEGATRON_LM_FLAGS.items():
        by_group.setdefault(group, []).append(flag)
    rows = ["| Megatron-LM group | why refused | flags |", "|---|---|---|"]
    for group in sorted(by_group, key=str.lower):
        flags = sorted(by_group[group])
        plain = [f for f in flags if f not in mlm.FLAG_REASONS]
        if plain:
            rows.append(f"| {group} | {_cell(mlm.GROUP_REASONS[group])} | "
                        f"{', '.join(f'`{f}`' for f in plain)} |")
        for flag in flags:
            if flag in mlm.FLAG_REASONS:
                rows.append(f"| {group} | {_cell(mlm.FLAG_REASONS[flag])} | `{flag}` |")
    return "\n".join(rows)


def flag_list_source(megatron_lm: dict[str, str], ours: set[str], version: str) -> str:
    """The text of megatron_lm_flag_list.py: Megatron-LM's flags that ``ours`` lacks."""
    lines = [f'"""Megatron-LM\'s flags (megatron-core {version}\'s megatron/training/arguments.py) '
             "that", "this trainer's parser lacks, by Megatron-LM's argument group. Generated by",
             "``python -m dev.gen_flag_docs --megatron-lm``; do not edit.", '"""', "",
             "MEGATRON_LM_FLAGS: dict[str, str] = {"]
    for flag in sorted(set(megatron_lm) - ours):
        lines.append(f"    {flag!r}: {megatron_lm[flag]!r},")
    return "\n".join(lines + ["}", ""])


def render() -> dict[str, str]:
    """The generated regions of docs/flags.md, by name."""
    parser = build_parser()
    return {"sdp4bit": sdp4bit_table(parser), "megatron": megatron_tables(parser),
            "no-op": no_op_table(parser), "refused": refused_table(parser),
            "megatron-lm": megatron_lm_table()}


def update(page: str, regions: dict[str, str]) -> str:
    """``page`` with each region's text between its markers (each must appear once)."""
    for name, body in regions.items():
        begin, end = f"<!-- gen:{name}:begin -->", f"<!-- gen:{name}:end -->"
        if page.count(begin) != 1 or page.count(end) != 1:
            raise ValueError(f"docs/flags.md must hold {begin} and {end} once each")
        head, rest = page.split(begin, 1)
        _, tail = rest.split(end, 1)
        page = f"{head}{begin}\n{body}\n{end}{tail}"
    return page


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dev.gen_flag_docs", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only say whether docs/flags.md is current (exit 1 if not)")
    ap.add_argument("--megatron-lm", action="store_true",
                    help="first rewrite megatron_lm_flag_list.py from the installed Megatron-LM "
                    "parser (megatron-core 0.19.2's environment)")
    args = ap.parse_args(argv)
    if args.megatron_lm:
        from dev.megatron_lm_parser import megatron_lm_flags
        from megatron.core import package_info

        ours = {s for a in build_parser()._actions for s in a.option_strings}
        FLAG_LIST.write_text(flag_list_source(megatron_lm_flags(), ours,
                                              package_info.__version__.split("+")[0]), encoding="utf-8")
        print(f"{FLAG_LIST.relative_to(ROOT)} written; run without --megatron-lm for the page")
        return 0
    current = PAGE.read_text(encoding="utf-8")
    wanted = update(current, render())
    if args.check:
        if wanted != current:
            print("docs/flags.md is out of date: run python -m dev.gen_flag_docs", file=sys.stderr)
            return 1
        return 0
    if wanted != current:
        PAGE.write_text(wanted, encoding="utf-8")
        print("docs/flags.md updated")
    else:
        print("docs/flags.md is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
