"""64-bit offsets in the compiled CPU kernels (``cpu_kernels.c``).

A production wire buffer exceeds 2**31 bytes (a 2.7B-parameter bucket, several messages),
so every size, count, index and offset in the C kernels is ``int64_t``. Two checks keep it so:

* the source: every 32-bit (or narrower) integer *variable* in the file is one of a short,
  reasoned list per function (flags, bit widths, dtype codes, bit patterns, the hash and its
  uint32 stream index, a code), no ``(int)`` cast exists, and the ctypes signatures pass
  each C parameter with its own width;
* the behaviour: ``tlq_receiver`` sums 523,777 messages whose last one starts beyond 2**31
  bytes. The wire is a sparse anonymous mapping: untouched pages read as the kernel's zero
  page, so it costs no memory, only one pass of reads (~1-2 s); only the last message holds
  data, and the output must be exactly its values. A 32-bit offset reads elsewhere (zeros or
  a crash, hence a subprocess).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
import textwrap

from megatron.sdp4bit.quantization import cpu_kernels

NARROW = r"(?:unsigned\s+int|unsigned|int|int32_t|uint32_t|int16_t|uint16_t|int8_t|uint8_t|short)"
# scope -> 32-bit-or-narrower variables allowed there, and why.
ALLOWED = {
    "bits_to_f32": {"u"},  # an fp32 bit pattern
    "f32_to_bits": {"u"},
    "f16_to_f32": {"h", "sign", "exp", "normal", "small", "special"},  # half/fp32 bit patterns
    "mask_if": {"c"},  # a condition
    # fp32/half bit patterns and their fields (exponent, shift, rounded mantissa, masks)
    "f32_to_f16": {"u", "sign", "normal", "e", "sh", "q", "up", "small", "nan", "is_nan",
                   "is_inf", "is_normal", "is_small"},
    "load_f32": {"dt"},  # dtype code
    "store_f32": {"dt", "u", "r"},  # dtype code, bf16 bit patterns
    "mix32": {"x"},  # the hash state (uint32 arithmetic by design)
    "pair_word": {"p", "k0", "k1"},  # a pair's stream index (< 2**31) and the key words
    "half_uniform": {"m"},  # a 16-bit half of a hash word
    "code_of": {"qm", "q"},  # the code, |q| <= 127
    "#define PAIR_CODES": {"w_", "C0", "C1"},  # hash word; the two codes (bytes)
    "#define PACK_LOOPS": {"stochastic"},  # a flag
    "quantize_group": {"bits", "stochastic", "k0", "k1", "idx0", "qm", "m", "b", "zero"},
    "dequantize_into": {"bits", "mode"},
    "dequantize_sum": {"bits"},
    "message_bytes": {"bits"},
    "hadamard": {"last"},
    "sdp4bit_convert": {"src_dt", "dst_dt"},
    "sdp4bit_qwd_sender": {"main_dt", "replica_dt", "bits", "stochastic", "k0", "k1"},
    "sdp4bit_qwd_receiver": {"replica_dt", "bits", "accumulate"},
    "sdp4bit_tlq_sender": {"dt", "bits", "stochastic", "k0", "k1"},
    "sdp4bit_tlq_middle": {"bits_in", "bits_out", "stochastic", "k0", "k1"},
    "sdp4bit_tlq_receiver": {"out_dt", "bits", "apply_scale", "accumulate"},
}


def _source() -> str:
    text = cpu_kernels.SOURCE.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"^typedef[^;]*;", " ", text, flags=re.M)  # vector types, not variables
    return re.sub(r"//[^\n]*", " ", text)


def _scopes(text: str) -> list[tuple[int, str]]:
    """(offset, name) of each function definition and macro, in order."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(
        r"^[A-Za-z_][\w \t\*]*?\b(\w+)\s*\([^;{}]*\)\s*\{", text, flags=re.M)]
    starts += [(m.start(), "#define " + m.group(1))
               for m in re.finditer(r"^#define\s+(\w+)", text, flags=re.M)]
    return sorted(starts)


def _narrow_variables(text: str) -> dict[str, set[str]]:
    scopes = _scopes(text)
    found: dict[str, set[str]] = {}
    for m in re.finditer(rf"(?<![\w*])(?:const\s+)?{NARROW}\s+(?!\*)([A-Za-z_]\w*)\b(?!\s*\()",
                         text):
        before = [name for start, name in scopes if start <= m.start()]
        found.setdefault(before[-1] if before else "<file>", set()).add(m.group(1))
    return found


def test_sizes_and_offsets_are_64_bit_in_the_c_source() -> None:
    text = _source()
    found = _narrow_variables(text)
    for scope, names in found.items():
        extra = names - ALLOWED.get(scope, set())
        assert not extra, (f"cpu_kernels.c, {scope}: 32-bit integer(s) {sorted(extra)}: sizes, "
                           "counts, indices and offsets must be int64_t (a wire buffer exceeds "
                           "2**31 bytes); a flag or bit pattern goes into ALLOWED with its reason")
    assert found["sdp4bit_tlq_middle"] == ALLOWED["sdp4bit_tlq_middle"]  # the parser sees them
    assert not re.search(r"\(\s*(?:int|unsigned|long)\s*\)", text), "an (int) cast narrows"


def test_ctypes_signatures_match_the_c_prototypes() -> None:
    """Each exported function's parameters cross ctypes with the C width (a size passed as
    c_int would be cut to 32 bits)."""
    widths = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "uint32_t": ctypes.c_uint32,
              "float": ctypes.c_float}
    text = _source()
    for name, argtypes in cpu_kernels._SIGNATURES.items():
        params = re.search(rf"\bint\s+{name}\s*\(([^)]*)\)", text).group(1).split(",")
        assert len(params) == len(argtypes), name
        for param, argtype in zip(params, argtypes):
            ctype = re.sub(r"\bconst\b|\w+$", "", param.strip()).strip()
            expected = ctypes.c_void_p if "*" in ctype else widths[ctype]
            assert argtype is expected, f"{name}: {param.strip()} passed as {argtype.__name__}"


_BEYOND_2GIB = textwrap.dedent("""
    import mmap, sys, torch
    from megatron.sdp4bit.quantization import cpu_kernels
    from megatron.sdp4bit.quantization import format as fmt

    G = 4096                     # one group of 8-bit codes per message
    nbytes = fmt.message_nbytes(G, 8, G)
    n_in = (1 << 31) // nbytes + 2
    assert (n_in - 1) * nbytes >= 1 << 31
    noreserve = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value
    mm = mmap.mmap(-1, n_in * nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | noreserve)
    wire = torch.frombuffer(mm, dtype=torch.uint8)  # zeros: scale 0, every value 0
    last = wire[(n_in - 1) * nbytes: n_in * nbytes]
    last[:4].view(torch.float32).fill_(1.0)
    values = torch.arange(G) % 100
    last[4:].copy_((values + 128).to(torch.uint8))  # code - 128 = value
    out = torch.full((G,), float("nan"))
    cpu_kernels.tlq_receiver(wire, out, n_in=n_in, bits=8, group_size=G, hadamard_block=0)
    bad = int((out != values.float()).sum())
    print("mismatches", bad)
    sys.exit(1 if bad else 0)
""")


def test_cpu_kernel_reads_a_message_beyond_2gib() -> None:
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    done = subprocess.run([sys.executable, "-c", _BEYOND_2GIB], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert "mismatches 0" in done.stdout


def test_the_source_check_sees_narrowing() -> None:
    """The source check has teeth: a narrowed loop counter and a narrowing cast are found."""
    text = _source().replace("for (int64_t k = 0; k < count; k++)",
                             "for (int k = 0; k < count; k++)")
    assert "k" in _narrow_variables(text)["dequantize_sum"]
    for cast in ("(int)", "( unsigned )", "(long)"):
        assert re.search(r"\(\s*(?:int|unsigned|long)\s*\)", f"x = {cast}y;"), cast
