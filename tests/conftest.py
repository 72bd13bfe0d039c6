"""Puts this folder on ``sys.path`` so that helpers shared by the test folders (``_noise.py``)
import by name, in pytest and in the processes the distributed tests spawn (spawn passes
``sys.path`` on)."""

import pathlib
import sys

_HERE = str(pathlib.Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
