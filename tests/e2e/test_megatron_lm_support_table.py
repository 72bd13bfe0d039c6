"""docs/megatron_lm.md's support table, held to the plug-in's real checks (no launch).

Every row gives Megatron-LM flags and what the plug-in does with them (the page says how to
read it): a "refused" row must stop Megatron-LM's ``parse_and_validate_args``, with the
plug-in on, in one line naming what the row names, before Megatron-LM's own checks; every
other row must pass the plug-in's checks (``config_of_megatron_lm_args`` on the parsed flags),
and a "supported" row names a test whose launches carry its flags (read from the test's
source, with the module-level names it uses). A row that says more than the code does fails
here.

Marked ``megatron_lm``: Megatron-LM's parser is megatron-core 0.19.2's (the second pass).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tests.helpers.megatron_lm_launch import MEGATRON_LM_FLAGS

pytestmark = pytest.mark.megatron_lm

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "megatron_lm.md"
PLUGIN_TESTS = "test_megatron_lm_trainer.py"
# the model and data flags of the plug-in's tests, without the settings the rows give
BASE = [f for f in MEGATRON_LM_FLAGS if f not in ("--bf16", "--use-distributed-optimizer")]
# Every launch that a "supported" row names quantizes with these; the plug-in's check of the
# row covers them, the source check the rest.
SET_UP = {"--use-distributed-optimizer", "--bf16", "--quantized-weights", "--quantized-gradients"}
STATUSES = ("supported", "supported, in our trainer", "not tested here")


def _rows() -> list[dict[str, str]]:
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("## What is supported\n", 1)[1].split("\n## ", 1)[0]
    header = "| setting | flags | the plug-in | tested by |"
    assert header in section, "the support table's header changed"
    rows = []
    for line in section.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 4, line
        flags = re.fullmatch(r"`([^`]+)`", cells[1])
        assert flags, f"flags cell is not one code span: {line}"
        rows.append({"setting": cells[0], "flags": flags.group(1), "status": cells[2],
                     "test": cells[3]})
    return rows


ROWS = _rows()


def _argv(flags: str, tmp_path) -> list[str]:
    return ["megatron_lm_gpt.py", *BASE,
            *[str(tmp_path / "dir") if f == "DIR" else f for f in flags.split()]]


@pytest.fixture
def plugin(monkeypatch):
    """The plug-in on, in this process, as the launcher leaves it before the script runs;
    Megatron-LM parses and validates before it starts torch.distributed."""
    from megatron.sdp4bit.integration import megatron_lm

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    megatron_lm.enable()
    try:
        yield megatron_lm
    finally:
        megatron_lm.disable()


def test_the_table_has_rows_of_every_kind():
    statuses = {row["status"].split(",")[0] for row in ROWS}
    assert statuses == {"supported", "refused", "not tested here"}, statuses
    for row in ROWS:
        assert row["status"] in STATUSES or re.fullmatch(r"refused, naming `[^`]+`",
                                                         row["status"]), row
        assert (row["test"] == "—") == (not row["status"].startswith("supported")), row


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"].startswith("refused")],
                         ids=lambda r: r["setting"][:40])
def test_a_refused_row_is_refused_in_one_line_naming_it(row, plugin, monkeypatch, capsys,
                                                        tmp_path):
    if "nvidia-resiliency-ext" in row["status"]:  # what the row is about: the package absent
        assert importlib.util.find_spec("nvidia_resiliency_ext") is None
    named = re.fullmatch(r"refused, naming `([^`]+)`", row["status"]).group(1)
    monkeypatch.setattr(sys, "argv", _argv(row["flags"], tmp_path))
    from megatron.training.arguments import parse_and_validate_args

    with pytest.raises(SystemExit) as stop:
        parse_and_validate_args()
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron_lm_gpt.py: error: "), err
    assert named in lines[0], (named, lines[0])
    assert "arguments" not in out  # before Megatron-LM's dump of its arguments


@pytest.mark.parametrize("row", [r for r in ROWS if not r["status"].startswith("refused")],
                         ids=lambda r: r["setting"][:40])
def test_a_row_that_is_not_refused_passes_the_plugins_checks(row, plugin, monkeypatch,
                                                              tmp_path):
    monkeypatch.setattr(sys, "argv", _argv(row["flags"], tmp_path))
    from megatron.training.arguments import parse_args

    config = plugin.config_of_megatron_lm_args(parse_args())
    assert config.enabled


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
    return names


def _source_of(path: Path, function: str) -> str:
    """The test function's source (decorators included) and that of every module-level name
    of its file it uses, and theirs in turn."""
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    names = _top_level(tree)
    assert function in names, f"{path.name} has no {function}"
    seen, todo, parts = set(), [function], []
    while todo:
        name = todo.pop()
        if name in seen or name not in names:
            continue
        seen.add(name)
        node = names[name]
        for decorator in getattr(node, "decorator_list", []):
            parts.append(ast.get_source_segment(text, decorator))
        parts.append(ast.get_source_segment(text, node))
        todo += [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    return "\n".join(parts)


@pytest.mark.parametrize("row", [r for r in ROWS if r["status"].startswith("supported")],
                         ids=lambda r: r["setting"][:40])
def test_a_supported_row_names_a_test_that_launches_its_flags(row):
    test = re.fullmatch(r"`(test_\w+\.py)::(test_\w+)`", row["test"])
    assert test, row
    file, function = test.groups()
    assert (file == PLUGIN_TESTS) == (row["status"] == "supported"), (
        f"{row['setting']}: 'supported' names a test of the plug-in ({PLUGIN_TESTS}), "
        "'supported, in our trainer' one of our trainer")
    source = _source_of(ROOT / "tests" / "e2e" / file, function)
    missing = [f for f in row["flags"].split()
               if f not in SET_UP and f != "DIR" and not f.isdigit() and f not in source]
    assert not missing, f"{row['setting']}: {file}::{function} never passes {missing}"


def test_the_source_check_follows_module_names_and_sees_a_flag_not_passed():
    """The source the check above reads: the dense test's own flags and those of the module
    constants it uses (``SDP4BIT_FLAGS``), not the MoE test's."""
    source = _source_of(ROOT / "tests" / "e2e" / PLUGIN_TESTS,
                        "test_megatron_lm_trainer_trains_saves_and_resumes_with_sdp4bit")
    assert "--log-memory-to-tensorboard" in source and "--gradient-error-feedback" in source
    assert "--moe-token-dispatcher-type" not in source
