"""Fault injection's specs (training/guards/faults.py): what the e2e fault tests plant."""

from __future__ import annotations

import pytest

from megatron.sdp4bit.training.guards import faults


def test_fault_specs():
    assert faults._parse("") == set()
    assert faults._parse("nan-grad@3:1, die-saving@8:0") == {("nan-grad", 3, 1),
                                                              ("die-saving", 8, 0)}
    with pytest.raises(ValueError, match="use KIND@ITERATION:RANK"):
        faults._parse("nan-grad@3")
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        faults._parse("boom@1:0")
