"""The command line's error type, the collection of its refusals and its warning line, in a
module of its own so that every part of :mod:`megatron.sdp4bit.training.cli` can use them
without importing the others.

[Note: every refusal in one message]
A launch that is refused should name everything there is to change, not one problem per
launch. Parsing collects the flags it refuses, and validation runs as named steps
(``validate.py``, ``installed.py``): each step still stops at its own first refusal, but a
refused step does not stop the others. A step that *needs* another (it reads what that one
fills in: ``--train-iters`` from ``--train-samples``, the data-parallel size, the defaults of
the model's sizes) is left out when that one was refused: it would read values that are not
there yet, or refuse the same thing again in other words. :class:`Refusals` runs the steps
and raises one :class:`ArgumentsError` for all of them: one refusal reads as it always did,
several as ``N problems with this command line; drop or replace each: (1) ...; (2) ...``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["ArgumentsError", "Refusal", "Refusals", "message_of", "warn"]


@dataclass(frozen=True)
class Refusal:
    """One refusal: ``text`` as a launch's whole message, ``listed`` (default ``text``) as
    one item of several (a refused flag reads ``--flag: why`` there)."""

    text: str
    listed: str = ""

    @property
    def item(self) -> str:
        return self.listed or self.text


def message_of(refusals: list[Refusal]) -> str:
    """One line for ``refusals`` (at least one)."""
    if len(refusals) == 1:
        return refusals[0].text
    return (f"{len(refusals)} problems with this command line; drop or replace each: "
            + "; ".join(f"({i}) {r.item}" for i, r in enumerate(refusals, 1)))


class ArgumentsError(ValueError):
    """A bad command line; the message is one line with the fix. ``refusals``: what it
    refuses, one entry per problem (one unless it collects several)."""

    def __init__(self, message: str, refusals: list[Refusal] | None = None) -> None:
        super().__init__(message)
        self.refusals = list(refusals) if refusals else [Refusal(message)]


class Refusals:
    """The refusals of one command line, collected step by step ([Note: every refusal in one
    message])."""

    def __init__(self) -> None:
        self.found: list[Refusal] = []
        self._refused: set[str] = set()

    def add(self, refusals: Iterable[Refusal]) -> None:
        self.found.extend(refusals)

    def run(self, name: str, step: Callable[[], None], needs: tuple[str, ...] = ()) -> None:
        """Run ``step``, recording its refusal under ``name``; left out (and counted as
        refused, for the steps that need it) when a step it ``needs`` was refused."""
        if self._refused.intersection(needs):
            self._refused.add(name)
            return
        try:
            step()
        except ArgumentsError as err:
            self.found.extend(err.refusals)
            self._refused.add(name)

    def raise_if_any(self) -> None:
        if self.found:
            raise ArgumentsError(message_of(self.found), self.found)


def warn(message: str) -> None:
    """One warning line on stderr, from rank 0 only (torchrun's ``$RANK``)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)
