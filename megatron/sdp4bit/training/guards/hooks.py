"""Named points of a training run where a test may act; a real run leaves them empty.

The reliability tests need one rank to misbehave at a chosen iteration: a NaN loss, a weight
that drifts, a crash in the middle of a save. Instead of a test branch at each of those
places, the trainer passes a named point there (:func:`fire`, :func:`transform`), and only
:func:`megatron.sdp4bit.training.guards.faults.install`, called when ``SDP4BIT_FAULT`` is set,
puts anything behind the points (``pretrain_gpt.py`` calls it). Without it every point is an empty loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

POINTS = {
    "loss": "(loss, iteration) -> loss: a micro-batch's loss before its backward pass",
    "before-save": "(state): the loop is about to save iteration state.iteration",
    "after-iteration": "(state): an iteration and its evaluation are done, before the "
                       "replica check and the saves",
    "save-files-written": "(iteration): this rank's files of a save are written, the other "
                          "ranks' not known yet",
    "save-space-checked": "(root, iteration): the free space of a torch_dist save was checked",
}
"""Each point and the arguments its hooks get."""

_HOOKS: dict[str, list[Callable[..., Any]]] = {point: [] for point in POINTS}


def add(point: str, hook: Callable[..., Any]) -> None:
    if point not in POINTS:
        raise ValueError(f"no hook point {point!r}; the points are {', '.join(POINTS)}")
    _HOOKS[point].append(hook)


def clear() -> None:
    """Remove every hook (tests that install some in their own process)."""
    for hooks in _HOOKS.values():
        hooks.clear()


def fire(point: str, *args: Any) -> None:
    for hook in _HOOKS[point]:
        hook(*args)


def transform(point: str, value: Any, *args: Any) -> Any:
    """``value`` passed through the point's hooks in order (unchanged without any)."""
    for hook in _HOOKS[point]:
        value = hook(value, *args)
    return value
