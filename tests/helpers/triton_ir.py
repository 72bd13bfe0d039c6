"""Find 32-bit offset arithmetic in a kernel's Triton IR (TTIR text), for the compile check.

[Note: which offsets must be 64-bit]
A wire buffer of a production bucket exceeds 2**31 bytes (a 2.7B-parameter bucket at TP 1 on
8-GPU nodes: (n_in - 1) x message bytes >= 2**31), so an address computed in int32 wraps and
the kernel reads the wrong message. Triton types a scalar kernel argument below 2**31, a loop
counter and ``tl.arange`` as i32, and does arithmetic in i32 until something i64 joins it.

The rule checked here: in the computation of every pointer offset (the second operand of
each ``tt.addptr``, followed back through its operands), no i32 ``muli`` / ``addi`` / ``subi``
/ ``shli`` may take a value that is not bounded by compile-time constants. Bounded = an
``arith.constant``, a ``tt.make_range`` (its bounds are constexprs), or shape ops and
arithmetic on bounded values only. A kernel argument, a loop counter, a program id or a
loaded value is unbounded: ``k * msg_nbytes`` in i32, with ``k`` the loop over messages, is
exactly the overflow. Sign extensions are followed through, so ``(a * b).to(int64)`` is
still flagged; ``a.to(int64) * b`` is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RISKY = {"arith.muli", "arith.addi", "arith.subi", "arith.shli"}
# Ops whose result is bounded when all their operands are.
_PASS_THROUGH = {"arith.extsi", "arith.extui", "arith.trunci", "tt.expand_dims", "tt.broadcast",
                 "tt.splat", "tt.reshape", "arith.divsi", "arith.divui", "arith.remsi",
                 "arith.remui", "arith.muli", "arith.addi", "arith.subi", "arith.shli",
                 "arith.andi", "arith.ori", "arith.xori", "arith.select", "arith.index_cast"}

_DEF = re.compile(r"^\s*(%[\w.$-]+(?:\s*,\s*%[\w.$-]+)*)\s*=\s*([\w.]+|\"[\w.]+\")(.*)$")
_VALUE = re.compile(r"%[\w.$-]+")


@dataclass(frozen=True)
class _Op:
    name: str
    operands: tuple[str, ...]
    text: str  # the defining line, without its location

    @property
    def is_i32(self) -> bool:
        # the result type is the last type of the line: "... : i32" or "... : tensor<..xi32>"
        types = self.text.rsplit(":", 1)[-1]
        return bool(re.search(r"\bi32\b|xi32>", types))


def _strip_loc(line: str) -> str:
    return re.sub(r"\s*loc\(.*$", "", line)


def parse(ttir: str) -> tuple[dict[str, _Op], list[tuple[str, str]]]:
    """``(definitions by SSA name, [(addptr line, offset value)])`` of one module's text.

    Block arguments (function arguments, loop counters, loop-carried values, reduction
    arguments) have no definition: they are unbounded leaves.
    """
    defs: dict[str, _Op] = {}
    addptrs: list[tuple[str, str]] = []
    for raw in ttir.splitlines():
        line = _strip_loc(raw)
        match = _DEF.match(line)
        if not match:
            continue
        results, name, rest = match.groups()
        name = name.strip('"')
        if name == "scf.for":  # its results are loop-carried values: unbounded
            continue
        operands = tuple(_VALUE.findall(rest.split(":", 1)[0] if name != "arith.constant"
                                        else ""))
        for result in re.findall(r"%[\w.$-]+", results):
            defs[result] = _Op(name, operands, line.strip())
        if name == "tt.addptr":
            addptrs.append((line.strip(), operands[1]))
    return defs, addptrs


def _bounded(value: str, defs: dict[str, _Op], memo: dict[str, bool]) -> bool:
    if value in memo:
        return memo[value]
    memo[value] = False  # cycles (none in SSA outside loops) count as unbounded
    op = defs.get(value)
    if op is None:
        result = False  # a block argument
    elif op.name in ("arith.constant", "tt.make_range"):
        result = True
    elif op.name in _PASS_THROUGH:
        result = all(_bounded(v, defs, memo) for v in op.operands)
    else:
        result = False
    memo[value] = result
    return result


def offset_violations(ttir: str) -> list[str]:
    """The i32 arithmetic lines on unbounded values found in pointer offsets (see the Note);
    raises ``ValueError`` when the text holds no ``tt.addptr`` (the parser no longer matches
    Triton's IR format, so an empty answer would prove nothing)."""
    defs, addptrs = parse(ttir)
    if not addptrs:
        raise ValueError("no tt.addptr found: the TTIR format changed, update the parser")
    memo: dict[str, bool] = {}
    found: list[str] = []
    seen: set[str] = set()
    stack = [offset for _, offset in addptrs]
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        op = defs.get(value)
        if op is None or op.name == "tt.addptr":  # pointer chains are checked on their own
            continue
        if op.name in _RISKY and op.is_i32 and not all(_bounded(v, defs, memo)
                                                       for v in op.operands):
            found.append(op.text)
        stack.extend(op.operands)
    return sorted(set(found))
