"""What a compiled kernel does per element, read from its PTX and its cubin: the facts the
PTX budget of ``tests/unit/test_triton_compile.py`` holds every kernel to.

[Note: the PTX budget]
A GPU is lent to this project now and then; CI has none. The kernels' speed on a GPU
follows mostly from their structure, which the compiled code shows without running it:

* global memory: how many load and store instructions per element, and how wide each is
  (``ld.global.v4.b32`` moves 16 bytes, ``ld.global.b16`` two): each byte read once and
  written once, with the widest access the data allow;
* no local memory (``.local`` accesses, spills in the cubin's resource usage);
* shared memory and barriers (``st.shared``, ``bar.sync``): a layout conversion or a
  reduction across warps per tile;
* arithmetic per element: the random stream's hash multiplies (``mul.lo`` by the hash
  constants), IEEE divisions, 64-bit integer divisions (a subroutine of ~70 instructions),
  and the number of SASS instructions (what the GPU issues).

Counts are static: an instruction inside a loop counts once. Per element means per
element that one thread holds (``R * GP / (32 * num_warps)``); a kernel that loops over
messages unrolls its loop body (``MESSAGES_PER_PASS`` messages) and has a remainder loop of
one message, so its per-message counts divide by ``MESSAGES_PER_PASS + 1``.

What the proxy cannot see: timing, occupancy as the GPU schedules it (it reports registers,
not how many programs end up resident), whether accesses coalesce in practice (it sees the
width of each thread's access, not the addresses of a warp), L2 behaviour, the clock,
branch divergence, and instructions that a branch skips (a division's slow path counts as
if it ran).
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import tempfile

# The lowbias32 multipliers as PTX prints them (signed decimal): one count per hash round.
_HASH_CONSTANTS = {str(c - (1 << 32) if c >= 1 << 31 else c) for c in (0x7FEB352D, 0x846CA68B)}
_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st)\.global(?:\.[a-z0-9_:]+)*?"
                     r"(?:\.v(\d))?\.[bsuf](8|16|32|64)\s", re.M)


def ptx_facts(ptx: str) -> dict:
    """Counts of the PTX text of one kernel (static, see the module docstring)."""
    loads: collections.Counter = collections.Counter()
    stores: collections.Counter = collections.Counter()
    for kind, vec, bits in _ACCESS.findall(ptx):
        width = int(vec or 1) * int(bits) // 8
        (loads if kind == "ld" else stores)[width] += 1
    multiplies = re.findall(r"\bmul\.lo\.[su]32\s+[^,]+,\s*[^,]+,\s*(-?\d+);", ptx)
    return {
        "global_loads": dict(sorted(loads.items())),  # bytes per access -> instructions
        "global_stores": dict(sorted(stores.items())),
        "local_accesses": len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
        "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
        "shared_stores": len(re.findall(r"\bst\.shared\b", ptx)),
        "hash_multiplies": sum(1 for c in multiplies if c in _HASH_CONSTANTS),
        "float_divisions": len(re.findall(r"\bdiv\.rn\.f32\b", ptx)),
        "int64_divisions": len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx)),
    }


def cubin_facts(cubin: bytes, tools: pathlib.Path) -> dict:
    """Registers, local memory (spills) and SASS instruction count of a cubin, with the
    ``cuobjdump`` that ships with triton (``tools``: its folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(path)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "--dump-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    if not match:
        raise ValueError(f"cuobjdump's resource usage changed format: {usage[-300:]}")
    registers, stack, shared, local = (int(x) for x in match.groups())
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))
    if not instructions:
        raise ValueError("cuobjdump printed no SASS: its format changed, update the parser")
    return {"registers": registers, "stack_bytes": stack, "shared_bytes": shared,
            "local_bytes": local, "sass_instructions": instructions}
