"""Faults and bad input under ``torchrun``: one clear line, nothing lost, no hang.

Each case launches the tiny GPT of test_pretrain_gpt.py on 4 gloo ranks and breaks one
thing: a data file, a checkpoint, a flag, a rank (stopped or killed), a gradient. What must
hold: a non-zero exit with exactly one ``pretrain_gpt.py: error:`` line and no traceback
(or the right behaviour, for the faults a run survives), every rank ending together, and no
checkpoint lost. docs/reliability.md lists the probes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import launch as _launch
from tests.helpers.trainer import (
    METHODS, ROOT, TINY, launch, one_error_line, train_lines, trainer_env)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SHORT = [a for a in TINY]
SHORT[SHORT.index("--train-iters") + 1] = "8"
SHORT[SHORT.index("--log-interval") + 1] = "1"
SHORT[SHORT.index("--eval-interval") + 1] = "100"
# The checkpoint probes here break the per-rank files; torch_dist's: test_dist_checkpoint.py.
SHORT += ["--ckpt-format", "torch"]
SDP4BIT = METHODS["SDP4Bit"] + ["--dp-ranks-per-node", "2"]


@pytest.mark.release_independent
def test_bad_data_file_stops_every_rank_with_one_line(data_prefix, tmp_path):
    prefix = data_prefix[data_prefix.index("--data-path") + 1]
    broken = tmp_path / "broken"
    for ext in (".idx", ".bin"):
        os.link(prefix + ext, str(broken) + ext)
    with open(str(broken) + ".bin", "r+b") as f:  # a truncated copy (hard link: copy first)
        data = f.read()
    os.remove(str(broken) + ".bin")
    with open(str(broken) + ".bin", "wb") as f:
        f.write(data[: len(data) // 2])
    flags = list(data_prefix)
    flags[flags.index("--data-path") + 1] = str(broken)
    start = time.time()
    message = one_error_line(launch(SHORT + flags))
    assert re.fullmatch(rf"{re.escape(str(broken))}\.bin is \d+ bytes but .* the pair does not "
                        r"match or one is truncated; rebuild both with "
                        r"tools/preprocess_data\.py", message), message
    assert time.time() - start < 90


@pytest.mark.release_independent
def test_crafted_index_cache_is_refused_and_runs_no_code(data_prefix, tmp_path):
    cache = data_prefix[data_prefix.index("--data-cache-path") + 1]
    os.makedirs(cache, exist_ok=True)
    marker = tmp_path / "code-ran"
    evil = os.path.join(cache, "0000-GPTDataset-train-document_index.npy")
    payload = ("cos\nsystem\n(S'touch " + str(marker) + "'\ntR.").encode()  # pickle protocol 0
    with open(evil, "wb") as f:
        f.write(payload)
    try:
        message = one_error_line(launch(SHORT + data_prefix))
    finally:
        os.remove(evil)
    assert message.startswith(f"dataset index cache {evil} is not a NumPy array file")
    assert not marker.exists()


def test_fp16_trains(tmp_path):
    """Loss scaling is wired (dynamic, megatron-core's default start at 2**32): the loss
    falls and the gradient norm is not zero once the scale has come down."""
    flags = [a for a in SHORT if a != "--bf16"] + ["--fp16", "--mock-data"]
    flags[flags.index("--train-iters") + 1] = "40"
    flags[flags.index("--log-interval") + 1] = "5"
    res = launch(flags + SDP4BIT)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = train_lines(res.stdout)
    assert lines[-1]["lm_loss"] < lines[1]["lm_loss"] - 0.3, [m["lm_loss"] for m in lines]
    assert lines[-1]["grad_norm"] > 0 and lines[-1]["loss_scale"] < 2.0 ** 32


def test_nan_gradient_is_skipped_on_every_rank(tmp_path):
    """A NaN in rank 1's gradients at iteration 3 (carried by the quantized collectives to
    every shard) skips that step on all ranks; replicas stay identical (checked every
    iteration) and training goes on."""
    res = launch(SHORT + SDP4BIT + ["--mock-data", "--check-replicas-interval", "1"],
                 env={"SDP4BIT_FAULT": "nan-grad@3:1"})
    assert res.returncode == 0, res.stderr[-3000:]
    skips = [x for x in res.stdout.splitlines() if x.startswith("skipped iteration")]
    assert skips == ["skipped iteration 3: non-finite gradients (NaN or Inf) on some rank; no "
                     "weight changed on any rank"]
    lines = {m["iteration"]: m for m in train_lines(res.stdout)}
    assert lines[3]["skipped_iterations"] == 1
    assert all(lines[i]["skipped_iterations"] == 0 for i in (2, 4, 8))
    assert lines[8]["lm_loss"] == lines[8]["lm_loss"]  # finite: no NaN reached a weight


@pytest.mark.release_independent  # SDP4Bit's replica check (the fault is planted by SDP4Bit)
def test_a_drifted_replica_is_caught_by_the_replica_check():
    res = launch(SHORT + SDP4BIT + ["--mock-data", "--check-replicas-interval", "2"],
                 env={"SDP4BIT_FAULT": "flip-replica@3:3"})
    assert re.fullmatch(r"model replicas differ across data-parallel ranks at iteration 4: bucket "
                        r"0 \(\d+ elements: [\w.]+, [\w.]+, \.\.\.\) differs between DP ranks 0 "
                        r"and 3; the run stops \(a bug or a hardware fault: resume from the last "
                        r"checkpoint\)", one_error_line(res))


@pytest.mark.release_independent  # the loop's count; the skip itself: the NaN test above
def test_too_many_skips_in_a_row_stop_the_run():
    res = launch(SHORT + SDP4BIT + ["--mock-data", "--max-consecutive-skipped-iterations", "2"],
                 env={"SDP4BIT_FAULT": "nan-grad@3:1,nan-grad@4:2"})
    message = one_error_line(res)
    assert message.startswith("stopping at iteration 4: 2 iterations in a row had non-finite "
                              "gradients")


def _train_and_save(tmp_path, extra=(), iters=8, env=None) -> tuple[str, list]:
    ckpt = str(tmp_path / "ckpt")
    flags = SHORT + SDP4BIT + ["--mock-data", "--save", ckpt, "--save-interval", "4", *extra]
    flags[flags.index("--train-iters") + 1] = str(iters)
    res = launch(flags, env=env)
    return ckpt, res


@pytest.fixture(scope="module")
def trained_4(tmp_path_factory) -> str:
    """A healthy SDP4Bit run's per-rank checkpoint of iteration 4, shared by the tests below
    that damage or refuse it (each takes a copy: :func:`copy_of_trained_4`)."""
    ckpt, res = _train_and_save(tmp_path_factory.mktemp("trained_4"), iters=4)
    assert res.returncode == 0, res.stderr[-3000:]
    return ckpt


def copy_of_trained_4(trained_4: str, tmp_path) -> str:
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(trained_4, ckpt)
    return ckpt


@pytest.mark.release_independent
def test_checkpoint_tampering_and_damage_are_named(trained_4, tmp_path):
    ckpt = copy_of_trained_4(trained_4, tmp_path)
    target = os.path.join(ckpt, "iter_0000004", "rank_00002.pt")
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0x01  # one bit, inside the tensors
    open(target, "wb").write(bytes(data))
    resume = SHORT + SDP4BIT + ["--mock-data", "--load", ckpt]
    resume[resume.index("--train-iters") + 1] = "10"
    none = f" (no other complete checkpoint is in {ckpt})"  # iteration 4 is its only one
    assert one_error_line(launch(resume)) == (
        f"checkpoint file {target} does not match its SHA-256 in the manifest: it changed "
        "after it was written (disk or copy error); load an earlier checkpoint" + none)
    os.remove(target)
    assert one_error_line(launch(resume)) == (
        f"checkpoint file {target} is missing: the checkpoint is incomplete; load an earlier "
        "one" + none)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("four\n")
    assert one_error_line(launch(resume)).startswith(
        f"{ckpt}/latest_checkpointed_iteration.txt holds 'four', not an iteration number")


@pytest.mark.release_independent  # SDP4Bit's save; the per-rank load: --no-load-optim's test
def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    ckpt, res = _train_and_save(tmp_path, env={"SDP4BIT_FAULT": "die-saving@8:1"})
    assert res.returncode != 0
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"
    resume = SHORT + SDP4BIT + ["--mock-data", "--load", ckpt, "--save", ckpt]
    res = launch(resume)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "loaded checkpoint from" in res.stdout and "at iteration 4" in res.stdout
    assert [m["iteration"] for m in train_lines(res.stdout)] == [5, 6, 7, 8]


@pytest.mark.release_independent
def test_runs_do_not_clobber_each_others_checkpoints(trained_4, tmp_path):
    ckpt = copy_of_trained_4(trained_4, tmp_path)
    fresh = SHORT + SDP4BIT + ["--mock-data", "--save", ckpt]
    assert one_error_line(launch(fresh)) == (
        f"--save {ckpt} already holds checkpoints up to iteration 4 of another run: resume it "
        f"with --load {ckpt}, choose another --save, or pass --overwrite-checkpoints to delete "
        "them")
    from megatron.sdp4bit.training.checkpoint.files import SaveDirLock

    lock = SaveDirLock(ckpt)  # a live run holding the folder
    try:
        message = one_error_line(launch(fresh + ["--load", ckpt]))
    finally:
        lock.release()
    assert message.startswith(f"--save {ckpt} is in use by another run (pid {os.getpid()} on ")


@pytest.mark.release_independent
def test_resume_checks_layout_schedule_and_method(trained_4, tmp_path):
    ckpt = copy_of_trained_4(trained_4, tmp_path)
    resume = SHORT + ["--mock-data", "--load", ckpt]
    tp2 = resume + METHODS["SDP4Bit"] + ["--tensor-model-parallel-size", "2",
                                        "--dp-ranks-per-node", "1"]
    assert re.fullmatch(r"checkpoint \S+iter_0000004 was saved with layout dp 4, tp 1; this "
                        r"run has dp 2, tp 2: resume with the same layout \(or start a new "
                        r"run\)", one_error_line(launch(tp2)))
    lr = resume + SDP4BIT + ["--lr", "1e-3", "--train-iters", "4"]
    assert re.fullmatch(r"resuming \S+iter_0000004 would change its schedule: --lr 0\.003 -> "
                        r"0\.001; pass --override-opt_param-scheduler to use this command "
                        r"line's schedule, or --use-checkpoint-opt_param-scheduler to keep the "
                        r"checkpoint's", one_error_line(launch(lr)))
    method = resume + METHODS["qWD"] + ["--dp-ranks-per-node", "2"]
    assert re.fullmatch(r"checkpoint \S+ was trained with SDP4Bit quantized_gradients True; "
                        r"this run has quantized_gradients False: use the same SDP4Bit flags, "
                        r"or pass --allow-changed-sdp4bit-settings to change the method on "
                        r"resume", one_error_line(launch(method)))
    longer = lr[:-2] + ["--train-iters", "6", "--override-opt_param-scheduler"]
    res = launch(longer)
    assert res.returncode == 0, res.stderr[-3000:]
    # the new schedule: peak 1e-3 (not the checkpoint's 3e-3), decaying over 6 iterations
    assert [m["iteration"] for m in train_lines(res.stdout)] == [5, 6]
    assert 0 < train_lines(res.stdout)[0]["learning_rate"] <= 1e-3


def test_no_load_optim_continues_from_the_loaded_weights(data_prefix, tmp_path):
    """The fp32 main params are taken from the loaded model, so the steps after a
    --no-load-optim resume continue from the trained weights. (Without that, the first step
    writes the random initialization back and the next losses jump to the start's level.)"""
    ckpt = str(tmp_path / "ckpt")
    base = SHORT + SDP4BIT + data_prefix
    base[base.index("--train-iters") + 1] = "16"
    res = launch(base + ["--save", ckpt])
    assert res.returncode == 0, res.stderr[-3000:]
    trained = [m["lm_loss"] for m in train_lines(res.stdout)]
    gap = trained[0] - trained[-1]
    assert gap > 0.5, trained  # the run learned something worth keeping
    resume = base + ["--load", ckpt, "--no-load-optim", "--no-load-rng",
                     "--override-opt_param-scheduler"]
    resume[resume.index("--train-iters") + 1] = "19"
    res = launch(resume)
    assert res.returncode == 0, res.stderr[-3000:]
    after = [m["lm_loss"] for m in train_lines(res.stdout)]
    assert len(after) == 3
    assert max(after) < trained[-1] + 0.3 * gap, (after, trained)


@pytest.mark.release_independent  # SDP4Bit's check before a save
def test_non_finite_weights_are_never_saved(tmp_path):
    ckpt, res = _train_and_save(tmp_path, env={"SDP4BIT_FAULT": "nan-weight@8:0"})
    message = one_error_line(res)
    assert message == (f"not saving iteration 8: the weights hold NaN or Inf; the last "
                       f"complete checkpoint in {ckpt} stays current")
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "4"


def _worker_pids(agent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@contextlib.contextmanager
def _training_job(extra: list[str]):
    """A 2-rank run (the real torchrun: fresh interpreters, so few) that would go on for
    100000 iterations, once it trains: yields the torchrun agent's process and its 2
    workers' pids; whatever is left is killed after."""
    flags = SHORT + SDP4BIT + ["--mock-data", *extra]
    flags[flags.index("--train-iters") + 1] = "100000"
    flags[flags.index("--dp-ranks-per-node") + 1] = "1"  # one rank per "node"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=trainer_env(), cwd=ROOT, start_new_session=True)
    try:
        if not any(" iteration " in line for line in proc.stdout):
            raise AssertionError("the run ended before training: " + proc.stderr.read()[-3000:])
        workers = _worker_pids(proc.pid)
        assert len(workers) == 2
        yield proc, workers
    finally:
        _kill_group(proc)


def _drain(stream, lines: list[str]) -> threading.Thread:
    """Read ``stream`` into ``lines`` on a thread (a full pipe would block the job)."""
    thread = threading.Thread(target=lambda: lines.extend(iter(stream.readline, "")),
                              daemon=True)
    thread.start()
    return thread


@pytest.mark.release_independent
def test_a_stopped_rank_ends_the_job_in_bounded_time():
    # "has sent no heartbeat" when the stop came before rank 0 saw the rank's first beat
    stopped = re.compile(r"pretrain_gpt\.py: error: rank \d (stopped responding|has sent no "
                         r"heartbeat) for \d+ s")
    with _training_job(["--heartbeat-timeout-seconds", "6"]) as (proc, workers):
        out, err = [], []
        _drain(proc.stdout, out)
        _drain(proc.stderr, err)
        os.kill(workers[1], signal.SIGSTOP)
        start = time.time()
        while time.time() - start < 60 and not any(stopped.search(x) for x in err):
            time.sleep(0.1)
        detected = time.time() - start
        # The rest is torchrun's: it sends SIGTERM to the ranks left and kills a rank that
        # has not exited 30 s later, which a stopped one cannot. Continued, it takes the
        # signal now.
        os.kill(workers[1], signal.SIGCONT)
        proc.wait(timeout=60)
    assert proc.returncode != 0
    assert any(stopped.search(x) for x in err), "".join(err)[-3000:]
    # heartbeat timeout 6 s + one interval (1.5 s) + the guard's period, and slack for a
    # busy machine
    assert detected < 30, detected


@pytest.mark.release_independent
def test_a_killed_rank_ends_the_job():
    with _training_job([]) as (proc, workers):
        os.kill(workers[1], signal.SIGKILL)
        start = time.time()
        proc.communicate(timeout=120)
        elapsed = time.time() - start
    assert proc.returncode != 0 and elapsed < 60, elapsed


@pytest.mark.release_independent
def test_workers_of_a_killed_agent_exit_on_their_own():
    with _training_job(["--heartbeat-timeout-seconds", "6"]) as (proc, workers):
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.5)
        alive = [w for w in workers if _alive(w)]
    assert not alive


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the job, stopped ones too
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.release_independent
def test_parse_errors_always_print_their_line():
    """Whichever rank exits first, the launch shows its one error line (four launches; before
    the fix about one launch in twelve lost it)."""
    for _ in range(4):
        message = one_error_line(launch(SHORT + ["--mock-data", "--lr", "-"], timeout=60))
        assert message == "argument --lr: invalid float value: '-'"


@pytest.mark.release_independent
def test_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _launch.python(os.path.join(ROOT, "pretrain_gpt.py"), [*SHORT, "--mock-data"],
                             env={**trainer_env(), "MASTER_PORT": str(port)}, cwd=ROOT, timeout=120)
    assert one_error_line(res) == (f"port {port} on 127.0.0.1 is in use (another run?): set "
                                   "MASTER_PORT to a free port (torchrun: --master-port, or "
                                   "--rdzv-endpoint host:port)")


@pytest.mark.release_independent
def test_preprocess_is_atomic_and_refuses_empty_input(data_prefix, tmp_path):
    prefix = data_prefix[data_prefix.index("--data-path") + 1]
    vocab = data_prefix[data_prefix.index("--vocab-file") + 1]
    merges = data_prefix[data_prefix.index("--merge-file") + 1]
    out = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        with open(prefix + ext, "rb") as src, open(f"{out}_text_document{ext}", "wb") as dst:
            dst.write(src.read())
    before = {ext: open(f"{out}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n" + "{broken\n")
    tool = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file",
            merges, "--output-prefix", out, "--overwrite"]

    def preprocess(*args: str) -> subprocess.CompletedProcess:
        return _launch.python(os.path.join(ROOT, "tools", "preprocess_data.py"), tool + list(args),
                              env=trainer_env(), cwd=ROOT, timeout=120)

    res = preprocess("--input", str(bad))
    assert res.returncode == 1 and f"{bad}:2: not valid JSON" in res.stderr
    after = {ext: open(f"{out}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")}
    assert after == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    res = preprocess("--input", str(empty))
    assert res.returncode == 1
    assert res.stderr.strip() == (f"preprocess_data.py: error: --input {empty} holds no "
                                  "document (no non-blank line)")
