"""Bucket padding: make every DDP bucket a whole number of quantization groups per shard.

[Note: why padding goes around DDP construction]
``_ParamAndGradBuffer.__init__`` lays out its buckets and allocates ``param_data`` /
``grad_data`` in one go; the end of each bucket is padded to a multiple of
``math.lcm(dp_size, 128)`` (``lcm(dp_size, 128, 2**16)`` with
``pad_buckets_for_high_nccl_busbw``) by a closure local to ``__init__``. No configuration
option reaches that divisor, and a buffer cannot be re-laid out once built (its views are
already the model's ``param.data`` and ``param.main_grad``). The only name the closure looks
up at call time is the module global ``math`` of ``param_and_grad_buffer``, so, while DDP is
being built inside :func:`sdp4bit_padding`, that global is a namespace whose ``lcm`` also
takes in :func:`~megatron.sdp4bit.comm.padding.divisor_from_config` for the buffer's DP size
(the first argument megatron-core passes). Everything else in it is the real ``math``. The
previous value is restored on exit, and :func:`~megatron.sdp4bit.integration.install_sdp4bit`
checks every bucket, so a layout built outside the context is refused with the fix, never
used unpadded.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator

from megatron.sdp4bit.comm import divisor_from_config
from megatron.sdp4bit.config import SDP4BitConfig


def _padded_math(config: SDP4BitConfig) -> types.SimpleNamespace:
    def lcm(dp_size: int, *rest: int) -> int:
        return math.lcm(dp_size, *rest, divisor_from_config(config, dp_size))

    namespace = types.SimpleNamespace(**{k: getattr(math, k) for k in dir(math) if not k.startswith("_")})
    namespace.lcm = lcm
    return namespace


@contextlib.contextmanager
def sdp4bit_padding(config: SDP4BitConfig) -> Iterator[None]:
    """Build megatron-core's ``DistributedDataParallel`` inside this to pad its buckets.

    With nothing quantized (``config.enabled`` False) it changes nothing. Not re-entrant
    across threads (DDP construction is single-threaded). See [Note: why padding goes
    around DDP construction].
    """
    if not config.enabled:
        yield
        return
    from megatron.core.distributed import param_and_grad_buffer

    previous = param_and_grad_buffer.math
    param_and_grad_buffer.math = _padded_math(config)
    try:
        yield
    finally:
        param_and_grad_buffer.math = previous
