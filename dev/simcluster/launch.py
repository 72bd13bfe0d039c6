"""One training run on the two-node cluster: a ``torchrun`` per node, as on a real cluster.

What a multi-node CPU launch needs (and what this does for each node):

* ``GLOO_SOCKET_IFNAME=<the node's link interface>``: otherwise gloo binds to the first
  interface it finds (often loopback) and the nodes cannot reach each other;
* ``torchrun --local-addr <the node's address>``: the address the node's agent advertises;
* a c10d rendezvous on node 0 (``--rdzv-endpoint <node 0>:<port>``) with
  ``--rdzv-conf is_host=1`` on node 0 and ``is_host=0`` on node 1: which agent hosts the
  rendezvous store (the default guesses from host names, which are the same here).

Every process of a run is in a process group of its own, so that :func:`run` can end exactly
its processes (and no other) when the run fails, times out or is interrupted.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dev.simcluster.netns import Cluster
from megatron.sdp4bit.training.observe.metrics_file import read_metrics

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass
class RunResult:
    method: str
    ms_per_iter: list[float]  # the timed iterations (after warm-up), from the log
    link_bytes_per_iter: list[float]  # per direction: node 0 -> 1, node 1 -> 0
    counted_inter_bytes_per_iter: float  # the trainer's own inter-node counters, per node
    counted_grad_inter_bytes_per_iter: float  # its gradient part
    load_average: float  # 1-minute load average at the end of the run
    timers_ms: dict[str, float]  # --timing-log-level 1: max over ranks, mean of timed iters

    @property
    def median_s(self) -> float:
        return statistics.median(self.ms_per_iter) / 1e3


def _kill(procs: list[subprocess.Popen]) -> None:
    """End the process groups of ``procs`` (torchrun agents and their workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while any(p.poll() is None for p in alive) and time.time() < deadline:
            time.sleep(0.1)


def _sampler(cluster: Cluster, node: int, out: Path) -> subprocess.Popen:
    n = cluster.nodes[node]
    return subprocess.Popen(
        n.exec_prefix() + [sys.executable, str(HERE / "sampler.py"), n.veth, "0.02"],
        stdout=open(out, "w"), stderr=subprocess.DEVNULL, start_new_session=True)


def _bytes_at(samples: list[tuple[float, int, int]], t: float, column: int) -> float:
    """Counter ``column`` (1 = tx, 2 = rx) at time ``t``, linearly interpolated."""
    for (t0, *a), (t1, *b) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            w = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
            return a[column - 1] + w * (b[column - 1] - a[column - 1])
    raise ValueError(f"time {t:.3f} is outside the sampled interval")


def _read_samples(path: Path) -> list[tuple[float, int, int]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            rows.append((float(parts[0]), int(parts[1]), int(parts[2])))
    return rows


def run(cluster: Cluster, method: str, trainer_args: list[str], *, warmup: int, iters: int,
        workdir: Path, port: int, timeout: float, ranks_per_node: int = 2) -> RunResult:
    """Train ``iters + warmup`` iterations (log every iteration); time the last ``iters``."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    host = cluster.nodes[0].address
    args = trainer_args + ["--train-iters", str(warmup + iters), "--log-interval", "1",
                           "--eval-iters", "0", "--metrics-jsonl", str(metrics)]
    procs, samplers, logs = [], [], []
    try:
        for i, node in enumerate(cluster.nodes):
            samplers.append(_sampler(cluster, i, workdir / f"link{i}.txt"))
            env = {**os.environ, "GLOO_SOCKET_IFNAME": node.veth, "OMP_NUM_THREADS": "1",
                   "PYTHONUNBUFFERED": "1"}
            cmd = node.exec_prefix() + [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", str(ranks_per_node), "--node-rank", str(i),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                "--rdzv-id", f"simcluster-{port}", "--rdzv-conf", f"is_host={int(i == 0)}",
                "--local-addr", node.address, "--max-restarts", "0",
                str(ROOT / "pretrain_gpt.py"), *args]
            log = open(workdir / f"node{i}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.time() + timeout
        while any(p.poll() is None for p in procs):
            if time.time() > deadline:
                raise TimeoutError(f"{method}: no result after {timeout:.0f} s "
                                   f"(logs in {workdir})")
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
        codes = [p.wait() if p.poll() is not None else None for p in procs]
        if codes != [0, 0]:
            tail = (workdir / "node1.log").read_text()[-2000:]
            raise RuntimeError(f"{method}: torchrun exit codes {codes}; end of node 1's log:\n"
                               f"{tail}")
    finally:
        _kill(procs + samplers)
        for log in logs:
            log.close()
    train, _ = read_metrics(metrics)
    if len(train) != warmup + iters:
        raise RuntimeError(f"{method}: {len(train)} logged iterations, expected "
                           f"{warmup + iters} ({metrics})")
    timed = train[warmup:]
    start, end = train[warmup - 1]["time"], train[-1]["time"]
    link = []
    for i in range(2):
        samples = _read_samples(workdir / f"link{i}.txt")
        link.append((_bytes_at(samples, end, 1) - _bytes_at(samples, start, 1)) / iters)
    counted_grads = ranks_per_node * statistics.mean(r["comm_bytes_grads_inter"] for r in timed)
    counted = counted_grads + ranks_per_node * statistics.mean(
        r["comm_bytes_params_inter"] for r in timed)
    timers = {}
    if timed[0].get("timers_ms"):
        names = set().union(*(r.get("timers_ms", {}) for r in timed))
        timers = {n: statistics.mean(r.get("timers_ms", {}).get(n, 0.0) for r in timed)
                  for n in sorted(names)}
    return RunResult(method=method, ms_per_iter=[r["elapsed_ms"] for r in timed],
                     link_bytes_per_iter=link, counted_inter_bytes_per_iter=counted,
                     counted_grad_inter_bytes_per_iter=counted_grads,
                     load_average=os.getloadavg()[0], timers_ms=timers)
