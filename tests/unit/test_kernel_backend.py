"""Backend choice for CUDA tensors without Triton, and the references' bounded memory.

No GPU is needed: a CUDA tensor is stood in for by an object with ``is_cuda`` and
``device`` (all ``resolve_backend`` reads), and the random stream's CUDA path runs on the
``meta`` device under a ``TorchFunctionMode`` that records every allocation.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from megatron.sdp4bit.quantization import backend, rng
from megatron.sdp4bit.quantization.backend import BACKEND_ENV, KernelBackend, resolve_backend

CUDA_TENSOR = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch):
    """``import triton`` fails, as on a CUDA machine whose triton is missing or broken."""
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    backend.triton_import_error.cache_clear()
    yield
    backend.triton_import_error.cache_clear()


def test_auto_refuses_cuda_tensors_without_triton(no_triton) -> None:
    assert not backend.triton_available()
    with pytest.raises(ImportError, match=(
            r"^SDP4Bit needs the Triton kernels for CUDA tensors but `import triton` failed "
            r"\(.*triton.*\): install triton \(CUDA builds of torch ship it\), or choose the "
            r"slower torch references explicitly with --kernel-backend torch "
            r"\(KernelBackend.TORCH, or SDP4BIT_KERNEL_BACKEND=torch\)$")):
        resolve_backend(KernelBackend.AUTO, CUDA_TENSOR)


def test_the_references_run_on_cuda_when_chosen(no_triton, monkeypatch) -> None:
    assert resolve_backend("torch", CUDA_TENSOR) is KernelBackend.TORCH
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend(KernelBackend.AUTO, CUDA_TENSOR) is KernelBackend.TORCH
    with pytest.raises(ImportError, match="the Triton backend was requested"):
        resolve_backend("triton", CUDA_TENSOR)


def test_auto_picks_triton_for_cuda_tensors_when_it_imports(monkeypatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(backend, "triton_import_error", lambda: None)
    assert resolve_backend(KernelBackend.AUTO, CUDA_TENSOR) is KernelBackend.TRITON


class _CudaOnMeta(TorchFunctionMode):
    """Runs CUDA allocations on ``meta`` and records the size of every int64 tensor made."""

    def __init__(self) -> None:
        super().__init__()
        self.int64_numels: list[int] = []
        self.arange_numel = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "meta"
        out = func(*args, **kwargs)
        if func is torch.arange:
            self.arange_numel += out.numel()
        if func is torch.empty and isinstance(out, torch.Tensor) and out.dtype == torch.int64:
            self.int64_numels.append(out.numel())
        return out


@pytest.mark.parametrize("device,numel", [("cuda", 1 << 26), ("cpu", 1 << 21)],
                         ids=["cuda-64M", "cpu-2M"])
def test_random_stream_scratch_is_bounded(device: str, numel: int) -> None:
    """The int64 hash scratch (a chunk's words, and their halves) stays at most 2**22 values
    per tensor, 48 MiB in all, however long the stream (a whole 2.7B-element bucket at once
    would be 32 GB), and the chunks cover it all: one hash per pair of elements."""
    mode = _CudaOnMeta()
    with mode:
        out = rng.uniform(1234, 0, numel, device)
    assert out.numel() == numel
    assert mode.arange_numel == numel // 2
    assert mode.int64_numels and max(mode.int64_numels) <= 1 << 22, mode.int64_numels[:3]
    assert sum(mode.int64_numels) <= 3 << 21, mode.int64_numels
    if device == "cpu":  # and the values are the stream's, chunk boundaries included
        edge = 2 * rng.chunk_pairs("cpu")
        whole = rng.uniform(1234, edge - 3, 7)
        assert torch.equal(out[edge - 3:edge + 4], whole)
