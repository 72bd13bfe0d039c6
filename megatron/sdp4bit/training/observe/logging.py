"""Megatron-LM's console lines: the arguments dump, the parameter count, the training and
evaluation lines, the checkpoint-saved lines; :func:`parse_log_line` reads a training line
back (tests, tools).

Training line (Megatron-LM's fields, order and number formats, then this rank's
communication)::

    [2025-01-01 12:00:00.123456] iteration       10/     100 | consumed samples:          80 |
    elapsed time per iteration (ms): 52.1 | throughput per GPU (TFLOP/s/GPU): 0.0 |
    learning rate: 9.000000E-04 | global batch size:     8 | lm loss: 5.170436E+00 |
    loss scale: 1.0 | grad norm: 1.234 | [num zeros: 17.0 |] [params norm: 20.123 |]
    number of skipped iterations:   0 |
    number of nan iterations:   0 | params intra bytes: 1024 (ideal unquantized 4096) |
    params inter bytes: 1024 (ideal unquantized 4096) | grads intra bytes: 2112 (ideal
    unquantized 8192) | grads inter bytes: 1088 (ideal unquantized 8192) |

(one line; wrapped here; the bracketed fields with ``--log-num-zeros-in-grad`` and
``--log-params-norm``, as Megatron-LM prints them). Byte counts are per iteration, averaged over the logging interval,
sent by this rank to ranks of its own node (intra) and of other nodes (inter): the computed
sizes of the messages handed to the collectives, next to what an ideal unquantized
collective would send (megatron.sdp4bit.comm.stats, [Note: what counts as sent]). With
``--timing-log-level`` >= 1 a block of timers follows each line
(:func:`megatron.sdp4bit.training.observe.timers.format_timers`).

[Note: two generations of the line]
Logs written before this trainer followed Megatron-LM's number formats have a timestamp
without microseconds and the throughput with four decimals (``0.0104``). The fields and
their order are the same, and the pattern below does not depend on either format, so
:func:`parse_log_line` reads both (runs already on disk, tools comparing old and new runs).
"""

from __future__ import annotations

import argparse
import math
import re
from datetime import datetime
from typing import Any

_BYTE_FIELDS = (("params_intra", "params intra"), ("params_inter", "params inter"),
                ("grads_intra", "grads intra"), ("grads_inter", "grads inter"))


def is_logging_rank() -> bool:
    """Whether this rank prints the training lines: Megatron-LM's last rank, which holds the
    loss with pipeline parallelism."""
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")  # Megatron-LM's, microseconds


def format_train_line(m: dict[str, Any]) -> str:
    """The training line of the module docstring from a metrics record."""
    return (
        f" [{_stamp()}] iteration {m['iteration']:8d}/{m['train_iters']:8d} |"
        f" consumed samples: {m['consumed_samples']:12d} |"
        f" elapsed time per iteration (ms): {m['elapsed_ms']:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): {m['tflops_per_gpu']:.1f} |"
        f" learning rate: {m['learning_rate']:.6E} |"
        f" global batch size: {m['global_batch_size']:5d} |"
        f" lm loss: {m['lm_loss']:.6E} |"
        f" loss scale: {m['loss_scale']:.1f} |"
        f" grad norm: {m['grad_norm']:.3f} |"
        + (f" num zeros: {float(m['num_zeros'])} |" if m.get("num_zeros") is not None else "")
        + (f" params norm: {m['params_norm']:.3f} |" if m.get("params_norm") is not None
           else "")
        + f" number of skipped iterations: {m['skipped_iterations']:3d} |"
        f" number of nan iterations: {m['nan_iterations']:3d} |"
        + "".join(f" {label} bytes: {m['comm_bytes_' + key]} (ideal unquantized "
                  f"{m['baseline_comm_bytes_' + key]}) |" for key, label in _BYTE_FIELDS)
        + "".join(f" expert {label} bytes: {m['comm_bytes_expert_' + key]} (ideal "
                  f"unquantized {m['baseline_comm_bytes_expert_' + key]}) |"
                  for key, label in _BYTE_FIELDS if "comm_bytes_expert_" + key in m)
        + "".join(f" {name}: {m[name]:.6E} |" for name in m.get("moe_losses", ()))
    )


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
    r"(?: num zeros: (?P<num_zeros>\S+) \|)?(?: params norm: (?P<params_norm>\S+) \|)?"
    r" number of skipped iterations:\s+(?P<skipped_iterations>\d+) \|"
    r" number of nan iterations:\s+(?P<nan_iterations>\d+) \|"
    + "".join(rf" {label} bytes: (?P<comm_bytes_{key}>\d+) \(ideal unquantized "
              rf"(?P<baseline_comm_bytes_{key}>\d+)\) \|" for key, label in _BYTE_FIELDS)
)


_EXPERT_BYTES = re.compile(r" expert (params intra|params inter|grads intra|grads inter) "
                           r"bytes: (\d+) \(ideal unquantized (\d+)\) \|")
_MOE_LOSSES = re.compile(r" ((?:seq_|global_)?load_balancing_loss|z_loss): (\S+) \|")


def parse_log_line(line: str) -> dict[str, float] | None:
    """The fields of a training line (either generation, [Note: two generations of the
    line]) as numbers, or ``None`` if ``line`` is not one (``comm_bytes_params`` and its
    baseline are the sums of the intra and inter fields)."""
    match = _LINE.search(line)
    if match is None:
        return None
    m = {k: (int(v) if v.isdigit() else float(v)) for k, v in match.groupdict().items()
         if v is not None}  # num zeros and params norm only with their flags
    for key, sent, ideal in _EXPERT_BYTES.findall(line):  # MoE runs: the expert part
        m[f"comm_bytes_expert_{key.replace(' ', '_')}"] = int(sent)
        m[f"baseline_comm_bytes_expert_{key.replace(' ', '_')}"] = int(ideal)
    for name, value in _MOE_LOSSES.findall(line):
        m[name] = float(value)
    for prefix in ("comm_bytes_params", "baseline_comm_bytes_params"):
        m[prefix] = m[prefix + "_intra"] + m[prefix + "_inter"]
    return m


def format_eval_lines(iteration: int, loss: float, split: str = "validation") -> str:
    """Megatron-LM's evaluation block: a bar, the line, a bar. During training it names the
    iteration; the test set, evaluated once after the last iteration, is named as Megatron-LM
    names it (``... at iteration N on test set``)."""
    ppl = math.exp(min(20.0, loss))
    where = f"iteration {iteration}" + (" on test set" if split == "test" else "")
    body = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
    bar = "-" * (len(body) + 1)
    return f"{bar}\n{body}\n{bar}"


def format_arguments(args: argparse.Namespace) -> str:
    """Megatron-LM's arguments dump: every setting after validation, one per line, sorted
    case-insensitively, the name padded with dots to 48 characters. The ``refused_*``
    entries are left out: they hold the Megatron-LM flags this trainer refuses, all unset by
    the time a run starts."""
    title = "arguments"
    rows = ["  {} {} {}".format(name, "." * (48 - len(name)), value)
            for name, value in vars(args).items() if not name.startswith("refused_")]
    return "\n".join([f"------------------------ {title} ------------------------",
                      *sorted(rows, key=str.lower),
                      f"-------------------- end of {title} ---------------------"])


def format_parameter_count(tp_rank: int, pp_rank: int, count: int) -> str:
    """Megatron-LM's parameter-count line, printed by the first data-parallel rank of each
    (tensor, pipeline) model-parallel position: the parameters that rank holds."""
    return (f" > number of parameters on (tensor, pipeline) model parallel rank "
            f"({tp_rank}, {pp_rank}): {count}")


def format_saving(iteration: int, save_dir: str, ckpt_format: str) -> str:
    """Megatron-LM's line before a checkpoint is written."""
    return (f"[{_stamp()}] saving checkpoint at iteration {iteration:7d} to {save_dir} in "
            f"{ckpt_format} format")


def format_scheduled(iteration: int, save_dir: str) -> str:
    """Megatron-LM's line after an asynchronous save (``--async-save``) was scheduled; its
    :func:`format_saved` line follows when the save is published."""
    return f"  scheduled an async checkpoint save at iteration {iteration:7d} to {save_dir}"


def format_saved(iteration: int, save_dir: str, tp: int, pp: int) -> str:
    """Megatron-LM's line after every rank wrote its part and the tracker file names the
    iteration (what cluster tooling waits for). Rank 0 prints it, so its own position, 1 of
    each model-parallel size, is the one named."""
    return (f"  [{_stamp()}] successfully saved checkpoint from iteration {iteration:7d} to "
            f"{save_dir} [ t 1/{tp}, p 1/{pp} ]")
