"""The replica checksum (integration/replicas.py): one changed element, one swap and one
flipped bit each change it."""

from __future__ import annotations

import torch

from megatron.sdp4bit.integration.replicas import checksum


def test_checksum_sees_one_changed_element_and_a_swap(monkeypatch):
    from megatron.sdp4bit.integration import replicas

    monkeypatch.setattr(replicas, "_CHUNK", 1024)  # several chunks on a small tensor
    x = torch.randn(3 * 1024 + 5).to(torch.bfloat16)
    base = checksum(x)
    assert checksum(x.clone()) == base
    y = x.clone()
    y[1024 + 7] = y[1024 + 7] + 1  # in the second chunk
    assert checksum(y) != base
    z = x.clone()
    z[[10, 11]] = z[[11, 10]]  # same values, other places
    assert torch.equal(z.sort().values, x.sort().values) and checksum(z) != base
    w = x.clone().view(torch.int16)
    w[3] ^= 1  # the lowest bit of one bf16
    assert checksum(w.view(torch.bfloat16)) != base
