"""Fused Triton kernels of the quantized collectives, one per reference operation.

Each function has the signature and semantics of its namesake in :mod:`.reference`;
:mod:`.ops` dispatches here for CUDA tensors (or on CPU under ``TRITON_INTERPRET=1``). The
kernels live in :mod:`.triton_qwd` (weight all-gather) and :mod:`.triton_tlq` (gradient
reduce-scatter), their shared pieces in :mod:`.triton_common`; read the latter's docstring
for which results are bit-identical to the reference and which agree within rounding.
"""

from megatron.sdp4bit.quantization.triton_qwd import qwd_receiver, qwd_sender
from megatron.sdp4bit.quantization.triton_tlq import tlq_middle, tlq_receiver, tlq_sender

__all__ = ["qwd_receiver", "qwd_sender", "tlq_middle", "tlq_receiver", "tlq_sender"]
