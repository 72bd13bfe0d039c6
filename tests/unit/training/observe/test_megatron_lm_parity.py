"""What a run writes, compared with what Megatron-LM writes: TensorBoard tags, W&B keys and
the console lines that cluster tooling reads (arguments dump, parameter count, training
and evaluation lines, checkpoint-saved lines).

Every expected name and format below is taken from Megatron-LM's source at tag
``core_v0.16.1`` (the Megatron-LM of the first tested megatron-core release); the comment
beside each says which function writes it. SDP4Bit's own figures are the only additions,
all under ``sdp4bit/``, and the test set's loss, which Megatron-LM files under the
validation tags and this trainer under ``lm loss test``.
"""

from __future__ import annotations

import math
import re
import sys
import types
from argparse import Namespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.observe import logging as console
from megatron.sdp4bit.comm.byte_counts import BYTE_SCALARS
from megatron.sdp4bit.training.observe.comm_counters import FIELDS
from megatron.sdp4bit.training.observe.metrics_writer import MetricsWriter

# megatron/training/training.py, training_log(): written every --tensorboard-log-interval
# iterations, each as '<tag>' against the iteration and '<tag> vs samples' against
# args.consumed_train_samples.
MEGATRON_LM_PER_ITERATION_TAGS = {
    "learning-rate", "learning-rate vs samples",  # if learning_rate is not None
    "batch-size", "batch-size vs samples",  # always
    "lm loss", "lm loss vs samples",  # the loss_dict key of pretrain_gpt.py's loss_func
    "loss-scale", "loss-scale vs samples",  # if args.log_loss_scale_to_tensorboard
    "world-size", "world-size vs samples",  # if args.log_world_size_to_tensorboard
    "grad-norm", "grad-norm vs samples",  # if grad_norm is not None
}
# training_log(), every --log-interval iterations: 'iteration-time' (seconds) with
# args.log_timers_to_tensorboard, 'throughput' with args.log_throughput too.
MEGATRON_LM_INTERVAL_TAGS = {"iteration-time", "throughput"}
# megatron/core/timers.py, Timers.write() (called by training_log with
# args.log_timers_to_tensorboard): name + '-time', the maximum over ranks.
MEGATRON_LM_TIMER_TAGS = {"forward-backward-time", "optimizer-time"}
# megatron/training/training.py, evaluate_and_print_results(): '{key} validation' and
# '{key} validation vs samples'; with args.log_validation_ppl_to_tensorboard also
# '{key} validation ppl' and '{key} validation ppl vs samples'.
MEGATRON_LM_EVAL_TAGS = {"lm loss validation", "lm loss validation vs samples",
                         "lm loss validation ppl", "lm loss validation ppl vs samples"}
# W&B: training_log() logs 'samples vs steps' and the plain tags above (never the
# 'vs samples' ones); Timers.write() the timers; evaluate_and_print_results()
# '{key} validation'.
MEGATRON_LM_WANDB_KEYS = {"samples vs steps", "learning-rate", "batch-size", "lm loss",
                          "loss-scale", "world-size", "grad-norm", "iteration-time",
                          "throughput", "forward-backward-time", "optimizer-time",
                          "lm loss validation"}
# This trainer's test-set tags (Megatron-LM writes the test loss under the validation ones).
TEST_TAGS = {"lm loss test", "lm loss test vs samples", "lm loss test ppl",
             "lm loss test ppl vs samples"}

# training_log()'s log_string, field by field: (text with Python format spec, value).
MEGATRON_LM_TRAIN_LINE = (
    (" iteration {:8d}/{:8d} |", (10, 100)),
    (" consumed samples: {:12d} |", (80,)),
    (" elapsed time per iteration (ms): {:.1f} |", (52.14,)),
    (" throughput per GPU (TFLOP/s/GPU): {:.1f} |", (0.0104,)),
    (" learning rate: {:.6E} |", (9e-4,)),
    (" global batch size: {:5d} |", (8,)),
    (" lm loss: {:.6E} |", (5.1704361,)),  # ' {key}: {:.6E} |' for each loss_dict key
    (" loss scale: {:.1f} |", (1.0,)),
    (" grad norm: {:.3f} |", (1.23456,)),
    (" number of skipped iterations: {:3d} |", (0,)),
    (" number of nan iterations: {:3d} |", (0,)),
)
# training_log(): f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]" first.
STAMP = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"


def _record() -> dict:
    r = {"iteration": 10, "train_iters": 100, "consumed_samples": 80, "elapsed_ms": 52.14,
         "tflops_per_gpu": 0.0104, "learning_rate": 9e-4, "global_batch_size": 8,
         "lm_loss": 5.1704361, "loss_scale": 1.0, "grad_norm": 1.23456,
         "skipped_iterations": 0, "nan_iterations": 0}
    hops = ("params_intra", "params_inter", "grads_intra", "grads_inter")
    r.update({f"comm_bytes_{k}": 101 + i for i, k in enumerate(hops)})
    r.update({f"baseline_comm_bytes_{k}": 401 + i for i, k in enumerate(hops)})
    assert set(FIELDS) <= set(r)
    return r


class _FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records every key logged."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.keys: set[str] = set()

    def init(self, **kwargs):
        return self

    def log(self, values: dict, step: int) -> None:
        self.keys.update(values)

    def finish(self) -> None:
        pass


def test_tensorboard_tags_and_wandb_keys_are_megatron_lms(tmp_path, monkeypatch):
    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    args = parse_args(
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --timing-log-level 1 "
         "--log-timers-to-tensorboard --log-world-size-to-tensorboard "
         "--log-validation-ppl-to-tensorboard --wandb-project p "
         f"--tensorboard-dir {tmp_path}").split(), world_size=2)
    writer = MetricsWriter(args)
    writer.iteration(10, 80, 5.0, 1e-3, 1.0, 1.0)
    writer.train({**_record(), "timers_ms": {"forward-backward": 30.0, "optimizer": 5.0,
                                             "sdp4bit-grads-quantize": 2.0}})
    writer.evaluation(10, 80, 4.0)
    writer.evaluation(10, 80, 4.5, split="test")
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    ours = {t for t in tags if t.startswith("sdp4bit/")}
    # a dense model's record: the bytes under the names both trainers write (the expert
    # part, MoE runs only, is not written)
    assert ours == set(BYTE_SCALARS) | {"sdp4bit/grads-quantize-time"}
    assert tags - ours - TEST_TAGS == (MEGATRON_LM_PER_ITERATION_TAGS | MEGATRON_LM_INTERVAL_TAGS
                                       | MEGATRON_LM_TIMER_TAGS | MEGATRON_LM_EVAL_TAGS)
    assert TEST_TAGS <= tags
    assert {k for k in wandb.keys if not k.startswith("sdp4bit/")} - {"lm loss test"} \
        == MEGATRON_LM_WANDB_KEYS
    # Megatron-LM's units: timers and iteration time in seconds
    assert [round(e.value, 6) for e in acc.Scalars("forward-backward-time")] == [0.03]
    assert [e.step for e in acc.Scalars("lm loss validation vs samples")] == [80]
    (ppl,) = acc.Scalars("lm loss validation ppl")
    assert ppl.value == pytest.approx(math.exp(4.0), rel=1e-6)  # fp32 in the event file


def test_training_line_is_megatron_lms_and_both_generations_parse():
    line = console.format_train_line(_record())
    expected = "".join(text.format(*values) for text, values in MEGATRON_LM_TRAIN_LINE)
    match = re.match(rf" {STAMP}(.*)$", line)
    assert match and match.group(1).startswith(expected), line
    assert " throughput per GPU (TFLOP/s/GPU): 0.0 |" in line  # Megatron-LM's .1f
    new = console.parse_log_line(line)
    # the line written before this trainer took Megatron-LM's formats: no microseconds,
    # throughput with four decimals
    old = (" [2026-11-22 19:49:52] iteration       10/     100 | consumed samples:           "
           "80 | elapsed time per iteration (ms): 52.1 | throughput per GPU (TFLOP/s/GPU): "
           "0.0104 | learning rate: 9.000000E-04 | global batch size:     8 | lm loss: "
           "5.170436E+00 | loss scale: 1.0 | grad norm: 1.235 | number of skipped iterations:"
           "   0 | number of nan iterations:   0 | params intra bytes: 101 (ideal unquantized "
           "401) | params inter bytes: 102 (ideal unquantized 402) | grads intra bytes: 103 "
           "(ideal unquantized 403) | grads inter bytes: 104 (ideal unquantized 404) |")
    parsed_old = console.parse_log_line(old)
    assert parsed_old["tflops_per_gpu"] == 0.0104 and new["tflops_per_gpu"] == 0.0
    for m in (new, parsed_old):
        assert (m["iteration"], m["train_iters"], m["consumed_samples"]) == (10, 100, 80)
        assert m["lm_loss"] == 5.170436 and m["grad_norm"] == 1.235
        assert (m["comm_bytes_params"], m["baseline_comm_bytes_params"]) == (203, 803)


def test_num_zeros_and_params_norm_fields_are_megatron_lms():
    # training_log(), after ' grad norm: {:.3f} |': f' num zeros: {num_zeros_in_grad} |' (a
    # float: count_zeros returns one) and f' params norm: {params_norm:.3f} |', each only
    # when computed (--log-num-zeros-in-grad, --log-params-norm).
    line = console.format_train_line({**_record(), "num_zeros": 17.0, "params_norm": 20.12345})
    grad = " grad norm: {:.3f} |".format(1.23456)
    assert f"{grad} num zeros: {17.0} | params norm: {20.12345:.3f} | number of skipped" in line
    m = console.parse_log_line(line)
    assert (m["num_zeros"], m["params_norm"], m["grad_norm"]) == (17.0, 20.123, 1.235)
    only_norm = console.parse_log_line(console.format_train_line({**_record(),
                                                                 "params_norm": 3.0}))
    assert only_norm["params_norm"] == 3.0 and "num_zeros" not in only_norm
    assert "params_norm" not in console.parse_log_line(console.format_train_line(_record()))


def test_statistics_and_memory_tags_are_megatron_lms(tmp_path, monkeypatch):
    # training_log(): 'num-zeros' and 'params-norm' each also '... vs samples'; with
    # args.log_memory_to_tensorboard 'mem-reserved-bytes', 'mem-allocated-bytes',
    # 'mem-max-allocated-bytes', 'mem-allocated-count' (torch.cuda.memory_stats()) against
    # the iteration only. Without CUDA the resident memory stands in.
    args = parse_args(
        ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data "
         f"--log-memory-to-tensorboard --tensorboard-dir {tmp_path}").split(), world_size=2)
    stats = {"reserved_bytes.all.current": 4096, "allocated_bytes.all.current": 1024,
             "allocated_bytes.all.peak": 2048, "allocation.all.current": 3}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: stats)
    writer = MetricsWriter(args)
    writer.iteration(10, 80, 5.0, 1e-3, 1.0, 1.0, num_zeros=7.0, params_norm=2.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    writer.iteration(20, 160, 5.0, 1e-3, 1.0, 1.0, num_zeros=8.0, params_norm=2.0)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = set(acc.Tags()["scalars"]) - MEGATRON_LM_PER_ITERATION_TAGS
    assert tags == {"num-zeros", "num-zeros vs samples", "params-norm", "params-norm vs samples",
                    "mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
                    "mem-allocated-count", "mem-resident-bytes", "mem-max-resident-bytes"}
    assert [(e.step, e.value) for e in acc.Scalars("params-norm vs samples")] == [
        (80, 2.5), (160, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("mem-allocated-count")] == [(10, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("mem-max-allocated-bytes")] == [(10, 2048)]
    (now,) = acc.Scalars("mem-resident-bytes")
    (peak,) = acc.Scalars("mem-max-resident-bytes")
    assert now.step == 20 and 1e7 < now.value <= peak.value


@pytest.mark.parametrize("split,where", [("validation", "iteration 20"),
                                         ("test", "iteration 20 on test set")])
def test_evaluation_block_is_megatron_lms(split, where):
    # evaluate_and_print_results(): string = f' validation loss at {prefix} | ', then
    # '{key} value: {:.6E} | ' and '{key} PPL: {:.6E} | '; a bar of len(string) + 1 dashes
    # above and below. The prefix is 'iteration N' during training, 'iteration N on test
    # set' for the test set.
    body = (f" validation loss at {where} | lm loss value: {4.0:.6E} | "
            f"lm loss PPL: {math.exp(4.0):.6E} | ")
    bar = "-" * (len(body) + 1)
    assert console.format_eval_lines(20, 4.0, split=split) == f"{bar}\n{body}\n{bar}"


def test_start_lines_are_megatron_lms():
    # megatron/training/arguments.py, _print_args("arguments", args): a title bar, one row
    # per argument '  {name} {dots} {value}' with 48 - len(name) dots, sorted
    # case-insensitively, then the end bar.
    text = console.format_arguments(Namespace(seq_length=32, Lr=0.001, refused_finetune=None))
    assert text.splitlines() == [
        "------------------------ arguments ------------------------",
        "  Lr " + "." * 46 + " 0.001",
        "  seq_length " + "." * 38 + " 32",
        "-------------------- end of arguments ---------------------",
    ]
    # megatron/training/training.py, get_model(): printed by data-parallel rank 0 of each
    # model-parallel position.
    assert console.format_parameter_count(1, 0, 123456) == (
        " > number of parameters on (tensor, pipeline) model parallel rank (1, 0): 123456")


def test_checkpoint_lines_are_megatron_lms():
    # megatron/training/checkpointing.py, save_checkpoint(): before writing,
    # f"[{stamp}] saving checkpoint at iteration {iteration:7d} to {save_dir} in {fmt} format";
    # after the tracker file is written, f"  [{stamp}] successfully saved checkpoint from
    # iteration {iteration:7d} to {args.save} [ t {tp rank + 1}/{tp}, p {pp rank + 1}/{pp} ]"
    # (print_rank_0: rank 0, so t 1 and p 1).
    saving = console.format_saving(60, "/ck", "torch_dist")
    assert re.fullmatch(rf"{STAMP} saving checkpoint at iteration      60 to /ck in torch_dist "
                        "format", saving), saving
    saved = console.format_saved(60, "/ck", 2, 4)
    assert re.fullmatch(rf"  {STAMP} successfully saved checkpoint from iteration      60 to "
                        r"/ck \[ t 1/2, p 1/4 \]", saved), saved
