"""The ``--exit-signal-handler`` handler on its own: the signal only sets a flag, the
previous handler comes back on release. Its use by the loop under torchrun:
tests/e2e/test_preemption.py."""

from __future__ import annotations

import argparse
import os
import re
import signal

import pytest

from megatron.sdp4bit.training.guards.exit_conditions import ExitPolicy
from megatron.sdp4bit.training.guards.exit_signal import EXIT_SIGNALS, ExitSignal, install


def test_the_signal_sets_the_flag_instead_of_ending_the_process():
    before = signal.getsignal(signal.SIGUSR2)
    handler = install("SIGUSR2")
    try:
        assert not handler.received and not handler.agreed()
        os.kill(os.getpid(), signal.SIGUSR2)  # default action: the end of this process
        os.kill(os.getpid(), signal.SIGUSR2)  # a second one changes nothing
        assert handler.received
        assert handler.agreed()  # no process group: this rank's own flag
    finally:
        handler.release()
    assert signal.getsignal(signal.SIGUSR2) is before
    handler.release()  # twice: nothing more to put back
    assert signal.getsignal(signal.SIGUSR2) is before


def test_only_megatron_lms_signals():
    assert install(None) is None  # no --exit-signal-handler: nothing installed
    assert EXIT_SIGNALS == ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")
    with pytest.raises(ValueError, match="^--exit-signal SIGKILL: use one of SIGTERM, SIGINT, "
                                         "SIGUSR1, SIGUSR2$"):
        ExitSignal("SIGKILL")


@pytest.mark.parametrize("case, saves, said", [
    ("signal", [7], r"\(checkpoint saved in \d+\.\d s\)"),
    ("just saved by --save-interval", [], r"\(checkpoint saved\)"),  # not twice
    ("diverging", [], r"\(this iteration not saved\)"),  # the save refused and said why
    ("no --save", [], r"\(no --save: nothing saved\)"),
])
def test_the_loops_exit_saves_once_and_says_what_it_did(monkeypatch, capsys, case, saves, said):
    """The last iteration of a run whose ranks agreed on the signal (the loop's exit, with a
    stand-in step and saves recorded instead of written)."""
    from megatron.sdp4bit.training import checkpoint_policy, loop

    args = argparse.Namespace(save=None if case == "no --save" else "CK", ckpt_format="torch_dist",
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              async_save=False, save_interval=7 if "interval" in case else None,
                              train_iters=10, exit_interval=None, exit_duration_in_mins=None,
                              overlap_param_gather=False)
    state = loop.TrainState(model=[], optimizer=None, scheduler=None, datasets=[],
                            vocab_size=0, iteration=7)
    if case == "diverging":
        state.skipped_in_a_row, state.saved_iteration = 1, 5
    written = []
    monkeypatch.setattr(checkpoint_policy, "is_logging_rank", lambda: True)
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    monkeypatch.setattr(checkpoint_policy.formats, "save",
                        lambda args, it, *a, **kw: written.append(it))
    monkeypatch.setattr(checkpoint_policy.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(checkpoint_policy, "current_batch", lambda samples: (8, 1))
    checkpoints = checkpoint_policy.CheckpointPolicy(args, state)
    checkpoints.after_iteration(num_microbatches=1)  # --save-interval's save, if due
    signal = ExitSignal("SIGTERM")
    signal._received = True
    stop = ExitPolicy(args, signal).due(state.iteration)
    done = checkpoints.before_exit(wait=stop.wait_for_save)
    assert written == ([7] if "interval" in case else saves)
    assert re.fullmatch(r"exiting program after receiving SIGTERM at iteration 7 " + said,
                        f"{stop.line} ({done})")
    capsys.readouterr()


def test_the_exits_in_megatron_lms_order(monkeypatch):
    """The signal first, then --exit-interval, then --exit-duration-in-mins (collectives
    every rank calls in the same order, so no rank waits on another's)."""
    import time

    args = argparse.Namespace(exit_interval=5, exit_duration_in_mins=1.0,
                              start_time=time.time() - 120)
    signal = ExitSignal("SIGTERM")
    policy = ExitPolicy(args, signal)
    assert policy.due(3).line == "exiting program after 1.0 minutes at iteration 3"
    assert policy.due(10).line == "exiting program at iteration 10"
    signal._received = True
    assert policy.due(10).line == "exiting program after receiving SIGTERM at iteration 10"
    assert policy.due(10).wait_for_save and not ExitPolicy(args).due(10).wait_for_save
    args.start_time = time.time()
    assert ExitPolicy(args).due(3) is None
