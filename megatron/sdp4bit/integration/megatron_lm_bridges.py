"""What megatron-core 0.19.2's wheel needs to run Megatron-LM's trainer here, apart from
SDP4Bit: two entries of the replacement table, in the plug-in's scope (``megatron_lm``),
applied by ``megatron_lm.enable()``.

[Note: Megatron-LM's trainer from the wheel, on Python 3.11]
* ``typing.override`` (added, Python < 3.12 only): ``megatron/training/models/gpt.py`` and
  ``hybrid.py`` import it, and ``megatron.training`` imports them; nothing else of
  ``megatron.training`` needs Python 3.12. The added decorator does what Python 3.12's does
  (sets ``__override__``; type checkers read it, the runtime does not).
  On Python >= 3.12 ``typing`` has it and the entry adds nothing: none of this is needed.
* ``megatron.core.datasets.utils.compile_helpers``: Megatron-LM's ``initialize_megatron``
  runs ``make`` in ``megatron/core/datasets`` on rank 0 and exits if it fails; the wheel
  ships ``helpers_cpp`` compiled and no Makefile, so there the make always fails. The wrapper
  skips the build when ``helpers_cpp`` imports (a checkout without it still builds).

[Note: the Python 3.12 bridge in every process]
``enable()`` adds ``typing.override`` in the process it runs in. Megatron-LM's trainer starts
other interpreters: its ``torch_dist`` save a ``spawn`` multiprocessing manager, its
persistent checkpoint worker a ``forkserver``; each re-imports the main script, and a script
in Megatron-LM's shape imports ``megatron.training`` at the top, so on Python 3.11 that
import fails there (``ImportError: cannot import name 'override' from 'typing'``, then an
``EOFError`` on rank 0). So where megatron-core's wheel requires a newer Python than the
environment's (the test environment ``.venv-mcore019``: 0.19.2 on 3.11),
``tools/setup_env.sh`` writes a ``.pth`` file that runs :func:`bridge_python_312` at every
interpreter's start: the same table entry (:data:`PYTHON_312`), applied by the same engine,
for the life of the process. It imports this module and the engine, no torch and no
megatron-core (``integration/__init__.py`` imports its names on first use; an entry that
adds a name is checked without reading the installed release): a few milliseconds. Where
the wheel's Python requirement holds (Python >= 3.12) no file is written.
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


def bridge_python_312() -> None:
    """Apply :data:`PYTHON_312` for the life of this process (nothing where ``typing``
    has ``override``): the test environment's ``.pth`` file calls it at interpreter start,
    [Note: the Python 3.12 bridge in every process]."""
    patches.apply([PYTHON_312])
COMPILE_HELPERS = declare(
    "megatron_lm.compile_helpers", "megatron.core.datasets.utils", "compile_helpers", MODULE,
    _compile_helpers, note=_NOTE, checked={"0.19.2": "()"}, applies=training_installed,
    scope=patches.MEGATRON_LM, wraps=True)
