"""CUDA dry run on CPU: run the CUDA branch of the trainer, with NCCL's rules, on gloo.

Every test runs in CPU mode, where every tensor is a host tensor, so a host tensor handed
to a collective that is NCCL on a GPU run (NCCL refuses it) goes unseen. The dry run makes
one process behave, as far as Python code can tell, like a rank of a CUDA run:

1. ``torch.cuda.is_available()`` is True, so the trainer takes its CUDA branch
   (``torch.cuda.set_device``, ``backend="nccl"``, ``model.cuda()``, ``non_blocking`` copies,
   the "CUDA" RNG, timers that synchronize, megatron-core's GPU allocations).
   [Note: the dry run's CUDA runtime]
   The runtime calls are stubs: CPU mode's (``integration/cuda_stubs.py``: current device,
   stream, "CUDA" random state) and the rest of what a CUDA process asks (availability,
   device count and properties, memory counters, events and streams that do nothing: CPU
   work is synchronous; NVTX ranges; ``torch._dynamo`` off, so that megatron-core's
   ``jit_fuser`` fusions run eagerly instead of being compiled for the real, CPU, device).
2. [Note: a GPU run's tensors, tagged]
   Every tensor is a CPU tensor underneath, computing for real, but carries what it would
   be on a GPU run as its Python class: :class:`DeviceTensor` (allocated on or moved to
   ``cuda``; reports ``device == cuda:N`` and ``is_cuda``) or :class:`HostTensor` (a factory
   without a device or with ``"cpu"``, ``.cpu()``, ``.to("cpu")``, ``torch.load`` with
   ``map_location="cpu"``). A :class:`~torch.overrides.TorchFunctionMode` assigns the class
   of every result: host only when every tensor input is host, as CUDA ops do. Plain
   tensors are those made in C++ (autograd's gradients): on a GPU run they sit on the
   device of their inputs, so they count as device tensors.
3. [Note: NCCL's rules on gloo]
   ``init_process_group("nccl")`` and ``new_group(backend="nccl")`` get gloo, and every
   tensor collective of ``torch.distributed`` is wrapped by a check of NCCL's rules before
   gloo runs it (in ``torch.distributed`` and ``distributed_c10d``, and in the megatron-core
   module globals that captured one at import, ``dist_all_gather_func = ...``): a host
   tensor, a non-contiguous tensor, mixed dtypes, or sizes that do not fit the group
   (all-gather, reduce-scatter, all-to-all) raise :class:`CudaDryRunError`
   with one line naming the collective, the group and the tensor. Object collectives
   (``all_gather_object``...) are exempt: torch moves their bytes to the device itself; so
   are the groups created with ``backend="gloo"`` (megatron-core's ``*_GLOO`` groups), gloo on
   a GPU run too.

Only :func:`enable_cuda_dryrun` switches it on (``dev/cuda_dryrun.py`` calls it before
importing the trainer); nothing else imports this module, the library included. Every
replaced attribute is an entry of the replacement table (:data:`DRY_RUN`): CPU mode's CUDA
stubs plus the rest of the runtime, the collectives and ``torch.load``. This module
registers its own entries (scope ``dryrun``) when it is imported, so the library's table
and its untested-release check never see them unless the dry run is in use.
Limits: docs/cuda_dryrun.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from megatron.sdp4bit.integration import cuda_stubs, patches
from megatron.sdp4bit.integration.cuda_stubs import (
    SHARED_STUBS,
    backward_in_mode,
    cuda_type_name,
    names_cuda,
)
from megatron.sdp4bit.integration.patches import CLASS, DRYRUN, MODULE, both, declare, on_torch
from megatron.sdp4bit.quantization.backend import BACKEND_ENV, KernelBackend

__all__ = ["CudaDryRunError", "DeviceTensor", "HostTensor", "enable_cuda_dryrun",
           "cuda_dryrun_active", "is_host"]


class CudaDryRunError(RuntimeError):
    """A collective that NCCL would refuse on a GPU run (one line: collective, group, tensor)."""


class DeviceTensor(torch.Tensor):
    """A CPU tensor that a GPU run would hold on the current CUDA device."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", cuda_stubs.DEVICE_INDEX[0])

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    def __reduce_ex__(self, protocol):  # checkpoints hold plain tensors
        return torch.Tensor.as_subclass(self, torch.Tensor).__reduce_ex__(protocol)


class HostTensor(torch.Tensor):
    """A CPU tensor that a GPU run would also hold in host memory."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol):
        return torch.Tensor.as_subclass(self, torch.Tensor).__reduce_ex__(protocol)


def is_host(t: torch.Tensor) -> bool:
    """Whether a GPU run would hold ``t`` in host memory (see the module docstring)."""
    return isinstance(t, HostTensor)


def _names_cpu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cpu"
    return isinstance(device, str) and device.split(":")[0] == "cpu"


_CPU = torch.device("cpu")


def _tag(t: torch.Tensor, cls: type) -> torch.Tensor:
    # The object's class changes in place: no alias is made, so identity, ``_base`` and
    # views stay what megatron-core expects.
    t.__class__ = cls
    return t


def _retag(out: Any, cls: type) -> Any:
    """``out`` with its plain tensors tagged ``cls`` (Parameters and tagged tensors stay)."""
    for t in pytree.tree_leaves(out) if not isinstance(out, torch.Size) else ():
        if type(t) is torch.Tensor:
            _tag(t, cls)
    return out


def _plain_copy(t: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        kwargs.pop("non_blocking", None)
        kwargs.pop("copy", None)
        kwargs.pop("memory_format", None)
        return t.to(_CPU, copy=True, **kwargs)


def _to_target(args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """Tensor.to's target device, and its arguments without it."""
    kwargs = dict(kwargs)
    if "device" in kwargs:
        return kwargs.pop("device"), args, kwargs
    if len(args) >= 2 and (isinstance(args[1], (str, int, torch.device))
                           and not isinstance(args[1], bool)):
        return args[1], (args[0], *args[2:]), kwargs
    return None, args, kwargs


class _DryRunMode(TorchFunctionMode):
    """Runs every torch call on the CPU and tags its results (module docstring, item 2)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.as_subclass:
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return self._move(args[0], device=True, kwargs={})
        if func is torch.Tensor.cpu:
            return self._move(args[0], device=False, kwargs={})
        if func is torch.Tensor.to:
            target, rest, kw = _to_target(args, kwargs)
            if target is not None and (names_cuda(target) or _names_cpu(target)):
                moved = self._move(rest[0], device=names_cuda(target), kwargs=kw)
                if len(rest) > 1 or kw:  # a dtype as well
                    with torch._C.DisableTorchFunctionSubclass():
                        cast = torch.Tensor.to(moved, *rest[1:], **kw)
                    side = HostTensor if is_host(moved) else DeviceTensor
                    return moved if cast is moved else _retag(cast, side)
                return moved
        # module.cuda() sets param.data = <device copy>: the parameter moves with it
        # (a new method-wrapper object each time, hence ==)
        if func == torch.Tensor.data.__set__:
            with torch._C.DisableTorchFunctionSubclass():
                func(*args)
            if isinstance(args[0], (DeviceTensor, HostTensor)) or type(args[0]) is torch.Tensor:
                _tag(args[0], HostTensor if is_host(args[1]) else DeviceTensor)
            return None
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunctionSubclass():
                name = func(*args)
            # megatron-core's optimizers recognise 16-bit parameters by the CUDA type name
            return cuda_type_name(name) if not is_host(args[0]) else name
        cls = None
        if "device" in kwargs and kwargs["device"] is not None:
            if names_cuda(kwargs["device"]):
                cls = DeviceTensor
            elif _names_cpu(kwargs["device"]):
                cls = HostTensor
            kwargs["device"] = _CPU if cls is not None else kwargs["device"]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(out is t for t in inputs):
            return out  # in place, or returns an input: keeps its class
        if cls is None:
            if inputs:
                cls = HostTensor if all(is_host(t) for t in inputs) else DeviceTensor
            else:  # a factory without a device: the host, as on a GPU run
                cls = HostTensor
        return _retag(out, cls)

    @staticmethod
    def _move(t: torch.Tensor, device: bool, kwargs: dict) -> torch.Tensor:
        """``.cuda()`` / ``.cpu()`` / ``.to(device)``: a copy when the side changes, as on a
        GPU (so that writing the copy never changes the original), else the tensor itself."""
        if device != is_host(t):
            return t
        copy = _plain_copy(t, **kwargs)  # differentiable, as .to() is
        return _tag(copy, DeviceTensor if device else HostTensor)


# --- collectives with NCCL's rules ------------------------------------------------------

_exempt = threading.local()  # inside an object collective or an already-checked call


@contextlib.contextmanager
def _unchecked():
    depth = getattr(_exempt, "depth", 0)
    _exempt.depth = depth + 1
    try:
        yield
    finally:
        _exempt.depth = depth


def _group_text(group: Any) -> str:
    pg = group if group is not None else dist.group.WORLD
    try:
        ranks = dist.get_process_group_ranks(pg)
    except (RuntimeError, ValueError):
        ranks = "?"
    desc = getattr(pg, "group_desc", "") or ""
    desc = "" if desc in ("undefined", "default_pg") else f" {desc}"
    return f"group{desc} (global ranks {ranks})" if group is not None else \
        f"the default group (global ranks {ranks})"


def _tensor_text(name: str, t: torch.Tensor) -> str:
    return f"'{name}' ({str(t.dtype).replace('torch.', '')} {list(t.shape)})"


class _Call:
    """One collective call being checked."""

    def __init__(self, op: str, group: Any) -> None:
        self.op, self.group = op, group

    def world(self) -> int:
        return dist.get_world_size(self.group)

    def fail(self, what: str) -> None:
        raise CudaDryRunError(f"CUDA dry run: {self.op} on {_group_text(self.group)}: {what}")

    def device(self, name: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or self.group in _GLOO_GROUPS:
            return
        if is_host(t):
            self.fail(f"tensor {_tensor_text(name, t)} is in host memory on a GPU run, and "
                      "NCCL refuses it: allocate it on the CUDA device "
                      "(torch.cuda.current_device())")
        if not t.is_contiguous():
            self.fail(f"tensor {_tensor_text(name, t)} is not contiguous; NCCL needs "
                      "contiguous tensors")

    def same_dtype(self, a: tuple[str, torch.Tensor], b: tuple[str, torch.Tensor]) -> None:
        if a[1].dtype != b[1].dtype:
            self.fail(f"{_tensor_text(*a)} and {_tensor_text(*b)} differ in dtype")

    def sizes(self, big: tuple[str, torch.Tensor], small: tuple[str, torch.Tensor]) -> None:
        w = self.world()
        if big[1].numel() != w * small[1].numel():
            self.fail(f"{_tensor_text(*big)} must hold group size {w} x the "
                      f"{small[1].numel()} elements of {_tensor_text(*small)}")


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> inspect.Signature:
    return inspect.signature(fn)


def _arguments(fn: Callable, args: tuple, kwargs: dict) -> dict:
    return dict(_signature(fn).bind_partial(*args, **kwargs).arguments)


def _check_call(op: str, a: dict) -> None:
    call = _Call(op, a.get("group"))
    if op in ("all_reduce", "broadcast", "reduce", "send", "recv", "isend", "irecv"):
        call.device("tensor", a.get("tensor"))
    elif op in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
        out, inp = ("output_tensor", a["output_tensor"]), ("input_tensor", a["input_tensor"])
        call.device(*out), call.device(*inp)
        call.same_dtype(out, inp), call.sizes(out, inp)
    elif op in ("reduce_scatter_tensor", "_reduce_scatter_base"):
        out, inp = ("output", a["output"]), ("input", a["input"])
        call.device(*out), call.device(*inp)
        call.same_dtype(out, inp), call.sizes(inp, out)
    elif op == "all_to_all_single":
        out, inp = ("output", a["output"]), ("input", a["input"])
        call.device(*out), call.device(*inp), call.same_dtype(out, inp)
        w = call.world()
        for (name, t), splits in ((out, a.get("output_split_sizes")),
                                  (inp, a.get("input_split_sizes"))):
            rows = t.shape[0] if t.dim() else 1
            # a list, or (megatron-core's alltoall token dispatcher) a NumPy array
            splits = None if splits is None or len(splits) == 0 else [int(s) for s in splits]
            if splits is None and rows % w:
                call.fail(f"dim 0 of {_tensor_text(name, t)} does not divide into group "
                          f"size {w}")
            if splits is not None and (len(splits) != w or sum(splits) != rows):
                call.fail(f"split sizes {list(splits)} of {_tensor_text(name, t)} do not "
                          f"give {w} pieces summing to dim 0 ({rows})")
    elif op == "all_gather":
        inp = ("tensor", a["tensor"])
        call.device(*inp)
        outs = a["tensor_list"]
        if len(outs) != call.world():
            call.fail(f"'tensor_list' has {len(outs)} tensors for group size {call.world()}")
        for i, t in enumerate(outs):
            call.device(f"tensor_list[{i}]", t)
            call.same_dtype((f"tensor_list[{i}]", t), inp)
            if t.numel() != inp[1].numel():
                call.fail(f"{_tensor_text(f'tensor_list[{i}]', t)} differs in size from "
                          f"{_tensor_text(*inp)}")
    elif op in ("reduce_scatter", "all_to_all", "gather", "scatter", "all_reduce_coalesced"):
        for name, value in a.items():
            for i, t in enumerate(value if isinstance(value, (list, tuple)) else [value]):
                call.device(f"{name}[{i}]" if isinstance(value, (list, tuple)) else name, t)
    elif op == "batch_isend_irecv":
        for i, p2p in enumerate(a["p2p_op_list"]):
            _Call(f"batch_isend_irecv[{i}] {getattr(p2p.op, '__name__', '?')}",
                  p2p.group).device("tensor", p2p.tensor)


_CHECKED = ("all_reduce", "broadcast", "reduce", "send", "recv", "isend", "irecv",
            "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
            "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
            "all_to_all", "all_to_all_single", "gather", "scatter", "batch_isend_irecv")
_OBJECT = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list", "barrier", "monitored_barrier")


CHECKED_CALLS = [0]  # tensor collectives checked in this process (the tool reports it)


def _checked(op: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_exempt, "depth", 0) == 0:
            _check_call(op, _arguments(fn, args, kwargs))
            CHECKED_CALLS[0] += 1
        with _unchecked():
            return fn(*args, **kwargs)
    wrapper._sdp4bit_dryrun_original = fn
    return wrapper


def _exempted(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _unchecked():
            return fn(*args, **kwargs)
    wrapper._sdp4bit_dryrun_original = fn
    return wrapper


# Groups the caller asked gloo for (megatron-core's ``*_GLOO`` groups, Megatron-LM's
# distributed-optimizer checkpoint gathers): gloo on a GPU run too, so host tensors are right
# there and NCCL's rules do not apply to them.
_GLOO_GROUPS: "weakref.WeakSet" = weakref.WeakSet()


def _gloo_for_nccl(fn: Callable, position: int) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args = list(args)
        asked = args[position] if len(args) > position else kwargs.get("backend")
        if len(args) > position and args[position] in ("nccl", dist.Backend.NCCL):
            args[position] = "gloo"
        if kwargs.get("backend") in ("nccl", dist.Backend.NCCL):
            kwargs["backend"] = "gloo"
        kwargs.pop("pg_options", None)  # NCCL's options mean nothing to gloo
        group = fn(*args, **kwargs)
        # (a rank outside the group gets an int, GroupMember.NON_GROUP_MEMBER)
        if asked in ("gloo", dist.Backend.GLOO) and isinstance(group, dist.ProcessGroup):
            _GLOO_GROUPS.add(group)
        return group
    return wrapper


_replaced: dict[int, Callable] = {}  # id(original) -> its one wrapper


def _wrapper_for(name: str) -> Callable[[Callable], Callable]:
    """The maker of collective ``name``'s wrapper: one wrapper per original, wherever the
    original is found (``torch.distributed``, ``distributed_c10d``, a captured global)."""

    def wrap(original: Callable) -> Callable:
        if id(original) not in _replaced:
            _replaced[id(original)] = (_checked(name, original) if name in _CHECKED
                                       else _exempted(original))
        return _replaced[id(original)]

    return wrap


def _gloo_maker(position: int) -> Callable[[Callable], Callable]:
    return lambda original: _gloo_for_nccl(original, position)


# How many CUDA devices the dry run's processes see (default: one per local rank).
DEVICES_ENV = "SDP4BIT_DRYRUN_DEVICES"


def _device_count() -> int:
    """One emulated device per local rank, or :data:`DEVICES_ENV` of them (1: the ranks
    share one device, as with ``--distributed-backend gloo`` on one GPU)."""
    if os.environ.get(DEVICES_ENV):
        return int(os.environ[DEVICES_ENV])
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))), 1)


def _set_device(device: Any) -> None:
    index = (device.index or 0 if isinstance(device, torch.device) else
             device if isinstance(device, int) else int(str(device).split(":")[-1]))
    if not 0 <= index < _device_count():  # what CUDA says to an ordinal it does not have
        raise RuntimeError(f"CUDA error: invalid device ordinal (cuda dry run: device {index} "
                           f"of {_device_count()})")
    cuda_stubs.DEVICE_INDEX[0] = index


_RUNTIME_NOTE = "[Note: the dry run's CUDA runtime] (testing/cuda_dryrun.py)"
_NCCL_NOTE = "[Note: NCCL's rules on gloo] (testing/cuda_dryrun.py)"


def _nothing() -> Callable[..., None]:
    # A new function each time: torch._dynamo's trace rules key torch's functions by
    # identity and refuse one object standing for two of them.
    return lambda *args, **kwargs: None


def _zero() -> Callable[..., int]:
    return lambda device=None: 0


# The statistics of CUDA's caching allocator, as torch.cuda.memory_stats_as_nested_dict gives
# them on a GPU (torch 2.13): per-pool statistics, single ones, and event counters. The dry
# run has no device memory: every value is 0 (Megatron-LM's --log-memory-to-tensorboard
# reads "reserved_bytes.all.current", "allocated_bytes.all.current" / ".peak" and
# "allocation.all.current").
_POOL_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
               "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_SINGLE_STATS = ("oversize_allocations", "oversize_segments")
_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
             "num_device_free", "max_split_size")
_METRICS = ("current", "peak", "allocated", "freed")


def _memory_stats_nested(device: Any = None) -> dict[str, Any]:
    stat = lambda: dict.fromkeys(_METRICS, 0)  # noqa: E731
    out: dict[str, Any] = dict.fromkeys(_COUNTERS, 0)
    out.update({name: {pool: stat() for pool in ("all", "large_pool", "small_pool")}
                for name in _POOL_STATS})
    out.update({name: stat() for name in _SINGLE_STATS})
    return out


def _memory_stats(device: Any = None) -> dict[str, Any]:
    """``torch.cuda.memory_stats``: the nested statistics flattened with dots, sorted."""
    flat: dict[str, Any] = {}

    def add(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{prefix}.{key}" if prefix else key, inner)
        else:
            flat[prefix] = value

    add("", _memory_stats_nested(device))
    return dict(sorted(flat.items()))


# (torch.cuda attribute, stub, fingerprint of torch's own)
_RUNTIME = (
    ("is_available", lambda: True, "()"),
    ("is_initialized", lambda: True, "()"),
    ("device_count", _device_count, "()"),
    ("set_device", _set_device, "(device)"),
    ("synchronize", _nothing(), "(device)"),
    ("Event", cuda_stubs.Event, "(enable_timing, blocking, interprocess, external)"),
    ("Stream", cuda_stubs.Stream, "(device, priority, **kwargs)"),
    ("default_stream", lambda device=None: cuda_stubs.STREAM, "(device)"),
    ("stream", lambda s=None: contextlib.nullcontext(), "(stream)"),
    ("set_rng_state", lambda state, device="cuda": torch.set_rng_state(state),
     "(new_state, device)"),
    ("manual_seed_all", _nothing(), "(seed)"),
    ("empty_cache", _nothing(), "()"),
    ("memory_allocated", _zero(), "(device)"),
    ("max_memory_allocated", _zero(), "(device)"),
    ("memory_reserved", _zero(), "(device)"),
    ("max_memory_reserved", _zero(), "(device)"),
    ("reset_peak_memory_stats", _nothing(), "(device)"),
    ("memory_stats", _memory_stats, "(device)"),
    ("memory_stats_as_nested_dict", _memory_stats_nested, "(device)"),
    ("device_memory_used", _zero(), "(device)"),
    ("get_device_capability", lambda device=None: (9, 0), "(device)"),
    ("get_device_name", lambda device=None: "CUDA dry run (CPU)", "(device)"),
)
RUNTIME_STUBS = tuple(
    declare(f"dryrun.cuda.{attr}", "torch.cuda", attr, MODULE, stub, note=_RUNTIME_NOTE,
            checked=on_torch(fp), scope=DRYRUN) for attr, stub, fp in _RUNTIME) + (
    declare("dryrun.cuda.random.set_rng_state", "torch.cuda.random", "set_rng_state", MODULE,
            dict((a, s) for a, s, _ in _RUNTIME)["set_rng_state"], note=_RUNTIME_NOTE,
            checked=on_torch("(new_state, device)"), scope=DRYRUN),
    declare("dryrun.cuda.nvtx.range_push", "torch.cuda.nvtx", "range_push", MODULE, _nothing(),
            note=_RUNTIME_NOTE, checked=on_torch("(msg)"), scope=DRYRUN),
    declare("dryrun.cuda.nvtx.range_pop", "torch.cuda.nvtx", "range_pop", MODULE, _nothing(),
            note=_RUNTIME_NOTE, checked=on_torch("()"), scope=DRYRUN),
    declare("dryrun.dynamo.disable", "torch._dynamo.config", "disable", MODULE, True,
            note=_RUNTIME_NOTE, checked=on_torch("<bool>"), scope=DRYRUN),
)

_C10D = "torch.distributed.distributed_c10d"
# megatron-core module globals that hold a collective captured at import (same in 0.16.1
# and 0.19.2); a capture not listed here is refused by enable_cuda_dryrun.
CAPTURED = (
    ("megatron.core.distributed.param_and_grad_buffer", "dist_all_gather_func",
     "all_gather_into_tensor"),
    ("megatron.core.distributed.param_and_grad_buffer", "dist_reduce_scatter_func",
     "reduce_scatter_tensor"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func", "all_gather_into_tensor"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func",
     "reduce_scatter_tensor"),
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func",
     "all_gather_into_tensor"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func",
     "reduce_scatter_tensor"),
    ("megatron.core.tensor_parallel.utils", "dist_all_gather_func", "all_gather_into_tensor"),
    ("megatron.core.timers", "dist_all_gather_func", "all_gather_into_tensor"),
    ("megatron.core.transformer.multi_token_prediction", "dist_all_gather_func",
     "all_gather_into_tensor"),
    ("megatron.core.utils", "dist_all_gather_func", "all_gather_into_tensor"),
)


# The parameters of torch's collectives (torch 2.13, pinned by requirements.txt) that the
# checks above were written against: _check_call binds the arguments by these names.
_COLLECTIVE_PARAMS = {
    "all_reduce": "(tensor, op, group, async_op)",
    "broadcast": "(tensor, src, group, async_op, group_src)",
    "reduce": "(tensor, dst, op, group, async_op, group_dst)",
    "send": "(tensor, dst, group, tag, group_dst)",
    "recv": "(tensor, src, group, tag, group_src)",
    "isend": "(tensor, dst, group, tag, group_dst)",
    "irecv": "(tensor, src, group, tag, group_src)",
    "all_gather": "(tensor_list, tensor, group, async_op)",
    "all_gather_into_tensor": "(output_tensor, input_tensor, group, async_op)",
    "all_gather_single": "(output_tensor, input_tensor, group, async_op)",
    "_all_gather_base": "(output_tensor, input_tensor, group, async_op)",
    "reduce_scatter": "(output, input_list, op, group, async_op)",
    "reduce_scatter_tensor": "(output, input, op, group, async_op)",
    "_reduce_scatter_base": "(output, input, op, group, async_op)",
    "all_to_all": "(output_tensor_list, input_tensor_list, group, async_op)",
    "all_to_all_single": "(output, input, output_split_sizes, input_split_sizes, group, "
                         "async_op)",
    "gather": "(tensor, gather_list, dst, group, async_op, group_dst)",
    "scatter": "(tensor, scatter_list, src, group, async_op, group_src)",
    "batch_isend_irecv": "(p2p_op_list)",
    "all_gather_object": "(object_list, obj, group)",
    "broadcast_object_list": "(object_list, src, group, device, group_src)",
    "gather_object": "(obj, object_gather_list, dst, group, group_dst)",
    "scatter_object_list": "(scatter_object_output_list, scatter_object_input_list, src, "
                           "group, group_src)",
    "send_object_list": "(object_list, dst, group, device, group_dst, use_batch)",
    "recv_object_list": "(object_list, src, group, device, group_src, use_batch)",
    "barrier": "(group, async_op, device_ids, timeout)",
    "monitored_barrier": "(group, timeout, wait_all_ranks)",
    "init_process_group": "(backend, init_method, timeout, world_size, rank, store, "
                          "group_name, pg_options, device_id, _ranks)",
    "new_group": "(ranks, timeout, backend, pg_options, use_local_synchronization, "
                 "group_desc, device_id, sort_ranks)",
}


def _collective_fingerprint(name: str) -> str:
    return _COLLECTIVE_PARAMS[name]


COLLECTIVES = tuple(
    declare(f"dryrun.{where}.{name}", module, name, MODULE, _wrapper_for(name), wraps=True,
            note=_NCCL_NOTE, checked=on_torch(_collective_fingerprint(name)), scope=DRYRUN)
    for name in _CHECKED + _OBJECT for where, module in (("c10d", _C10D),
                                                         ("dist", "torch.distributed"))
) + tuple(
    declare(f"dryrun.{where}.{name}", module, name, MODULE, _gloo_maker(position), wraps=True,
            note=_NCCL_NOTE, checked=on_torch(_collective_fingerprint(name)), scope=DRYRUN)
    for name, position in (("init_process_group", 0), ("new_group", 2))
    for where, module in (("c10d", _C10D), ("dist", "torch.distributed"))
) + tuple(
    declare(f"dryrun.captured.{module.removeprefix('megatron.core.')}.{attr}", module, attr,
            MODULE,
            _wrapper_for(name), wraps=True, note=_NCCL_NOTE,
            checked=both(_collective_fingerprint(name)), scope=DRYRUN)
    for module, attr, name in CAPTURED
)


def _undeclared_capture() -> str | None:
    """A megatron module global that still holds an unwrapped collective, or None."""
    originals = {id(w._sdp4bit_dryrun_original): w.__name__ for w in _replaced.values()}
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron") or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in originals:
                return (f"{name}.{attr} holds torch.distributed.{originals[id(value)]} "
                        "unchecked: add it to CAPTURED in megatron/sdp4bit/testing/cuda_dryrun.py")
    return None


def _host_load(load: Callable) -> Callable:
    @functools.wraps(load)
    def wrapper(*args, **kwargs):
        out = load(*args, **kwargs)
        location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
        if location is not None and _names_cpu(location):
            return _retag(out, HostTensor)
        return _retag(out, DeviceTensor)  # loaded where it was saved: on the device
    return wrapper


LOAD = declare("dryrun.torch.load", "torch", "load", MODULE, _host_load, wraps=True,
               note="[Note: a GPU run's tensors, tagged] (testing/cuda_dryrun.py)",
               checked=on_torch("(f, map_location, pickle_module, *, weights_only, mmap, "
                                "**pickle_load_args)"), scope=DRYRUN)



def _backward_in_mode(original):
    """autograd's engine run with the dry run's mode entered again: a ``TorchFunctionMode``
    is off while it handles ``torch.autograd.backward``, so the Python of the backward pass
    (custom functions' ``backward``: megatron-core's sequence-parallel linear layers
    allocate there with ``device=torch.cuda.current_device()``) would not see it. Autograd
    runs the backward of CPU tensors on the calling thread, where the mode lives. CPU mode
    does the same ([Note: the backward pass in CPU mode], integration/cpu_mode.py)."""
    return backward_in_mode(original, lambda: _mode)


BACKWARD = declare("dryrun.autograd._engine_run_backward", "torch.autograd",
                   "_engine_run_backward", MODULE, _backward_in_mode, wraps=True,
                   note="[Note: a GPU run's tensors, tagged] (testing/cuda_dryrun.py)",
                   checked=on_torch("(t_outputs, *args, **kwargs)"), scope=DRYRUN)



def _record_stream(self: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream`` on the dry run's tensors (module docstring, item 1): CUDA's
    takes a device tensor and a stream, and holds the tensor's memory until the stream's
    queued work is done; every op here is done when it returns, so there is nothing to
    hold. torch's own refuses the stub stream and the CPU tensor underneath."""
    if is_host(self):
        raise CudaDryRunError(
            f"CUDA dry run: record_stream on tensor {_tensor_text('self', self)} in host "
            "memory on a GPU run: CUDA records streams of device tensors only")
    if not isinstance(stream, (cuda_stubs.Stream, torch.Stream)):
        raise TypeError(f"record_stream(): argument 'stream' must be a Stream, not "
                        f"{type(stream).__name__}")


RECORD_STREAM = declare("dryrun.tensor.record_stream", "torch:Tensor", "record_stream", CLASS,
                        _record_stream, note=_RUNTIME_NOTE, checked=on_torch("<builtin>"),
                        scope=DRYRUN)
"""megatron-core's alltoall token dispatcher records the current stream on the token counts
it copies to the host (``moe_utils.maybe_move_tensor_to_cpu``)."""

DRY_RUN = SHARED_STUBS + RUNTIME_STUBS + (RECORD_STREAM,) + COLLECTIVES + (LOAD, BACKWARD)
"""Everything the dry run replaces: CPU mode's CUDA stubs plus NCCL's rules."""

_mode: _DryRunMode | None = None


def cuda_dryrun_active() -> bool:
    return _mode is not None


def enable_cuda_dryrun() -> None:
    """Switch this process to the CUDA dry run (module docstring). Idempotent; refused
    when a real GPU is present (run on it instead)."""
    global _mode
    if _mode is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the CUDA dry run emulates CUDA on the CPU; this machine has a GPU: "
                           "run pretrain_gpt.py on it instead")
    # Triton cannot run here: the quantization kernels use their torch references.
    os.environ[BACKEND_ENV] = KernelBackend.TORCH.value
    patches.apply(DRY_RUN)  # for the life of the process
    undeclared = _undeclared_capture()
    if undeclared is not None:
        raise CudaDryRunError(f"CUDA dry run: {undeclared}")
    mode = _DryRunMode()
    mode.__enter__()
    _mode = mode
