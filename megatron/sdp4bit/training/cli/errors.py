"""The one error type of the command line, in a module of its own so that every part of
:mod:`megatron.sdp4bit.training.cli` can raise it without importing the others."""

from __future__ import annotations

__all__ = ["ArgumentsError"]


class ArgumentsError(ValueError):
    """A bad command line; the message is one line with the fix."""
