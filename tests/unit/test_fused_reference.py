"""Semantics of the fused reference operations the collectives are built from."""

import pytest
import torch

from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization import reference as ref


def _nearest(values: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Round-to-nearest D(Q(values)) written independently of the reference."""
    qm = 2 ** (bits - 1) - 1
    g = values.float().reshape(-1, group)
    s = g.abs().amax(1, keepdim=True) / qm
    q = torch.where(s > 0, torch.floor(g / torch.where(s > 0, s, 1) + 0.5), 0).clamp(-qm, qm)
    return (q * s).reshape(values.shape)


def test_qwd_sender_and_receiver():
    world, shard, bits, group = 3, 64, 4, 32
    torch.manual_seed(0)
    replica = torch.randn(world * shard).to(torch.bfloat16)
    mains = [replica[r * shard:(r + 1) * shard].float() + 1e-2 * torch.randn(shard)
             for r in range(world)]
    nbytes = fmt.message_nbytes(shard, bits, group)
    wire = torch.empty(world * nbytes, dtype=torch.uint8)
    for r in range(world):
        ref.qwd_sender(mains[r], replica[r * shard:(r + 1) * shard],
                       wire[r * nbytes:(r + 1) * nbytes], bits=bits, group_size=group,
                       stochastic=False, seed=0)
    expected = replica.float() + torch.cat(
        [_nearest(mains[r] - replica[r * shard:(r + 1) * shard].float(), bits, group)
         for r in range(world)])
    ref.qwd_receiver(wire, replica, world=world, bits=bits, group_size=group)
    assert torch.equal(replica, expected.to(torch.bfloat16))


def test_qwd_direct_mode_overwrites():
    shard, group = 64, 64
    main = torch.randn(shard)
    wire = torch.empty(fmt.message_nbytes(shard, 8, group), dtype=torch.uint8)
    ref.qwd_sender(main, None, wire, bits=8, group_size=group, stochastic=False, seed=0)
    replica = torch.full((shard,), 123.0)
    ref.qwd_receiver(wire, replica, world=1, bits=8, group_size=group, accumulate=False)
    assert torch.equal(replica, _nearest(main, 8, group))


@pytest.mark.parametrize("m,n,p", [(2, 2, 1), (2, 3, 2), (1, 4, 1), (3, 1, 2)],
                         ids=lambda v: str(v))
def test_tlq_sender_orders_by_destination(m, n, p):
    c, bits, group = 32, 8, 32
    x = torch.randn(m * n * p * c)
    msg_numel = m * c
    nbytes = fmt.message_nbytes(msg_numel, bits, group)
    wire = torch.empty(p * n * nbytes, dtype=torch.uint8)
    ref.tlq_sender(x, wire, num_dests=n, blocks_per_dest=m, slices=p, bits=bits,
                   group_size=group, hadamard_block=0, stochastic=False, seed=0)
    view = x.view(m, n, p, c)
    for sl in range(p):
        for dest in range(n):
            k = sl * n + dest
            got = ref._read_messages(wire[k * nbytes:(k + 1) * nbytes], 1, msg_numel, bits,
                                     group).view(-1)
            assert torch.equal(got, _nearest(view[:, dest, sl, :].reshape(-1), bits, group))


def test_tlq_middle_and_receiver_sum_and_scale():
    n_in, numel, group = 3, 128, 32
    parts = [torch.randn(numel) for _ in range(n_in)]
    nbytes = fmt.message_nbytes(numel, 8, group)
    wire = torch.empty(n_in * nbytes, dtype=torch.uint8)
    for i, part in enumerate(parts):
        ref.tlq_sender(part, wire[i * nbytes:(i + 1) * nbytes], num_dests=1, blocks_per_dest=1,
                       slices=1, bits=8, group_size=group, hadamard_block=0, stochastic=False,
                       seed=0)
    total = sum(_nearest(p, 8, group) for p in parts)
    n_out = 2
    out_bytes = fmt.message_nbytes(numel // n_out, 4, group)
    mid = torch.empty(n_out * out_bytes, dtype=torch.uint8)
    ref.tlq_middle(wire, mid, n_in=n_in, numel=numel, bits_in=8, group_size_in=group,
                   n_out=n_out, bits_out=4, group_size_out=group, stochastic=False, seed=0)
    out = torch.empty(numel // n_out, dtype=torch.bfloat16)
    ref.tlq_receiver(mid[out_bytes:], out, n_in=1, bits=4, group_size=group,
                     hadamard_block=0, scale=0.5)
    expected = _nearest(total[numel // n_out:], 4, group) * 0.5
    assert torch.equal(out, expected.to(torch.bfloat16))


def test_receiver_applies_inverse_hadamard():
    x = torch.randn(256)
    nbytes = fmt.message_nbytes(256, 8, 64)
    wire = torch.empty(nbytes, dtype=torch.uint8)
    ref.tlq_sender(x, wire, num_dests=1, blocks_per_dest=1, slices=1, bits=8, group_size=64,
                   hadamard_block=32, stochastic=False, seed=0)
    out = torch.empty(256)
    ref.tlq_receiver(wire, out, n_in=1, bits=8, group_size=64, hadamard_block=32)
    assert float((out - x).abs().max()) < 0.05  # 8-bit error in the smoothed domain


def test_message_shape_errors_name_the_fix():
    with pytest.raises(ValueError, match="not a whole number of groups of 64"):
        fmt.check_message_shape(100, 4, 64)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        fmt.check_message_shape(12, 4, 2)


def test_rounded_main_sends_zero_where_the_16bit_weight_is_unchanged():
    """qWD's 'rounded-main' target (comm/all_gather.py, [Note: what qWD sends]): the sender
    gets the main weights rounded to bf16, so an element whose bf16 value did not change has
    a difference of exactly 0, code 0 under stochastic rounding, and keeps its bits; with
    the fp32 main weights the same element's sub-ulp residual is sent as a whole step with
    probability residual / step, so many such elements move."""
    shard, group = 4096, 2048
    g = torch.Generator().manual_seed(3)
    replica = torch.randn(shard, generator=g).to(torch.bfloat16)
    ulp = torch.exp2(torch.floor(torch.log2(replica.float().abs())) - 7)  # bf16: 8-bit significand
    kept = torch.arange(shard) % 2 == 0
    # kept: a residual of 0.2 ulp (below the 0.25 ulp of the gap under a power of two);
    # the others: a real update, 0.01 x N(0, 1), which sets each group's step (~0.005)
    residual = 0.2 * ulp * torch.where(torch.rand(shard, generator=g) < 0.5, -1.0, 1.0)
    main = replica.float() + torch.where(kept, residual, 1e-2 * torch.randn(shard, generator=g))
    assert torch.equal(main.to(torch.bfloat16)[kept], replica[kept])

    def send(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        message = torch.empty(fmt.message_nbytes(shard, 4, group), dtype=torch.uint8)
        ref.qwd_sender(target, replica, message, bits=4, group_size=group, stochastic=True,
                       seed=11)
        after = replica.clone()
        ref.qwd_receiver(message, after, world=1, bits=4, group_size=group)
        codes = fmt.unpack_codes(fmt.split_message(message, shard, 4, group)[1], 4)
        return codes.view(-1).long() - 8, after  # q = code - (qmax + 1)

    q, after = send(main.to(torch.bfloat16))
    assert (q[kept] == 0).all()
    assert torch.equal(after[kept].view(torch.int16), replica[kept].view(torch.int16))
    assert (q[~kept] != 0).sum() > 0.6 * int((~kept).sum())  # the updates are sent (~75%)
    q32, after32 = send(main)
    moved = int((after32[kept] != replica[kept]).sum())
    # r / s averages ~0.18 over these magnitudes: 378 nonzero codes and 305 moved bf16 values
    # of 2048 with this seed, against exactly 0 with the rounded target
    assert int((q32[kept] != 0).sum()) > 200 and moved > 200, moved
