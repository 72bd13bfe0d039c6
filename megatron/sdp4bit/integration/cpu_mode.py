"""CPU development mode: run megatron-core (0.16.1, 0.19.2) on CPU with the gloo backend.

megatron-core assumes CUDA: it allocates its buffers on ``torch.cuda.current_device()``,
creates small bookkeeping tensors with ``device="cuda"``, and recognises mixed-precision
parameters by ``param.type() == "torch.cuda.BFloat16Tensor"``. On a CUDA-less build every
one of those calls raises or takes the wrong branch. ``enable_cpu_mode()`` is the only
place in SDP4Bit that changes that; nothing else in the package touches devices, and a
run with CUDA never calls it (it refuses to switch on when CUDA is available).

What it changes (all in this process, in the thread that calls it, until exit), each a
replacement of the table (``patches.py``) but items 2 and 3, a mode:

1. ``torch.cuda.current_device`` returns ``0`` instead of raising "Torch not compiled with
   CUDA enabled". Used by ``param_and_grad_buffer`` (buffer allocation),
   ``p2p_communication`` (pipeline shapes), ``distrib_optimizer`` (checkpoint buffers).
2. A ``TorchFunctionMode`` (``_CudaToCpuMode``), pushed on the mode stack, rewrites
   CUDA device arguments to ``"cpu"``:
   - the ``device=`` keyword of every torch function when it names CUDA (``"cuda"``,
     ``"cuda:N"``, ``torch.device("cuda")``) or is a bare int (which means a CUDA
     ordinal). Used by the optimizers' ``found_inf``/``_scale`` tensors,
     ``schedules.forward_backward_*`` (``total_num_tokens``), ``clip_grads``;
   - ``Tensor.to(<cuda device>)`` and ``Tensor.cuda()`` become moves to the CPU.
   Each of these would otherwise raise, so the mode changes no call that works on CPU.
3. The same mode makes ``Tensor.type()`` (no argument) of a CPU floating-point tensor
   report the CUDA type name (``torch.cuda.BFloat16Tensor``...). ``DistributedOptimizer``
   and ``Float16OptimizerWithFloat16Params`` pick the fp32-main-parameter branch with this
   string test and raise ``TypeError`` for anything else; ``clip_grads`` asserts it.
   This is the one rewrite of a call that does not raise on CPU; ``Tensor.type()`` without
   arguments is used nowhere in SDP4Bit.
4. The "CUDA" random state is the CPU generator's, and
5. ``torch.cuda.current_stream()`` is a stream that never waits: both are the stubs the
   CUDA dry run applies too (``cuda_stubs.py``, [Note: the CUDA runtime on the CPU]).
6. megatron-core's causal attention mask, ``transformer.utils.get_default_causal_mask(sq)``,
   is replaced by one that builds the same boolean mask on the CPU, in ``transformer.utils``
   and in ``fusions.fused_softmax`` (which imported the name and is its only caller).
   [Note: the causal mask in the backward pass]
   The function is the same in 0.16.1 and 0.19.2: ``torch.triu(torch.ones(sq, sq,
   device="cuda"), diagonal=1).bool()``. The mode of item 2 rewrites that call in the
   forward pass, but activation recompute (``--recompute-granularity selective`` recomputes
   ``core_attn``, ``full`` whole layers) runs the attention again inside the backward pass,
   which never sees the mode: ``torch.autograd.backward`` is itself a torch function, and a
   ``TorchFunctionMode`` is off while it handles one, so the whole backward pass runs
   without it unless item 7 enters it again (the replacement keeps the mask right either
   way). ``get_sliding_window_causal_mask`` has the same CUDA call
   but is only reached with sliding-window attention, which the trainer does not configure.

7. The device rewrite of item 2 is on again inside the backward pass.
   [Note: the backward pass in CPU mode]
   ``torch.autograd.backward`` and ``torch.autograd.grad`` both end in
   ``torch.autograd._engine_run_backward`` (a plain function of ``torch.autograd``, not a
   torch function), which CPU mode wraps to run with the mode entered again. Autograd runs
   the backward of CPU tensors on the calling thread, so the Python of the backward pass
   (custom functions' ``backward``, recomputed layers, gradient hooks) sees the rewrite as the
   forward pass does: megatron-core's ``_AllToAll.backward`` (the expert dispatchers)
   allocates with ``device=torch.cuda.current_device()`` there, and raised "Cannot access
   accelerator device when none is available" without it.
8. Mixture-of-experts layers run.
   [Note: mixture-of-experts on the CPU]
   Three more CUDA-only spots of megatron-core's MoE code: the alltoall token dispatcher
   builds a ``torch.cuda.Stream`` for its device-to-host copies when constructed (the stub
   stream of item 5, ``cuda_stubs.Stream``, stands in); it moves the all-to-all's split
   sizes to the host as NumPy arrays only when they are CUDA tensors
   (``moe_utils.maybe_move_tensor_to_cpu``), so on the CPU they stay tensors, which gloo's
   ``all_to_all_single`` does not take: the replacement converts them as it would a CUDA
   tensor; and 0.16.1's router computes its logits through ``te_general_gemm``, a name
   ``moe_utils`` defines only when Transformer Engine imports (a ``NameError`` without it):
   the replacement computes the same products in the router dtype with torch (applied only
   where the name is undefined; 0.19.2 defines it as None and takes the same torch path).

9. ``torch.cuda.synchronize()`` returns at once.
   [Note: synchronize in CPU mode]
   CPU work is done when the call that does it returns, so there is nothing to wait for;
   without CUDA the call raises instead. megatron-core's asynchronous checkpoint save calls
   it when it schedules the write (after copying the tensors to the host, and before
   forking the writer: ``TemporalAsyncCaller.schedule_async_call``,
   ``FileSystemWriterAsync.preload_tensors``), so ``--async-save`` needs it
   (integration/async_save.py). The trainer's own calls are guarded by
   ``torch.cuda.is_available()`` and never reach it.

What it needs from the caller, through ordinary megatron-core options (no patch):
``TransformerConfig(use_cpu_initialization=True)``, ``get_gpt_layer_local_spec()``
(no Transformer Engine), no fused kernels (``masked_softmax_fusion``,
``bias_activation_fusion``, ``gradient_accumulation_fusion``... left off), and the
default process group on gloo.

Limits: the mode stack is thread-local, so only the calling thread (the training thread;
megatron-core runs its Python on one thread, and autograd runs CPU backward functions on
it, item 7) sees the rewrite. There is no ``disable``: a process either runs megatron-core on CPU or not.

Quiet: with item 4, megatron-core's RNG tracker forks the CPU generator itself, so its
check "CPU RNG state changed within GPU RNG context" (a ``logging`` warning from
``megatron.core.tensor_parallel.random``, several per step) is always true and says
nothing; CPU mode drops that one message (a logging filter, not a replacement).
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode

from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.cuda_stubs import (
    SHARED_STUBS,
    Stream,
    backward_in_mode,
    cuda_type_name,
    names_cuda,
)
from megatron.sdp4bit.integration.patches import CPU_MODE, MODULE, both, declare, on_torch

__all__ = ["enable_cpu_mode", "cpu_mode_active", "names_cuda"]

_mode: "_CudaToCpuMode | None" = None
_CPU = torch.device("cpu")


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU; see the module docstring (items 2 and 3)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.cuda:
            return torch.Tensor.to(args[0], _CPU, non_blocking=kwargs.get("non_blocking", False))
        if func is torch.Tensor.to and len(args) >= 2 and names_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and args[0].is_floating_point():
                return cuda_type_name(name)
            return name
        return func(*args, **kwargs)


def _router_gating_linear_cpu(inp: torch.Tensor, weight: torch.Tensor,
                              bias: torch.Tensor | None, router_dtype: torch.dtype) -> torch.Tensor:
    """megatron-core's router logits without Transformer Engine: the same products in
    ``router_dtype``; autograd's backward of the casts gives the original's gradients
    (``grad_output @ weight`` cast to the input's dtype, ``grad_output^T @ input`` cast to
    the weight's)."""
    out = inp.to(router_dtype) @ weight.to(router_dtype).t()
    return out if bias is None else out + bias.to(router_dtype)


def _move_splits_to_host_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``maybe_move_tensor_to_cpu`` for a run whose "device" is the CPU:
    what it would do to a CUDA tensor (``as_numpy``: the NumPy array the all-to-all's split
    sizes must be), with no stream to record on."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _engine_run_backward_in_mode(original):
    """[Note: the backward pass in CPU mode]: this module's mode, entered again."""
    return backward_in_mode(original, lambda: _mode)


def _te_general_gemm_undefined() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return not hasattr(moe_utils, "te_general_gemm")


def _default_causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


_MASK_NOTE = "[Note: the causal mask in the backward pass] (integration/cpu_mode.py)"
_MOE_NOTE = "[Note: mixture-of-experts on the CPU] (integration/cpu_mode.py)"
def _synchronize_nothing(device=None) -> None:
    """[Note: synchronize in CPU mode]: no device work to wait for."""


CPU_MODE_STUBS = SHARED_STUBS + (
    declare("cpu.cuda.synchronize", "torch.cuda", "synchronize", MODULE, _synchronize_nothing,
            note="[Note: synchronize in CPU mode] (integration/cpu_mode.py)",
            checked=on_torch("(device)"), scope=CPU_MODE),
    declare("cpu.cuda.Stream", "torch.cuda", "Stream", MODULE, Stream, note=_MOE_NOTE,
            checked=on_torch("(device, priority, **kwargs)"), scope=CPU_MODE),
    declare("cpu.moe_router.router_gating_linear", "megatron.core.transformer.moe.router",
            "router_gating_linear", MODULE, _router_gating_linear_cpu, note=_MOE_NOTE,
            # 0.19.2 defines te_general_gemm (as None) and takes the torch path itself
            checked={"0.16.1": "(inp, weight, bias, router_dtype)"},
            applies=_te_general_gemm_undefined, scope=CPU_MODE),
    declare("cpu.token_dispatcher.maybe_move_tensor_to_cpu",
            "megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
            MODULE, _move_splits_to_host_cpu, note=_MOE_NOTE,
            checked=both("(tensor, as_numpy, record_stream)"), scope=CPU_MODE),
    declare("cpu.autograd._engine_run_backward", "torch.autograd", "_engine_run_backward",
            MODULE, _engine_run_backward_in_mode, wraps=True,
            note="[Note: the backward pass in CPU mode] (integration/cpu_mode.py)",
            checked=on_torch("(t_outputs, *args, **kwargs)"), scope=CPU_MODE),
    declare("cpu.transformer_utils.get_default_causal_mask",
            "megatron.core.transformer.utils", "get_default_causal_mask", MODULE,
            _default_causal_mask_cpu, note=_MASK_NOTE, checked=both("(sq)"),
            scope=CPU_MODE),
    declare("cpu.fused_softmax.get_default_causal_mask", "megatron.core.fusions.fused_softmax",
            "get_default_causal_mask", MODULE, _default_causal_mask_cpu, note=_MASK_NOTE,
            checked=both("(sq)"), scope=CPU_MODE),
)
"""What CPU mode replaces: the shared CUDA stubs and megatron-core's causal mask."""


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_MESSAGE = "CPU RNG state changed within GPU RNG context"


class _DropSameGeneratorWarning(logging.Filter):
    """Drops :data:`_RNG_MESSAGE` (module docstring, "Quiet")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_MESSAGE


def cpu_mode_active() -> bool:
    """Whether :func:`enable_cpu_mode` has switched this process to CPU mode."""
    return _mode is not None


def enable_cpu_mode(*, force: bool = False) -> None:
    """Make megatron-core run on CPU (see the module docstring). Idempotent.

    Refuses with ``RuntimeError`` when CUDA is available, because a GPU run must use
    megatron-core unchanged; ``force=True`` overrides that (for debugging only: tensors
    that megatron-core meant for the GPU then live on the CPU).
    """
    global _mode
    if _mode is not None:
        return
    if torch.cuda.is_available() and not force:
        raise RuntimeError(
            "enable_cpu_mode() refused: CUDA is available, and GPU runs must use megatron-core "
            "unchanged. Run on the GPU without CPU mode, hide the GPUs "
            "(CUDA_VISIBLE_DEVICES=''), or pass force=True to debug on the CPU anyway."
        )
    patches.apply(CPU_MODE_STUBS)  # for the life of the process: there is no disable
    logging.getLogger(_RNG_LOGGER).addFilter(_DropSameGeneratorWarning())
    mode = _CudaToCpuMode()
    mode.__enter__()
    _mode = mode
