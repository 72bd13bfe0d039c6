"""CPU development mode: run megatron-core (0.16.1, 0.19.2) on CPU with the gloo backend.

megatron-core assumes CUDA: it allocates its buffers on ``torch.cuda.current_device()``,
creates small bookkeeping tensors with ``device="cuda"``, and recognises mixed-precision
parameters by ``param.type() == "torch.cuda.BFloat16Tensor"``. On a CUDA-less build every
one of those calls raises or takes the wrong branch. ``enable_cpu_mode()`` is the only
place in SDP4Bit that changes that; nothing else in the package touches devices, and a
run with CUDA never calls it (it refuses to switch on when CUDA is available).

What it changes (all in this process, in the thread that calls it, until exit), each a
replacement of the table (``patches.py``) but item 2 and 3, a mode:

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
   without it. ``get_sliding_window_causal_mask`` has the same CUDA call
   but is only reached with sliding-window attention, which the trainer does not configure.

What it needs from the caller, through ordinary megatron-core options (no patch):
``TransformerConfig(use_cpu_initialization=True)``, ``get_gpt_layer_local_spec()``
(no Transformer Engine), no fused kernels (``masked_softmax_fusion``,
``bias_activation_fusion``, ``gradient_accumulation_fusion``... left off), and the
default process group on gloo.

Limits: the mode stack is thread-local, so only the calling thread (the training thread;
megatron-core runs its Python on one thread) sees the rewrite, and not inside the backward
pass (item 6): the Python that runs there (recomputed layers, custom autograd functions'
``backward``, gradient hooks) gets the patched functions of items 1, 4, 5 and 6 but no
rewrite of ``device=`` arguments, so a CUDA-only call there needs a patch of its own.
There is no ``disable``: a process either runs megatron-core on CPU or not.

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
from megatron.sdp4bit.integration.cuda_stubs import SHARED_STUBS, cuda_type_name, names_cuda
from megatron.sdp4bit.integration.patches import CPU_MODE, MODULE, both, declare

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


def _default_causal_mask_cpu(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


_MASK_NOTE = "[Note: the causal mask in the backward pass] (integration/cpu_mode.py)"
CPU_MODE_STUBS = SHARED_STUBS + (
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
