"""``--timing-log-level``: where the time of a step goes, Megatron-LM's way.

megatron-core times its own phases through the object it finds in ``config.timers``
(``timers(name, log_level=...)`` returning something with ``start``/``stop``):
``forward-backward``, ``forward-compute``/``backward-compute`` (level 2), ``all-grads-sync``
(waiting for the data-parallel gradient reduction), ``params-all-gather``,
``optimizer-inner-step`` and the other optimizer stages. :class:`Timers` is that object; the
trainer adds ``optimizer`` (the whole step), and SDP4Bit's collectives report their phases
(``sdp4bit-grads-quantize``, ``-requantize``, ``-wait``, ``-dequantize``,
``sdp4bit-params-quantize``, ``-wait``, ``-dequantize``: ``megatron.sdp4bit.comm.stats``).

Level 0 (the default) times nothing extra. Level 1 times the phases that run once or a few
times per step; level 2 adds those that run per micro-batch. On CUDA every timer
synchronizes the device at start and stop, and with ``barrier_with_L1_time`` (Megatron-LM's
default; ``--no-barrier-with-level-1-timing`` turns it off) level-1 timers also wait for all
ranks, so that a slow rank shows as itself and not as waiting time on the others; both cost
time, which is why the level is opt-in. Phases that overlap (gradient reduction under
backward) are each timed in full: the timers do not add up to the step.

At each log interval :meth:`Timers.collect` gathers every rank's times (a collective: all
ranks call it) and :func:`format_timers` prints them as Megatron-LM does.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron.sdp4bit.comm.stats import PHASES

# What Megatron-LM's training loop logs, in its order, then SDP4Bit's phases.
TIMERS_TO_LOG = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
    "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params", "optimizer",
    *(f"sdp4bit-{phase}" for phase in PHASES),
)
LOG_OPTIONS = ("max", "minmax", "all")
MAX_LEVEL = 2


class _Timer:
    def __init__(self, sync_cuda: bool) -> None:
        self.elapsed = 0.0
        self._start: float | None = None
        self._sync_cuda = sync_cuda

    def _sync(self, barrier: bool) -> None:
        if barrier:
            dist.barrier()
        if self._sync_cuda:
            torch.cuda.synchronize()

    def start(self, barrier: bool = False) -> None:
        assert self._start is None, "timer started twice"
        self._sync(barrier)
        self._start = time.perf_counter()

    def stop(self, barrier: bool = False) -> None:
        assert self._start is not None, "timer stopped before it started"
        self._sync(barrier)
        self.elapsed += time.perf_counter() - self._start
        self._start = None


class _NoTimer:
    """A timer above the configured level: does nothing."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass


_NO_TIMER = _NoTimer()


class Timers:
    """Named wall-clock timers, called as megatron-core calls ``config.timers``."""

    def __init__(self, log_level: int, log_option: str = "minmax") -> None:
        if not 0 <= log_level <= MAX_LEVEL:
            raise ValueError(f"timing log level {log_level}: use 0, 1 or 2")
        if log_option not in LOG_OPTIONS:
            raise ValueError(f"timing log option {log_option!r}: use one of {LOG_OPTIONS}")
        self.log_level = log_level
        self.log_option = log_option
        self._timers: dict[str, _Timer] = {}
        self._sync_cuda = torch.cuda.is_available()

    def __call__(self, name: str, log_level: int | None = None) -> _Timer | _NoTimer:
        if name in self._timers:
            return self._timers[name]
        if (MAX_LEVEL if log_level is None else log_level) > self.log_level:
            return _NO_TIMER
        timer = self._timers[name] = _Timer(self._sync_cuda)
        return timer

    def add(self, name: str, seconds: float, log_level: int = 1) -> None:
        """Add time measured elsewhere (SDP4Bit's phases) to timer ``name``."""
        timer = self(name, log_level)
        if isinstance(timer, _Timer):
            timer.elapsed += seconds

    def collect(self, names: tuple[str, ...] = TIMERS_TO_LOG, normalizer: float = 1.0
                ) -> dict[str, list[float]]:
        """Every rank's time of each timer in ``names``, in ms divided by ``normalizer`` (the
        iterations of the interval), resetting them. Collective over the default group.
        Returns ``{name: [rank 0 ms, rank 1 ms, ...]}`` for the timers that ran on some rank.
        """
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        mine = torch.zeros(len(names), dtype=torch.float64, device=device)
        for i, name in enumerate(names):
            timer = self._timers.get(name)
            if timer is not None:
                mine[i] = timer.elapsed * 1e3 / normalizer
                timer.elapsed = 0.0
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        table = torch.stack(gathered).cpu().T.tolist()  # [names][ranks]
        return {name: row for name, row in zip(names, table) if any(v > 0 for v in row)}


def format_timers(times: dict[str, list[float]], log_option: str) -> str | None:
    """Megatron-LM's timer block: max, (min, max) or every rank, in ms per iteration."""
    if not times:
        return None
    if log_option == "all":
        lines = ["times across ranks (ms):"]
        for name, per_rank in times.items():
            lines.append(f"  {name}:")
            lines += [f"     rank {r:2d}: {v:.2f}" for r, v in enumerate(per_rank) if v > 0]
        return "\n".join(lines)
    head = "max time across ranks (ms):" if log_option == "max" else \
        "(min, max) time across ranks (ms):"
    lines = [head]
    for name, per_rank in times.items():
        ran = [v for v in per_rank if v > 0]
        label = (name + " ").ljust(48, ".")
        if log_option == "max":
            lines.append(f"    {label}: {max(ran):.2f}")
        else:
            lines.append(f"    {label}: ({min(ran):.2f}, {max(ran):.2f})")
    return "\n".join(lines)


def max_times(times: dict[str, list[float]]) -> dict[str, float]:
    """``{name: max over ranks}`` for the metrics file and TensorBoard."""
    return {name: round(max(per_rank), 3) for name, per_rank in times.items()}
