"""Reading a ``--metrics-jsonl`` file back: one JSON object per logged iteration and evaluation.

The writer is :mod:`.logging`; the readers are the summary, plotting and loss-comparison
tools under ``tools/`` and the cluster simulation.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """Return (training records, validation records), each in file order."""
    train, val = [], []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not JSON ({err.msg})") from err
            if "lm_loss" in record:
                train.append(record)
            elif "val_lm_loss" in record:
                val.append(record)
    if not train:
        raise ValueError(f"{path}: no training iteration was logged")
    return train, val
