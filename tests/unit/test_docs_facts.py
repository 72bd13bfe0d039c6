"""Numbers the docs state that the code decides: each is read from the page and compared with
the code, so a page that keeps an old number when the code changes fails here.

* bit widths: the format's widths (``config.SUPPORTED_BITS``) in design.md section 3, with
  qmax and the code range at each width; no page but flags.md (generated, checked by
  ``tests/unit/training/cli/test_flag_docs.py``) lists another set of widths;
  ``quantize()``'s padding unit ``lcm(group_size, 32 // bits)``, stated and measured;
* the replacement table's scopes: listed once (integration.md), every list of them complete,
  every count of them right;
* the replacement table (integration.md): every registered entry in a row, and each row's
  count of entries (the plug-in's ``megatron_lm.*`` targets among them) the code's;
* defaults: the keyword defaults of the comm and quantization signatures that comm.md and
  api.md quote, and the group sizes, bit widths and Hadamard block that design.md states
  as defaults;
* counts stated in words where the code has the list: CPU mode's changes, the seams.
"""

from __future__ import annotations

import ast
import fnmatch
import inspect
import math
import re
from pathlib import Path

import pytest

from megatron.sdp4bit.config import ACCEPTED_BITS, SUPPORTED_BITS, SDP4BitConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}


def _text(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def _number(token: str) -> int:
    return int(token) if token.isdigit() else WORDS[token.lower()]


def _bullet(text: str, label: str) -> str:
    """The Markdown bullet that starts with ``- **label**``, its continuation lines included."""
    start = text.index(f"- **{label}**")
    end = re.search(r"\n(?:- |\n)", text[start + 1:])
    return text[start: start + 1 + end.start()] if end else text[start:]


# ------------------------------------------------------------------ bit widths
# An enumeration of widths: "2, 4 or 8", "4 and 8", next to the word bit(s) or width(s).
_ENUM = r"\b(\d{1,2}(?:, \d{1,2})*,? (?:or|and) \d{1,2})"
_BIT_ENUMS = (re.compile(r"(?i)(?:\b|_)(?:bits?|widths?)\b[.*:]*[^.;|\n]{0,40}?" + _ENUM + r"\b"),
              re.compile(_ENUM + r"[ -]bits?\b"))


def bit_enumerations(text: str) -> list[tuple[int, ...]]:
    """Every enumeration of bit widths in ``text``, as sorted tuples (numbers above 16 are
    group sizes, not widths: left out)."""
    found = []
    for pattern in _BIT_ENUMS:
        for match in pattern.finditer(text):
            widths = tuple(sorted(int(n) for n in re.findall(r"\d+", match.group(1))))
            if max(widths) <= 16:
                found.append(widths)
    return found


def test_the_enumeration_reader_sees_the_old_statements():
    """The statements this test was written against are found, and would fail."""
    assert bit_enumerations("**Bits.** 4 and 8 wherever a width is configurable") == [(4, 8)]
    assert bit_enumerations("Bits 4 and 8 only; `group_size` positive") == [(4, 8)]
    assert bit_enumerations("inter hop at `config.inter_bits` (2, 4 or 8)") == [(2, 4, 8)]
    assert bit_enumerations("8-bit groups of 512 and 4-bit across") == []


def test_design_states_the_format_widths():
    section = _text("design.md").split("## 3. Numerics")[1].split("## 4.")[0]
    bits = _bullet(section, "Bits.")
    assert set(bit_enumerations(bits)) == {tuple(SUPPORTED_BITS)}, bits
    assert "config.SUPPORTED_BITS" in bits and "config.ACCEPTED_BITS" in bits
    from megatron.sdp4bit.quantization.format import qmax

    groups, codes = _bullet(section, "Groups."), _bullet(section, "Codes.")
    stated_qmax = {int(b): int(q) for q, b in re.findall(r"(\d+)\s+at\s+(\d+)\s+bits", groups)}
    assert stated_qmax == {b: qmax(b) for b in SUPPORTED_BITS}, groups
    stated_codes = {int(b): int(top) for top, b in re.findall(r"1\.\.(\d+)\s+at\s+(\d+)\s+bits", codes)}
    assert stated_codes == {b: 2 ** b - 1 for b in SUPPORTED_BITS}, codes


def test_no_page_lists_other_widths():
    """Outside flags.md (each flag's widths, generated from ``ACCEPTED_BITS``), a list of bit
    widths is the format's, ``SUPPORTED_BITS``: a page that narrows it states a fact that is
    flags.md's, and goes stale with it."""
    bad = []
    for page in PAGES:
        if page.name == "flags.md":
            continue
        for widths in bit_enumerations(page.read_text(encoding="utf-8")):
            if widths != tuple(SUPPORTED_BITS):
                bad.append(f"{page.name}: widths {widths}, the format's are {SUPPORTED_BITS} "
                           f"(each flag's: flags.md)")
    assert not bad, "\n".join(bad)
    # what flags.md states per flag narrows the format's widths, never widens them
    assert all(set(widths) <= set(SUPPORTED_BITS) for widths in ACCEPTED_BITS.values())


def test_quantize_pads_as_the_api_page_says():
    """api.md's padding unit, ``lcm(group_size, 32 // bits)``, is what ``quantize`` pads to
    at every width (group 4 tells it from ``lcm(group_size, 8)``: 16 at 2 bits)."""
    import torch

    from megatron.sdp4bit.quantization import quantize

    stated = set(re.findall(r"lcm\(group_size, ([^)]+)\)",
                            "".join(p.read_text(encoding="utf-8") for p in PAGES)))
    assert stated == {"32 // bits"}, stated
    for bits in SUPPORTED_BITS:
        q = quantize(torch.ones(1), bits, 4, stochastic=False, backend="torch")
        assert q.padded_numel == math.lcm(4, 32 // bits), bits


# ------------------------------------------------------------------ scopes
def _scopes():
    from megatron.sdp4bit.integration import patches

    return patches.SCOPES


def test_the_scopes_are_listed_once_in_full():
    scopes = _scopes()
    holds = _text("integration.md").split("An entry holds:")[1].split("\n\n")[0]
    listed = re.findall(r"`(\w+)`:\s", holds.split("its scope, who applies it (")[1])
    assert listed == list(scopes), listed
    bad = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        # a run of backticked scope names: "`seam`, `padding`, `checkpoint` and ..."
        names = "|".join(scopes)
        for run in re.finditer(rf"`(?:{names})`(?:,? (?:and |or )?`(?:{names})`){{2,}}", text):
            found = re.findall(r"`(\w+)`", run.group(0))
            if set(found) != set(scopes):
                bad.append(f"{page.name}: lists the scopes {found}, the code has {list(scopes)}: "
                           "cite integration.md's list instead")
        for count in re.findall(r"\b(\w+) scopes\b", text):
            if count.lower() in WORDS or count.isdigit():
                if _number(count) != len(scopes):
                    bad.append(f"{page.name}: '{count} scopes', the code has {len(scopes)}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the replacement table
def _registered():
    """Every entry of the table: the library's and the CUDA dry run's (registered when its
    tool is imported)."""
    from dev import cuda_dryrun  # noqa: F401
    from megatron.sdp4bit.integration import patches

    return patches.all_replacements()


def _table_rows() -> list[tuple[str, str]]:
    """(entries cell, target cell) of each row of integration.md's replacement table."""
    text = _text("integration.md").split("| entries (scope) | target |")[1]
    rows = []
    for line in text.splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows.append((cells[0], cells[1]))
    return rows


def _groups(cell: str) -> list[tuple[list[str], int | None]]:
    """The entries cell as groups: the backticked names before each "(N" count, and the
    names with no count after them (each one entry)."""
    groups, names = [], []
    for match in re.finditer(r"`([^`]+)`|\((\d+)[;)]", cell):
        if match.group(1):
            names.append(match.group(1))
        else:
            groups.append((names, int(match.group(2))))
            names = []
    groups += [([n], None) for n in names]
    return groups


def test_every_entry_is_in_the_table_with_the_count_the_code_has():
    entries = _registered()
    rows = _table_rows()
    patterns = [p for cell, _ in rows for names, _ in _groups(cell) for p in names]
    exact = {p for p in patterns if "*" not in p}

    def row_pattern(name: str) -> str | None:
        if name in exact:
            return name
        matching = [p for p in patterns if "*" in p and fnmatch.fnmatchcase(name, p)]
        return max(matching, key=len) if matching else None

    owner = {e.name: row_pattern(e.name) for e in entries}
    missing = sorted(n for n, p in owner.items() if p is None)
    assert not missing, f"entries in no row of integration.md's replacement table: {missing}"
    bad = []
    for cell, _ in rows:
        for names, count in _groups(cell):
            have = sorted(n for n, p in owner.items() if p in names)
            if count is None and len(have) != 1:
                bad.append(f"{names[0]}: {len(have)} entries, the row names one")
            elif count is not None and len(have) != count:
                bad.append(f"{', '.join(names)}: the row says {count} entries, the code has "
                           f"{len(have)}: {have}")
    assert not bad, "\n".join(bad)


def test_the_plugin_row_names_every_target():
    """The ``megatron_lm.*`` row's target cell names every attribute the plug-in replaces
    (whatever their number: the count is checked above)."""
    from megatron.sdp4bit.integration import patches

    (cell,) = [target for entries, target in _table_rows() if "`megatron_lm.*`" in entries]
    named = {n.split(".")[-1] for n in re.findall(r"`([^`]+)`", cell)}
    plugin = [e for e in _registered() if patches.MEGATRON_LM in e.scopes
              and e.name.startswith("megatron_lm.") and e.name != "megatron_lm.typing.override"]
    assert plugin
    assert {e.attribute for e in plugin} == named, named


# ------------------------------------------------------------------ defaults
def _calls(text: str) -> list[tuple[str, dict[str, str]]]:
    """``name(... key=value ...)`` in backticks: the name and its top-level ``key=value``
    pairs (a call nested in the arguments is its own entry)."""
    out = []
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # examples, not signatures
    for code in re.findall(r"`([^`]+)`", text):
        for start in re.finditer(r"\b(\w+)\(", code):
            depth, i = 1, start.end()
            while i < len(code) and depth:
                depth += {"(": 1, ")": -1}.get(code[i], 0)
                i += 1
            args = code[start.end(): i - 1]
            flat = re.sub(r"\([^()]*\)", "", args)
            out.append((start.group(1), dict(re.findall(r"(\w+)=([^,\s]+)", flat))))
    return out


def _public_callables() -> dict[str, object]:
    import megatron.sdp4bit.comm as comm
    import megatron.sdp4bit.quantization as quantization

    return {name: getattr(module, name) for module in (comm, quantization)
            for name in getattr(module, "__all__", dir(module)) if not name.startswith("_")}


def _default_mismatches(page: str, text: str) -> tuple[list[str], int]:
    """The quoted ``key=literal`` of comm and quantization signatures in ``text`` (outside code
    blocks, whose calls are examples) that are not the code's defaults, and how many were read."""
    known = _public_callables()
    seen, bad = 0, []
    for name, pairs in _calls(text):
        if name not in known or not pairs:
            continue
        params = inspect.signature(known[name]).parameters
        for key, value in pairs.items():
            if key not in params:
                bad.append(f"{page}: {name}() has no parameter {key}")
                continue
            try:
                stated = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                continue  # a name (ReduceOp.SUM), not a literal
            if params[key].default is not inspect.Parameter.empty:
                seen += 1
                if stated != params[key].default:
                    bad.append(f"{page}: {name}({key}={value}), the code's default is "
                               f"{params[key].default!r}")
    return bad, seen


@pytest.mark.parametrize("page, quoted", [("api.md", 3), ("comm.md", 20)])
def test_quoted_signature_defaults_are_the_code(page, quoted):
    bad, seen = _default_mismatches(page, _text(page))
    assert not bad, "\n".join(bad)
    assert seen >= quoted, seen  # the page's signatures were read


def test_a_stale_default_is_caught():
    from megatron.sdp4bit.comm import GradientQuantConfig

    default = GradientQuantConfig().intra_group_size
    planted = (f"| `GradientQuantConfig(intra_bits=8, intra_group_size={default + 2})` | x |\n"
               "```python\nGradientQuantConfig(intra_group_size=64)  # an example\n```\n")
    assert _default_mismatches("x.md", planted) == ([
        f"x.md: GradientQuantConfig(intra_group_size={default + 2}), the code's default is "
        f"{default}"], 2)


_D = SDP4BitConfig()
# design.md's statements of the defaults: (pattern, the values its groups must have).
DEFAULT_SITES = [
    (r"\*\*qWD\*\*: all-gather of (\d+)-bit quantized weight \*differences\*, groups of (\d+)",
     (_D.weight_quantization_bits, _D.wq_group_size)),
    (r"(\d+)-bit inside a node in groups of (\d+) and (\d+)-bit across nodes in groups of "
     r"(\d+) \(the defaults",
     (_D.gradient_quantization_bits_intra, _D.gq_group_size_intra,
      _D.gradient_quantization_bits_inter, _D.gq_group_size_inter)),
    (r"after a (\d+)-point block Hadamard transform", (_D.hadamard_block_size,)),
    (r"q_r = Q4\(d_r\)\s+(\d+)-bit, groups of (\d+)", (_D.weight_quantization_bits,
                                                      _D.wq_group_size)),
    (r"Hadamard \((\d+)-point blocks\), (\d+)-bit groups of (\d+)",
     (_D.hadamard_block_size, _D.gradient_quantization_bits_intra, _D.gq_group_size_intra)),
    (r"block of H = (\d+) values", (_D.hadamard_block_size,)),
]


@pytest.mark.parametrize("pattern, values", DEFAULT_SITES, ids=lambda x: str(x)[:40])
def test_design_states_the_defaults(pattern, values):
    matches = re.findall(pattern, _text("design.md"))
    assert matches, f"design.md no longer says {pattern!r}: update DEFAULT_SITES"
    for match in matches:
        match = (match,) if isinstance(match, str) else match
        assert tuple(map(int, match)) == values, (pattern, match, values)


# ------------------------------------------------------------------ counts in words
def test_cpu_mode_lists_every_change():
    """integration.md's numbered list of what CPU mode changes has the items of
    cpu_mode.py's docstring, and api.md states no count of its own."""
    from megatron.sdp4bit.integration import cpu_mode

    in_code = re.findall(r"^(\d+)\. ", cpu_mode.__doc__, flags=re.M)
    section = _text("integration.md").split("## CPU mode (`cpu_mode.py`)")[1].split("\n## ")[0]
    in_doc = re.findall(r"^(\d+)\. ", section, flags=re.M)
    assert in_doc == in_code, (in_doc, in_code)
    assert not re.search(r"\b(\w+) documented changes", _text("api.md"))


def test_the_seams_are_counted_right():
    from megatron.sdp4bit.integration import patches

    seams = [e for e in _registered() if patches.SEAM in e.scopes]
    (count,) = re.findall(r"enters through (\w+) seams \(a fourth with TP > 1\)",
                          _text("integration.md"))
    assert _number(count) + 1 == len(seams), (count, [e.name for e in seams])


def test_flag_defaults_stated_in_prose_are_the_parser_s():
    """"`--flag` (default N)" outside flags.md (which is generated from the parser) states
    the parser's default."""
    from megatron.sdp4bit.training.cli.arguments import build_parser

    defaults = {s: a.default for a in build_parser()._actions for s in a.option_strings}
    seen, bad = 0, []
    for page in PAGES:
        if page.name == "flags.md":
            continue
        text = page.read_text(encoding="utf-8")
        for flag, value in re.findall(r"`(--[a-z0-9-]+)`(?: [A-Z]+)? \(defaults? (\d[\d.]*)",
                                      text):
            seen += 1
            if flag not in defaults or defaults[flag] is None \
                    or float(value) != float(defaults[flag]):
                bad.append(f"{page.name}: {flag} (default {value}), the parser's is "
                           f"{defaults.get(flag)!r}")
    assert not bad, "\n".join(bad)
    assert seen >= 2, seen
