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

[Note: butterfly order]
Every implementation (this torch reference, the CPU kernels, the Triton kernels) computes the
transform the same way, so that they agree bit for bit: ``log2(block)`` butterfly stages of
half-width ``h = 1, 2, 4, ..., block/2``, each replacing the pair ``(x[j], x[j+h])`` of every
``2h``-aligned run by ``(x[j] + x[j+h], x[j] - x[j+h])`` in fp32, then one multiplication by
``1/sqrt(block)`` rounded to fp32. This is ``H x`` for the Sylvester matrix ``H``
(``H_2k = [[H_k, H_k], [H_k, -H_k]]``) with ``block * log2(block)`` additions instead of the
``block**2`` multiply-adds of a matrix product, whose summation order would depend on the
BLAS library.
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


def block_scale(block: int) -> float:
    """``1/sqrt(block)`` rounded to fp32: the factor every implementation multiplies by."""
    return float(torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32))


def _apply(x: torch.Tensor, block: int) -> torch.Tensor:
    """Fast Walsh-Hadamard butterflies, then the scale: see [Note: butterfly order]."""
    check_hadamard_block(block)
    if x.numel() % block:
        raise ValueError(
            f"hadamard transform needs numel divisible by the block: numel={x.numel()}, "
            f"block={block}"
        )
    y = x.reshape(-1, block).to(torch.float32)
    h = 1
    while h < block:
        pairs = y.view(-1, block // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2).view(-1, block)
        h *= 2
    return (y * block_scale(block)).reshape(x.shape)


def hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Transform every contiguous block of ``block`` values of ``x`` (flattened); fp32 out."""
    return _apply(x, block)


def inverse_hadamard_transform(x: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of :func:`hadamard_transform` (the same orthonormal, symmetric matrix)."""
    return _apply(x, block)
