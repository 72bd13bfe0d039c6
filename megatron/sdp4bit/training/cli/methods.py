"""The paper's methods as ``pretrain_gpt.py`` flags: Table 1's columns, ZeRO++'s ULq, qWD
with its rounded target, and SDP4Bit below its 4 inter-node bits: error feedback on the
inter-node hop (``-EF``, the option's defaults; ``-EF-nearest`` with its round-to-nearest
compensated quantization) and 2-bit inter-node gradients (``-2bit``).

Shared by the tools that run every method on the same model (``tools/loss_compare.py``,
``benchmarks/accuracy_study.py``). Gradient groups of 128 on both hops, as every released
script of the paper passes.
"""

from __future__ import annotations

_TLQ = ["--quantized-gradients", "--gq-group-size-intra", "128", "--gq-group-size-inter", "128"]
_QWD = ["--quantized-weights"]
_SDP4BIT = _QWD + _TLQ + ["--hadamard-transform"]
_EF = ["--gradient-error-feedback"]
_2BIT = ["--gradient-quantization-bits-inter", "2"]

METHOD_FLAGS: dict[str, list[str]] = {
    "baseline": [],
    "qW": _QWD + ["--weight-quantization-mode", "direct"],
    "qWD": _QWD,
    "qWD-rounded": _QWD + ["--weight-difference-target", "rounded-main"],
    "TLq": _TLQ,
    "ULq": _TLQ + ["--gradient-quantization-bits-intra", "4"],
    "TLq-HS": _TLQ + ["--hadamard-transform"],
    "SDP4Bit": _SDP4BIT,
    "SDP4Bit-EF": _SDP4BIT + _EF,
    "SDP4Bit-2bit": _SDP4BIT + _2BIT,
    "SDP4Bit-2bit-EF": _SDP4BIT + _2BIT + _EF,
    "SDP4Bit-2bit-EF-nearest": _SDP4BIT + _2BIT + _EF
    + ["--gradient-error-feedback-rounding", "nearest"],
}
"""Method name -> its SDP4Bit flags (the rest of the command line is the caller's)."""
