"""The fused Triton kernels against the torch references, in the Triton interpreter on CPU.

The kernels must reproduce the reference's bytes exactly, with round-to-nearest and with
stochastic rounding (they evaluate the same counter hash), with and without the Hadamard
transform (the same butterflies in the same order). Sizes are tiny: the interpreter runs
each program in numpy.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be tested")
if os.environ["TRITON_INTERPRET"] != "1":
    pytest.skip("TRITON_INTERPRET is not 1: these tests run the kernels in the interpreter "
                "(tests/gpu runs them compiled)", allow_module_level=True)

from megatron.sdp4bit.quantization import format as fmt  # noqa: E402
from megatron.sdp4bit.quantization import ops  # noqa: E402
from megatron.sdp4bit.quantization import reference as ref  # noqa: E402
from megatron.sdp4bit.quantization import triton_kernels as tk  # noqa: E402
from dev import kernel_checks as kc  # noqa: E402

CPU = "cpu"
# Seeds exercise both 32-bit words of the stream key, including values >= 2**31 in each.
SEEDS = [12345, (0x9E3779B9 << 32) | 0x80000001]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _ids(value):
    return str(value)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("replica", ["bf16", "fp32", None], ids=["bf16", "fp32", "direct"])
@pytest.mark.parametrize("bits,group,numel", [(4, 64, 192), (8, 64, 192), (4, 96, 192),
                                              (2, 64, 192), (2, 96, 192),
                                              (4, 2048, 4096)], ids=_ids)
def test_qwd_sender(bits, group, numel, replica, stochastic):
    for seed in SEEDS:
        kc.check_qwd_sender(CPU, numel=numel, bits=bits, group=group,
                            replica_dtype=DTYPES.get(replica), stochastic=stochastic,
                            seed=seed)


@pytest.mark.parametrize("replica", ["bf16", "fp16"])
def test_qwd_sender_of_rounded_main_weights(replica):
    """qWD's 'rounded-main' target: 16-bit main weights, zero differences in every group."""
    for seed in SEEDS:
        kc.check_qwd_sender(CPU, numel=4096, bits=4, group=2048,
                            replica_dtype=DTYPES[replica], stochastic=True, seed=seed,
                            rounded_main=True)


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
@pytest.mark.parametrize("bits,group,world", [(4, 64, 1), (4, 64, 3), (8, 32, 3),
                                              (2, 64, 3), (2, 96, 2),
                                              (4, 96, 2)], ids=_ids)
def test_qwd_receiver(bits, group, world, dtype, accumulate):
    kc.check_qwd_receiver(CPU, world=world, shard=2 * group, bits=bits, group=group,
                          replica_dtype=DTYPES[dtype], accumulate=accumulate, seed=world)


# (blocks_per_dest M, num_dests N, slices P, chunk c): the two-level layout, N=1, M=1,
# pipelined, and a chunk smaller than a group (groups then span chunks).
LAYOUTS = [(2, 2, 1, 64), (2, 3, 2, 64), (1, 4, 1, 128), (3, 1, 2, 64), (2, 2, 2, 32)]


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("hadamard", [0, 32, 4], ids=["noH", "H32", "H4"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_tlq_sender(layout, bits, hadamard, stochastic):
    blocks, dests, slices, chunk = layout
    for dtype in DTYPES.values():
        kc.check_tlq_sender(CPU, blocks=blocks, dests=dests, slices=slices, chunk=chunk,
                            bits=bits, group=64, hadamard=hadamard, dtype=dtype,
                            stochastic=stochastic, seed=SEEDS[1])


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("n_in,n_out", [(1, 1), (3, 1), (2, 2), (4, 2)], ids=_ids)
@pytest.mark.parametrize("bits_in,group_in,bits_out,group_out",
                         [(8, 64, 4, 64), (4, 64, 8, 64), (8, 128, 4, 64), (8, 32, 4, 64)],
                         ids=_ids)
def test_tlq_middle(bits_in, group_in, bits_out, group_out, n_in, n_out, stochastic):
    kc.check_tlq_middle(CPU, n_in=n_in, numel=256, bits_in=bits_in, group_in=group_in,
                        n_out=n_out, bits_out=bits_out, group_out=group_out,
                        stochastic=stochastic, seed=SEEDS[0] + n_in)


def test_tlq_middle_groups_not_a_power_of_two():
    """Groups of 96 fill 128-lane tiles: the padding lanes must not enter a group's absmax."""
    for n_in, n_out, bits_out in ((1, 1, 8), (3, 2, 4), (2, 2, 2)):
        kc.check_tlq_middle(CPU, n_in=n_in, numel=384, bits_in=8, group_in=96, n_out=n_out,
                            bits_out=bits_out, group_out=96, stochastic=True, seed=7,
                            nan_group=1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("scale,accumulate", [(1.0, False), (1 / 3, False), (0.25, True)],
                         ids=["sum", "mean3", "mean4-add"])
@pytest.mark.parametrize("hadamard", [0, 32, 8], ids=["noH", "H32", "H8"])
@pytest.mark.parametrize("bits,n_in", [(2, 1), (2, 3), (4, 1), (4, 3), (8, 2)],
                         ids=_ids)
def test_tlq_receiver(bits, n_in, hadamard, scale, accumulate, dtype):
    kc.check_tlq_receiver(CPU, n_in=n_in, numel=256, bits=bits, group=64, hadamard=hadamard,
                          scale=scale, accumulate=accumulate, dtype=DTYPES[dtype], seed=n_in)


# ------------------------------------------------------------------------ NaN and Inf


def _nan_scales(wire, count, numel, bits, group):
    scales, payload = fmt.split_messages(wire, count, numel, bits, group)
    codes = fmt.unpack_codes(payload, bits).view(count, -1, group)
    return torch.isnan(scales), codes


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_senders_mark_nonfinite_groups(bits):
    """NaN in the first group and Inf in the last: scale NaN and q = 0 there, others intact."""
    kc.check_qwd_sender(CPU, numel=192, bits=bits, group=64, replica_dtype=torch.bfloat16,
                        stochastic=True, seed=1, nonfinite=True)
    kc.check_tlq_sender(CPU, blocks=2, dests=2, slices=1, chunk=64, bits=bits, group=64,
                        hadamard=32, dtype=torch.float32, stochastic=False, seed=1,
                        nonfinite=True)
    main = torch.randn(192)
    main[5], main[190] = float("nan"), float("inf")
    wire = torch.empty(fmt.message_nbytes(192, bits, 64), dtype=torch.uint8)
    tk.qwd_sender(main, None, wire, bits=bits, group_size=64, stochastic=True, seed=3)
    nan, codes = _nan_scales(wire, 1, 192, bits, 64)
    assert nan.tolist() == [[True, False, True]]
    offset = 2 ** (bits - 1)
    assert (codes[0, 0] == offset).all() and (codes[0, 2] == offset).all()


@pytest.mark.parametrize("hadamard", [0, 32])
def test_receivers_propagate_nan_groups(hadamard):
    kc.check_tlq_middle(CPU, n_in=3, numel=256, bits_in=8, group_in=64, n_out=2, bits_out=4,
                        group_out=64, stochastic=True, seed=5, nan_group=2)
    kc.check_qwd_receiver(CPU, world=2, shard=128, bits=4, group=64,
                          replica_dtype=torch.bfloat16, accumulate=True, seed=5, nan_group=1)
    wire = kc.random_wire(2, 256, 4, 64, seed=5, nan_group=1)
    out = torch.zeros(256)
    tk.tlq_receiver(wire, out, n_in=2, bits=4, group_size=64, hadamard_block=hadamard)
    nonfinite = ~torch.isfinite(out.view(4, 64))
    assert nonfinite.all(1).tolist() == [False, True, False, False]
    assert not nonfinite[[0, 2, 3]].any()


# ------------------------------------------------------------------ arguments and dispatch


def test_empty_input_writes_nothing():
    out = torch.full((8,), 7, dtype=torch.uint8)
    tk.tlq_sender(torch.empty(0), out, num_dests=2, blocks_per_dest=1, slices=1, bits=4,
                  group_size=64, hadamard_block=32, stochastic=True, seed=0)
    tk.qwd_sender(torch.empty(0), torch.empty(0), out, bits=4, group_size=64,
                  stochastic=True, seed=0)
    assert (out == 7).all()


def _raises_like_reference(fn_name, match, *args, **kwargs):
    """The kernel refuses the arguments with the reference's error."""
    for impl in (getattr(ref, fn_name), getattr(tk, fn_name)):
        with pytest.raises(ValueError, match=match):
            impl(*args, **kwargs)


def test_bad_shapes_fail_like_reference():
    wire = torch.zeros(4096, dtype=torch.uint8)
    _raises_like_reference("qwd_sender", "not a whole number of groups of 64",
                           torch.randn(100), None, wire, bits=4, group_size=64,
                           stochastic=False, seed=0)
    _raises_like_reference("qwd_sender", "bits=3 is not supported",
                           torch.randn(128), None, wire, bits=3, group_size=64,
                           stochastic=False, seed=0)
    _raises_like_reference("tlq_receiver", "payload of 4 bytes, not a multiple of 4|"
                           "payload of 6 bytes", wire, torch.zeros(12), n_in=1, bits=4,
                           group_size=6, hadamard_block=0)
    _raises_like_reference("tlq_middle", "with at least 2176 bytes",
                           wire[:100], wire, n_in=2, numel=1024, bits_in=8,
                           group_size_in=64, n_out=1, bits_out=4, group_size_out=64,
                           stochastic=False, seed=0)


def test_kernel_specific_errors():
    wire = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="must be a power of two"):
        tk.tlq_sender(torch.randn(256), wire, num_dests=1, blocks_per_dest=1, slices=1,
                      bits=4, group_size=64, hadamard_block=24, stochastic=False, seed=0)
    with pytest.raises(ValueError, match="holds 16 elements, not a multiple of "
                                         "hadamard_block=32"):
        tk.tlq_sender(torch.randn(256), wire, num_dests=4, blocks_per_dest=4, slices=1,
                      bits=4, group_size=64, hadamard_block=32, stochastic=False, seed=0)
    with pytest.raises(ValueError, match="4-byte aligned"):
        tk.qwd_sender(torch.randn(64), None, wire[1:], bits=4, group_size=64,
                      stochastic=False, seed=0)
    with pytest.raises(ValueError, match="replica must be contiguous"):
        tk.qwd_receiver(wire, torch.zeros(256, 2)[:, 0], world=1, bits=4, group_size=64)
    with pytest.raises(ValueError, match="must divide one another"):
        tk.tlq_middle(wire, wire, n_in=1, numel=192, bits_in=8, group_size_in=64, n_out=1,
                      bits_out=8, group_size_out=96, stochastic=False, seed=0)


def test_ops_dispatch_to_triton_on_request():
    """``backend="triton"`` runs the kernel (bit-exact here) through the public dispatcher."""
    x = torch.randn(256)
    a = torch.empty(fmt.message_nbytes(256, 4, 64), dtype=torch.uint8)
    b = torch.empty_like(a)
    for backend, out in (("torch", a), ("triton", b)):
        ops.qwd_sender(x, None, out, bits=4, group_size=64, stochastic=True, seed=9,
                       backend=backend)
    assert torch.equal(a, b)
