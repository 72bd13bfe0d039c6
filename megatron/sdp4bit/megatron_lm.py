"""Run a Megatron-LM training script with SDP4Bit: its flags plus SDP4Bit's, nothing else changed.

    torchrun --nproc-per-node 8 -m megatron.sdp4bit.megatron_lm pretrain_gpt.py \\
        <their Megatron-LM flags> --use-distributed-optimizer --bf16 \\
        --quantized-weights --quantized-gradients --hadamard-transform

The first argument is the script (a path to a ``.py`` file) or a module (``pkg.pretrain``);
the rest is its command line, which Megatron-LM's parser reads with SDP4Bit's flag group
added. This is :func:`megatron.sdp4bit.integration.megatron_lm.enable` followed by the
script, run as ``__main__`` (docs/megatron_lm.md).
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print("usage: python -m megatron.sdp4bit.megatron_lm SCRIPT.py|MODULE [FLAGS...]",
              file=sys.stderr)
        raise SystemExit(2)
    target, flags = argv[0], argv[1:]
    from megatron.sdp4bit.integration import megatron_lm

    try:
        megatron_lm.enable()
    except RuntimeError as err:
        print(f"megatron_lm: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if target.endswith(".py") or os.path.isfile(target):
        if not os.path.isfile(target):
            print(f"megatron_lm: error: {target} is not a file", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [target, *flags]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python SCRIPT`
        runpy.run_path(target, run_name="__main__")
    else:
        sys.argv = [target, *flags]
        runpy.run_module(target, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
