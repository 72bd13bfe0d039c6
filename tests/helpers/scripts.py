"""Import a user tool (a script under ``tools/``, not a package) as a module, by its path.

The tools are run as ``python tools/NAME.py``; what they share lives in ``megatron.sdp4bit``,
so loading one by path needs nothing on ``sys.path``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_tool(relative_path: str) -> ModuleType:
    """The module of ``ROOT / relative_path`` (e.g. ``"tools/plot_metrics.py"``), executed
    once per call under the file's stem as its name."""
    path = ROOT / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
