"""The paper's methods as ``pretrain_gpt.py`` flags: Table 1's columns, ZeRO++'s ULq, and
qWD with its rounded target.

Shared by the tools that run every method on the same model (``tools/loss_compare.py``,
``benchmarks/accuracy_study.py``). Gradient groups of 128 on both hops, as every released
script of the paper passes.
"""

from __future__ import annotations

_TLQ = ["--quantized-gradients", "--gq-group-size-intra", "128", "--gq-group-size-inter", "128"]
_QWD = ["--quantized-weights"]

METHOD_FLAGS: dict[str, list[str]] = {
    "baseline": [],
    "qW": _QWD + ["--weight-quantization-mode", "direct"],
    "qWD": _QWD,
    "qWD-rounded": _QWD + ["--weight-difference-target", "rounded-main"],
    "TLq": _TLQ,
    "ULq": _TLQ + ["--gradient-quantization-bits-intra", "4"],
    "TLq-HS": _TLQ + ["--hadamard-transform"],
    "SDP4Bit": _QWD + _TLQ + ["--hadamard-transform"],
}
"""Method name -> its SDP4Bit flags (the rest of the command line is the caller's)."""
