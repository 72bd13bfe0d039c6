"""``--exit-duration-in-mins`` (training/guards/exit_conditions.py): measured from the
run's start, off when not given; without a process group it is this rank's decision."""

from __future__ import annotations

import argparse

from megatron.sdp4bit.training.guards import exit_conditions


def test_exit_duration_is_measured_from_the_start(monkeypatch):
    start = 1_000_000.0
    args = argparse.Namespace(exit_duration_in_mins=2.0, start_time=start)
    now = start
    monkeypatch.setattr(exit_conditions.time, "time", lambda: now)
    assert not exit_conditions.exit_duration_reached(args)
    now = start + 119.0
    assert not exit_conditions.exit_duration_reached(args)
    now = start + 121.0
    assert exit_conditions.exit_duration_reached(args)
    # off by default, whatever the time
    off = argparse.Namespace(exit_duration_in_mins=None, start_time=start)
    assert not exit_conditions.exit_duration_reached(off)
