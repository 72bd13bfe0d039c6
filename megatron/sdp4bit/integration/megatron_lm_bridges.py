"""What megatron-core 0.19.2's wheel needs to run Megatron-LM's trainer here, apart from
SDP4Bit: two entries of the replacement table, in the plug-in's scope (``megatron_lm``),
applied by ``megatron_lm.enable()``.

[Note: Megatron-LM's trainer from the wheel, on Python 3.11]
* ``typing.override`` (added, Python < 3.12 only): ``megatron/training/models/gpt.py`` and
  ``hybrid.py`` import it, and ``megatron.training`` imports them; nothing else of
  ``megatron.training`` needs Python 3.12. The added decorator does what Python 3.12's does
  (sets ``__override__``; type checkers read it, the runtime does not).
* ``megatron.core.datasets.utils.compile_helpers``: Megatron-LM's ``initialize_megatron``
  runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits if it fails; the wheel
  ships ``helpers_cpp`` compiled and no Makefile, so there the make always fails. The wrapper
  skips the build when ``helpers_cpp`` imports (a checkout without it still builds).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.patches import MODULE, declare

_NOTE = ("[Note: Megatron-LM's trainer from the wheel, on Python 3.11] "
         "(integration/megatron_lm_bridges.py)")


def training_installed() -> bool:
    """Whether ``megatron.training`` (Megatron-LM's trainer) can be imported."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def _override(method: Callable) -> Callable:
    """Python 3.12's ``typing.override`` (sets ``__override__``; nothing else at run time)."""
    try:
        method.__override__ = True
    except (AttributeError, TypeError):
        pass
    return method


def _compile_helpers(original: Callable) -> Callable:
    @functools.wraps(original)
    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
            original()
    return compile_helpers


PYTHON_312 = declare("megatron_lm.typing.override", "typing", "override", MODULE, _override,
                     note=_NOTE, checked={"0.19.2": "<absent>"}, applies=training_installed,
                     scope=patches.MEGATRON_LM, adds=True)
"""Added before ``megatron.training`` is imported (the release walk adds it too)."""
COMPILE_HELPERS = declare(
    "megatron_lm.compile_helpers", "megatron.core.datasets.utils", "compile_helpers", MODULE,
    _compile_helpers, note=_NOTE, checked={"0.19.2": "()"}, applies=training_installed,
    scope=patches.MEGATRON_LM, wraps=True)
