"""The run's numbers to the ``--metrics-jsonl`` file, TensorBoard and W&B.

TensorBoard tags and W&B keys are Megatron-LM's (its ``training_log`` and
``evaluate_and_print_results``), so dashboards and scripts built for Megatron-LM runs read
these runs unchanged; SDP4Bit's own figures are under ``sdp4bit/``. Which tag when:

* every ``--tensorboard-log-interval`` iterations, this iteration's values: ``lm loss``,
  ``learning-rate`` (off with ``--no-log-learnig-rate-to-tensorboard``), ``batch-size``,
  ``loss-scale`` (off with ``--no-log-loss-scale-to-tensorboard``), ``grad-norm``,
  ``world-size`` (with ``--log-world-size-to-tensorboard``), ``num-zeros`` (with
  ``--log-num-zeros-in-grad``), ``params-norm`` (with ``--log-params-norm``), each also as
  ``<tag> vs samples`` against the consumed samples; W&B gets the plain tags and ``samples
  vs steps``; with ``--log-memory-to-tensorboard`` the ``mem-*`` tags of :mod:`.memory`
  (against the iteration only, TensorBoard only, as Megatron-LM);
* every ``--log-interval`` iterations, over the interval: ``iteration-time`` (seconds) and
  ``throughput`` (TFLOP/s per GPU), which Megatron-LM writes only with
  ``--log-timers-to-tensorboard`` and this trainer always; SDP4Bit's bytes per iteration,
  under the names Megatron-LM's trainer gets them through the plug-in too
  (``comm/byte_counts.py``); with ``--log-timers-to-tensorboard`` the timers as
  ``<name>-time`` (seconds, the maximum over ranks; SDP4Bit's phases as
  ``sdp4bit/<phase>-time``);
* at each evaluation: ``lm loss validation`` and ``lm loss validation vs samples``, with
  ``--log-validation-ppl-to-tensorboard`` also ``lm loss validation ppl`` (and ``vs
  samples``); the test set's loss, evaluated once at the end, as ``lm loss test ...``
  (Megatron-LM writes it under the validation tags, where it would sit on top of the last
  validation point).

The JSON-lines file keeps its own keys (``lm_loss``, ``val_lm_loss``, ``elapsed_ms``,
``num_zeros``, ``params_norm``, ``memory`` (tag -> value), ...:
:mod:`.metrics_file` and the tools under ``tools/`` read them), one object per logged
iteration and per evaluation.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from megatron.sdp4bit.training.observe.comm_counters import scalars_of_record
from megatron.sdp4bit.training.observe.memory import memory_scalars

def _timer_tag(name: str) -> str:
    if name.startswith("sdp4bit-"):
        return f"sdp4bit/{name[len('sdp4bit-'):]}-time"
    return f"{name}-time"


class MetricsWriter:
    """Fans metrics out to the JSON-lines file, TensorBoard and W&B (each optional). Only
    the rank that prints the training line (the last) makes one."""

    def __init__(self, args) -> None:
        self._jsonl = None
        if args.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_jsonl)), exist_ok=True)
            self._jsonl = open(args.metrics_jsonl, "a", encoding="utf-8")
        self._tb_interval = args.tensorboard_log_interval
        self._tb_ppl = args.log_validation_ppl_to_tensorboard
        self._tb_timers = args.log_timers_to_tensorboard
        self._lr = args.log_learning_rate_to_tensorboard
        self._loss_scale = args.log_loss_scale_to_tensorboard
        self._world_size = args.world_size if args.log_world_size_to_tensorboard else None
        self._memory = args.log_memory_to_tensorboard
        self._batch_size = args.global_batch_size
        self._seq_length = args.seq_length  # for consumed_tokens in --metrics-jsonl
        self._tb = None
        if args.tensorboard_dir:
            # Importable: argument checking refuses --tensorboard-dir without it.
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=args.tensorboard_dir)
        self._wandb = None
        if args.wandb_project:
            import wandb  # importable: argument checking refuses --wandb-project without it

            self._wandb = wandb.init(project=args.wandb_project, name=args.wandb_exp_name or None,
                                     dir=args.wandb_save_dir or None, config=vars(args))

    def _scalars(self, values: dict[str, float], step: int,
                 samples: int | None = None) -> None:
        """``values`` to TensorBoard (also against the consumed ``samples`` when given)
        and W&B, under the same names."""
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, step)
                if samples is not None:
                    self._tb.add_scalar(f"{tag} vs samples", value, samples)
        if self._wandb is not None and values:
            self._wandb.log(dict(values), step=step)

    def iteration_due(self, iteration: int) -> bool:
        """Whether :meth:`iteration` writes anything at ``iteration`` (the caller then
        reads the loss scale, a device synchronization on GPU)."""
        return (self._tb is not None or self._wandb is not None) and \
            iteration % self._tb_interval == 0

    def iteration(self, iteration: int, consumed_samples: int, loss: float,
                  learning_rate: float, loss_scale: float, grad_norm: float,
                  num_zeros: float | None = None, params_norm: float | None = None,
                  batch_size: int | None = None) -> None:
        """One training iteration's values, written every ``--tensorboard-log-interval``
        iterations (``num_zeros`` and ``params_norm`` when their flags ask for them);
        ``batch_size``: this iteration's global batch size (``--rampup-batch-size``), by
        default ``--global-batch-size``."""
        if not self.iteration_due(iteration):
            return
        if self._wandb is not None:
            self._wandb.log({"samples vs steps": consumed_samples}, step=iteration)
        values: dict[str, float] = {}
        if self._lr:
            values["learning-rate"] = learning_rate
        values["batch-size"] = self._batch_size if batch_size is None else batch_size
        values["lm loss"] = loss
        if self._loss_scale:
            values["loss-scale"] = loss_scale
        if self._world_size is not None:
            values["world-size"] = self._world_size
        values["grad-norm"] = grad_norm
        if num_zeros is not None:
            values["num-zeros"] = num_zeros
        if params_norm is not None:
            values["params-norm"] = params_norm
        self._scalars(values, iteration, samples=consumed_samples)
        if self._memory and self._tb is not None:
            for tag, value in memory_scalars().items():
                self._tb.add_scalar(tag, value, iteration)

    def train(self, m: dict[str, Any]) -> None:
        """A logged iteration's record (the averages over the log interval)."""
        self._write({**m, "consumed_tokens": m["consumed_samples"] * self._seq_length})
        values = {"iteration-time": m["elapsed_ms"] / 1e3, "throughput": m["tflops_per_gpu"]}
        values.update(scalars_of_record(m))  # SDP4Bit's bytes, named as in both trainers
        values.update({name: m[name] for name in m.get("moe_losses", ())})  # Megatron-LM's tags
        if self._tb_timers:
            values.update({_timer_tag(name): ms / 1e3
                           for name, ms in m.get("timers_ms", {}).items()})
        self._scalars(values, m["iteration"])

    def evaluation(self, iteration: int, consumed_samples: int, loss: float,
                   split: str = "validation") -> None:
        """A validation loss, or with ``split="test"`` the test set's (keys ``test_lm_*``)."""
        key = "val" if split == "validation" else split
        ppl = math.exp(min(20.0, loss))
        self._write({"iteration": iteration, f"{key}_lm_loss": loss, f"{key}_lm_ppl": ppl})
        tag = f"lm loss {split}"
        if self._tb is not None:
            self._tb.add_scalar(tag, loss, iteration)
            self._tb.add_scalar(f"{tag} vs samples", loss, consumed_samples)
            if self._tb_ppl:
                self._tb.add_scalar(f"{tag} ppl", ppl, iteration)
                self._tb.add_scalar(f"{tag} ppl vs samples", ppl, consumed_samples)
        if self._wandb is not None:
            self._wandb.log({tag: loss}, step=iteration)

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
