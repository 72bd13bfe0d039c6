"""Argument checks shared by the collectives: local, so every rank raises before any
collective is issued and nobody is left waiting in one."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_float_buffers(**buffers: torch.Tensor) -> None:
    """Each buffer is a contiguous fp32/bf16/fp16 tensor, and all are on one device."""
    for name, tensor in buffers.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype {tensor.dtype} is not supported: use float32, "
                             "bfloat16 or float16")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous: pass tensor.contiguous()")
    devices = {name: t.device for name, t in buffers.items()}
    if len(set(devices.values())) > 1:
        (a, da), (b, db) = list(devices.items())[:2]
        raise ValueError(f"{a} is on {da} but {b} on {db}")
