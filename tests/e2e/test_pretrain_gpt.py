"""End to end: ``torchrun ... pretrain_gpt.py`` on CPU (gloo), tiny GPT (2 x 64, seq 32).

Four ranks stand in for 2 nodes x 2 GPUs (``--dp-ranks-per-node 2``); separately, two
``torchrun --nnodes 2`` launches on localhost find N = 2, M = 2 by themselves. Every launch
is a few seconds of training after ~10 s of start-up on 2 cores, so cases share launches:
the SDP4Bit run on preprocessed data is also the uninterrupted reference of the resume check.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import launch as _launch
from tests.helpers.scripts import load_tool
from tests.helpers.trainer import METHODS, ROOT, TINY, free_port, torchrun, train_lines, trainer_env


def check_run(lines: list[dict], method: str, consumed: list[int] | None = None) -> None:
    """``consumed``: the samples consumed at iterations 5, 10, 15, 20 (default 16 each)."""
    assert [m["iteration"] for m in lines] == [5, 10, 15, 20]
    assert lines[-1]["lm_loss"] < lines[0]["lm_loss"] - 0.3, [m["lm_loss"] for m in lines]
    assert [m["consumed_samples"] for m in lines] == (consumed or [80, 160, 240, 320])
    for m in lines:
        assert m["nan_iterations"] == 0 and m["skipped_iterations"] == 0
        p, pb = m["comm_bytes_params"], m["baseline_comm_bytes_params"]
        intra, intra_b = m["comm_bytes_grads_intra"], m["baseline_comm_bytes_grads_intra"]
        inter, inter_b = m["comm_bytes_grads_inter"], m["baseline_comm_bytes_grads_inter"]
        # N = 2, M = 2: per rank the unquantized schedule sends (N-1)*M shards inside the node
        # and (M-1) across, so the intra baseline is twice the inter one.
        assert pb > 0 and inter_b > 0 and intra_b == 2 * inter_b
        # The all-gather sends one message to the node peer and two to the other node's ranks
        # (each field the interval's mean, rounded down: with --overlap-param-gather an
        # interval need not hold one all-gather per iteration).
        assert 0 <= m["comm_bytes_params_inter"] - 2 * m["comm_bytes_params_intra"] <= 1
        assert 0 <= m["baseline_comm_bytes_params_inter"] - \
            2 * m["baseline_comm_bytes_params_intra"] <= 1
        if "qWD" in method or method == "SDP4Bit":
            # 16-bit weights vs 4 bits + one fp32 scale per 2048 = 4.0156 bits: 3.98x (the
            # means rounded down: p by less than a byte).
            assert 3.7 < pb / p <= 16 / (4 + 32 / 2048) * (1 + 1 / p), (p, pb)
        else:
            assert p == pb
        if method in ("TLq-HS", "SDP4Bit"):
            # fp32 vs 4 bits + fp32 scale per 128 = 4.25 bits: 7.53x across nodes;
            # 8.25 bits inside: 3.88x. Padding of tiny buckets costs a little.
            assert 6.8 < inter_b / inter <= 32 / (4 + 32 / 128) + 1e-9, (inter, inter_b)
            assert 3.5 < intra_b / intra <= 32 / (8 + 32 / 128) + 1e-9, (intra, intra_b)
        else:
            assert (intra, inter) == (intra_b, inter_b)


# Each method on one data kind (SDP4Bit runs on both: preprocessed in the resume test, mock in
# the two-node test); the baseline on both, as the reference. Seven launches in all.
CASES = [("baseline", "mock"), ("baseline", "preprocessed"), ("qWD", "mock"),
         ("TLq-HS", "preprocessed")]


@pytest.mark.slow
@pytest.mark.distributed
# The second pass runs the baseline on Megatron-LM's per-split files only: the resume test
# below trains qWD and TLq-HS together on preprocessed data, the model-parallel and fault
# tests on mock data, through the same megatron-core paths.
@pytest.mark.parametrize("method,data", [
    pytest.param(m, d, id=f"{m}-{d}",
                 marks=[] if (m, d) == ("baseline", "preprocessed")
                 else [pytest.mark.release_independent])
    for m, d in CASES])
def test_method_trains(method, data, data_prefix, tmp_path):
    flags = ["--mock-data"] if data == "mock" else data_prefix
    tiny = TINY
    per_split = method == "baseline" and data == "preprocessed"
    if per_split:  # Megatron-LM's per-split files instead of --data-path and --split
        prefix = flags[1]
        flags = flags[2:] + [x for s in ("train", "valid", "test")
                             for x in (f"--{s}-data-path", prefix)]
        tiny = [x for x in TINY if x not in ("--split", "90,10,0")]
        # The accuracy scripts' selective recompute, in both passes: the attention's core
        # again inside backward, where megatron-core builds its mask with device="cuda"
        # (CPU mode keeps it on the CPU: integration/cpu_mode.py, items 6 and 7; the run
        # fails with both broken). test_sample_scripts_cpu.py runs such a script once.
        flags += ["--recompute-activations", "--recompute-granularity", "selective"]
    if method == "TLq-HS":  # where the time goes: Megatron-LM's timers plus SDP4Bit's phases
        flags = flags + ["--timing-log-level", "1", "--timing-log-option", "max"]
    metrics = tmp_path / "metrics.jsonl"
    res = torchrun(tiny + flags + METHODS[method] + ["--dp-ranks-per-node", "2",
                                                     "--metrics-jsonl", str(metrics)])
    lines = train_lines(res.stdout)
    check_run(lines, method)
    timed = re.findall(r"max time across ranks \(ms\):\n((?:    .*\n)+)", res.stdout)
    if method == "TLq-HS":
        assert len(timed) == len(lines), res.stdout[-3000:]
        names = {line.split(" ..")[0].strip() for line in timed[-1].splitlines()}
        assert {"forward-backward", "all-grads-sync", "optimizer", "sdp4bit-grads-quantize",
                "sdp4bit-grads-requantize", "sdp4bit-grads-wait",
                "sdp4bit-grads-dequantize"} <= names, names
        assert not any(name.startswith("sdp4bit-params") for name in names)  # not quantized
    else:
        assert not timed
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [r for r in records if "lm_loss" in r]
    evals = [r for r in records if "val_lm_loss" in r]
    assert [r["iteration"] for r in train] == [5, 10, 15, 20]
    comm = ["comm_bytes_params", "comm_bytes_grads_intra", "comm_bytes_grads_inter"]
    required = {"iteration", "lm_loss", "grad_norm", "elapsed_ms", *comm,
                *("baseline_" + k for k in comm)}
    assert all(required <= set(r) for r in train)
    assert [r["iteration"] for r in evals] == [10, 20]
    tests = [r for r in records if "test_lm_loss" in r]
    if per_split:  # the log names the files; the test set is evaluated once, at the end
        assert f"data: train {prefix}; valid {prefix}; test {prefix}" in res.stdout
        assert [r["iteration"] for r in tests] == [20] and \
            " validation loss at iteration 20 on test set |" in res.stdout and \
            tests[0]["test_lm_loss"] < train[0]["lm_loss"]
    else:
        assert not tests and " data: " in res.stdout
    for rec, line in zip(train, lines):
        assert rec["comm_bytes_params"] == line["comm_bytes_params"]
        assert abs(rec["lm_loss"] - line["lm_loss"]) <= 1e-6 * abs(line["lm_loss"])
        if method == "TLq-HS":
            timers = rec["timers_ms"]
            assert 0 < timers["sdp4bit-grads-quantize"] < timers["forward-backward"]
            assert timers["optimizer"] < rec["elapsed_ms"]
        else:
            assert "timers_ms" not in rec


# Megatron-LM's batch-size ramp-up, sample-based (TINY's 20 iterations and 2 warm-up
# iterations of 16 as samples): --rampup-batch-size 8 8 96 up to 16 gives the iterations
# starting at 0, 8, ..., 88 samples 8 (one micro-batch per rank), those from 96 on 16 (two);
# 224 samples are 20 iterations (Megatron-LM's count: 13 start within the 96, then 7 of 16).
RAMPUP = ["--train-samples", "224", "--rampup-batch-size", "8", "8", "96",
          "--lr-warmup-samples", "32"]


def _ramped(flags: list[str]) -> list[str]:
    out = list(flags)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        del out[out.index(flag):out.index(flag) + 2]
    return out + RAMPUP


@pytest.mark.slow
@pytest.mark.distributed
def test_sdp4bit_resume_matches_uninterrupted(data_prefix, tmp_path):
    """SDP4Bit on preprocessed data with the batch ramped up from 8 to 16 (from iteration
    13), the collectives overlapped (--overlap-param-gather: each step's all-gather runs in the
    next forward pass, or earlier in an evaluation's or before a save). Saved every 5
    iterations and at 12, before the batch grows, as Megatron-LM saves then. A second launch
    resumes from 10 (80 samples, in the middle of the ramp-up; an evaluation iteration) and
    evaluates at 12, 15 and 18 instead of 20: it must log the same batch sizes, losses,
    gradient norms and bytes at 15 and 20 as the uninterrupted run, and save the same weights
    at 20. Neither where a run evaluates nor where it resumes changes its training
    (integration/param_sync.py, [Note: a parameter sync sends each step once])."""
    ckpt, again = tmp_path / "ckpt", tmp_path / "again"
    base = _ramped(TINY) + data_prefix + METHODS["SDP4Bit"] + [
        "--dp-ranks-per-node", "2", "--overlap-grad-reduce", "--overlap-param-gather"]
    first = torchrun(base + ["--save", str(ckpt), "--save-interval", "5"])
    assert "(TP 1, PP 1, 1 micro-batches per step rising to 2)" in first.stdout
    assert re.findall(r"successfully saved checkpoint from iteration +(\d+)", first.stdout) \
        == ["5", "10", "12", "15", "20"], first.stdout[-3000:]
    assert re.findall(r"validation loss at iteration (\d+) ", first.stdout) == ["10", "20"]
    full = train_lines(first.stdout)
    check_run(full, "SDP4Bit", consumed=[40, 80, 144, 224])
    assert [m["global_batch_size"] for m in full] == [8, 8, 16, 16]
    for m in full:  # --lr 3e-3 cosine to 3e-4 over the samples after the 32 of warm-up
        decay = (m["consumed_samples"] - 32) / (224 - 32)
        lr = 3e-4 + (3e-3 - 3e-4) * 0.5 * (1 + math.cos(math.pi * decay))
        assert abs(m["learning_rate"] - lr) <= 1e-6 * lr, (m, lr)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10\n")
    resumed_run = torchrun(base + ["--load", str(ckpt), "--eval-interval", "3",
                                   "--save", str(again), "--save-interval", "5"])
    assert "loaded checkpoint from" in resumed_run.stdout
    assert re.findall(r"validation loss at iteration (\d+) ", resumed_run.stdout) == \
        ["12", "15", "18"]
    resumed = train_lines(resumed_run.stdout)
    assert [m["iteration"] for m in resumed] == [15, 20]
    for a, b in zip(full[2:], resumed):  # the parameter bytes of an interval are those of
        # the all-gathers it ran, and an evaluation or a save runs the step's before its forward
        for key in ("lm_loss", "grad_norm", "learning_rate", "consumed_samples",
                    "global_batch_size", "comm_bytes_grads_intra", "comm_bytes_grads_inter"):
            assert a[key] == b[key], (key, a, b)
    read = load_tool("tools/checkpoint/export_hf.py").read_model_tensors
    theirs, ours = (read(str(d / "iter_0000020")) for d in (ckpt, again))
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():  # bf16 widened to fp32: equal iff the bits are
        assert torch.equal(tensor, ours[name]), f"{name} differs at iteration 20"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("parallel, grads", [
    ("--tensor-model-parallel-size 2 --sequence-parallel", "fp32"),
    ("--pipeline-model-parallel-size 2 --grad-reduce-in-bf16", "bf16")], ids=["TP2-SP", "PP2"])
def test_sdp4bit_under_model_parallelism(parallel, grads):
    """TP=2 x DP=2 (with sequence parallelism on the local spec's norms) and PP=2 x DP=2 on
    4 ranks, 1 DP rank per node: the DP groups of 2 take the single inter-node hop (4-bit)
    and the weight all-gather is qWD. The replica check runs every iteration: DP replicas,
    and with TP 2 the TP ranks' copies of the weights TP does not split, bitwise equal.
    PP2 reduces its gradient buffers in bf16 (--grad-reduce-in-bf16): the bytes compare
    against megatron-core's bf16 reduction, half of fp32's, and the start-up and end lines
    say so."""
    res = torchrun(TINY + ["--mock-data", "--dp-ranks-per-node", "1", *parallel.split(),
                           *METHODS["SDP4Bit"], "--check-replicas-interval", "1"])
    assert "data-parallel topology: 2 ranks = 1 per node x 2 nodes" in res.stdout
    assert re.search(rf"SDP4Bit installed on \d+ bucket\(s\): .* \| bytes counted against "
                     rf"megatron-core's bf16 parameter all-gather and {grads} gradient "
                     r"reduction\n", res.stdout), res.stdout[-3000:]
    calls = re.search(r"SDP4Bit on this rank: (\d+) quantized gradient reduce-scatters, "
                      r"(\d+) quantized parameter all-gathers", res.stdout)
    assert calls and int(calls[1]) >= 20 and int(calls[2]) >= 20, res.stdout[-2000:]
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == [5, 10, 15, 20]
    assert lines[-1]["lm_loss"] < lines[0]["lm_loss"] - 0.3, [m["lm_loss"] for m in lines]
    last = lines[-1]
    assert last["comm_bytes_grads_intra"] == last["baseline_comm_bytes_grads_intra"] == 0
    inter, inter_b = last["comm_bytes_grads_inter"], last["baseline_comm_bytes_grads_inter"]
    # one 4-bit value and a 4-byte scale per 128 against a 32- or 16-bit gradient
    bound = (32 if grads == "fp32" else 16) / (4 + 32 / 128)
    assert 0.8 * bound < inter_b / inter <= bound + 1e-9, (inter, inter_b)
    ratio = re.search(r"grads (\d\.\d{4}) against (\w+) gradient reduction;", res.stdout)
    assert ratio and ratio[2] == grads and float(ratio[1]) == pytest.approx(
        1 / bound, abs=2e-4), res.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.release_independent  # torchrun's rendezvous and the trainer's topology detection
def test_two_node_rendezvous_detects_topology(tmp_path):
    """Two ``torchrun --nnodes 2 --nproc-per-node 2`` launches on localhost (c10d rendezvous):
    no override, the trainer must find N = 2 DP ranks per node on M = 2 nodes."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "e2e", os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--mock-data",
           *METHODS["SDP4Bit"]]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=trainer_env(), cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out[-2000:] + err[-4000:]
    stdout = "".join(o for o, _ in outs)
    assert "data-parallel topology: 4 ranks = 2 per node x 2 nodes" in stdout
    check_run(train_lines(stdout), "SDP4Bit")


BAD = {
    "unknown": (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    "quant-no-distopt": (["--quantized-weights"],
                         "--quantized-weights requires --use-distributed-optimizer"),
    "fp16-bf16": (["--fp16", "--bf16"], "--fp16 and --bf16 are mutually exclusive: pass one"),
    "batch": (["--global-batch-size", "3"], "--global-batch-size=3 is not divisible by "
              "--micro-batch-size x data-parallel size = 2 x 1 = 2"),
    # a refused flag, a contradiction and what this machine lacks, named at once
    "several": (["--no-save-optim", "--fp16", "--bf16", "--attention-backend", "fused"],
                "3 problems with this command line; drop or replace each: (1) --no-save-optim: "
                "checkpoints always hold the optimizer state: a resumed run repeats the "
                "uninterrupted one only with it; (2) --fp16 and --bf16 are mutually exclusive: "
                "pass one; (3) --attention-backend fused (or --use-flash-attn) runs Transformer "
                "Engine's CUDA kernels and there is no CUDA device here: drop the flag"),
}


@pytest.mark.release_independent  # the argument checks run before megatron-core is used
def test_bad_flags_exit_with_one_line():
    base = [a for a in TINY if a not in ("--use-distributed-optimizer", "--bf16")]
    base = base[:base.index("--global-batch-size")] + base[base.index("--global-batch-size") + 2:]
    for name, (extra, message) in BAD.items():
        res = _launch.python(os.path.join(ROOT, "pretrain_gpt.py"), [*base, "--mock-data", *extra],
                             env=trainer_env(), cwd=ROOT, timeout=60)
        assert res.returncode == 2, name
        assert res.stdout == ""
        assert res.stderr.splitlines() == [f"pretrain_gpt.py: error: {message}"], name
