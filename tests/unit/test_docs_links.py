"""Every relative link of README.md and docs/*.md points to a file of the repository, and
every ``#anchor`` to a heading of the page it names.

Links are read as GitHub renders them: ``[text](target)`` and ``![alt](target)`` outside
fenced code blocks and inline code; web addresses are not followed. An anchor is GitHub's
slug of a heading: lower case, everything but letters, digits, ``_``, ``-`` and spaces
dropped, spaces made ``-``; a repeated heading gets ``-1``, ``-2``...
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """``page:line: target (why)`` for every relative link that does not resolve."""
    bad = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif root.resolve() not in [dest, *dest.parents]:
                bad.append(f"{where} (outside the repository)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{where} (no heading with that anchor)")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page)


def test_the_checker_sees_broken_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Top\n## The suite's time, and `how`\n## Top\n```\n# not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#the-suites-time-and-how) [dup](docs/a.md#top-1) [web](https://x.y/z)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#not-a-heading) [self](#top)\n"
        "`[in code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n![img](docs/a.png)\n")
    assert anchors(tmp_path / "docs" / "a.md") == {"top", "the-suites-time-and-how", "top-1"}
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:2: docs/b.md (no such file)",
        "README.md:2: docs/a.md#not-a-heading (no heading with that anchor)",
        "README.md:2: #top (no heading with that anchor)",
        "README.md:7: docs/a.png (no such file)",
    ]
