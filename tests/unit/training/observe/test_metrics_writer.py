"""MetricsWriter: consumed tokens in --metrics-jsonl, Megatron-LM's TensorBoard switches."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.observe.logging import COMM_KEYS, MetricsWriter

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data").split()


def record(it: int) -> dict:
    r = {"iteration": it, "consumed_samples": 8 * it, "lm_loss": 5.0, "learning_rate": 1e-3,
         "grad_norm": 1.0, "loss_scale": 1.0, "elapsed_ms": 10.0, "tflops_per_gpu": 0.1}
    r.update({k: 1 for k in COMM_KEYS})
    r.update({"baseline_" + k: 4 for k in COMM_KEYS})
    return r


def tags(folder) -> set[str]:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return set(acc.Tags()["scalars"])


def write(tmp_path, extra: str) -> set[str]:
    tb = tmp_path / "tb"
    args = parse_args(BASE + ["--metrics-jsonl", str(tmp_path / "new" / "m.jsonl"),
                              "--tensorboard-dir", str(tb)] + extra.split(), world_size=4)
    writer = MetricsWriter(args)
    writer.train(record(1))
    writer.train(record(2))
    writer.close()
    return tags(tb)


def test_metrics_file_gets_consumed_tokens_in_a_new_folder(tmp_path):
    write(tmp_path, "")
    lines = [json.loads(x) for x in (tmp_path / "new" / "m.jsonl").read_text().splitlines()]
    assert [(r["consumed_samples"], r["consumed_tokens"]) for r in lines] == [(8, 256),
                                                                            (16, 512)]


def test_default_tensorboard_scalars(tmp_path):
    got = write(tmp_path, "")
    assert {"lm loss", "learning_rate", "loss_scale"} <= got
    assert not {"batch-size", "world-size"} & got


def test_tensorboard_switches(tmp_path):
    got = write(tmp_path, "--log-batch-size-to-tensorboard --log-world-size-to-tensorboard "
                          "--no-log-learnig-rate-to-tensorboard --no-log-loss-scale-to-tensorboard")
    assert {"lm loss", "batch-size", "world-size", "grad_norm"} <= got
    assert not {"learning_rate", "loss_scale"} & got
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("batch-size")] == [8.0, 8.0]  # 2 x 4 ranks
    assert [e.value for e in acc.Scalars("world-size")] == [4.0, 4.0]
