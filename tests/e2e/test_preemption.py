"""``--exit-signal-handler`` under the real ``torchrun``: a signal saves and ends the run, and
the saved run continues as if nothing had happened.

Four launches share the assertions (SDP4Bit on 4 ranks, 2 per "node", every iteration
logged, no periodic save):

1. the uninterrupted run to ``ITERS``, the reference;
2. real ``torchrun``, SIGTERM to the agent once iteration 2 is logged; it forwards the
   signal to every worker;
3. real ``torchrun`` resuming from 2's checkpoint, with ``--async-save``, SIGTERM to one
   worker alone once two more iterations are logged; the other ranks learn it at the
   end-of-step agreement, and the exit waits for the asynchronous save to be published;
4. a resume from 3's checkpoint to ``ITERS``.

The logged losses (and gradient norms, learning rates, byte counts) of 2, 3 and 4 must be
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

import pytest

from tests.helpers.trainer import METHODS, ROOT, TINY, torchrun, train_lines, trainer_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

ITERS = 12
# torchrun's wait for its workers after forwarding a signal (--shutdown-timeout's default).
TORCHRUN_GRACE_S = 30
FLAGS = [*TINY, "--mock-data", *METHODS["SDP4Bit"], "--dp-ranks-per-node", "2",
         "--exit-signal-handler", "--save-interval", "1000"]
for flag, value in (("--train-iters", ITERS), ("--log-interval", 1), ("--eval-interval", 100)):
    FLAGS[FLAGS.index(flag) + 1] = str(value)
COMPARED = ("lm_loss", "grad_norm", "learning_rate", "consumed_samples", "comm_bytes_params",
            "comm_bytes_grads_intra", "comm_bytes_grads_inter")


def _signalled_run(args: list[str], after: int, target: str) -> dict:
    """Real torchrun; once iteration ``after`` is logged, SIGTERM to the agent
    (``target="agent"``) or to its third worker (``"worker"``). Returns the exit status, the
    output, and the seconds from the signal to the agent's exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=trainer_env(), cwd=ROOT, start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, "")),
                              daemon=True)
    reader.start()
    out: list[str] = []
    try:
        for line in proc.stdout:
            out.append(line)
            if any(m["iteration"] >= after for m in train_lines(line)):
                break
        else:
            raise AssertionError("the run ended before iteration "
                                 f"{after}: {''.join(out)[-2000:]}{''.join(err)[-3000:]}")
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) == 4, workers
        sent = time.monotonic()
        os.kill(proc.pid if target == "agent" else int(workers[2]), signal.SIGTERM)
        out.extend(proc.stdout)
        proc.wait(timeout=120)
        elapsed = time.monotonic() - sent
        reader.join(timeout=10)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left, if anything
        except ProcessLookupError:
            pass
    return {"rc": proc.returncode, "stdout": "".join(out), "stderr": "".join(err),
            "seconds": elapsed}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ckpt = str(tmp_path_factory.mktemp("preempt") / "ckpt")
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    result: dict = {"full": train_lines(torchrun(FLAGS).stdout)}
    result["agent"] = _signalled_run(FLAGS + ["--save", ckpt], after=2, target="agent")
    with open(tracker) as f:
        result["agent"]["tracker"] = int(f.read())
    resume = FLAGS + ["--save", ckpt, "--load", ckpt, "--async-save"]
    result["worker"] = _signalled_run(resume, after=result["agent"]["tracker"] + 2,
                                      target="worker")
    with open(tracker) as f:
        result["worker"]["tracker"] = int(f.read())
    result["rest"] = torchrun(FLAGS + ["--load", ckpt]).stdout
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
    # --async-save: scheduled, then published (renamed, tracker written) before the exit
    out = run["stdout"]
    scheduled = out.index(f"scheduled an async checkpoint save at iteration {stop:7d}")
    assert scheduled < out.index(f"successfully saved checkpoint from iteration {stop:7d}"), \
        out[-2000:]
    # torchrun saw nothing: it exits 0 only when every worker did
    assert run["rc"] == 0, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"]


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
