"""Compile every Triton kernel for a CUDA target without a GPU (ptxas ships with triton).

Run as a script, without TRITON_INTERPRET: Triton picks interpreted or compiled kernels when
the kernel module is imported. Each launch that the host wrappers make is intercepted and
compiled ahead of time for ``--arch`` (e.g. 90 = Hopper) instead of being run. Prints one
JSON line per compiled kernel: name, arch, cubin size, and the PTX facts the numerics rely
on (IEEE division, no approximate instructions, where fused multiply-adds appear).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime import jit  # noqa: E402

from megatron.sdp4bit.quantization import format as fmt  # noqa: E402
from megatron.sdp4bit.quantization import triton_kernels as tk  # noqa: E402

_OPTION_NAMES = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")


def _compile_instead_of_run(arch: int, seen: list[dict]):
    target = GPUTarget("cuda", arch, 32)

    def run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTION_NAMES}
        bound = dict(zip([p.name for p in self.params], args), **kwargs)
        signature, constexprs = {}, {}
        for p in self.params:
            value = bound[p.name]
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", value
            else:
                signature[p.name] = jit.mangle_type(value, False)
        kernel = triton.compile(ASTSource(self, signature, constexprs), target=target,
                                options=options)
        ptx = kernel.asm["ptx"]
        seen.append({
            "kernel": self.fn.__name__, "arch": arch, "cubin_bytes": len(kernel.asm["cubin"]),
            "float_divs": sorted(set(re.findall(r"\bdiv\.[a-z]+\.f32", ptx))),
            "approx": len(re.findall(r"\.approx\.", ptx)),
            "fma_f32": len(re.findall(r"\bfma\.rn\.f32", ptx)),
            "constexprs": {k: v for k, v in constexprs.items() if isinstance(v, (int, bool))},
        })

    return run


def launch_all(bits: int, hadamard: int, in_dtype: torch.dtype, out_dtype: torch.dtype,
               stochastic: bool) -> None:
    """Call every host wrapper once on small CPU tensors (nothing runs: launches compile)."""
    n, g = 4096, 128
    x = torch.randn(n).to(in_dtype)
    replica = torch.randn(n).to(torch.bfloat16)
    out = torch.empty(fmt.message_nbytes(n, bits, 2048), dtype=torch.uint8)
    tk.qwd_sender(x, replica, out, bits=bits, group_size=2048, stochastic=stochastic, seed=1)
    tk.qwd_sender(x, None, out, bits=bits, group_size=2048, stochastic=stochastic, seed=1)
    wire = torch.empty(2 * fmt.message_nbytes(n // 2, bits, 2048), dtype=torch.uint8)
    tk.qwd_receiver(wire, replica, world=2, bits=bits, group_size=2048)
    msg = n // 4  # M=2 blocks per destination, N=2 destinations, P=2 slices
    send = torch.empty(4 * fmt.message_nbytes(msg, 8, g), dtype=torch.uint8)
    tk.tlq_sender(x, send, num_dests=2, blocks_per_dest=2, slices=2, bits=8, group_size=g,
                  hadamard_block=hadamard, stochastic=stochastic, seed=3)
    mid = torch.empty(2 * fmt.message_nbytes(msg // 2, bits, g), dtype=torch.uint8)
    tk.tlq_middle(send[: 2 * fmt.message_nbytes(msg, 8, g)], mid, n_in=2, numel=msg, bits_in=8,
                  group_size_in=g, n_out=2, bits_out=bits, group_size_out=g,
                  stochastic=stochastic, seed=4)
    shard = torch.empty(msg // 2, dtype=out_dtype)
    tk.tlq_receiver(mid, shard, n_in=2, bits=bits, group_size=g, hadamard_block=hadamard,
                    scale=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", type=int, required=True)
    parser.add_argument("--bits", type=int, required=True)
    parser.add_argument("--hadamard", type=int, required=True)
    parser.add_argument("--in-dtype", required=True)
    parser.add_argument("--out-dtype", required=True)
    parser.add_argument("--nearest", action="store_true")
    a = parser.parse_args()
    seen: list[dict] = []
    jit.JITFunction.run = _compile_instead_of_run(a.arch, seen)
    launch_all(a.bits, a.hadamard, getattr(torch, a.in_dtype), getattr(torch, a.out_dtype),
               not a.nearest)
    for entry in seen:
        print(json.dumps(entry))


if __name__ == "__main__":
    main()
