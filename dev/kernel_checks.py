"""Kernel-versus-reference checks shared by the kernel tests: the Triton kernels in the
interpreter and the CPU kernels (tests/unit), the Triton kernels compiled for CUDA (tests/gpu).
Each ``check_*`` builds inputs on ``device``, runs the kernel module ``impl``
(:mod:`~megatron.sdp4bit.quantization.triton_kernels` by default, or
:mod:`~megatron.sdp4bit.quantization.cpu_kernels`) there and the torch reference on CPU
copies (the oracle), and asserts the same bytes, with and without the Hadamard transform:
scales equal (NaN where the reference has NaN), payload bitwise equal, and output values
bitwise equal except that a NaN need only be a NaN (its payload bits are not specified).
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import reference as ref


def _triton():
    from megatron.sdp4bit.quantization import triton_kernels

    return triton_kernels


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """NaN exactly where expected has NaN; every other element bitwise equal."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan), "NaN positions differ"
    a = torch.where(nan, torch.zeros_like(actual), actual)
    e = torch.where(nan, torch.zeros_like(expected), expected)
    bad = (a.view(torch.uint8) != e.view(torch.uint8)).view(a.numel(), -1).any(1)
    assert not bad.any(), (f"{int(bad.sum())} of {a.numel()} values differ, first at "
                           f"{int(bad.nonzero()[0])}: {a.flatten()[bad][:4]} vs "
                           f"{e.flatten()[bad][:4]}")


def assert_same_wire(actual: torch.Tensor, expected: torch.Tensor, count: int, numel: int,
                     bits: int, group: int) -> None:
    a_scales, a_payload = fmt.split_messages(actual.cpu(), count, numel, bits, group)
    e_scales, e_payload = fmt.split_messages(expected, count, numel, bits, group)
    assert_same_values(a_scales, e_scales)
    assert_same_values(a_payload, e_payload)


def random_wire(count: int, numel: int, bits: int, group: int, *, seed: int,
                nan_group: int | None = None) -> torch.Tensor:
    """``count`` messages of random codes (every code value, 0 included) and positive scales;
    ``nan_group``: that group of message 0 gets a NaN scale (a non-finite sender group)."""
    g = torch.Generator().manual_seed(seed)
    wire = torch.empty(count * fmt.message_nbytes(numel, bits, group), dtype=torch.uint8)
    scales, payload = fmt.split_messages(wire, count, numel, bits, group)
    payload.copy_(torch.randint(0, 256, payload.shape, generator=g, dtype=torch.uint8))
    scales.copy_(torch.rand(scales.shape, generator=g) * 0.1 + 1e-3)
    scales[0, 0] = 0.0  # an all-zero group
    if nan_group is not None:
        scales[0, nan_group] = float("nan")
    return wire


def check_qwd_sender(device: str, *, impl=None, numel: int, bits: int, group: int,
                     replica_dtype: torch.dtype | None, stochastic: bool, seed: int,
                     nonfinite: bool = False, rounded_main: bool = False) -> None:
    """``rounded_main``: the main weights come rounded to the replica's dtype, as qWD's
    'rounded-main' target hands them over; about half the elements then equal the replica
    exactly (a zero difference) and the others moved by a few units in the last place."""
    g = torch.Generator().manual_seed(seed % (1 << 63))
    main = torch.randn(numel, generator=g)
    replica = None
    if replica_dtype is not None:
        replica = (main + 1e-2 * torch.randn(numel, generator=g)).to(replica_dtype)
    if rounded_main:
        moved = torch.rand(numel, generator=g) < 0.5
        main = torch.where(moved, main, replica.float()).to(replica_dtype)
    if nonfinite:
        main[1] = float("nan")
        main[-1] = float("inf")
    expected = torch.empty(fmt.message_nbytes(numel, bits, group), dtype=torch.uint8)
    ref.qwd_sender(main, replica, expected, bits=bits, group_size=group,
                   stochastic=stochastic, seed=seed)
    out = torch.full_like(expected, 0xAA, device=device)
    (impl or _triton()).qwd_sender(main.to(device), None if replica is None else replica.to(device), out,
                  bits=bits, group_size=group, stochastic=stochastic, seed=seed)
    assert_same_wire(out, expected, 1, numel, bits, group)


def check_qwd_receiver(device: str, *, impl=None, world: int, shard: int, bits: int, group: int,
                       replica_dtype: torch.dtype, accumulate: bool, seed: int,
                       nan_group: int | None = None) -> None:
    wire = random_wire(world, shard, bits, group, seed=seed, nan_group=nan_group)
    replica = torch.randn(world * shard, generator=torch.Generator().manual_seed(seed))
    replica = replica.to(replica_dtype)
    expected = replica.clone()
    ref.qwd_receiver(wire, expected, world=world, bits=bits, group_size=group,
                     accumulate=accumulate)
    actual = replica.to(device)
    (impl or _triton()).qwd_receiver(wire.to(device), actual, world=world, bits=bits, group_size=group,
                    accumulate=accumulate)
    assert_same_values(actual, expected)


def check_tlq_sender(device: str, *, impl=None, blocks: int, dests: int, slices: int, chunk: int,
                     bits: int, group: int, hadamard: int, dtype: torch.dtype,
                     stochastic: bool, seed: int, nonfinite: bool = False) -> None:
    numel = blocks * dests * slices * chunk
    inp = torch.randn(numel, generator=torch.Generator().manual_seed(seed % (1 << 63)))
    inp[::97] *= 20.0  # outliers, where the transform matters
    if nonfinite:
        inp[0] = float("nan")
        inp[-1] = float("-inf")
    inp = inp.to(dtype)
    msg_numel = blocks * chunk
    count = slices * dests
    expected = torch.empty(count * fmt.message_nbytes(msg_numel, bits, group),
                           dtype=torch.uint8)
    kwargs = dict(num_dests=dests, blocks_per_dest=blocks, slices=slices, bits=bits,
                  group_size=group, hadamard_block=hadamard, stochastic=stochastic, seed=seed)
    ref.tlq_sender(inp, expected, **kwargs)
    out = torch.full_like(expected, 0xAA, device=device)
    (impl or _triton()).tlq_sender(inp.to(device), out, **kwargs)
    assert_same_wire(out, expected, count, msg_numel, bits, group)


def check_tlq_middle(device: str, *, impl=None, n_in: int, numel: int, bits_in: int, group_in: int,
                     n_out: int, bits_out: int, group_out: int, stochastic: bool, seed: int,
                     nan_group: int | None = None) -> None:
    wire = random_wire(n_in, numel, bits_in, group_in, seed=seed, nan_group=nan_group)
    out_numel = numel // n_out
    expected = torch.empty(n_out * fmt.message_nbytes(out_numel, bits_out, group_out),
                           dtype=torch.uint8)
    kwargs = dict(n_in=n_in, numel=numel, bits_in=bits_in, group_size_in=group_in,
                  n_out=n_out, bits_out=bits_out, group_size_out=group_out,
                  stochastic=stochastic, seed=seed)
    ref.tlq_middle(wire, expected, **kwargs)
    out = torch.full_like(expected, 0xAA, device=device)
    (impl or _triton()).tlq_middle(wire.to(device), out, **kwargs)
    assert_same_wire(out, expected, n_out, out_numel, bits_out, group_out)


def check_tlq_receiver(device: str, *, impl=None, n_in: int, numel: int, bits: int, group: int,
                       hadamard: int, scale: float, accumulate: bool, dtype: torch.dtype,
                       seed: int, nan_group: int | None = None) -> None:
    wire = random_wire(n_in, numel, bits, group, seed=seed, nan_group=nan_group)
    start = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = start.clone()
    kwargs = dict(n_in=n_in, bits=bits, group_size=group, hadamard_block=hadamard,
                  scale=scale, accumulate=accumulate)
    ref.tlq_receiver(wire, expected, **kwargs)
    actual = start.to(device)
    (impl or _triton()).tlq_receiver(wire.to(device), actual, **kwargs)
    assert_same_values(actual, expected)
