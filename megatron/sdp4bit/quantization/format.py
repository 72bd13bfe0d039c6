"""Wire format of one quantized message.

A message carries ``numel`` values quantized in groups of ``group_size`` at ``bits`` bits::

    [ scales: float32 x ngroups ][ payload: uint8 x numel * bits / 8 ]

Scales come first so that they are 4-byte aligned whatever the payload length. Messages to
different peers lie back to back in one wire buffer (one collective per hop), so a message's
total length must stay a multiple of 4 bytes: the fused operations require ``numel`` to be a
multiple of ``group_size`` and ``numel * bits / 8`` to be a multiple of 4 (the comm layer's
padding guarantees both).

Codes are offset binary: ``code = q + 2**(bits-1)``, so 2-bit codes are 1..3, 4-bit codes
1..15 and 8-bit codes 1..255 (0 is never produced). Packing, the one order every backend
uses: the codes of a byte are its elements in order from the least significant bits up.
4 bits: element ``2i`` in the low nibble of byte ``i``, element ``2i+1`` in the high nibble.
2 bits: element ``4i+k`` in bits ``2k`` and ``2k+1`` of byte ``i`` (k = 0..3).

At 2 bits ``qmax = 2**(2-1) - 1 = 1``: the scale is the group's absmax and the levels are
``-s, 0, s`` (three of the four codes; code 0 is never produced, as at every width).
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.config import check_bits


def qmax(bits: int) -> int:
    """Largest quantized magnitude: 1 for 2 bits, 7 for 4 bits, 127 for 8 bits."""
    check_bits("bits", bits)
    return (1 << (bits - 1)) - 1


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def payload_nbytes(numel: int, bits: int) -> int:
    check_bits("bits", bits)
    return (numel * bits + 7) // 8


def message_nbytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes of one message of ``numel`` values: scales plus payload."""
    return 4 * num_groups(numel, group_size) + payload_nbytes(numel, bits)


def check_message_shape(numel: int, bits: int, group_size: int) -> None:
    """Messages inside a wire buffer must hold whole groups and keep 4-byte alignment."""
    check_bits("bits", bits)
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size={group_size} must be a positive even integer")
    if group_size * bits % 8:
        raise ValueError(f"group_size={group_size} must be a multiple of 4 at {bits} bits "
                         "(a group fills whole bytes: four codes per byte)")
    if numel % group_size:
        raise ValueError(
            f"a message of {numel} elements is not a whole number of groups of {group_size}: "
            "pad the buffer to megatron.sdp4bit.comm.padding.required_divisor()"
        )
    if (numel * bits // 8) % 4:
        raise ValueError(
            f"a message of {numel} elements at {bits} bits has a payload of "
            f"{numel * bits // 8} bytes, not a multiple of 4: pad the buffer"
        )


def split_message(message: torch.Tensor, numel: int, bits: int, group_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(scales fp32 [ngroups], payload uint8 [numel*bits/8])`` of one message."""
    ngroups = num_groups(numel, group_size)
    scales = message[: 4 * ngroups].view(torch.float32)
    payload = message[4 * ngroups: 4 * ngroups + payload_nbytes(numel, bits)]
    return scales, payload


def split_messages(wire: torch.Tensor, count: int, numel: int, bits: int, group_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Views ``(scales [count, ngroups], payload [count, nbytes])`` of ``count`` messages."""
    nbytes = message_nbytes(numel, bits, group_size)
    if wire.dtype != torch.uint8 or wire.dim() != 1 or wire.numel() < count * nbytes:
        raise ValueError(
            f"wire buffer must be 1D uint8 with at least {count * nbytes} bytes, got "
            f"{tuple(wire.shape)} {wire.dtype}"
        )
    if wire.storage_offset() % 4 or nbytes % 4:
        raise ValueError(
            f"wire buffer messages must start at 4-byte offsets (storage offset "
            f"{wire.storage_offset()}, message of {nbytes} bytes): pad the buffer"
        )
    ngroups = num_groups(numel, group_size)
    if count * nbytes == 0:
        empty = wire[:0]
        return empty.view(torch.float32).view(count, 0), empty.view(count, 0)
    msgs = wire[: count * nbytes].view(count, nbytes)
    return msgs[:, : 4 * ngroups].view(torch.float32), msgs[:, 4 * ngroups:]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (last dim a multiple of ``8 // bits``) -> packed payload bytes along the
    last dim, in the order of the module docstring."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    codes = codes.unflatten(-1, (-1, per_byte))
    packed = codes[..., 0].clone()
    for k in range(1, per_byte):
        packed |= codes[..., k] << (bits * k)
    return packed


def unpack_codes(payload: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: packed bytes -> uint8 codes along the last dim."""
    if bits == 8:
        return payload
    mask = (1 << bits) - 1
    parts = [(payload >> (bits * k)) & mask for k in range(8 // bits)]
    return torch.stack(parts, dim=-1).flatten(-2)
