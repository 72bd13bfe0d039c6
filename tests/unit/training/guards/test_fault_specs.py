"""Fault injection's specs (training/guards/faults.py), what the e2e fault tests plant, and
the hook points it installs them behind (training/guards/hooks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.sdp4bit.training.guards import faults, hooks


def test_fault_specs():
    assert faults._parse("") == set()
    assert faults._parse("nan-grad@3:1, die-saving@8:0") == {("nan-grad", 3, 1),
                                                              ("die-saving", 8, 0)}
    with pytest.raises(ValueError, match="use KIND@ITERATION:RANK"):
        faults._parse("nan-grad@3")
    with pytest.raises(ValueError, match="unknown fault 'boom'"):
        faults._parse("boom@1:0")


@pytest.fixture
def clean_hooks():
    hooks.clear()
    yield
    hooks.clear()


def test_a_run_without_faults_has_empty_hook_points(monkeypatch, clean_hooks):
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.install()
    assert all(not installed for installed in hooks._HOOKS.values())
    loss = torch.tensor(2.0)
    assert hooks.transform("loss", loss, 3) is loss


def test_faults_act_at_their_point_iteration_and_rank_only(monkeypatch, clean_hooks):
    monkeypatch.setenv(faults.ENV, "nan-grad@3:1,flip-replica@2:0")
    monkeypatch.setattr(faults.dist, "get_rank", lambda: 1)
    faults.install()
    assert [p for p, installed in hooks._HOOKS.items() if installed] == ["loss",
                                                                          "after-iteration"]
    assert torch.isnan(hooks.transform("loss", torch.tensor(2.0), 3))
    assert hooks.transform("loss", torch.tensor(2.0), 4).item() == 2.0
    weight = torch.nn.Parameter(torch.zeros(3))
    state = SimpleNamespace(model=[torch.nn.ParameterList([weight])], iteration=2)
    hooks.fire("after-iteration", state)  # rank 1: not the flipped rank
    assert weight.tolist() == [0.0, 0.0, 0.0]
    monkeypatch.setattr(faults.dist, "get_rank", lambda: 0)
    hooks.fire("after-iteration", state)
    assert weight.tolist() == [1.0, 0.0, 0.0]


def test_an_unknown_hook_point_is_refused(clean_hooks):
    with pytest.raises(ValueError, match="^no hook point 'loss-scale'; the points are loss, "):
        hooks.add("loss-scale", lambda loss, it: loss)
