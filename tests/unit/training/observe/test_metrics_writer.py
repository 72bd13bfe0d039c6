"""MetricsWriter: consumed tokens in --metrics-jsonl, Megatron-LM's TensorBoard switches and
values (the tag names themselves: test_megatron_lm_parity.py)."""

from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.observe.comm_counters import EXPERT_FIELDS, FIELDS
from megatron.sdp4bit.training.observe.metrics_writer import MetricsWriter

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data").split()


def record(it: int) -> dict:
    r = {"iteration": it, "consumed_samples": 8 * it, "lm_loss": 5.0, "learning_rate": 1e-3,
         "grad_norm": 1.0, "loss_scale": 1.0, "elapsed_ms": 10.0 * it, "tflops_per_gpu": 0.1}
    r.update({k: 4 if k.startswith("baseline_") else 1 for k in FIELDS})
    return r


def events(folder) -> EventAccumulator:
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def write(tmp_path, extra: str) -> EventAccumulator:
    """Iterations 1 to 4 (loss 6 - it/10, lr it/1000), a log line at 2 and 4."""
    tb = tmp_path / "tb"
    args = parse_args(BASE + ["--metrics-jsonl", str(tmp_path / "new" / "m.jsonl"),
                              "--tensorboard-dir", str(tb)] + extra.split(), world_size=4)
    writer = MetricsWriter(args)
    for it in range(1, 5):
        writer.iteration(it, 8 * it, 6 - it / 10, it / 1000, 2.0 ** it, 0.5 * it)
        if it % 2 == 0:
            writer.train(record(it))
    writer.close()
    return events(tb)


def test_metrics_file_gets_consumed_tokens_in_a_new_folder(tmp_path):
    write(tmp_path, "")
    lines = [json.loads(x) for x in (tmp_path / "new" / "m.jsonl").read_text().splitlines()]
    assert [(r["consumed_samples"], r["consumed_tokens"]) for r in lines] == [(16, 512),
                                                                            (32, 1024)]


def test_per_iteration_values_against_iterations_and_samples(tmp_path):
    acc = write(tmp_path, "--tensorboard-log-interval 2")
    # every second iteration, this iteration's value (not the log interval's mean)
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("lm loss")] == [(2, 5.8), (4, 5.6)]
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [16, 32]
    assert [e.value for e in acc.Scalars("loss-scale")] == [4.0, 16.0]
    assert [e.value for e in acc.Scalars("grad-norm vs samples")] == [1.0, 2.0]
    assert [e.value for e in acc.Scalars("batch-size")] == [8.0, 8.0]  # 2 x 4 ranks
    # the log interval's figures: seconds per iteration, as Megatron-LM writes them
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("iteration-time")] == [
        (2, 0.02), (4, 0.04)]
    assert [e.value for e in acc.Scalars("sdp4bit/grads-inter-bytes-unquantized")] == [4, 4]
    assert [e.value for e in acc.Scalars("sdp4bit/grads-bytes")] == [2, 2]  # the hops' sum


def test_tensorboard_switches(tmp_path):
    got = set(write(tmp_path, "--log-world-size-to-tensorboard "
                              "--no-log-learnig-rate-to-tensorboard "
                              "--no-log-loss-scale-to-tensorboard").Tags()["scalars"])
    assert {"lm loss", "batch-size", "world-size", "world-size vs samples", "grad-norm"} <= got
    assert not {"learning-rate", "learning-rate vs samples", "loss-scale"} & got
    default = set(write(tmp_path / "default", "").Tags()["scalars"])
    assert {"learning-rate", "loss-scale"} <= default and "world-size" not in default


def test_moe_record_writes_expert_bytes_and_auxiliary_losses(tmp_path):
    """A MoE run's record: the expert part of the bytes under sdp4bit/expert-*, the routers'
    auxiliary losses under Megatron-LM's tags; the console line carries and parses both."""
    from megatron.sdp4bit.training.observe.logging import format_train_line, parse_log_line

    tb = tmp_path / "tb"
    args = parse_args(BASE + ["--tensorboard-dir", str(tb)], world_size=4)
    writer = MetricsWriter(args)
    m = {**record(2), "train_iters": 10, "global_batch_size": 8, "skipped_iterations": 0,
         "nan_iterations": 0, "load_balancing_loss": 1.25, "z_loss": 0.5,
         "moe_losses": ["load_balancing_loss", "z_loss"]}
    m.update({k: 9 if k.startswith("baseline_") else 7 for k in EXPERT_FIELDS})
    writer.train(m)
    writer.close()
    scalars = events(tb).Tags()["scalars"]
    assert {"sdp4bit/expert-grads-inter-bytes", "sdp4bit/expert-params-intra-bytes-unquantized",
            "load_balancing_loss", "z_loss"} <= set(scalars)
    assert events(tb).Scalars("load_balancing_loss")[0].value == 1.25
    parsed = parse_log_line(format_train_line(m))
    assert parsed["comm_bytes_expert_grads_inter"] == 7
    assert parsed["baseline_comm_bytes_expert_params_intra"] == 9
    assert parsed["load_balancing_loss"] == 1.25 and parsed["z_loss"] == 0.5
