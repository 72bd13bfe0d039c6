"""Every Python block of README.md and docs/*.md is code that works as written.

A fenced block opened with ```` ```python ```` is one of two kinds (docs/testing.md, "The
docs' code"):

* **an excerpt**: the line before the fence is ``<!-- excerpt: PATH -->`` and PATH is a file
  the suite runs (``EXCERPT_SOURCES``). The block's lines, split at lines that are exactly
  ``...`` (lines left out), must be runs of consecutive lines of PATH, verbatim and in order.
  What the suite runs is then what the page shows.
* **a snippet**: it must compile, and every module it imports must import and hold the names
  it takes from it. A snippet may not install SDP4Bit (``install_sdp4bit(``,
  ``sdp4bit_padding(``): a loop that does is only correct as a whole (the finalize hook, the
  iteration hook), so that code is quoted from ``examples/own_loop.py``, and an excerpt that
  installs shows the finalize hook and ``handle.set_iteration`` too (``WITH_INSTALL``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXCERPT = re.compile(r"<!--\s*excerpt:\s*(\S+)\s*-->")
# A file a page may quote -> the test that runs it.
EXCERPT_SOURCES = {"examples/own_loop.py": "tests/e2e/test_own_loop_example.py"}
INSTALLS = re.compile(r"\b(install_sdp4bit|sdp4bit_padding)\(")
# What an excerpt that installs SDP4Bit must show with it (a loop without them is refused).
WITH_INSTALL = ("config.finalize_model_grads_func = ", "handle.set_iteration(")
# Modules that only later megatron-core wheels ship -> the test that imports them there. On an
# older release (pass 1's 0.16.1) a snippet importing them is checked to compile, not to import.
LATER_RELEASE_MODULES = {"megatron.training": "tests/e2e/test_megatron_lm_trainer.py"}


def _later_release_module(name: str) -> bool:
    from megatron.core import package_info

    major, minor = (int(x) for x in package_info.__version__.split(".")[:2])
    return (major, minor) < (0, 17) and any(
        name == m or name.startswith(m + ".") for m in LATER_RELEASE_MODULES)


def _bridged(name: str):
    """Where a release ships one of LATER_RELEASE_MODULES: the Python 3.11 bridge that
    ``megatron_lm.enable()`` applies first (a snippet importing them calls it before)."""
    if not any(name == m or name.startswith(m + ".") for m in LATER_RELEASE_MODULES):
        return contextlib.nullcontext()
    from megatron.sdp4bit.integration import megatron_lm, patches

    return patches.applied([megatron_lm.PYTHON_312])


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str | None, str]]:
    """(line number of the fence, the excerpt's source or None, the block's code) of every
    ```python block."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if re.match(r"^```python\s*$", lines[i]):
            before = next((x for x in reversed(lines[:i]) if x.strip()), "")
            m = EXCERPT.fullmatch(before.strip())
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append((i + 1, m.group(1) if m else None, "\n".join(lines[i + 1:end])))
            i = end
        elif lines[i].lstrip().startswith(("```", "~~~")):  # another fenced block: skip it
            fence = lines[i].lstrip()[:3]
            i = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence),
                     len(lines))
        i += 1
    return out


def excerpt_problem(code: str, source: str, root: Path = ROOT) -> str | None:
    """Why ``code`` is not a verbatim excerpt of ``source`` (None if it is)."""
    if source not in EXCERPT_SOURCES:
        return f"{source} is not a file the suite runs ({sorted(EXCERPT_SOURCES)})"
    lines = (root / source).read_text(encoding="utf-8").splitlines()
    parts, part = [], []
    for line in code.splitlines():
        if line == "...":
            parts.append(part)
            part = []
        else:
            part.append(line)
    parts.append(part)
    start = 0
    for part in parts:
        if not part:
            return "an empty part between '...' lines"
        at = next((k for k in range(start, len(lines) - len(part) + 1)
                   if lines[k:k + len(part)] == part), None)
        if at is None:
            return f"these lines are not in {source} (verbatim, after the previous part): " \
                   f"{part[0]!r}..."
        start = at + len(part)
    missing = [x for x in WITH_INSTALL if INSTALLS.search(code) and x not in code]
    return f"installs SDP4Bit without showing {missing}" if missing else None


def snippet_problem(code: str) -> str | None:
    """Why ``code`` would not run as written, as far as compiling and importing tell."""
    if INSTALLS.search(code):
        return "installs SDP4Bit outside an excerpt of examples/own_loop.py"
    try:
        tree = ast.parse(code)
        compile(tree, "<snippet>", "exec")
    except SyntaxError as err:
        return f"does not compile: {err}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as err:
                    return f"import {alias.name}: {err}"
        elif isinstance(node, ast.ImportFrom):
            if _later_release_module(node.module or ""):
                continue
            try:
                with _bridged(node.module or ""):
                    module = importlib.import_module(node.module or "")
            except ImportError as err:
                return f"from {node.module} import ...: {err}"
            for alias in node.names:
                if not hasattr(module, alias.name):
                    try:
                        importlib.import_module(f"{node.module}.{alias.name}")
                    except ImportError:
                        return f"{node.module} has no {alias.name}"
    return None


def _cases():
    for page in pages():
        for line, source, code in python_blocks(page.read_text(encoding="utf-8")):
            yield pytest.param(source, code, id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("source,code", list(_cases()))
def test_python_block_runs_as_written(source, code):
    problem = excerpt_problem(code, source) if source else snippet_problem(code)
    assert problem is None, problem


def test_the_api_page_quotes_the_install_from_the_example():
    quoted = [source for _, source, code in python_blocks(
        (ROOT / "docs" / "api.md").read_text(encoding="utf-8")) if "install_sdp4bit(" in code]
    assert quoted == ["examples/own_loop.py"]
    for test in EXCERPT_SOURCES.values():  # each source is really run by the suite
        assert (ROOT / test).is_file(), test


def test_the_checker_catches_what_would_not_run(tmp_path):
    source = "examples/own_loop.py"
    lines = (ROOT / source).read_text(encoding="utf-8").splitlines()
    install = next(i for i, x in enumerate(lines) if x.startswith("handle = install_sdp4bit("))
    hook = lines[install - 2]  # the finalize hook, two lines above
    assert hook.startswith("config.finalize_model_grads_func")
    iteration = next(i for i, x in enumerate(lines) if "handle.set_iteration(" in x)
    good = "\n".join(lines[install - 2:install + 1] + ["..."] + lines[iteration:iteration + 1]
                     + ["..."] + lines[-2:])
    assert excerpt_problem(good, source) is None
    # what the docs had: the install without the hook (verbatim lines, but refused as written)
    assert excerpt_problem("\n".join(lines[install - 1:install + 1] + ["..."]
                                     + lines[iteration:iteration + 1]), source) == \
        "installs SDP4Bit without showing ['config.finalize_model_grads_func = ']"
    # lines that are not the file's, consecutive, in order
    assert "not in" in excerpt_problem("\n".join([lines[install - 3], lines[install]]), source)
    assert "not in" in excerpt_problem(lines[install].replace("sdp4bit)", "config)"), source)
    assert "not in" in excerpt_problem("\n".join(lines[-2:] + ["..."] + lines[install:install + 1]),
                                       source)  # out of order
    assert "not a file the suite runs" in excerpt_problem(lines[0], "examples/other.py")
    assert snippet_problem("handle = install_sdp4bit([ddp], optimizer, config)") == \
        "installs SDP4Bit outside an excerpt of examples/own_loop.py"
    assert snippet_problem("from megatron.sdp4bit.comm import build_topology, nothing_here") \
        == "megatron.sdp4bit.comm has no nothing_here"
    assert snippet_problem("import megatron.sdp4bit.no_such_module").startswith(
        "import megatron.sdp4bit.no_such_module:")
    assert snippet_problem("x = (").startswith("does not compile")
    assert snippet_problem("from megatron.sdp4bit.quantization import quantize\nq = quantize") \
        is None
    page = ("text\n\n<!-- excerpt: examples/own_loop.py -->\n```python\na\n```\n"
            "```bash\n```python\n```\n```python\nb\n```\n")
    assert python_blocks(page) == [(4, "examples/own_loop.py", "a"), (10, None, "b")]
