"""The CUDA runtime on the CPU: the stubs CPU mode and the CUDA dry run share.

[Note: the CUDA runtime on the CPU]
megatron-core and the trainer ask the CUDA runtime for the current device, the current
stream and the random state, and megatron-core sets its "CUDA" random state with its own
``tensor_parallel.random._set_cuda_rng_state``. On a CUDA-less build each of those raises,
or (``_set_cuda_rng_state``) queues the call until CUDA initialises, i.e. never. CPU mode
(``cpu_mode.py``) and the CUDA dry run (``megatron/sdp4bit/testing/cuda_dryrun.py``) both
need them to answer as one CUDA device would, so both apply :data:`SHARED_STUBS`:

* ``torch.cuda.current_device()`` is the device ``torch.cuda.set_device`` chose (only the
  dry run stubs ``set_device``; CPU mode never calls it, so it stays 0);
* ``torch.cuda.current_stream()`` is one stream whose ``wait_event`` / ``wait_stream`` /
  ``synchronize`` do nothing (CPU work is synchronous): 0.19.2's ``start_grad_sync`` reads it
  on every call, to wait on CUDA-graph events a CPU run never has;
* the "CUDA" random state is the CPU generator's: ``torch.cuda.get_rng_state`` returns
  ``torch.get_rng_state()``, ``torch.cuda.manual_seed`` seeds the CPU generator, and
  megatron-core's ``_set_cuda_rng_state`` sets it. ``CudaRNGStatesTracker`` (used by
  ``model_parallel_cuda_manual_seed`` and around every attention dropout) then swaps the
  state of the generator CPU dropout draws from: the tracker keeps its meaning (distinct
  streams per TP rank) on the CPU.

``torch.cuda.random`` holds the same two random functions under their own names
(megatron-core's ``tensor_parallel.random`` reads ``get_rng_state`` there), so each is
replaced in both modules.
:func:`cuda_type_name` is the other piece both share: megatron-core's optimizers recognise a
16-bit parameter by ``param.type() == "torch.cuda.BFloat16Tensor"``, so both modes make
``Tensor.type()`` of a tensor that stands for a device tensor report the CUDA name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from megatron.sdp4bit.integration.patches import CPU_MODE, DRYRUN, MODULE, both, declare, on_torch

DEVICE_INDEX = [0]  # what torch.cuda.set_device chose (the dry run's stub sets it)


def backward_in_mode(original: Callable, current_mode: Callable[[], Any]) -> Callable:
    """autograd's engine run (``torch.autograd.backward`` and ``torch.autograd.grad`` both
    end there) with the ``TorchFunctionMode`` that ``current_mode()`` returns entered again
    (none: as it was). A mode is off while it handles ``torch.autograd.backward``; autograd
    runs the backward of CPU tensors on the calling thread, where the mode lives, so this
    makes the Python of the backward pass see it ([Note: the backward pass in CPU mode],
    integration/cpu_mode.py). CPU mode and the CUDA dry run both wrap with it."""

    def run(*args, **kwargs):
        mode = current_mode()
        if mode is None:
            return original(*args, **kwargs)
        with mode:
            return original(*args, **kwargs)

    return run


def names_cuda(device: Any) -> bool:
    """Whether a torch ``device=`` argument names a CUDA device (an ordinal, "cuda", "cuda:N",
    a CUDA ``torch.device``)."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare ordinal is a CUDA device for every torch factory
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return False


def cuda_type_name(name: str) -> str:
    """``Tensor.type()``'s answer for the same tensor on a CUDA device
    (``torch.BFloat16Tensor`` -> ``torch.cuda.BFloat16Tensor``)."""
    return name.replace("torch.", "torch.cuda.", 1)


class Event:
    """A CUDA event on the CPU: records the time, never waits."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "Event") -> float:
        return ((end._time or 0.0) - (self._time or 0.0)) * 1e3


class Stream:
    """A CUDA stream on the CPU: everything is already done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> Event:
        event = event or Event()
        event.record()
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


STREAM = Stream()


def current_device() -> int:
    return DEVICE_INDEX[0]


def current_stream(device: Any = None) -> Stream:
    return STREAM


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def manual_seed(seed: int) -> None:
    # The CPU generator alone: torch.manual_seed would also call manual_seed_all, which
    # the dry run makes a no-op and CPU mode queues forever.
    torch.default_generator.manual_seed(int(seed))


def set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1,
                       graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


_NOTE = "[Note: the CUDA runtime on the CPU] (integration/cuda_stubs.py)"
_SHARED = (CPU_MODE, DRYRUN)  # applied by both
SHARED_STUBS = (
    declare("cuda.current_device", "torch.cuda", "current_device", MODULE, current_device,
            note=_NOTE, scope=_SHARED, checked=on_torch("()")),
    declare("cuda.current_stream", "torch.cuda", "current_stream", MODULE, current_stream,
            note=_NOTE, scope=_SHARED, checked=on_torch("(device)")),
    declare("cuda.get_rng_state", "torch.cuda", "get_rng_state", MODULE, get_rng_state,
            note=_NOTE, scope=_SHARED, checked=on_torch("(device)")),
    declare("cuda.random.get_rng_state", "torch.cuda.random", "get_rng_state", MODULE,
            get_rng_state, note=_NOTE, scope=_SHARED, checked=on_torch("(device)")),
    declare("cuda.manual_seed", "torch.cuda", "manual_seed", MODULE, manual_seed,
            note=_NOTE, scope=_SHARED, checked=on_torch("(seed)")),
    declare("cuda.random.manual_seed", "torch.cuda.random", "manual_seed", MODULE, manual_seed,
            note=_NOTE, scope=_SHARED, checked=on_torch("(seed)")),
    declare("mcore.random._set_cuda_rng_state", "megatron.core.tensor_parallel.random",
            "_set_cuda_rng_state", MODULE, set_cuda_rng_state, note=_NOTE, scope=_SHARED,
            checked=both("(new_state, device, graph_safe)")),
)
