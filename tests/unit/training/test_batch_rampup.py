"""--rampup-batch-size in the loop and the step, without processes: each iteration hands
megatron-core's schedule its own number of micro-batches (the schedule runs that many and
averages the gradient over them; with the final number instead, the first iterations would
read more samples than the loop counts, and a resumed run would read other data), the
learning-rate schedule advances by the samples consumed, the log line and TensorBoard show
the current global batch size, and a run resumed mid-ramp from its consumed samples continues
with the same batch sizes.

Megatron-LM's sizes for 4 4 24 up to --global-batch-size 12, micro-batch 2 x 2 data-parallel
ranks (4 samples per micro-batch round): an increment every 12 samples, so the iterations
starting at 0, 4, 8 take 4, those at 12, 20 take 8, and the rest 12 (60 samples: 7
iterations, 52 consumed)."""

from __future__ import annotations

import types

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron.sdp4bit.training import build, loop, metrics_step, step
from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.observe.logging import parse_log_line

ARGV = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --global-batch-size 12 --train-samples 60 "
        "--rampup-batch-size 4 4 24 --lr 1e-3 --lr-warmup-samples 16 --mock-data "
        "--log-interval 1 --eval-interval 100 --eval-iters 0").split()
SIZES = [4, 4, 4, 8, 8, 12, 12]
CONSUMED_BEFORE = [0, 4, 8, 12, 20, 28, 40]


class _Optimizer:
    """What the step, the loop and megatron-core's LR schedule touch of an optimizer."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = [{"lr": 1e-3}]

    def zero_grad(self) -> None:
        pass

    def step(self):
        return True, 1.0, None

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)


def _linear_lr(samples: int) -> float:
    """--lr 1e-3, warm-up over 16 samples, linear decay to 0 over --train-samples 60."""
    if samples <= 16:
        return 1e-3 * samples / 16
    return 1e-3 * (1 - (samples - 16) / (60 - 16))


def test_the_step_runs_this_iterations_micro_batches_and_the_schedule_counts_samples(
        monkeypatch):
    args = parse_args(ARGV, world_size=2)
    optimizer = _Optimizer()
    state = types.SimpleNamespace(model=[], optimizer=optimizer, timers=None, iteration=0,
                                  scheduler=build._scheduler(args, optimizer))
    given = []

    def schedule(**kwargs):  # megatron-core's forward_backward_func
        given.append(kwargs["num_microbatches"])
        return [{"lm loss": torch.tensor(7.0)}] * kwargs["num_microbatches"]

    monkeypatch.setattr(step, "get_forward_backward_func", lambda: schedule)
    monkeypatch.setattr(step, "_reported_loss", lambda args, losses, group: 7.0)
    monkeypatch.setattr(step.parallel_state, "get_data_parallel_group", lambda: None)
    monkeypatch.setattr(step, "grads_finite", lambda model: True)
    monkeypatch.setattr(step.dist, "get_rank", lambda: 0)
    for size in SIZES:
        step.train_step(args, state, iter(()), size // 4)
        state.iteration += 1
    assert given == [1, 1, 1, 2, 2, 3, 3]
    assert state.scheduler.num_steps == 52
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_linear_lr(52), rel=1e-12)


def _train(monkeypatch, capsys, tmp_path, iteration: int = 0, consumed: int = 0,
           argv: list[str] = ARGV):
    """The loop with a stand-in step; returns (iteration, consumed samples before it,
    micro-batches) per step, the log lines and TensorBoard's batch-size."""
    args = parse_args(argv + ["--tensorboard-dir", str(tmp_path)], world_size=2)
    steps = []

    def train_step(args, state, data_iterator, num_microbatches):
        steps.append((state.iteration + 1, state.consumed_samples, num_microbatches))
        return 7.0, 1.0, True, None

    monkeypatch.setattr(loop, "train_step", train_step)
    monkeypatch.setattr(metrics_step, "is_logging_rank", lambda: True)
    monkeypatch.setattr(loop.dist, "get_rank", lambda: 0)
    state = loop.TrainState(model=[], optimizer=_Optimizer(), scheduler=None,
                            datasets=[None] * 3, vocab_size=1152, iteration=iteration,
                            consumed_samples=consumed)
    loop.train(args, state)
    lines = [m for m in map(parse_log_line, capsys.readouterr().out.splitlines()) if m]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    board = [(e.step, e.value) for e in events.Scalars("batch-size")]
    return steps, lines, board, state


def test_the_loop_grows_the_batch_and_a_resumed_run_continues_it(monkeypatch, capsys,
                                                                  tmp_path):
    steps, lines, board, state = _train(monkeypatch, capsys, tmp_path / "full")
    assert steps == [(i + 1, c, s // 4) for i, (c, s) in enumerate(zip(CONSUMED_BEFORE, SIZES))]
    assert [m["global_batch_size"] for m in lines] == SIZES
    assert [m["consumed_samples"] for m in lines] == [c + s for c, s in
                                                      zip(CONSUMED_BEFORE, SIZES)]
    assert board == [(i + 1, float(s)) for i, s in enumerate(SIZES)]
    assert (state.iteration, state.consumed_samples) == (7, 52)
    # resumed after iteration 4 (20 samples): iterations 5 to 7 as in the full run
    steps_r, lines_r, board_r, _ = _train(monkeypatch, capsys, tmp_path / "resumed",
                                          iteration=4, consumed=20)
    assert steps_r == steps[4:]
    assert [(m["iteration"], m["global_batch_size"], m["consumed_samples"]) for m in lines_r] \
        == [(m["iteration"], m["global_batch_size"], m["consumed_samples"]) for m in lines[4:]]
    assert board_r == board[4:]


def test_an_uneven_ramp_up_resumes_from_every_iteration(monkeypatch, capsys, tmp_path):
    """4 4 13 up to 12: an increment every 6.5 samples (13 / 2, not whole), so the batch
    grows after 8 samples and jumps to 12 past 13, within one iteration each: sizes 4, 4, 8,
    then 12. A run resumed after any iteration (its consumed samples are none of the
    increments' boundaries) takes the uninterrupted run's remaining iterations and sizes
    (the same held under torchrun with SDP4Bit, resumed at 4 ranks and at 2)."""
    argv = list(ARGV)
    argv[argv.index("--rampup-batch-size") + 3] = "13"
    steps, _, _, state = _train(monkeypatch, capsys, tmp_path / "full", argv=argv)
    assert [(c, m * 4) for _, c, m in steps] == [(0, 4), (4, 4), (8, 8), (16, 12), (28, 12),
                                                 (40, 12)]
    for k in range(1, len(steps)):
        resumed, _, _, _ = _train(monkeypatch, capsys, tmp_path / f"from{k}", iteration=k,
                                  consumed=steps[k][1], argv=argv)
        assert resumed == steps[k:], k


def test_evaluation_uses_the_full_global_batch_during_the_ramp_up(monkeypatch):
    """Megatron-LM's evaluate: --eval-iters batches of --global-batch-size (3 micro-batches
    of 2 on each of the 2 ranks), also while training still takes 4 samples."""
    args = parse_args(ARGV[:-1] + ["2"], world_size=2)  # --eval-iters 2
    given = []

    def schedule(**kwargs):
        given.append((kwargs["num_microbatches"], kwargs["forward_only"]))
        return [{"lm loss": torch.tensor(7.0)}] * kwargs["num_microbatches"]

    monkeypatch.setattr(step, "get_forward_backward_func", lambda: schedule)
    monkeypatch.setattr(step, "_reported_loss", lambda args, losses, group: len(losses))
    monkeypatch.setattr(step.parallel_state, "get_data_parallel_group", lambda: None)
    state = types.SimpleNamespace(model=[])
    assert step.evaluate(args, state, iter(())) == 6
    assert given == [(3, True), (3, True)]
