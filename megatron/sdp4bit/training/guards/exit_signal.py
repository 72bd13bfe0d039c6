"""``--exit-signal-handler``: a signal asks the run to save a checkpoint and exit 0.

Megatron-LM's meaning: with the flag, the signal ``--exit-signal`` names (SIGTERM by
default) no longer kills a rank. Its handler only notes that the signal came; the rank
finishes the iteration it is in, and at the iteration's end every rank takes part in one
small all-reduce (the MAX of the flags, on the default group: a host tensor under gloo, a
device tensor under NCCL). When any rank got the signal, all of them learn it at the same
iteration, save one checkpoint there through the loop's own save, and return from the
loop; the process then ends as a finished run does, with exit status 0.

[Note: where the signal comes from]
SLURM sends SIGTERM before a time limit or a preemption and SIGKILL ``KillWait`` seconds
later (30 by default); ``#SBATCH --signal=TERM@SECONDS`` asks for it earlier. ``torchrun``
catches SIGTERM, SIGINT, SIGHUP and SIGQUIT (its ``--signals-to-handle``), sends the same
signal to each of its workers and waits for them for its shutdown timeout
(``--shutdown-timeout``, else ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s) before it
sends SIGKILL; then it raises the signal as an exception and exits 1 whatever its workers
did. A signal sent to one worker alone (``kill`` of its process, a node's own agent)
reaches only that rank; the others learn it at the agreement, and ``torchrun``, which saw nothing, exits
0 once every worker has. docs/reliability.md has the measured times.

[Note: why the handler only sets a flag]
CPython runs a signal handler in the main thread between two bytecodes, which may be in
the middle of anything: a collective's Python wrapper, a checkpoint write, a ``print``.
Setting a flag is safe there; a collective or a print is not (a print re-entered from a
handler raises). The signal is installed with ``siginterrupt(sig, False)`` (SA_RESTART), so
that a system call another thread is in when the signal lands (gloo's sockets, the
watchdog's store requests) resumes instead of failing with EINTR. Signals that arrive
while a checkpoint is written, or more than once (SLURM may signal every process of the
step as well as ``torchrun``), change nothing: the flag is already set.
"""

from __future__ import annotations

import signal
from types import FrameType

# Megatron-LM's choices for --exit-signal. SIGKILL and SIGSTOP cannot be caught.
EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class ExitSignal:
    """One signal's handler on this rank. :meth:`install` it, call :meth:`agreed` once per
    iteration on every rank (a collective); :meth:`release` puts the previous handler back
    (``pretrain_gpt.py`` never does: its process ends with the run)."""

    def __init__(self, name: str) -> None:
        if name not in EXIT_SIGNALS:
            raise ValueError(f"--exit-signal {name}: use one of {', '.join(EXIT_SIGNALS)}")
        self.name = name
        self._signum = signal.Signals[name]
        self._received = False
        self._previous: object = None
        self._installed = False

    @property
    def received(self) -> bool:
        """Whether this rank got the signal (the others may have, see :meth:`agreed`)."""
        return self._received

    def install(self) -> ExitSignal:
        self._previous = signal.signal(self._signum, self._on_signal)
        signal.siginterrupt(self._signum, False)  # [Note: why the handler only sets a flag]
        self._installed = True
        return self

    def release(self) -> None:
        """Put back the handler there was before :meth:`install`."""
        if self._installed:
            signal.signal(self._signum, self._previous)  # type: ignore[arg-type]
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._received = True

    def agreed(self) -> bool:
        """Whether any rank got the signal. Collective: every rank calls it after every
        iteration, so that all of them stop after the same one."""
        import torch
        import torch.distributed as dist

        # NCCL refuses host tensors: on the current device whenever there is one.
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        flag = torch.tensor([int(self._received)], dtype=torch.int32, device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def install(name: str | None) -> ExitSignal | None:
    """The handler of ``--exit-signal`` when ``--exit-signal-handler`` resolved it to a
    name (``args.exit_signal``), else None (the signal keeps its default action)."""
    return ExitSignal(name).install() if name is not None else None
