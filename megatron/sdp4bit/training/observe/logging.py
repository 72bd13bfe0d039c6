"""Megatron-LM's progress lines, the ``--metrics-jsonl`` file, TensorBoard and W&B.

Training line (Megatron-LM's fields and order, then this rank's communication)::

    [2025-01-01 12:00:00] iteration       10/     100 | consumed samples:          80 |
    elapsed time per iteration (ms): 52.1 | throughput per GPU (TFLOP/s/GPU): 0.0 |
    learning rate: 9.000000E-04 | global batch size:     8 | lm loss: 5.170436E+00 |
    loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 |
    number of nan iterations:   0 | params intra bytes: 1024 (ideal unquantized 4096) |
    params inter bytes: 1024 (ideal unquantized 4096) | grads intra bytes: 2112 (ideal
    unquantized 8192) | grads inter bytes: 1088 (ideal unquantized 8192) |

(one line; wrapped here). Byte counts are per iteration, averaged over the logging interval,
sent by this rank to ranks of its own node (intra) and of other nodes (inter): the computed
sizes of the messages handed to the collectives, next to what an ideal unquantized
collective would send (megatron.sdp4bit.comm.stats, [Note: what counts as sent]).
:func:`parse_log_line` reads a line back (tests, tools). With ``--timing-log-level`` >= 1 a
block of timers follows each line (:func:`megatron.sdp4bit.training.observe.timers.format_timers`).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from typing import Any

COMM_KEYS = ("comm_bytes_params", "comm_bytes_params_intra", "comm_bytes_params_inter",
             "comm_bytes_grads_intra", "comm_bytes_grads_inter")


def format_train_line(m: dict[str, Any]) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f" [{stamp}] iteration {m['iteration']:8d}/{m['train_iters']:8d} |"
        f" consumed samples: {m['consumed_samples']:12d} |"
        f" elapsed time per iteration (ms): {m['elapsed_ms']:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {m['tflops_per_gpu']:.4f} |"
        f" learning rate: {m['learning_rate']:.6E} |"
        f" global batch size: {m['global_batch_size']:5d} |"
        f" lm loss: {m['lm_loss']:.6E} |"
        f" loss scale: {m['loss_scale']:.1f} |"
        f" grad norm: {m['grad_norm']:.3f} |"
        f" number of skipped iterations: {m['skipped_iterations']:3d} |"
        f" number of nan iterations: {m['nan_iterations']:3d} |"
        + "".join(f" {label} bytes: {m['comm_bytes_' + key]} (ideal unquantized "
                  f"{m['baseline_comm_bytes_' + key]}) |" for key, label in _BYTE_FIELDS)
    )


_BYTE_FIELDS = (("params_intra", "params intra"), ("params_inter", "params inter"),
                ("grads_intra", "grads intra"), ("grads_inter", "grads inter"))


_LINE = re.compile(
    r"iteration\s+(?P<iteration>\d+)/\s*(?P<train_iters>\d+) \|"
    r" consumed samples:\s+(?P<consumed_samples>\d+) \|"
    r" elapsed time per iteration \(ms\): (?P<elapsed_ms>[\d.]+) \|"
    r" throughput per GPU \(TFLOP/s/GPU\): (?P<tflops_per_gpu>[\d.]+) \|"
    r" learning rate: (?P<learning_rate>\S+) \|"
    r" global batch size:\s+(?P<global_batch_size>\d+) \|"
    r" lm loss: (?P<lm_loss>\S+) \|"
    r" loss scale: (?P<loss_scale>\S+) \|"
    r" grad norm: (?P<grad_norm>\S+) \|"
    r" number of skipped iterations:\s+(?P<skipped_iterations>\d+) \|"
    r" number of nan iterations:\s+(?P<nan_iterations>\d+) \|"
    + "".join(rf" {label} bytes: (?P<comm_bytes_{key}>\d+) \(ideal unquantized "
              rf"(?P<baseline_comm_bytes_{key}>\d+)\) \|" for key, label in _BYTE_FIELDS)
)


def parse_log_line(line: str) -> dict[str, float] | None:
    """The fields of a training line as numbers, or ``None`` if ``line`` is not one
    (``comm_bytes_params`` and its baseline are the sums of the intra and inter fields)."""
    match = _LINE.search(line)
    if match is None:
        return None
    m = {k: (int(v) if v.isdigit() else float(v)) for k, v in match.groupdict().items()}
    for prefix in ("comm_bytes_params", "baseline_comm_bytes_params"):
        m[prefix] = m[prefix + "_intra"] + m[prefix + "_inter"]
    return m


def format_eval_lines(iteration: int, loss: float, label: str = "validation") -> str:
    ppl = math.exp(min(20.0, loss))
    body = (f" {label} loss at iteration {iteration} | lm loss value: {loss:.6E} |"
            f" lm loss PPL: {ppl:.6E} |")
    bar = "-" * (len(body) + 1)
    return f"{bar}\n{body}\n{bar}"


class MetricsWriter:
    """Fans metrics out to the JSON-lines file, TensorBoard and W&B (each optional)."""

    def __init__(self, args) -> None:
        self._jsonl = None
        if args.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_jsonl)), exist_ok=True)
            self._jsonl = open(args.metrics_jsonl, "a", encoding="utf-8")
        self._tb = None
        self._tb_interval = args.tensorboard_log_interval
        self._tb_ppl = args.log_validation_ppl_to_tensorboard
        self._tb_timers = args.log_timers_to_tensorboard
        # Megatron-LM's TensorBoard switches (training/cli/megatron_flags.py).
        self._tb_skip = {key for key, on in (("learning_rate", args.log_learning_rate_to_tensorboard),
                                             ("loss_scale", args.log_loss_scale_to_tensorboard))
                         if not on}
        self._tb_extra = {tag: value for tag, on, value in (
            ("batch-size", args.log_batch_size_to_tensorboard, args.global_batch_size),
            ("world-size", args.log_world_size_to_tensorboard, args.world_size)) if on}
        self._seq_length = args.seq_length  # for consumed_tokens in --metrics-jsonl
        if args.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ImportError("--tensorboard-dir needs the tensorboard package: "
                                  "pip install tensorboard") from err
            self._tb = SummaryWriter(log_dir=args.tensorboard_dir)
        self._wandb = None
        if args.wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("--wandb-project needs the wandb package: pip install wandb"
                                  ) from err
            self._wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None,
                                     dir=args.wandb_save_dir or None, config=vars(args))

    def train(self, m: dict[str, Any]) -> None:
        self._write({**m, "consumed_tokens": m["consumed_samples"] * self._seq_length})
        step = m["iteration"]
        if self._tb is not None and step % self._tb_interval == 0:
            for key in ("lm_loss", "learning_rate", "grad_norm", "loss_scale", "elapsed_ms",
                        "tflops_per_gpu", *COMM_KEYS, *("baseline_" + k for k in COMM_KEYS)):
                if key not in self._tb_skip:
                    self._tb.add_scalar(key.replace("_", " ") if key == "lm_loss" else key,
                                        m[key], step)
            for tag, value in self._tb_extra.items():
                self._tb.add_scalar(tag, value, step)
            if self._tb_timers:
                for name, ms in m.get("timers_ms", {}).items():
                    self._tb.add_scalar(f"{name}-time", ms, step)
        if self._wandb is not None:
            flat = {k: v for k, v in m.items() if isinstance(v, (int, float))}
            flat.update({f"{k}-time": v for k, v in m.get("timers_ms", {}).items()})
            self._wandb.log(flat, step=step)

    def evaluation(self, iteration: int, loss: float, split: str = "validation") -> None:
        """A validation loss, or with ``split="test"`` the test set's (keys ``test_lm_*``)."""
        key = "val" if split == "validation" else split
        ppl = math.exp(min(20.0, loss))
        self._write({"iteration": iteration, f"{key}_lm_loss": loss, f"{key}_lm_ppl": ppl})
        if self._tb is not None:
            self._tb.add_scalar(f"lm loss {split}", loss, iteration)
            if self._tb_ppl:
                self._tb.add_scalar(f"lm loss {split} ppl", ppl, iteration)
        if self._wandb is not None:
            self._wandb.log({f"{key}_lm_loss": loss}, step=iteration)

    def _write(self, record: dict[str, Any]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
