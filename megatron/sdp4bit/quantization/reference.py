"""Pure-torch reference of every quantization operation (no Triton import).

These functions are the test oracle for the Triton kernels *and* the production path of the
CPU mode, so they are vectorized over groups and elements (no Python loop over data).

Quantization rules (docs/design.md §3), for a group ``x`` of ``G`` values and ``b`` bits:

* ``qmax = 2**(b-1) - 1``; scale ``s = absmax(x) / qmax`` computed in fp32, and its
  reciprocal ``r = 1 / s`` rounded to fp32 once per group;
* ``q = clamp(floor(x * r + u), -qmax, qmax)`` (``x * r`` and ``+ u`` each rounded to fp32)
  with ``u = hash(seed, i)`` uniform on (0, 1) (stochastic rounding, unbiased:
  :mod:`.rng`) or ``u = 0.5`` (round to nearest, ties upwards). ``x * r`` instead of
  ``x / s`` since version 0.2.0 ([Note: rounding stream versions] in :mod:`.rng`): a GPU
  divides with a dozen instructions, multiplies with one;
* a group of zeros has ``s = 0`` and ``q = 0``;
* a group holding NaN or Inf gets ``s = NaN`` and ``q = 0``: it dequantizes to all-NaN, so
  Megatron's found-inf / NaN checks still see it;
* dequantized value ``q * s`` in fp32.

``i``, the index of the random stream, is the element's position in the operation's output
numbering (message-major), so every element of one call draws a distinct number.
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.quantization import format as fmt
from megatron.sdp4bit.quantization.hadamard import hadamard_transform, inverse_hadamard_transform
from megatron.sdp4bit.quantization.rng import uniform


def quantize_groups(x: torch.Tensor, bits: int, *, stochastic: bool, seed: int,
                    stream_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows of ``x`` ([ngroups, G], any float dtype).

    Returns ``(codes uint8 [ngroups, G], scales fp32 [ngroups])``.
    """
    qm = fmt.qmax(bits)
    x = x.to(torch.float32)
    absmax = x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    finite = torch.isfinite(absmax)
    scales = torch.where(finite, absmax / qm, torch.full_like(absmax, float("nan")))
    usable = finite & (scales > 0)
    ones = torch.ones_like(scales)
    inverse = ones / torch.where(usable, scales, ones)  # IEEE division, once per group
    if stochastic:
        u = uniform(seed, stream_start, x.numel(), x.device).view(x.shape)
    else:
        u = 0.5
    q = torch.floor(x * inverse[..., None] + u).clamp_(-qm, qm)
    q = torch.where(usable[..., None], q, torch.zeros_like(q))
    codes = (q + (qm + 1)).to(torch.uint8)
    return codes, scales


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``(codes - offset) * scale`` in fp32; ``codes`` [ngroups, G], ``scales`` [ngroups]."""
    q = codes.to(torch.float32) - float(fmt.qmax(bits) + 1)
    return q * scales[..., None]


def _write_messages(values: torch.Tensor, out: torch.Tensor, count: int, bits: int,
                    group_size: int, stochastic: bool, seed: int) -> None:
    """Quantize ``values`` ([count, L] fp32) into ``count`` messages of ``out``."""
    numel = values.shape[1]
    fmt.check_message_shape(numel, bits, group_size)
    codes, scales = quantize_groups(values.reshape(-1, group_size), bits,
                                    stochastic=stochastic, seed=seed)
    out_scales, out_payload = fmt.split_messages(out, count, numel, bits, group_size)
    out_scales.copy_(scales.view(count, -1))
    out_payload.copy_(fmt.pack_codes(codes.view(count, numel), bits))


def _read_messages(wire: torch.Tensor, count: int, numel: int, bits: int,
                   group_size: int) -> torch.Tensor:
    """Dequantize ``count`` messages of ``numel`` values each -> fp32 [count, numel]."""
    fmt.check_message_shape(numel, bits, group_size)
    scales, payload = fmt.split_messages(wire, count, numel, bits, group_size)
    codes = fmt.unpack_codes(payload, bits).reshape(-1, group_size)
    return dequantize_groups(codes, scales.reshape(-1), bits).view(count, numel)


def _sum_rows(values: torch.Tensor) -> torch.Tensor:
    """fp32 sum of the rows of ``values`` [n, L] in row order, starting from +0: the order
    every backend uses (``((0 + v0) + v1) + ...``), so that sums agree bit for bit."""
    total = values.new_zeros(values.shape[1:])
    for row in values:
        total += row
    return total


def qwd_sender(main_shard: torch.Tensor, replica_shard: torch.Tensor | None, out: torch.Tensor,
               *, bits: int, group_size: int, stochastic: bool, seed: int) -> None:
    """One qWD message: ``Q(main_shard - replica_shard)`` (``Q(main_shard)`` when the replica is
    None: direct mode) into ``out`` (uint8, ``message_nbytes(numel)`` bytes)."""
    values = main_shard.to(torch.float32)
    if replica_shard is not None:
        values = values - replica_shard.to(torch.float32)
    _write_messages(values.view(1, -1), out, 1, bits, group_size, stochastic, seed)


def qwd_receiver(wire: torch.Tensor, replica: torch.Tensor, *, world: int, bits: int,
                 group_size: int, accumulate: bool = True) -> None:
    """Apply the ``world`` gathered messages: ``replica[s] (+)= D(message s)`` for every shard.

    ``replica`` is the whole 1D buffer (``world`` equal shards); arithmetic in fp32, rounded
    once to the replica's dtype, so every rank computes identical bits.
    """
    delta = _read_messages(wire, world, replica.numel() // world, bits, group_size).view(-1)
    if accumulate:
        delta = replica.to(torch.float32) + delta
    replica.copy_(delta)


def tlq_sender(inp: torch.Tensor, out: torch.Tensor, *, num_dests: int, blocks_per_dest: int,
               slices: int, bits: int, group_size: int, hadamard_block: int,
               stochastic: bool, seed: int) -> None:
    """First hop of the gradient all-to-all: (Hadamard ->) quantize -> pack by destination.

    ``inp`` (1D, fp32/bf16/fp16) is viewed as ``[blocks_per_dest, num_dests, slices, c]``
    (for the two-level path: ``[M nodes, N local ranks, P slices, c]``, i.e. shard ``m*N+n``
    cut in P slices). ``out`` receives ``slices * num_dests`` messages, slice-major then
    destination, each holding the ``blocks_per_dest`` chunks of that destination in order:
    destination ``n'`` of slice ``p`` gets ``inp[:, n', p, :]``.
    """
    values = inp.reshape(blocks_per_dest, num_dests, slices, -1)
    if hadamard_block:
        values = hadamard_transform(values, hadamard_block)
    values = values.permute(2, 1, 0, 3).reshape(slices * num_dests, -1)
    _write_messages(values.to(torch.float32), out, slices * num_dests, bits, group_size,
                    stochastic, seed)


def tlq_middle(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, numel: int,
               bits_in: int, group_size_in: int, n_out: int, bits_out: int,
               group_size_out: int, stochastic: bool, seed: int) -> None:
    """Between the hops: dequantize ``n_in`` messages of ``numel`` values, sum them in fp32
    (message order, :func:`_sum_rows`), requantize as ``n_out`` messages of ``numel // n_out`` values."""
    total = _sum_rows(_read_messages(wire_in, n_in, numel, bits_in, group_size_in))
    _write_messages(total.view(n_out, -1), out, n_out, bits_out, group_size_out,
                    stochastic, seed)


def tlq_receiver(wire_in: torch.Tensor, out: torch.Tensor, *, n_in: int, bits: int,
                 group_size: int, hadamard_block: int, scale: float = 1.0,
                 accumulate: bool = False) -> None:
    """Last hop: dequantize ``n_in`` messages of ``out.numel()`` values, fp32 sum, inverse
    Hadamard, multiply by ``scale`` (1/W for AVG), write (or add) into ``out``."""
    total = _sum_rows(_read_messages(wire_in, n_in, out.numel(), bits, group_size))
    if hadamard_block:
        total = inverse_hadamard_transform(total, hadamard_block)
    if scale != 1.0:
        total = total * scale
    if accumulate:
        total = out.to(torch.float32) + total
    out.copy_(total.view(out.shape))
