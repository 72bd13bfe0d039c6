"""Bucket padding: make every DDP bucket a whole number of quantization groups per shard.

[Note: why padding goes around DDP construction]
megatron-core lays out a buffer's buckets once, when DDP is built, and pads the end of each
bucket to a multiple of ``math.lcm(dp_size, 128)`` (``lcm(dp_size, 128, 2**16)`` with
``pad_buckets_for_high_nccl_busbw``). No configuration option reaches that divisor, and a
buffer cannot be re-laid out once built (its views are already the model's ``param.data``
and ``param.main_grad``). The divisor is computed by a call to the global ``math`` of one
megatron-core module, looked up at call time (``releases.bucket_padding_module``: the
closure in ``_ParamAndGradBuffer.__init__`` in 0.16.1; ``optimizer/param_layout.py``'s
``bucket_end_divisor`` in 0.19.2, called by ``DistributedOptimizer.compute_full_param_layout``
from DDP's constructor). While DDP (and, in 0.19.2, a layout computed by the caller) is
built inside :func:`sdp4bit_padding`, that global is a namespace whose ``lcm`` also takes in
:func:`~megatron.sdp4bit.comm.padding.divisor_from_config` for the buffer's DP size (the
first argument megatron-core passes, in both releases). Everything else in it is the real
``math``. The previous value is restored on exit, and
:func:`~megatron.sdp4bit.integration.install_sdp4bit` checks every bucket, so a layout built
outside the context is refused with the fix, never used unpadded.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from megatron.sdp4bit.comm import divisor_from_config
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.patches import MODULE, PADDING, declare
from megatron.sdp4bit.integration.releases import bucket_padding_module


def _padded_math(original: types.ModuleType, *, config: SDP4BitConfig) -> types.SimpleNamespace:
    """The module's ``math`` with an ``lcm`` that also takes in the quantizers' divisor."""

    def lcm(dp_size: int, *rest: int) -> int:
        return original.lcm(dp_size, *rest, divisor_from_config(config, dp_size))

    names = {k: getattr(original, k) for k in dir(original) if not k.startswith("_")}
    return types.SimpleNamespace(**{**names, "lcm": lcm})


def _is_padding_module(name: str):
    return lambda: bucket_padding_module().__name__ == name


_NOTE = "[Note: why padding goes around DDP construction] (integration/padding.py)"
_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_LAYOUT = "megatron.core.optimizer.param_layout"
PADDING = (
    declare("padding.param_and_grad_buffer.math", _BUFFER, "math", MODULE, _padded_math,
            wraps=True, note=_NOTE, witness="_ParamAndGradBuffer",
            checked={"0.16.1": "(ddp_config, param_dtype, grad_dtype, params, "
                               "data_parallel_group, bucket_size, param_to_name, "
                               "gradient_scaling_factor, param_indices, nccl_ub, "
                               "pg_collection)"},
            applies=_is_padding_module(_BUFFER), scope=PADDING),
    declare("padding.param_layout.math", _LAYOUT, "math", MODULE, _padded_math, wraps=True,
            note=_NOTE, witness="bucket_end_divisor",
            checked={"0.19.2": "(data_parallel_world_size, pad_for_high_nccl_busbw)"},
            applies=_is_padding_module(_LAYOUT), scope=PADDING),
)
"""Exactly one applies: the module whose ``math`` gives the bucket-end divisor."""


@contextlib.contextmanager
def sdp4bit_padding(config: SDP4BitConfig) -> Iterator[None]:
    """Build megatron-core's ``DistributedDataParallel`` inside this to pad its buckets
    (with 0.19.2, also ``DistributedOptimizer.compute_full_param_layout`` when the caller
    computes the layout and passes it to DDP, as Megatron-LM's training loop does).

    With nothing quantized (``config.enabled`` False) it changes nothing. Not re-entrant
    across threads (DDP construction is single-threaded). See [Note: why padding goes
    around DDP construction].
    """
    if not config.enabled:
        yield
        return
    entry = next(e for e in PADDING if patches.applies(e))
    with patches.applied([entry.on(config=config)]):
        yield
