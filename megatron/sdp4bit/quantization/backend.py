"""Which implementation runs an operation: Triton kernels, CPU kernels or torch references."""

from __future__ import annotations

import enum
import functools
import os

import torch

from megatron.sdp4bit.config import KERNEL_BACKENDS

BACKEND_ENV = "SDP4BIT_KERNEL_BACKEND"


KernelBackend = enum.Enum("KernelBackend", {name.upper(): name for name in KERNEL_BACKENDS})
KernelBackend.__doc__ = """``AUTO`` = Triton for CUDA tensors (``ImportError`` when triton cannot be
imported: the references are never chosen silently on a GPU), the compiled CPU kernels for
CPU tensors (the torch references, with one warning, where those cannot be built);
``TORCH`` / ``TRITON`` / ``CPU`` force one. All produce the same bytes. One member per name
of ``megatron.sdp4bit.config.KERNEL_BACKENDS``.

``TRITON`` on CPU tensors only works under ``TRITON_INTERPRET=1`` (tests, debugging).
The environment variable ``SDP4BIT_KERNEL_BACKEND`` (auto, torch, triton, cpu) overrides
``AUTO`` for a whole process, e.g. to debug numerics with the references.
"""


BACKEND_NAMES = KERNEL_BACKENDS


@functools.lru_cache(maxsize=None)
def triton_import_error() -> str | None:
    """``None`` when ``import triton`` works, else the reason it does not (one line)."""
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return None


def triton_available() -> bool:
    return triton_import_error() is None


def _env_backend() -> KernelBackend:
    value = os.environ.get(BACKEND_ENV, "auto").lower()
    try:
        return KernelBackend(value)
    except ValueError:
        raise ValueError(
            f"{BACKEND_ENV}={value!r} is not a backend: use one of {', '.join(BACKEND_NAMES)}"
        ) from None


def resolve_backend(backend: KernelBackend | str, tensor: torch.Tensor) -> KernelBackend:
    """Turn ``backend`` into ``TORCH`` or ``TRITON`` for an operation on ``tensor``."""
    backend = KernelBackend(backend)
    if backend is KernelBackend.AUTO:
        backend = _env_backend()
    if backend is KernelBackend.AUTO:
        if tensor.is_cuda:
            if not triton_available():
                # Refused rather than a silent fallback: the references (same bits) run each
                # operation as a dozen full-size torch passes, a slowdown to choose on purpose.
                raise ImportError(
                    f"SDP4Bit needs the Triton kernels for CUDA tensors but `import triton` "
                    f"failed ({triton_import_error()}): install triton (CUDA builds of torch "
                    "ship it), or choose the slower torch references explicitly with "
                    f"--kernel-backend torch (KernelBackend.TORCH, or {BACKEND_ENV}=torch)")
            return KernelBackend.TRITON
        if tensor.device.type == "cpu":
            from megatron.sdp4bit.quantization import cpu_kernels

            if cpu_kernels.available():
                return KernelBackend.CPU
        return KernelBackend.TORCH
    if backend is KernelBackend.CPU and tensor.device.type != "cpu":
        raise ValueError(f"the CPU kernel backend takes CPU tensors, got {tensor.device}: use "
                         "KernelBackend.AUTO")
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
