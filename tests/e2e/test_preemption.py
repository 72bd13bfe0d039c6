"""``--exit-signal-handler`` under the real ``torchrun``: a signal saves and ends the run, and
the saved run continues as if nothing had happened; without the flag, a signal during an
asynchronous save ends the job and leaves nothing running.

Five launches share the assertions (SDP4Bit on 2 ranks, one per "node", so the gradients
take the inter-node hop; every iteration logged, no periodic save unless said):

1. the uninterrupted run to ``ITERS``, the reference;
2. real ``torchrun``, SIGTERM to the agent once iteration 2 is logged; it forwards the
   signal to every worker;
3. real ``torchrun`` resuming from 2's checkpoint, with ``--async-save`` and a save two
   iterations on whose writer on rank 0 sleeps (``SDP4BIT_FAULT=slow-writer``); SIGTERM to
   rank 1's worker alone once that save is scheduled: the other rank learns it at the
   end-of-step agreement, and the exit waits for the save in flight, publishes it, then
   saves and publishes the iteration it stops at;
4. real ``torchrun`` resuming from 3's checkpoint the same way but without
   ``--exit-signal-handler``; SIGTERM to rank 0's worker while its writer sleeps: the job
   dies, the tracker still names 3's checkpoint, and no process of the job (workers,
   writers, results-queue servers) is alive a few seconds after ``torchrun`` exits;
5. a resume from 3's checkpoint to ``ITERS``, past 4's leftover partial folder.

The logged losses (and gradient norms, learning rates, byte counts) of 2, 3 and 5 must be
those of 1 at the same iterations, bit for bit: each checkpoint holds the exact state of
its iteration. docs/reliability.md has the measured times.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.helpers.processes import describe, family, kill_all, still_alive
from tests.helpers.trainer import METHODS, ROOT, TINY, torchrun, train_lines, trainer_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

# Room for the signals' lag: each signal lands some iterations after the line that sent it
# (about 0.2 s each; on 2 loaded cores the lags of launches 2 and 3 once added up to 4 or
# more, with 12 iterations in all), and launch 4's must still come before the end:
# ITERS > 2 + lag (launch 2) + 2 + lag (launch 3) + 2.
ITERS = 20
# torchrun's wait for its workers after forwarding a signal (--shutdown-timeout's default).
TORCHRUN_GRACE_S = 30
# "a few seconds after the job ended": what may still be ending then is an orphan
ORPHAN_GRACE_S = 3
# Two ranks: every launch but the reference starts fresh interpreters (the real torchrun).
NPROC = 2
FLAGS = [*TINY, "--mock-data", *METHODS["SDP4Bit"], "--dp-ranks-per-node", "1",
         "--exit-signal-handler", "--save-interval", "1000"]
for flag, value in (("--train-iters", ITERS), ("--log-interval", 1), ("--eval-interval", 100)):
    FLAGS[FLAGS.index(flag) + 1] = str(value)
COMPARED = ("lm_loss", "grad_norm", "learning_rate", "consumed_samples", "comm_bytes_params",
            "comm_bytes_grads_intra", "comm_bytes_grads_inter")


def _logged(iteration: int):
    return lambda line: any(m["iteration"] >= iteration for m in train_lines(line))


def _scheduled(iteration: int):
    return lambda line: f"scheduled an async checkpoint save at iteration {iteration:7d}" in line


def _with(flags: list[str], **values) -> list[str]:
    """``flags`` with the given flags' values replaced (``save_interval=5``)."""
    flags = list(flags)
    for name, value in values.items():
        flags[flags.index("--" + name.replace("_", "-")) + 1] = str(value)
    return flags


def _signalled_run(args: list[str], when, target: str | int, fault: str = "") -> dict:
    """Real torchrun; once a line of its output satisfies ``when``, SIGTERM to the agent
    (``target="agent"``) or to the worker of global rank ``target``. Returns the exit
    status, the output, the seconds from the signal to the agent's exit, and the job's
    processes still alive ``ORPHAN_GRACE_S`` seconds after it exited."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(NPROC),
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"), *args]
    env = {**trainer_env(), **({"SDP4BIT_FAULT": fault} if fault else {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=ROOT, start_new_session=True)
    # Both streams are read by threads: the job ends when torchrun exits, whereas the pipes
    # end only when every process holding them has (an orphan would hold them open).
    out: list[str] = []
    err: list[str] = []
    moment = threading.Event()

    def read_out() -> None:
        for line in proc.stdout:
            out.append(line)
            if not moment.is_set() and when(line):
                moment.set()

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")),
                                daemon=True)]
    for reader in readers:
        reader.start()
    job: list[psutil.Process] = []
    by_rank: dict[int, list[psutil.Process]] = {}
    try:
        deadline = time.monotonic() + 600
        while not moment.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the run ended (or hung) before the signal's moment: "
                                     f"{''.join(out)[-2000:]}{''.join(err)[-3000:]}")
        workers = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
        assert sorted(workers) == list(range(NPROC)), workers
        job = family(proc.pid)  # the agent, its workers and what they started
        by_rank = {rank: family(worker.pid) for rank, worker in workers.items()}
        sent = time.monotonic()
        os.kill(proc.pid if target == "agent" else workers[target].pid, signal.SIGTERM)
        proc.wait(timeout=120)
        elapsed = time.monotonic() - sent
        left = still_alive(job, within=ORPHAN_GRACE_S)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left, if anything
        except ProcessLookupError:
            pass
        kill_all(job)
        for reader in readers:
            reader.join(timeout=30)
    return {"rc": proc.returncode, "stdout": "".join(out), "stderr": "".join(err),
            "seconds": elapsed, "by_rank": by_rank, "left": left}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ckpt = str(tmp_path_factory.mktemp("preempt") / "ckpt")
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    result: dict = {"full": train_lines(torchrun(FLAGS, nproc=NPROC).stdout)}
    result["agent"] = _signalled_run(FLAGS + ["--save", ckpt], when=_logged(2), target="agent")
    with open(tracker) as f:
        result["agent"]["tracker"] = int(f.read())
    # a save in flight (its writer on rank 0 asleep) when rank 1 gets the signal
    in_flight = result["agent"]["tracker"] + 2
    resume = _with(FLAGS, save_interval=in_flight) + ["--save", ckpt, "--load", ckpt,
                                                      "--async-save"]
    result["worker"] = _signalled_run(resume, when=_scheduled(in_flight), target=1,
                                      fault=f"slow-writer@{in_flight}:0")
    result["worker"]["in_flight"] = in_flight
    with open(tracker) as f:
        result["worker"]["tracker"] = int(f.read())
    # the same without --exit-signal-handler: rank 0's worker dies during its save
    killed_at = result["worker"]["tracker"] + 2
    assert killed_at < ITERS, ("the signals came too late to test anything: launch 2 stopped "
                               f"at {result['agent']['tracker']}, launch 3 at "
                               f"{result['worker']['tracker']}, of {ITERS} iterations")
    unhandled = [f for f in _with(FLAGS, save_interval=killed_at)
                 if f != "--exit-signal-handler"]
    result["killed"] = _signalled_run(unhandled + ["--save", ckpt, "--load", ckpt,
                                                   "--async-save"],
                                      when=_scheduled(killed_at), target=0,
                                      fault=f"slow-writer@{killed_at}:0")
    result["killed"]["at"] = killed_at
    with open(tracker) as f:
        result["killed"]["tracker"] = int(f.read())
    result["rest"] = torchrun(FLAGS + ["--load", ckpt], nproc=NPROC).stdout
    return result


def _check_saved_and_exited(run: dict, start: int) -> int:
    """The run logged iterations start+1..N, saved N, said why it exited, and no worker
    failed; returns N."""
    logged = [m["iteration"] for m in train_lines(run["stdout"])]
    stop = run["tracker"]
    assert logged == list(range(start + 1, stop + 1)), (logged, run["stdout"][-2000:])
    assert stop < ITERS, "the signal came too late to test anything"
    assert f"successfully saved checkpoint from iteration {stop:7d} to " in run["stdout"]
    assert f"exiting program after receiving SIGTERM at iteration {stop} (checkpoint saved in " \
        in run["stdout"], run["stdout"][-2000:]
    assert "pretrain_gpt.py: error" not in run["stdout"] + run["stderr"]
    # within torchrun's grace: no worker was killed
    assert "forcefully exiting" not in run["stderr"] and run["seconds"] < TORCHRUN_GRACE_S, run
    assert not run["left"], f"alive after the job ended: {describe(run['left'])}"
    return stop


def test_sigterm_to_torchrun_saves_the_current_iteration_and_exits(runs):
    run = runs["agent"]
    _check_saved_and_exited(run, 0)
    # torchrun's own verdict: it exits 1 after a signal whatever its workers did, with the
    # signal as a traceback of its own; no worker printed one.
    assert run["rc"] == 1, run["stderr"][-3000:]
    assert "Received 15 death signal, shutting down workers" in run["stderr"]
    tracebacks = run["stderr"].split("Traceback (most recent call last)")[1:]
    assert len(tracebacks) == 1 and tracebacks[0].rstrip().endswith("got signal: 15"), \
        run["stderr"][-4000:]


def test_sigterm_to_one_worker_saves_and_every_rank_exits_0(runs):
    run = runs["worker"]
    start = runs["agent"]["tracker"]
    assert "loaded checkpoint from" in run["stdout"]
    stop = _check_saved_and_exited(run, start)
    # --async-save: the save in flight when the signal came (its writer still asleep) is
    # published, then the iteration the run stops at (the same one, if the ranks agreed on
    # the signal at its end), before the exit: the tracker names it (rank 0 prints the
    # saves' lines, the last rank the exit's: their order in the output is not the ranks')
    out = run["stdout"]
    for saved in sorted({run["in_flight"], stop}):
        scheduled = out.index(f"scheduled an async checkpoint save at iteration {saved:7d}")
        assert scheduled < out.index(f"successfully saved checkpoint from iteration "
                                     f"{saved:7d}"), out[-2000:]
    # torchrun saw nothing: it exits 0 only when every worker did
    assert run["rc"] == 0, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"]


def test_sigterm_during_an_async_save_without_the_handler_leaves_nothing_running(runs):
    run = runs["killed"]
    # the save was in flight: rank 0's worker had started its writer and the results-queue
    # server
    assert len(run["by_rank"][0]) >= 3, describe(run["by_rank"][0])
    assert run["rc"] != 0, run["stderr"][-3000:]  # the job died
    assert f"successfully saved checkpoint from iteration {run['at']:7d}" not in run["stdout"]
    assert run["tracker"] == runs["worker"]["tracker"]  # the previous complete checkpoint
    assert not run["left"], f"alive {ORPHAN_GRACE_S} s after the job ended: " \
        f"{describe(run['left'])}"
    # the next run resumed from that checkpoint (launch 5)
    assert f"at iteration {run['tracker']}" in runs["rest"], runs["rest"][-2000:]


def test_resumed_runs_repeat_the_uninterrupted_run_bit_for_bit(runs):
    full = {m["iteration"]: m for m in runs["full"]}
    assert sorted(full) == list(range(1, ITERS + 1))
    pieces = [train_lines(runs[k]["stdout"]) for k in ("agent", "worker")]
    pieces.append(train_lines(runs["rest"]))
    logged = [m["iteration"] for piece in pieces for m in piece]
    assert logged == list(range(1, ITERS + 1)), logged  # no iteration lost or repeated
    for m in (m for piece in pieces for m in piece):
        for key in COMPARED:
            assert m[key] == full[m["iteration"]][key], (key, m, full[m["iteration"]])
