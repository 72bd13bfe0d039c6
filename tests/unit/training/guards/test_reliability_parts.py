"""The small pieces behind the reliability guarantees: replica checksums, fault specs and
the heartbeat watchdog's decisions (the end-to-end proofs are in tests/e2e/test_faults.py)."""

from __future__ import annotations

import time

import pytest
import torch

from megatron.sdp4bit.training.guards import faults, watchdog
from megatron.sdp4bit.training.guards.replicas import checksum


def test_checksum_sees_one_changed_element_and_a_swap(monkeypatch):
    from megatron.sdp4bit.training.guards import replicas

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


def test_fault_specs():
    assert faults._parse("") == set()
    assert faults._parse("nan-grad@3:1, die-saving@8:0") == {("nan-grad", 3, 1),
                                                              ("die-saving", 8, 0)}
    with pytest.raises(ValueError, match="use KIND@ITERATION:RANK"):
        faults._parse("nan-grad@3")
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        faults._parse("boom@1:0")


class _Store:
    """The part of torch's Store the watchdog uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]


def test_watchdog_names_the_silent_rank(monkeypatch):
    stops = []
    monkeypatch.setattr(watchdog, "_stop", stops.append)
    store = _Store()
    dog = watchdog.Watchdog(store, rank=0, world=3, timeout=0.3, interval=0.05)
    store.set(f"{watchdog._PREFIX}1", "1")
    store.set(f"{watchdog._PREFIX}2", "1")
    dog._check()
    for beat in range(2, 10):  # rank 1 keeps beating, rank 2 stopped at its first beat
        time.sleep(0.05)
        store.set(f"{watchdog._PREFIX}1", str(beat))
        dog._check()
    assert len(stops) >= 1 and stops[0].startswith("rank 2 stopped responding for 0 s")
    assert not any(s.startswith("rank 1") for s in stops)


def test_other_ranks_watch_rank_0_only():
    dog = watchdog.Watchdog(_Store(), rank=2, world=4, timeout=10, interval=1)
    assert list(dog._last) == [0]
    with pytest.raises(ValueError, match="must exceed the interval"):
        watchdog.Watchdog(_Store(), rank=0, world=2, timeout=1, interval=1)
