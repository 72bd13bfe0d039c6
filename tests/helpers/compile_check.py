"""Compile every Triton kernel for a CUDA target without a GPU (ptxas ships with triton).

Run as a script, without TRITON_INTERPRET: Triton picks interpreted or compiled kernels when
the kernel module is imported. Each launch that the host wrappers make is intercepted and
compiled ahead of time for ``--arch`` (e.g. 90 = Hopper) instead of being run. The launch is
specialised as Triton's launcher specialises it (its own binder: 16-byte divisibility of
aligned pointers and of integers, integers equal to 1 as constants), so what compiles here
is what a GPU would run for the same arguments; the sizes below are chosen so that no size
argument is 1 (production sizes never are) and every size argument is a multiple of 16, as
in production buckets (the padding rule makes shards whole numbers of groups, and groups
come in powers of two), so that the alignment Triton proves is the production one. Prints
one JSON line per compiled kernel: name, arch, cubin size, the PTX facts the numerics rely
on (IEEE division, no approximate instructions, where fused multiply-adds appear), the
32-bit offset arithmetic of the IR (``triton_ir.offset_violations``), and the structural
facts of the PTX budget (``ptx_budget``: accesses, barriers, hash rounds, registers,
spills, SASS instructions) with the elements each thread holds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run without TRITON_INTERPRET=1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime import jit  # noqa: E402

from megatron.sdp4bit.quantization import format as fmt  # noqa: E402
from megatron.sdp4bit.quantization import triton_kernels as tk  # noqa: E402

from tests.helpers import ptx_budget as _ptx_budget  # noqa: E402
from tests.helpers import triton_ir as _triton_ir  # noqa: E402

def _compile_instead_of_run(arch: int, seen: list[dict]):
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    tools = pathlib.Path(get_ptxas(arch).path).parent  # ptxas and cuobjdump ship together

    def run(self, *args, grid, warmup, **kwargs):
        # JITFunction.run's own steps, minus the device: bind and specialise the arguments
        # with the launcher's binder, pack them, compile for the target.
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound,
                                                                specialization, options)
        kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=target,
                                options=options.__dict__)
        ptx = kernel.asm["ptx"]
        seen.append({
            "kernel": self.fn.__name__, "arch": arch, "cubin_bytes": len(kernel.asm["cubin"]),
            "float_divs": sorted(set(re.findall(r"\bdiv\.[a-z]+\.f32", ptx))),
            "approx": len(re.findall(r"\.approx\.", ptx)),
            "fma_f32": len(re.findall(r"\bfma\.rn\.f32", ptx)),
            "divisible_by_16": sorted(name for (i,), attr in attrs.items()
                                      for name in [self.params[i].name]
                                      if ["tt.divisibility", 16] in attr),
            "int32_offsets": _triton_ir.offset_violations(kernel.asm["ttir"]),
            "constexprs": {self.params[path[0]].name: v for path, v in constexprs.items()
                           if isinstance(v, (int, bool))},
            "num_warps": options.num_warps,
            **_ptx_budget.ptx_facts(ptx),
            **_ptx_budget.cubin_facts(kernel.asm["cubin"], tools),
        })

    return run


def launch_all(bits: int, hadamard: int, in_dtype: torch.dtype, out_dtype: torch.dtype,
               stochastic: bool) -> None:
    """Call every host wrapper once on small CPU tensors (nothing runs: launches compile).

    The layouts of production, at sizes whose size arguments are multiples of 16 (none is
    1): qWD shards of 16 groups of 2048; TLq with M=2 blocks per destination, N=2
    destinations and P=2 slices of 16 groups of 128, two messages per hop. tlq_sender
    writes the 8-bit intra-node hop, tlq_middle and tlq_receiver the ``bits`` inter-node
    hop."""
    nw = 16 * 2 * 2048  # qWD: 2 shards of 16 groups
    x = torch.randn(nw).to(in_dtype)
    replica = torch.randn(nw).to(torch.bfloat16)
    out = torch.empty(fmt.message_nbytes(nw, bits, 2048), dtype=torch.uint8)
    tk.qwd_sender(x, replica, out, bits=bits, group_size=2048, stochastic=stochastic, seed=1)
    tk.qwd_sender(x, None, out, bits=bits, group_size=2048, stochastic=stochastic, seed=1)
    wire = torch.empty(2 * fmt.message_nbytes(nw // 2, bits, 2048), dtype=torch.uint8)
    tk.qwd_receiver(wire, replica, world=2, bits=bits, group_size=2048)
    g = 128
    n = 8 * 16 * g
    x = x[:n]
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
    parser.add_argument("--arch", type=int)
    parser.add_argument("--bits", type=int)
    parser.add_argument("--hadamard", type=int)
    parser.add_argument("--in-dtype")
    parser.add_argument("--out-dtype")
    parser.add_argument("--nearest", action="store_true")
    parser.add_argument("--case", action="append", default=[],
                        metavar="ARCH,BITS,H,IN,OUT,ROUNDING",
                        help="instead of the flags above, one case per --case (e.g. "
                             "90,4,32,float32,float32,stochastic), all in this process; "
                             "each JSON line then names its case")
    a = parser.parse_args()
    if a.case:
        cases = [c.split(",") for c in a.case]
        if any(len(c) != 6 or c[5] not in ("stochastic", "nearest") for c in cases):
            parser.error(f"--case takes ARCH,BITS,H,IN,OUT,stochastic|nearest: {a.case}")
    elif None in (a.arch, a.bits, a.hadamard, a.in_dtype, a.out_dtype):
        parser.error("give --arch, --bits, --hadamard, --in-dtype and --out-dtype, or --case")
    else:
        cases = [[a.arch, a.bits, a.hadamard, a.in_dtype, a.out_dtype,
                  "nearest" if a.nearest else "stochastic"]]
    for arch, bits, hadamard, in_dtype, out_dtype, rounding in cases:
        seen: list[dict] = []
        jit.JITFunction.run = _compile_instead_of_run(int(arch), seen)
        launch_all(int(bits), int(hadamard), getattr(torch, in_dtype),
                   getattr(torch, out_dtype), rounding == "stochastic")
        for entry in seen:
            if a.case:
                entry["case"] = ",".join(map(str, (arch, bits, hadamard, in_dtype, out_dtype,
                                                   rounding)))
            print(json.dumps(entry))


if __name__ == "__main__":
    main()
