"""Skipped steps in the loop: said every time, a run that never updates fails, and no
checkpoint is saved (or pointed at) while the run diverges. No processes: the loop's
bookkeeping runs on a stand-in optimizer; saving is recorded instead of written."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron.sdp4bit.training import checkpoint_policy, loop
from megatron.sdp4bit.training.guards import skips


class _Optimizer:
    def __init__(self, scale: float | None = None):
        self.grad_scaler = object() if scale is not None else None
        self.scale = scale or 1.0

    def get_loss_scale(self):
        return torch.tensor(self.scale)


def _run(monkeypatch, capsys, outcomes, *, scale=None, save_interval=1, limit=4):
    args = argparse.Namespace(loss_scale=None, min_loss_scale=1.0, save="CK", async_save=False,
                              max_consecutive_skipped_iterations=limit,
                              ckpt_format="torch_dist", tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, overlap_param_gather=False)
    state = loop.TrainState(model=[], optimizer=_Optimizer(scale), scheduler=None, datasets=[],
                            vocab_size=0)
    saved = []
    monkeypatch.setattr(skips, "_is_logging_rank", lambda: True)
    monkeypatch.setattr(checkpoint_policy, "is_logging_rank", lambda: True)
    monkeypatch.setattr(checkpoint_policy.formats, "save",
                        lambda args, it, *a, **kw: saved.append(it))
    monkeypatch.setattr(checkpoint_policy.dist, "get_rank", lambda: 0)
    checkpoints = checkpoint_policy.CheckpointPolicy(args, state)
    error = None
    try:
        for ok in outcomes:  # what train() does after each step
            state.iteration += 1
            skips.count_skip(args, state, ok)
            if state.iteration % save_interval == 0:
                checkpoints.save()
        skips.check_progress(state, 0)
    except loop.TrainingStopped as err:
        error = str(err)
    return state, saved, error, capsys.readouterr().out


def test_a_blown_up_run_saves_nothing_while_diverging_and_names_no_bad_checkpoint(
        monkeypatch, capsys):
    """--lr 1e10: step 1 succeeds (finite, huge weights), every later step is non-finite."""
    _, saved, error, out = _run(monkeypatch, capsys, [True] + [False] * 4)
    assert saved == [1]  # not 2, 3, 4
    assert "not saving iteration 2: the last 1 iteration(s) were skipped (non-finite " \
           "gradients); CK keeps iteration 1" in out
    assert error == ("stopping at iteration 5: 4 iterations in a row had non-finite gradients "
                     "(loss scale 1); no checkpoint of this run is known healthy (iteration 1 "
                     "was followed by non-finite gradients): start again with a lower --lr or "
                     "check the data (--max-consecutive-skipped-iterations sets the limit)")


def test_the_stop_names_the_last_checkpoint_followed_by_a_finite_step(monkeypatch, capsys):
    _, saved, error, _ = _run(monkeypatch, capsys, [True] * 5 + [False] * 4, save_interval=2)
    assert saved == [2, 4]
    assert "resume from iteration 4 in CK (the last checkpoint followed by a finite step)" \
        in error


def test_dynamic_fp16_skips_are_said_and_a_run_without_an_update_fails(monkeypatch, capsys):
    """--fp16 --initial-loss-scale 1e30: the scale never comes down far enough in 6 steps."""
    state, saved, error, out = _run(monkeypatch, capsys, [False] * 6, scale=1e30)
    assert out.count("fp16 gradients overflowed; the loss scale comes down (now 1e+30)") == 6
    assert saved == [1, 2, 3, 4, 5, 6]  # calibrating: weights unchanged, nothing diverges
    assert error == ("no iteration of this run updated the weights: all 6 were skipped for "
                     "non-finite gradients (loss scale now 1e+30); lower --initial-loss-scale "
                     "or --lr, or check the data")


@pytest.mark.parametrize("outcomes", [[True, False, True], [False, True]])
def test_runs_that_recover_end_normally(monkeypatch, capsys, outcomes):
    _, _, error, _ = _run(monkeypatch, capsys, outcomes)
    assert error is None
