"""One run with every observability flag (2 ranks, CPU, SDP4Bit): Megatron-LM's ``num zeros``
and ``params norm`` fields, the parameter norm equal to the one of the optimizer's fp32 main
shards saved in the checkpoint, the TensorBoard tags (``params-norm``, ``num-zeros``,
``mem-*``), the --metrics-jsonl keys, and a torch.profiler trace for the profiled rank only,
holding the profiled iterations and the operators' shapes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.trainer import METHODS, torchrun, train_lines

pytestmark = [pytest.mark.distributed]

ITERS = 4
FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
         f"--train-iters {ITERS} --lr 3e-3 --bf16 --use-distributed-optimizer --mock-data "
         "--log-interval 1 --eval-interval 100 --eval-iters 1 --seed 7 --ckpt-format torch "
         "--log-params-norm --log-num-zeros-in-grad --log-memory-to-tensorboard "
         "--profile --use-pytorch-profiler --profile-step-start 1 --profile-step-end 3 "
         "--profile-ranks 1 --pytorch-profiler-collect-shapes").split()
# GPT of 2 layers, hidden 64, FFN 256, 32 positions, output layer tied to the embedding,
# 1152 vocabulary rows (test_megatron_flags_run.py derives the same count).
PARAMS = 1152 * 64 + 32 * 64 + 2 * (4 * 64 + 64 * 192 + 192 + 64 * 64 + 64
                                    + 64 * 256 + 256 + 256 * 64 + 64) + 2 * 64


def test_every_observability_flag(tmp_path):
    tb, ckpt, metrics = tmp_path / "tb", tmp_path / "ckpt", tmp_path / "m.jsonl"
    res = torchrun(FLAGS + METHODS["SDP4Bit"] + [
        "--tensorboard-dir", str(tb), "--save", str(ckpt), "--metrics-jsonl", str(metrics)],
        nproc=2)
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == list(range(1, ITERS + 1))
    for m in lines:
        zeros = m["num_zeros"]
        assert zeros == int(zeros) and 0 <= zeros <= PARAMS, m
    # The norm over the fp32 main parameters, each rank holding a shard (distributed
    # optimizer): the saved shards of both ranks, squared and summed, are that norm.
    folder = ckpt / f"iter_{ITERS:07d}"
    total = 0.0
    for rank in range(2):
        state = torch.load(folder / f"rank_{rank:05d}.pt", weights_only=False)
        shards = [p for opt in state["optimizer"] for p in opt["main_params"]]
        assert sum(p.numel() for p in shards) > 0
        total += sum(float(p.double().pow(2).sum()) for p in shards)
    expected = math.sqrt(total)
    assert abs(lines[-1]["params_norm"] - expected) <= 5e-4 + 1e-6 * expected, (
        lines[-1]["params_norm"], expected)
    # One rank's shard alone (a norm not summed over data-parallel ranks) is far off.
    assert all(abs(m["params_norm"] - expected) < 0.5 * expected for m in lines)

    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"params-norm", "params-norm vs samples", "num-zeros", "num-zeros vs samples",
            "mem-resident-bytes", "mem-max-resident-bytes"} <= tags, tags
    norms = [e.value for e in events.Scalars("params-norm")]
    assert [e.step for e in events.Scalars("params-norm")] == list(range(1, ITERS + 1))
    assert [round(v, 3) for v in norms] == pytest.approx([m["params_norm"] for m in lines],
                                                         abs=1.5e-3)
    assert [e.value for e in events.Scalars("num-zeros")] == [m["num_zeros"] for m in lines]
    for now, peak in zip(events.Scalars("mem-resident-bytes"),
                         events.Scalars("mem-max-resident-bytes")):
        assert 1e7 < now.value <= peak.value  # a Python process with torch: tens of MB
    records = [json.loads(x) for x in metrics.read_text().splitlines()
               if "lm_loss" in json.loads(x)]
    assert [r["params_norm"] for r in records] == pytest.approx(norms, rel=1e-6)
    assert [r["num_zeros"] for r in records] == [m["num_zeros"] for m in lines]
    assert set(records[0]["memory"]) == {"mem-resident-bytes", "mem-max-resident-bytes"}

    # torch.profiler's trace under --tensorboard-dir, from rank 1 only (--profile-ranks 1),
    # holding the profiled steps (schedule: wait 0, warm-up 1, active 3 - 1 = 2).
    traces = sorted(p.name for p in tb.glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].startswith("rank-1."), traces
    trace = json.loads((tb / traces[0]).read_text())
    steps = {e["name"] for e in trace["traceEvents"]
             if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}, steps
    # --pytorch-profiler-collect-shapes: operators carry their inputs' shapes
    assert any("Input Dims" in e.get("args", {}) for e in trace["traceEvents"])
