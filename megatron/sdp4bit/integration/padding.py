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
import math
import types
from collections.abc import Iterator

from megatron.sdp4bit.comm import divisor_from_config
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.releases import bucket_padding_module


def _padded_math(config: SDP4BitConfig) -> types.SimpleNamespace:
    def lcm(dp_size: int, *rest: int) -> int:
        return math.lcm(dp_size, *rest, divisor_from_config(config, dp_size))

    namespace = types.SimpleNamespace(**{k: getattr(math, k) for k in dir(math) if not k.startswith("_")})
    namespace.lcm = lcm
    return namespace


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
    module = bucket_padding_module()
    previous = module.math
    module.math = _padded_math(config)
    try:
        yield
    finally:
        module.math = previous
