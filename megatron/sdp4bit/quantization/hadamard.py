"""Block Walsh-Hadamard transform (orthonormal, Sylvester order).

Each contiguous block of ``block`` values is multiplied by ``H / sqrt(block)``, where ``H``
is the Sylvester Hadamard matrix. The normalized matrix is symmetric and orthogonal, so the
transform is its own inverse and preserves the 2-norm of every block.

[Note: why Hadamard smoothing]
A group's scale is set by its largest magnitude. One gradient outlier inflates the scale and
crushes its neighbours to zero at 4 bits. Mixing each block of 32 values with an orthogonal
transform spreads the outlier's energy over the block, so the absmax shrinks towards the
block's RMS and the quantization step with it. The transform is linear: partial sums can be
added in the transformed domain and transformed back once, after the last hop.
"""

from __future__ import annotations

import functools
import math

import torch


def check_hadamard_block(block: int) -> None:
    if not isinstance(block, int) or block < 1 or block & (block - 1):
        raise ValueError(f"hadamard_block={block} must be a power of two (e.g. 32), or 0 for off")


@functools.lru_cache(maxsize=16)
def _hadamard_matrix_cpu(block: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(block)).to(torch.float32)


def hadamard_matrix(block: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal ``block x block`` Hadamard matrix in fp32."""
    check_hadamard_block(block)
    return _hadamard_matrix_cpu(block).to(device)


def _apply(x: torch.Tensor, block: int) -> torch.Tensor:
    check_hadamard_block(block)
    if x.numel() % block:
        raise ValueError(
            f"hadamard transform needs numel divisible by the block: numel={x.numel()}, "
            f"block={block}"
        )
    h = hadamard_matrix(block, x.device)
    flat = x.reshape(-1, block).to(torch.float32)
    return (flat @ h).reshape(x.shape)


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Transform every contiguous block of ``block`` values of ``x`` (flattened); fp32 out."""
    return _apply(x, block)


def inverse_hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`hadamard_transform` (the same orthonormal, symmetric matrix)."""
    return _apply(x, block)
