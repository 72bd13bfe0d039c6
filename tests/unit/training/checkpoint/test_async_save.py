"""``--async-save``'s bookkeeping without processes: the order of the finalize step, what a
failed write or an abort publishes (nothing), and where the loop finalizes (before the next
save, on exit, at the end; a failing run aborts). megatron-core's queue is a stand-in that
says when a write is done; the real writer runs in tests/distributed/test_async_save_writer.py."""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from megatron.sdp4bit.integration.async_save import WriterFailed
from megatron.sdp4bit.training import checkpoint_policy, loop
from megatron.sdp4bit.training.checkpoint import disk_space
from megatron.sdp4bit.training.checkpoint.async_save import AsyncSaves, PendingSave
from megatron.sdp4bit.training.checkpoint.files import CheckpointError


class _Request:
    """megatron-core's ``AsyncRequest``: its finalize functions, megatron-core's first."""

    def __init__(self, log: list) -> None:
        self.finalize_fns = [lambda: log.append("megatron-core finalize")]

    def add_finalize_fn(self, fn) -> None:
        self.finalize_fns.append(fn)


class _Writer:
    """``BackgroundWriter``: ``done`` says how many scheduled writes have exited."""

    def __init__(self, log: list) -> None:
        self.log, self.requests, self.done, self.fail = log, [], 0, None
        self.closed = None

    def schedule(self, request, limit: float, before_write=None) -> None:
        self.requests.append(request)
        self.log.append(f"fork writer (limit {limit:g} s)")

    def finalize(self, blocking: bool) -> list[int]:
        self.log.append(f"agree (blocking={blocking})")
        if self.fail is not None:
            self.requests.pop(0)
            raise self.fail
        ready = len(self.requests) if blocking else min(self.done, len(self.requests))
        finished = []
        for _ in range(ready):
            for fn in self.requests.pop(0).finalize_fns:
                fn()
            finished.append(len(finished))
        self.done -= min(self.done, ready)
        return finished

    def close(self, abort: bool = False) -> None:
        self.closed = "abort" if abort else "closed"


def _saves(log):
    writer = _Writer(log)
    return AsyncSaves(timeout_seconds=600.0, writer=writer), writer


def _schedule(saves, log, iteration):
    saves.schedule(_Request(log), PendingSave("CK", f"CK/iter_{iteration}.partial", iteration, {}),
                   lambda save: log.append(f"publish {save.iteration}"))


def test_a_save_is_published_only_by_its_finalize_after_megatron_cores():
    log = []
    saves, writer = _saves(log)
    assert saves.finalize() == [] and log == []  # nothing pending: not even the agreement
    _schedule(saves, log, 4)
    assert saves.finalize() == [] and saves.pending == [4]  # still writing on some rank
    assert "publish 4" not in log
    writer.done = 1
    assert saves.finalize() == [4] and saves.pending == []
    assert log == ["fork writer (limit 600 s)", "agree (blocking=False)", "agree (blocking=False)",
                   "megatron-core finalize", "publish 4"]
    _schedule(saves, log, 8)
    assert saves.close() == [8] and writer.closed == "closed"
    assert log[-3:] == ["agree (blocking=True)", "megatron-core finalize", "publish 8"]


def test_a_failed_write_publishes_nothing_and_names_the_save(monkeypatch, tmp_path):
    log = []
    saves, writer = _saves(log)
    monkeypatch.setattr(disk_space.dist, "get_rank", lambda: 0)
    partial = tmp_path / "iter_0000004.partial"
    partial.mkdir()
    saves.schedule(_Request(log), PendingSave(str(tmp_path), str(partial), 4, {}),
                   lambda save: log.append("publish"))
    writer.fail = CheckpointException("write", {1: (OSError(28, "No space left on device"),
                                                    None)})
    with pytest.raises(CheckpointError, match=r"^saving iteration 4 to .* failed \(No space "
                       r"left on device\): its partial folder is removed and .* holds no "
                       r"complete checkpoint yet"):
        saves.finalize()
    assert "publish" not in log and not partial.exists() and saves.pending == []


@pytest.mark.parametrize("failure,cause,fix", [
    (WriterFailed(1, 4242, -9, 3.0, 8.0), "rank 1's checkpoint writer (pid 4242) was killed by "
     "signal SIGKILL before it finished", "restart the run (a SIGKILL nobody sent is often the "
     "kernel's out-of-memory killer: see dmesg)"),
    (WriterFailed(0, 7, -15, 3.0, 8.0), "rank 0's checkpoint writer (pid 7) was killed by "
     "signal SIGTERM before it finished", "restart the run"),
    (WriterFailed(2, 77, 3, 1.0, 8.0), "rank 2's checkpoint writer (pid 77) exited with status "
     "3 before it finished", "restart the run"),
    (WriterFailed(2, 77, None, 8.4, 8.0, ranks=3), "rank 2's checkpoint writer (pid 77) (and 2 "
     "other rank(s)' writers) had not finished after 8.4 s, its time limit being 8.0 s: it was "
     "killed", "the limit is --async-save-timeout-seconds plus 1 s per 10 MiB the rank writes; "
     "a writer that runs this long is stopped or its file system hangs: check it, raise the "
     "flag if the file system is only slow, and restart the run"),
], ids=["SIGKILL", "SIGTERM", "status", "stuck"])
def test_a_writer_that_ended_badly_is_named_not_the_disk(monkeypatch, tmp_path, failure, cause,
                                                         fix):
    log = []
    writer = _Writer(log)
    saves = AsyncSaves(timeout_seconds=5.0, writer=writer)
    monkeypatch.setattr(disk_space.dist, "get_rank", lambda: 0)
    root = tmp_path / "CK"
    partial = root / "iter_0000010.partial"
    partial.mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("5\n")
    save = PendingSave(str(root), str(partial), 10, {}, local_bytes=30 << 20)
    assert saves.time_limit(save) == 8.0  # the flag plus 1 s per 10 MiB
    saves.schedule(_Request(log), save, lambda save: log.append("publish"))
    assert log[0] == "fork writer (limit 8 s)"
    writer.fail = failure
    with pytest.raises(CheckpointError) as err:
        saves.finalize(blocking=True)
    assert str(err.value) == (f"saving iteration 10 to {root} failed: {cause}; its partial "
                              f"folder is removed and iteration 5 in {root} stays the current "
                              f"checkpoint; {fix}")
    assert "publish" not in log and not partial.exists() and saves.pending == []


def test_abort_publishes_nothing_and_a_failed_close_aborts():
    log = []
    saves, writer = _saves(log)
    _schedule(saves, log, 4)
    assert saves.close(abort=True) == [] and writer.closed == "abort"
    assert log == ["fork writer (limit 600 s)"]  # no agreement (other ranks may be gone)
    saves, writer = _saves(log)
    _schedule(saves, log, 6)
    writer.fail = RuntimeError("a rank was lost")
    with pytest.raises(RuntimeError):
        saves.close()
    assert writer.closed == "abort" and "publish 6" not in log


class _LoopSaves:
    """What the loop sees of :class:`AsyncSaves`: a save is done when finalized."""

    def __init__(self, log: list) -> None:
        self.log, self._pending = log, []

    def finalize(self, blocking: bool = False) -> list[int]:
        self.log.append(f"finalize blocking={blocking}")
        done, self._pending = (self._pending, []) if blocking else ([], self._pending)
        return done

    def close(self, abort: bool = False) -> list[int]:
        self.log.append(f"close abort={abort}")
        return [] if abort else self.finalize(True)


def _loop_state(monkeypatch, log):
    args = argparse.Namespace(save="CK", ckpt_format="torch_dist", async_save=True,
                              async_save_timeout_seconds=600.0,
                              tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              overlap_param_gather=False)
    state = loop.TrainState(model=[], optimizer=None, scheduler=None, datasets=[],
                            vocab_size=0)
    saves = _LoopSaves(log)
    monkeypatch.setattr(checkpoint_policy, "AsyncSaves", lambda timeout_seconds: saves)

    def save(args, iteration, *a, background=None, **kw):
        log.append(f"schedule {iteration}")
        background._pending.append(iteration)

    monkeypatch.setattr(checkpoint_policy.formats, "save", save)
    monkeypatch.setattr(checkpoint_policy.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(checkpoint_policy, "is_logging_rank", lambda: True)
    monkeypatch.setattr(loop, "is_logging_rank", lambda: True)
    return args, state, checkpoint_policy.CheckpointPolicy(args, state)


def test_the_loop_finishes_a_pending_save_before_the_next_and_says_when_it_is_saved(
        monkeypatch, capsys):
    log = []
    args, state, checkpoints = _loop_state(monkeypatch, log)
    state.iteration = 3
    checkpoints.save()
    out = capsys.readouterr().out
    assert "scheduled an async checkpoint save at iteration       3 to CK" in out
    assert "successfully saved" not in out and state.saved_iteration is None
    state.iteration = 6
    checkpoints.save()  # the save of 3 is published first
    assert log == ["finalize blocking=True", "schedule 3", "finalize blocking=True",
                   "schedule 6"]
    out = capsys.readouterr().out
    assert out.index("successfully saved checkpoint from iteration       3 to CK") < \
        out.index("saving checkpoint at iteration       6")
    assert state.saved_iteration == 3


def test_an_exit_signal_waits_for_the_save_it_asked_for(monkeypatch, capsys):
    log = []
    args, state, checkpoints = _loop_state(monkeypatch, log)
    state.iteration = 5
    assert checkpoints.before_exit(wait=True).startswith("checkpoint saved in ")
    assert log[-2:] == ["schedule 5", "finalize blocking=True"]
    assert state.saved_iteration == 5
    assert "successfully saved checkpoint from iteration       5 to CK" in \
        capsys.readouterr().out
    # the interval's save of the iteration the signal stops at is still being written: the
    # exit publishes it without saving twice, and says how long it waited
    state.iteration = 8
    checkpoints.save()
    checkpoints.saved_now = True
    log.clear()
    assert checkpoints.before_exit(wait=True).startswith("checkpoint saved in ")
    assert log == ["finalize blocking=True"] and state.saved_iteration == 8


@pytest.mark.parametrize("error,closed", [(loop.TrainingStopped("diverged"), "close abort=False"),
                                          (RuntimeError("lost a rank"), "close abort=True")])
def test_train_publishes_on_an_agreed_stop_and_aborts_on_a_failure(monkeypatch, error, closed):
    log = []
    args, state, _ = _loop_state(monkeypatch, log)

    def run(*a):
        raise error

    monkeypatch.setattr(loop, "_train", run)
    with pytest.raises(type(error)):
        loop.train(args, state)
    assert log[0] == closed
    monkeypatch.setattr(loop, "_train", lambda *a: None)
    log.clear()
    assert loop.train(args, state) is state
    assert log == ["close abort=False", "finalize blocking=True"]
