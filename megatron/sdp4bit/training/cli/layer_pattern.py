"""A per-layer 0/1 pattern as Megatron-LM writes it (``--moe-layer-freq``), parsed in bounded
time and memory, never evaluated.

[Note: the layer-pattern grammar]
Megatron-LM's ``moe_freq_type`` takes an integer N (one MoE layer every N layers: layer i is
a MoE layer when ``i % N == 0``, megatron-core's reading) or a Python list expression over
the characters ``0-9 [ ] ( ) , + *`` (``"[1,0,1]"``, ``"([1]*3+[0]*1)*3"``), which it hands to
``eval``. The characters alone do not bound the work: ``[1]*9**9**9`` is 9^(9^9) (``**`` is two
allowed characters) and never finishes, and ``[1]*10**8`` builds a list of 10^8 items (1.2 GB)
before anything can say it is too long. This module reads the same expressions with a
grammar of its own:

    expr   := term ('+' term)*
    term   := atom ('*' atom)*
    atom   := INTEGER | '[' [expr (',' expr)* [',']] ']' | '(' expr ')'

A value is an integer or a list of integers; ``+`` adds integers or concatenates lists;
``*`` multiplies integers or repeats a list by an integer (either side), as Python does.
Lengths and integers are computed before any list is built and refused above
:data:`MAX_LAYERS`; the text is refused above :data:`MAX_CHARS` characters and
:data:`MAX_DEPTH` nested brackets; ``**`` (a power) is not part of the grammar. So every
input is answered after one pass over at most 4,096 characters.
"""

from __future__ import annotations

import re

__all__ = ["MAX_CHARS", "MAX_DEPTH", "MAX_LAYERS", "PatternError", "parse_layer_pattern"]

MAX_LAYERS = 1 << 16  # no list or integer of a pattern exceeds this (a model's layers)
MAX_CHARS = 4096
MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")


class PatternError(ValueError):
    """A pattern outside the grammar or the bounds; the message says which."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.tokens: list[str | int] = []
        for match in _TOKEN.finditer(text):
            digits, char = match.groups()
            if digits is not None:
                if len(digits) > 6 or int(digits) > MAX_LAYERS:
                    raise PatternError(f"the number {digits[:12]}{'...' if len(digits) > 12 else ''}"
                                       f" exceeds {MAX_LAYERS}")
                self.tokens.append(int(digits))
            elif char is not None and not char.isspace():
                if char not in "[](),+*":
                    raise PatternError(f"{char!r} is not part of a pattern (digits and "
                                       "[ ] ( ) , + * only)")
                self.tokens.append(char)
        self.at = 0
        self.depth = 0

    def peek(self) -> str | int | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str | int:
        token = self.peek()
        if token is None:
            raise PatternError("it ends too early")
        if expected is not None and token != expected:
            raise PatternError(f"{expected!r} expected where {token!r} is")
        self.at += 1
        return token


# A value while parsing: an integer, or a list kept as its items (bounded by MAX_LAYERS).
_Value = int | list


def _size(value: _Value) -> int:
    return len(value) if isinstance(value, list) else value


def _checked(n: int) -> int:
    if n > MAX_LAYERS:
        raise PatternError(f"it gives {n} (layers or a count), more than {MAX_LAYERS}")
    return n


def _expr(r: _Reader) -> _Value:
    value = _term(r)
    while r.peek() == "+":
        r.take()
        right = _term(r)
        if isinstance(value, list) != isinstance(right, list):
            raise PatternError("'+' joins two lists or two numbers, not a list and a number")
        _checked(_size(value) + _size(right))
        value = value + right
    return value


def _term(r: _Reader) -> _Value:
    value = _atom(r)
    while r.peek() == "*":
        r.take()
        if r.peek() == "*":
            raise PatternError("'**' (a power) is not accepted: write the count out")
        right = _atom(r)
        if isinstance(value, list) and isinstance(right, list):
            raise PatternError("'*' repeats a list by a number, not by a list")
        _checked(_size(value) * _size(right))
        if isinstance(right, list):
            value, right = right, value
        value = value * right
    return value


def _atom(r: _Reader) -> _Value:
    token = r.take()
    if isinstance(token, int):
        return token
    if token not in "[(":
        raise PatternError(f"{token!r} where a number, '[' or '(' is expected")
    r.depth += 1
    if r.depth > MAX_DEPTH:
        raise PatternError(f"more than {MAX_DEPTH} nested brackets")
    if token == "(":
        value = _expr(r)
        if r.peek() == ",":
            raise PatternError("a ',' inside '( )' makes a tuple: use '[ ]' for a list")
        r.take(")")
    else:
        value = []
        while r.peek() != "]":
            item = _expr(r)
            if isinstance(item, list):
                raise PatternError("a list inside a list: the pattern is one flat list")
            value.append(item)
            _checked(len(value))
            if r.peek() != "]":
                r.take(",")
        r.take("]")
    r.depth -= 1
    return value


def parse_layer_pattern(text: str) -> list[int]:
    """The flat list a Megatron-LM pattern expression (``"([1]*3+[0]*1)*3"``) gives, each item
    0 or 1; raises :class:`PatternError` (one line) for anything else, in bounded time and
    memory ([Note: the layer-pattern grammar])."""
    if len(text) > MAX_CHARS:
        raise PatternError(f"it is {len(text)} characters long, more than {MAX_CHARS}")
    reader = _Reader(text)
    value = _expr(reader)
    if reader.peek() is not None:
        raise PatternError(f"{reader.peek()!r} after the end of the expression")
    if not isinstance(value, list):
        raise PatternError("it gives a number, not a list")
    if any(x not in (0, 1) for x in value):
        raise PatternError("its items must be 0 (a dense layer) or 1 (a MoE layer)")
    return value
