"""The ``--exit-signal-handler`` handler on its own: the signal only sets a flag, the
previous handler comes back on release. Its use by the loop under torchrun:
tests/e2e/test_preemption.py."""

from __future__ import annotations

import argparse
import os
import re
import signal

import pytest

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
    ("diverging", [], r"\(this iteration not saved\)"),  # _save refused and said why
    ("no --save", [], r"\(no --save: nothing saved\)"),
])
def test_the_loops_exit_saves_once_and_says_what_it_did(monkeypatch, capsys, case, saves, said):
    from megatron.sdp4bit.training import loop

    args = argparse.Namespace(save=None if case == "no --save" else "CK", ckpt_format="torch_dist",
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    state = loop.TrainState(model=[], optimizer=None, scheduler=None, datasets=[],
                            vocab_size=0, iteration=7)
    if case == "just saved by --save-interval":
        state.saved_iteration = 7
    if case == "diverging":
        state.skipped_in_a_row, state.saved_iteration = 1, 5
    written = []
    monkeypatch.setattr(loop, "_is_logging_rank", lambda: True)
    monkeypatch.setattr(loop.checkpoint_formats, "save", lambda args, it, *a, **kw: written.append(it))
    monkeypatch.setattr(loop.faults, "active", lambda *a: False)
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    loop._exit_on_signal(args, state, ExitSignal("SIGTERM"),
                         saved=case == "just saved by --save-interval")
    assert written == saves
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"exiting program after receiving SIGTERM at iteration 7 " + said, last)
