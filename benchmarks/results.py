"""What the checkpoint tools record with their figures, and where they write them."""

from __future__ import annotations

import datetime
import json
import os
import shlex
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def header(tool_file: str, cli: list[str], machine: str, load_before: float) -> dict:
    """The command as typed from the repository root, the machine, the load average before
    and now, the date (UTC)."""
    return {"command": "python " + shlex.join([os.path.relpath(tool_file, ROOT)] + cli),
            "machine": machine, "load_average": [load_before, os.getloadavg()[0]],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write(name: str, record: dict, render: Callable[[dict], str]) -> None:
    """benchmarks/NAME.json and its rendering, benchmarks/NAME.md."""
    out = ROOT / "benchmarks"
    (out / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{name}.md").write_text(render(record))
    print(f"wrote {out / (name + '.md')}")
