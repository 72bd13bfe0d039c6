"""The heartbeat watchdog's decisions (training/guards/watchdog.py) and its stop at teardown
(the end-to-end proofs are in tests/e2e/test_faults.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron.sdp4bit.training.guards import watchdog
from tests.helpers.memory_store import MemoryStore


def test_watchdog_names_the_silent_rank(monkeypatch):
    stops = []
    monkeypatch.setattr(watchdog, "_stop", stops.append)
    store = MemoryStore()
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
    dog = watchdog.Watchdog(MemoryStore(), rank=2, world=4, timeout=10, interval=1)
    assert list(dog._last) == [0]
    with pytest.raises(ValueError, match="must exceed the interval"):
        watchdog.Watchdog(MemoryStore(), rank=0, world=2, timeout=1, interval=1)


def test_watchdog_forgets_finished_ranks_and_waits_for_first_beats(monkeypatch):
    stops = []
    monkeypatch.setattr(watchdog, "_stop", stops.append)
    store = MemoryStore()
    dog = watchdog.Watchdog(store, rank=0, world=3, timeout=0.2, interval=0.05)
    dog._create_counters()  # rank 0 creates every counter empty: one multi_get reads all
    assert store.data == {f"{watchdog._PREFIX}1": b"", f"{watchdog._PREFIX}2": b""}
    store.set(f"{watchdog._PREFIX}2", "done")  # rank 2 ended its run in order
    dog._check()
    assert list(dog._last) == [1] and stops == []
    time.sleep(0.25)
    dog._check()  # rank 1 never wrote its counter
    assert stops and stops[0].startswith("rank 1 has sent no heartbeat for 0 s")


class _FlakyStore(MemoryStore):
    """Fails its first ``failures`` requests, then answers (forever when None)."""

    def __init__(self, failures):
        super().__init__()
        self.failures = failures

    def set(self, key, value):
        if self.failures is None or self.failures > 0:
            self.failures = None if self.failures is None else self.failures - 1
            raise RuntimeError("Connection reset by peer")
        super().set(key, value)


def _run_dog(store, monkeypatch, seconds, connect=None):
    stops = []
    monkeypatch.setattr(watchdog, "_stop", stops.append)
    dog = watchdog.Watchdog(store, rank=1, world=2, timeout=0.6, interval=0.1,
                            connect=connect)
    dog.start()
    start = time.monotonic()
    while time.monotonic() - start < seconds and not stops:
        store.data[f"{watchdog._PREFIX}0"] = str(time.monotonic()).encode()  # rank 0 beats
        time.sleep(0.05)
    return dog, stops, time.monotonic() - start


def test_transient_store_errors_are_retried(monkeypatch):
    store = _FlakyStore(failures=3)  # 0.3 s of errors, under the 0.6 s timeout
    dog, stops, _ = _run_dog(store, monkeypatch, 1.5)
    assert stops == [] and dog.stop()
    assert store.data[f"{watchdog._PREFIX}1"] == b"done"


def test_stop_returns_as_soon_as_the_heartbeat_thread_ends():
    """stop() ends both threads without waiting out the guard's period (half an interval:
    2.5 s here, which every rank of every run would otherwise wait at its exit)."""
    store = MemoryStore()
    dog = watchdog.Watchdog(store, rank=1, world=2, timeout=20, interval=5)
    dog.start()
    time.sleep(0.2)  # the first beat is sent; both threads are in their waits
    start = time.monotonic()
    assert dog.stop()
    assert time.monotonic() - start < 1.0
    assert store.data[f"{watchdog._PREFIX}1"] == b"done"


def test_a_store_that_keeps_failing_ends_the_rank_within_the_timeout(monkeypatch):
    connects = []
    dog, stops, elapsed = _run_dog(_FlakyStore(failures=None), monkeypatch, 3.0,
                                   connect=lambda: connects.append(1) or _FlakyStore(None))
    dog.stop()
    assert stops and stops[0].startswith(
        "rank 1: the launcher's store has not answered for 1 s (the last request failed: "
        "RuntimeError; a network partition, or the torchrun agent is stopped; "
        "--heartbeat-timeout-seconds 0.6): ending the job"), stops
    assert 0.6 <= elapsed < 0.6 + 0.1 + 0.5  # timeout + a guard period + slack
    assert len(connects) >= 3  # a new connection tried at every failed beat


_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=timedelta(seconds=60))
print(s.port, flush=True)
beat = 0
while True:  # rank 0's heartbeat, from the store's own process
    beat += 1
    s.set("sdp4bit-heartbeat/0", str(beat))
    time.sleep(0.1)
"""

_WORKER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from megatron.sdp4bit.training.guards.watchdog import Watchdog
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                      timeout=timedelta(seconds=2))
dog = Watchdog(store, rank=1, world=2, timeout=2.0, interval=0.25)
dog.start()
time.sleep(1.0)
print("beating", flush=True)
time.sleep(120)
"""


def test_a_store_that_stops_answering_ends_the_rank_within_the_timeout():
    """A partition, cheaply: the store's process is SIGSTOPped, so requests block in a
    socket receive (TCPStore's own timeout does not bound check or multi_get)."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        port = server.stdout.readline().strip()
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, port], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert worker.stdout.readline().strip() == "beating"
        os.kill(server.pid, signal.SIGSTOP)
        start = time.monotonic()
        _, err = worker.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        server.kill()
        server.wait()
    assert worker.returncode == 1, err
    assert "pretrain_gpt.py: error: rank 1: the launcher's store has not answered for 2 s" \
        in err, err
    assert elapsed < 2.0 + 0.125 + 3.0, elapsed  # timeout + a guard period + slack


_EXIT = """
import time
from datetime import timedelta
import torch.distributed as dist
from megatron.sdp4bit.training.guards.watchdog import Watchdog
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=timedelta(seconds=30))
store = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                      timeout=timedelta(seconds=30))
server.set("sdp4bit-heartbeat/1", "1")
dog = Watchdog(store, rank=0, world=2, timeout=60.0, interval=0.0005)  # always in a request
dog.start()
time.sleep(0.3)
assert dog.stop()
"""


def test_stopping_the_watchdog_before_exit_prevents_the_abort():
    """A daemon thread inside a store request at interpreter exit aborts the process
    (``terminate called without an active exception``); stop() joins it first."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for _ in range(3):
        res = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True,
                             env=env, timeout=120)
        assert res.returncode == 0 and "terminate called" not in res.stderr, \
            (res.returncode, res.stderr)


def test_teardown_stops_the_watchdog_first(monkeypatch):
    from megatron.sdp4bit.training import build

    calls = []

    class Dog:
        def stop(self):
            calls.append("watchdog")
            return True

    monkeypatch.setattr(build.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(build.parallel_state, "destroy_model_parallel",
                        lambda: calls.append("model-parallel"))
    monkeypatch.setattr(build.dist, "destroy_process_group",
                        lambda: calls.append("process-group"))
    build.teardown(Dog())
    assert calls == ["watchdog", "model-parallel", "process-group"]
