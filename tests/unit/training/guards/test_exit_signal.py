"""The ``--exit-signal-handler`` handler on its own: the signal only sets a flag, the
previous handler comes back on release. Its use by the loop under torchrun:
tests/e2e/test_preemption.py."""

from __future__ import annotations

import os
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
