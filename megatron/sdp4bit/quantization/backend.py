"""Which implementation runs an operation: the Triton kernels or the torch references."""

from __future__ import annotations

import enum
import functools
import os

import torch

BACKEND_ENV = "SDP4BIT_KERNEL_BACKEND"


class KernelBackend(enum.Enum):
    """``AUTO`` = Triton for CUDA tensors, torch otherwise; ``TORCH`` / ``TRITON`` force one.

    ``TRITON`` on CPU tensors only works under ``TRITON_INTERPRET=1`` (tests, debugging).
    The environment variable ``SDP4BIT_KERNEL_BACKEND`` (auto, torch, triton) overrides
    ``AUTO`` for a whole process, e.g. to debug numerics on a GPU with the references.
    """

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _env_backend() -> KernelBackend:
    value = os.environ.get(BACKEND_ENV, "auto").lower()
    try:
        return KernelBackend(value)
    except ValueError:
        raise ValueError(
            f"{BACKEND_ENV}={value!r} is not a backend: use auto, torch or triton"
        ) from None


def resolve_backend(backend: KernelBackend | str, tensor: torch.Tensor) -> KernelBackend:
    """Turn ``backend`` into ``TORCH`` or ``TRITON`` for an operation on ``tensor``."""
    backend = KernelBackend(backend)
    if backend is KernelBackend.AUTO:
        backend = _env_backend()
    if backend is KernelBackend.AUTO:
        use_triton = tensor.is_cuda and triton_available()
        return KernelBackend.TRITON if use_triton else KernelBackend.TORCH
    if backend is KernelBackend.TRITON:
        if not triton_available():
            raise ImportError("the Triton backend was requested but triton is not installed: "
                              "pip install triton, or use KernelBackend.TORCH")
        if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise NotImplementedError(
                "Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 (slow, for "
                "tests) or use KernelBackend.TORCH"
            )
    return backend
