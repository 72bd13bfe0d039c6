#!/usr/bin/env python
"""Peak memory of saving and loading a ``--ckpt-format torch_dist`` checkpoint, per rank,
next to the model and optimizer state the rank holds; and the checkpoint's size on disk.

    python -m benchmarks.load_memory                        # every case below (~5 min)
    python -m benchmarks.load_memory --cases quickstart-dp4
    python -m benchmarks.load_memory --write-results        # also benchmarks/load_memory.{md,json}

Each case launches ``torchrun`` on this file: the ranks build the trainer's model, DDP
buffers and distributed optimizer exactly as ``pretrain_gpt.py`` does (``training/build.py``,
SDP4Bit installed, ``--mock-data``), give the optimizer its Adam state (megatron-core's
``_init_optimizer_states_with_dummy_values``), save with the trainer's ``torch_dist`` writer,
then load that checkpoint back with the trainer's loader (SHA-256 check included). Around
the save and around the load each rank resets its peak resident set size (Linux: ``5`` to
``/proc/self/clear_refs``) and reads it afterwards (``VmHWM``), so a peak is the most the
process held during that step; "extra" is the peak minus the resident size just before.

The models: the quickstart's (tools/quickstart.sh: 2 layers, hidden 64, GPT-2's vocabulary
padded to 50,304) and a larger one (12 layers, hidden 1024, 16 heads, 1024 positions), both
with the quickstart's SDP4Bit flags. Prints a table; writes files only with
``--write-results``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import results

ROOT = Path(__file__).resolve().parents[1]

_SDP4BIT = ("--use-distributed-optimizer --quantized-weights --quantized-gradients "
            "--hadamard-transform --gq-group-size-intra 128 --gq-group-size-inter 128").split()
_COMMON = ("--micro-batch-size 4 --global-batch-size 16 --train-iters 1 --lr 3e-3 --bf16 "
           "--mock-data --tokenizer-type NullTokenizer --vocab-size 50256").split() + _SDP4BIT
MODELS = {
    "quickstart": ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
                   "--max-position-embeddings 128").split(),
    "large": ("--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 "
              "--max-position-embeddings 1024").split(),
}
# name -> (model, processes, extra flags)
CASES = {
    "quickstart-dp4": ("quickstart", 4, ["--dp-ranks-per-node", "2"]),
    "quickstart-dp2": ("quickstart", 2, ["--dp-ranks-per-node", "1"]),
    "quickstart-dp4-fully": ("quickstart", 4, ["--dp-ranks-per-node", "2",
                                               "--dist-ckpt-optim-fully-reshardable"]),
    "large-dp2": ("large", 2, ["--dp-ranks-per-node", "1"]),
    "large-dp2-fully": ("large", 2, ["--dp-ranks-per-node", "1",
                                     "--dist-ckpt-optim-fully-reshardable"]),
}
MB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> int:
    """Reset the peak resident size to the current one; returns the current one."""
    gc.collect()
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    return _status("VmRSS")


def _state_bytes(state) -> dict[str, int]:
    """What this rank holds: 16-bit weights and fp32 gradients (DDP buffers, the whole model
    on every DP rank) and the optimizer's fp32 main weights and Adam moments (its shard)."""
    from megatron.sdp4bit.training.checkpoint.common import inner_optimizers as _inner_optimizers

    weights = grads = 0
    for chunk in state.model:
        for buffer in chunk.buffers:
            weights += buffer.param_data.numel() * buffer.param_data.element_size()
            grads += buffer.grad_data.numel() * buffer.grad_data.element_size()
    optimizer = 0
    for opt in _inner_optimizers(state.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                optimizer += p.numel() * p.element_size()
                optimizer += sum(t.numel() * t.element_size()
                                 for t in opt.optimizer.state.get(p, {}).values()
                                 if hasattr(t, "numel") and t.dim() > 0)
    params = sum(p.numel() for chunk in state.model for p in chunk.parameters())
    return {"params": params, "weights": weights, "grads": grads, "optimizer": optimizer}


def worker(out: str, flags: list[str]) -> None:
    """One rank (under torchrun): build, save, load; rank 0 writes every rank's figures."""
    from megatron.sdp4bit.training.observe.noise import quiet_megatron_core

    quiet_megatron_core()
    import torch.distributed as dist

    from megatron.sdp4bit.training import build, sdp4bit_setup
    from megatron.sdp4bit.training.checkpoint import formats
    from megatron.sdp4bit.training.checkpoint.common import inner_optimizers as _inner_optimizers
    from megatron.sdp4bit.training.cli.arguments import parse_args, sdp4bit_config_from_args

    args = parse_args(flags)
    config = sdp4bit_config_from_args(args)
    build.init_distributed(args)
    config = config.replace(dp_ranks_per_node=config.dp_ranks_per_node
                            or build.detect_dp_ranks_per_node())
    state, _ = build.build_state(args, config)
    sdp4bit_setup.install(config, state)
    for opt in _inner_optimizers(state.optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    record = _state_bytes(state)

    dist.barrier()
    before = _reset_peak()
    t0 = time.perf_counter()
    folder = formats.save(args, 1, args.global_batch_size, state.model, state.optimizer,
                          state.scheduler, state.settings)
    record.update(save_s=time.perf_counter() - t0, save_before=before,
                  save_peak=_status("VmHWM"))
    dist.barrier()
    before = _reset_peak()
    t0 = time.perf_counter()
    iteration = formats.load(args, state.model, state.optimizer, state.scheduler,
                             state.settings).iteration
    assert iteration == 1
    record.update(load_s=time.perf_counter() - t0, load_before=before,
                  load_peak=_status("VmHWM"))
    records: list = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        files = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"ranks": records, "files": files}, f)
    state.lifecycle.uninstall(finish_param_sync=False)
    build.teardown()


def run_case(name: str, work: Path) -> dict:
    model, nproc, extra = CASES[name]
    ckpt = work / name
    shutil.rmtree(ckpt, ignore_errors=True)
    out = work / f"{name}.json"
    flags = MODELS[model] + _COMMON + extra + ["--save", str(ckpt), "--load", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "benchmarks.load_memory", "--worker", str(out), "--", *flags]
    t0 = time.time()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        raise SystemExit(f"{name} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    result = json.loads(out.read_text())
    shutil.rmtree(ckpt, ignore_errors=True)
    result.update(model=model, nproc=nproc, flags=extra, wall_s=time.time() - t0)
    return result


def _row(name: str, r: dict) -> str:
    ranks = r["ranks"]
    held = [x["weights"] + x["grads"] + x["optimizer"] for x in ranks]
    load = max(ranks, key=lambda x: x["load_peak"] - x["load_before"])  # the rank needing most
    save_extra = max(x["save_peak"] - x["save_before"] for x in ranks)
    disk = sum(r["files"].values())
    first = ranks[0]
    return (f"| {name} | {r['nproc']} | {first['params'] / 1e6:.2f} M | "
            f"{first['weights'] / MB:.1f} + {first['grads'] / MB:.1f} + "
            f"{max(x['optimizer'] for x in ranks) / MB:.1f} = {max(held) / MB:.1f} | "
            f"{load['load_before'] / MB:.0f} -> {load['load_peak'] / MB:.0f} | "
            f"{(load['load_peak'] - load['load_before']) / MB:.1f} | {save_extra / MB:.1f} | "
            f"{disk / MB:.2f} | {max(x['load_s'] for x in ranks):.1f} / "
            f"{max(x['save_s'] for x in ranks):.1f} |")


def render(record: dict) -> str:
    lines = ["# Checkpoint memory and size (torch_dist)", "",
             "Written by `benchmarks/load_memory.py` (see its docstring). MB = 2**20 "
             "bytes. Held: the state a rank holds (bf16 weights + fp32 gradient buffer, both "
             "the whole model, + its shard of the fp32 main weights and Adam moments; the "
             "largest over the ranks). Load: the resident size just before the load -> the "
             "peak during it, and the difference (extra), for the rank whose extra is "
             "largest. Save extra: the same difference for the save, largest over the ranks. "
             "Disk: the sum of the checkpoint folder's file sizes.", "",
             f"- command: `{record['command']}`",
             f"- machine: {record['machine']}",
             f"- load average (1 min) before / after: {record['load_average'][0]:.1f} / "
             f"{record['load_average'][1]:.1f}",
             f"- date: {record['date']}", "",
             "| case | ranks | parameters | held (MB): weights + grads + optimizer | load: "
             "RSS before -> peak (MB) | load extra (MB) | save extra (MB) | disk (MB) | "
             "load / save (s) |",
             "|---|---:|---:|---|---|---:|---:|---:|---|"]
    lines += [_row(name, r) for name, r in record["cases"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    cli = sys.argv[1:] if argv is None else list(argv)
    if cli[:1] == ["--worker"]:
        worker(cli[1], cli[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--work-dir", type=Path, help="where the checkpoints are written "
                        "(default: a temporary folder; each is removed after its case)")
    parser.add_argument("--write-results", action="store_true",
                        help="also write benchmarks/load_memory.{md,json} (else print only)")
    args = parser.parse_args(cli)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cases = {}
        for name in args.cases:
            cases[name] = run_case(name, work)
            print(_row(name, cases[name]), flush=True)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, "
               f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB")
    record = {**results.header(__file__, cli, machine, load_before), "cases": cases}
    print()
    print(render(record))
    if args.write_results:
        results.write("load_memory", record, render)


if __name__ == "__main__":
    main()
