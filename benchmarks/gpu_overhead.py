"""The GPU check's overhead step: SDP4Bit's compute in a training step, on one GPU.

Baseline: ``pretrain_gpt.py`` trains the paper's GPT 1.3B (the speed scripts' model card and
flags: 24 layers, hidden 2048, 16 heads, sequence 2048, micro batch 1, bf16, the distributed
optimizer, selective recomputation; megatron-core's local layers, since the GPU image has no
Transformer Engine) on one GPU, with no quantization flag. Its step time (forward, backward
and the optimizer, read from ``--metrics-jsonl``) is what one rank spends per step at any
data-parallel size in the paper's weak scaling (micro batch 1 per rank, no accumulation).

Added work: what SDP4Bit's collectives compute per step on one rank at DP 8, 16 and 128 with
8 ranks per node (the paper's H800 nodes; TP 1 for 1.3B), the speed scripts' settings (qWD
4 bits in groups of 2048; TLq-HS 8 then 4 bits in groups of 128, Hadamard 32, 8 pipeline
slices): the same fused operations the comm layer issues (``comm/reduce_scatter.py``,
``comm/all_gather.py``), on buffers sized by its own functions (``required_divisor``,
``hops``, ``message_nbytes``), with random messages standing in for what the all-to-alls and
the all-gather would deliver. No collective runs: communication time (what SDP4Bit saves)
is not part of this. All parameters are treated as one bucket (the speed scripts' layout:
megatron-core splits off a second bucket of 0.3% of them, ``benchmarks/scale.md``).

The figure: added work as a percentage of the baseline step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from benchmarks.quantization import random_wire, time_op
from benchmarks.scale import MODELS, sdp4bit_config
from megatron.sdp4bit.comm.config import GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.comm.padding import required_divisor
from megatron.sdp4bit.comm.reduce_scatter import hops
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.format import message_nbytes

ROOT = Path(__file__).resolve().parents[1]
MODEL = "1.3B"
DP_SIZES = (8, 16, 128)
RANKS_PER_NODE = 8
SEQ = 2048
PARAMS_LINE = re.compile(r"number of parameters on \(tensor, pipeline\) model parallel rank "
                         r"\(0, 0\): (\d+)")


def trainer_flags(rehearse: bool, iters: int, metrics: Path) -> list[str]:
    """``pretrain_gpt.py``'s flags: the speed scripts' baseline on one GPU (a tiny model in
    the rehearsal)."""
    layers, hidden, heads = (2, 64, 4) if rehearse else MODELS[MODEL]
    seq = 64 if rehearse else SEQ
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", str(iters),
            "--lr", "2e-4", "--min-lr", "2e-5", "--lr-decay-style", "cosine",
            "--lr-warmup-fraction", "0.01", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--adam-eps", "1e-8", "--weight-decay", "0.1", "--clip-grad", "1.0", "--bf16",
            "--use-distributed-optimizer", "--recompute-activations",
            "--recompute-granularity", "selective", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "50257",
            "--log-interval", "1", "--eval-interval", "1000000", "--eval-iters", "0",
            "--transformer-impl", "local", "--metrics-jsonl", str(metrics)]


def baseline_step(rehearse: bool, work_dir: Path, log=print) -> dict:
    """Train the baseline; the median step time after the warm-up iterations."""
    iters, warmup = (3, 1) if rehearse else (12, 4)
    metrics = work_dir / "baseline_metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "1", "pretrain_gpt.py", *trainer_flags(rehearse, iters, metrics)]
    env = dict(os.environ)
    if not rehearse:
        env.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    (work_dir / "baseline_train.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"the baseline training run failed (exit {done.returncode}): "
                           + (done.stdout + done.stderr)[-3000:])
    params = PARAMS_LINE.search(done.stdout)
    if params is None:
        raise RuntimeError("the trainer printed no parameter count")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r["elapsed_ms"] for r in records
             if "elapsed_ms" in r and r["iteration"] > warmup]
    if not steps:
        raise RuntimeError(f"no step time after {warmup} warm-up iterations in {metrics}")
    log(f"baseline: {int(params.group(1)):,} parameters, step {statistics.median(steps):.1f} ms "
        f"(median of {len(steps)})")
    return dict(command="python -m torch.distributed.run --standalone --nproc-per-node 1 "
                "pretrain_gpt.py " + " ".join(trainer_flags(rehearse, iters, metrics))
                .replace(str(metrics), "<metrics.jsonl>"),
                parameters=int(params.group(1)), step_ms=round(statistics.median(steps), 3),
                steps_ms=[round(s, 3) for s in steps], warmup_iterations=warmup,
                tflops_per_gpu=round(statistics.median(
                    r["tflops_per_gpu"] for r in records
                    if "tflops_per_gpu" in r and r["iteration"] > warmup), 2),
                wall_s=round(time.perf_counter() - start, 1))


def configs(backend: str) -> tuple[GradientQuantConfig, WeightQuantConfig]:
    """The speed scripts' SDP4Bit settings for the model."""
    config = sdp4bit_config(MODEL)
    grads = GradientQuantConfig.from_sdp4bit(config)
    weights = WeightQuantConfig.from_sdp4bit(config)
    return (dataclasses.replace(grads, kernel_backend=backend),
            dataclasses.replace(weights, kernel_backend=backend))


def rank_work(numel: int, dp: int, device: torch.device, backend: str
              ) -> tuple[dict, list[tuple[str, Callable[[], None]]]]:
    """The phases of one rank's SDP4Bit work per step at DP ``dp`` on a bucket of ``numel``
    parameters: ``(sizes, [(phase, run)])``, issued as the comm layer issues them."""
    grads, weights = configs(backend)
    n = min(RANKS_PER_NODE, dp)
    m = dp // n
    divisor = required_divisor(dp, **weights.divisor_kwargs(), **grads.divisor_kwargs())
    length = -(-numel // divisor) * divisor
    shard = length // dp
    wkw = dict(bits=weights.bits, group_size=weights.group_size, backend=backend)
    grad = torch.randn(length, device=device)
    replica = torch.randn(length, device=device).to(torch.bfloat16)
    main = replica[:shard].float() + 1e-3 * torch.randn(shard, device=device)
    message = torch.empty(message_nbytes(shard, weights.bits, weights.group_size),
                          dtype=torch.uint8, device=device)
    gathered = random_wire(dp, shard, weights.bits, weights.group_size, device)
    out = torch.empty(shard, device=device)
    h, sr = grads.hadamard_block, grads.stochastic
    phases = [
        ("qwd_sender", lambda: ops.qwd_sender(main, replica[:shard], message, stochastic=sr,
                                              seed=1, **wkw)),
        ("qwd_receiver", lambda: ops.qwd_receiver(gathered, replica, world=dp,
                                                  accumulate=True, **wkw)),
    ]
    layout = hops(n, m, shard, grads)
    if len(layout) == 2:
        intra, inter = layout
        p, c = grads.pipeline_slices, shard // grads.pipeline_slices
        send1 = torch.empty(intra.buffer_nbytes, dtype=torch.uint8, device=device)
        recv1 = random_wire(p * n, m * c, grads.intra_bits, grads.intra_group_size, device)
        send2 = torch.empty(inter.buffer_nbytes, dtype=torch.uint8, device=device)
        recv2 = random_wire(p * m, c, grads.inter_bits, grads.inter_group_size, device)
        b1, b2 = n * intra.message_nbytes, m * inter.message_nbytes

        def middle() -> None:
            for i in range(p):
                ops.tlq_middle(recv1[i * b1:(i + 1) * b1], send2[i * b2:(i + 1) * b2],
                               n_in=n, numel=m * c, bits_in=grads.intra_bits,
                               group_size_in=grads.intra_group_size, n_out=m,
                               bits_out=grads.inter_bits,
                               group_size_out=grads.inter_group_size, stochastic=sr, seed=2,
                               backend=backend)

        def receiver() -> None:
            for i in range(p):
                ops.tlq_receiver(recv2[i * b2:(i + 1) * b2], out[i * c:(i + 1) * c], n_in=m,
                                 bits=grads.inter_bits, group_size=grads.inter_group_size,
                                 hadamard_block=h, scale=1.0 / dp, backend=backend)

        phases += [
            ("tlq_sender", lambda: ops.tlq_sender(
                grad, send1, num_dests=n, blocks_per_dest=m, slices=p, bits=grads.intra_bits,
                group_size=grads.intra_group_size, hadamard_block=h, stochastic=sr, seed=3,
                backend=backend)),
            (f"tlq_middle (x{p})", middle), (f"tlq_receiver (x{p})", receiver)]
    else:  # one node: the single intra-node hop
        (hop,) = layout
        send = torch.empty(hop.buffer_nbytes, dtype=torch.uint8, device=device)
        recv = random_wire(dp, shard, grads.intra_bits, grads.intra_group_size, device)
        phases += [
            ("tlq_sender", lambda: ops.tlq_sender(
                grad, send, num_dests=dp, blocks_per_dest=1, slices=1, bits=grads.intra_bits,
                group_size=grads.intra_group_size, hadamard_block=h, stochastic=sr, seed=3,
                backend=backend)),
            ("tlq_receiver", lambda: ops.tlq_receiver(
                recv, out, n_in=dp, bits=grads.intra_bits, group_size=grads.intra_group_size,
                hadamard_block=h, scale=1.0 / dp, backend=backend))]
    sizes = dict(dp=dp, ranks_per_node=n, nodes=m, bucket=length, shard=shard,
                 hops=[dict(name=x.name, peers=x.peers, collectives=x.collectives,
                            message_bytes=x.message_nbytes) for x in layout])
    return sizes, phases


def added_work(numel: int, device: torch.device, backend: str, warmup: int, iters: int,
               dp_sizes=DP_SIZES, log=print) -> list[dict]:
    rows = []
    for dp in dp_sizes:
        sizes, phases = rank_work(numel, dp, device, backend)
        times = {}
        for name, fn in phases:
            times[name] = round(time_op(fn, device, warmup, iters)[0] * 1e3, 4)
        rows.append(dict(**sizes, phases_ms=times, total_ms=round(sum(times.values()), 4)))
        log(f"DP {dp}: {rows[-1]['total_ms']:.2f} ms of quantization work per step "
            f"({', '.join(f'{k} {v:.2f}' for k, v in times.items())})")
        del phases
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def run(rehearse: bool, device: torch.device, work_dir: Path, log=print) -> dict:
    start = time.perf_counter()
    base = baseline_step(rehearse, work_dir, log)
    # The rehearsal's interpreted kernels run on the smallest bucket each DP size allows.
    numel = 1 if rehearse else base["parameters"]
    warmup, iters = (0, 1) if rehearse else (2, 5)
    # The rehearsal takes one DP size of each layout: one hop (8), two hops (16).
    dp_sizes = DP_SIZES[:2] if rehearse else DP_SIZES
    rows = added_work(numel, device, "triton", warmup, iters, dp_sizes, log=log)
    for row in rows:
        row["percent_of_step"] = round(100 * row["total_ms"] / base["step_ms"], 3)
    return dict(model=MODEL if not rehearse else "rehearsal (2 layers, hidden 64, seq 64)",
                baseline=base, backend="triton", ranks_per_node=RANKS_PER_NODE,
                settings=dataclasses.asdict(sdp4bit_config(MODEL)), warmup=warmup, iters=iters,
                work_numel=numel, dp=rows, seconds=round(time.perf_counter() - start, 1))
