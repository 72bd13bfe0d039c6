"""Command-line flags generated from :class:`SDP4BitConfig`, so each flag lives in one place.

Beside ``config.py`` (no layer): the trainer's parser (``training/cli/arguments.py``) and
Megatron-LM's, through the plug-in (``integration/megatron_lm.py``), add the same group.

Field ``foo_bar`` becomes ``--foo-bar``; the field's docstring is the flag's help; a ``bool``
field is a ``store_true`` switch, a ``Literal`` field offers its values as choices and
``int | None`` takes an integer (``None`` when absent). The dataclass default is the flag's
default. Field ``seed`` is shared with Megatron's ``--seed`` and is not added twice;
``--rounding-seed`` sets it alone (the rounding noise without the data order and the
initialization), for measuring the method's run-to-run noise.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import types
import typing
from typing import Any

from megatron.sdp4bit.config import SDP4BitConfig

# Fields whose flag is defined by the Megatron part of the parser (same name, same meaning).
SHARED_FIELDS = ("seed",)


def field_docstrings(cls: type) -> dict[str, str]:
    """Map each dataclass field to the string literal that follows it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_sdp4bit_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`SDP4BitConfig` field to ``parser`` (group ``SDP4Bit``)."""
    group = parser.add_argument_group("SDP4Bit", "4-bit communication quantization")
    hints = typing.get_type_hints(SDP4BitConfig)
    docs = field_docstrings(SDP4BitConfig)
    for f in dataclasses.fields(SDP4BitConfig):
        if f.name in SHARED_FIELDS:
            continue
        hint = hints[f.name]
        help_text = docs.get(f.name, "")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default}
        if hint is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(hint) is typing.Literal:
            kwargs["choices"] = list(typing.get_args(hint))
            kwargs["type"] = str
        elif hint is int:
            kwargs["type"] = int
        elif typing.get_origin(hint) in (typing.Union, types.UnionType):
            inner = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(inner) != 1 or inner[0] is not int:
                raise TypeError(f"SDP4BitConfig.{f.name}: unsupported type {hint}")
            kwargs["type"] = int
        else:
            raise TypeError(f"SDP4BitConfig.{f.name}: unsupported type {hint}")
        if f.default is not None and hint is not bool:
            help_text += f" (default: {f.default})"
        group.add_argument(_flag(f.name), help=help_text, **kwargs)
    group.add_argument("--rounding-seed", type=int, default=None,
                       help="seed of the stochastic-rounding noise alone (default: --seed); "
                       "two runs that differ only in it show the method's run-to-run noise")


def sdp4bit_config_from_args(args: argparse.Namespace) -> SDP4BitConfig:
    """Build the :class:`SDP4BitConfig` from parsed arguments (raises ``ValueError``)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SDP4BitConfig)}
    if getattr(args, "rounding_seed", None) is not None:
        values["seed"] = args.rounding_seed
    return SDP4BitConfig(**values)


def in_flag_words(err: ValueError) -> str:
    """The first line of :class:`SDP4BitConfig`'s error with its field names as the flags a
    user typed (``wq_group_size=3`` -> ``--wq-group-size=3``)."""
    return re.sub(r"\b([a-z]+(?:_[a-z0-9]+)+)=",
                  lambda m: "--" + m.group(1).replace("_", "-") + "=", str(err).splitlines()[0])
