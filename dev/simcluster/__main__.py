"""Speed of SDP4Bit on a simulated two-node cluster with a slow link between the nodes.

    sudo bash benchmarks/simcluster.sh                         # none 1gbit 300mbit 100mbit
    sudo bash benchmarks/simcluster.sh 1gbit 100mbit --rounds 5
    sudo bash benchmarks/simcluster.sh --write-results         # benchmarks/simcluster.*
    sudo bash benchmarks/simcluster.sh 1gbit --model moe --methods baseline SDP4Bit \\
        --write-results                                        # benchmarks/simcluster_moe.*
    sudo bash benchmarks/simcluster.sh none 1gbit 100mbit --methods baseline SDP4Bit \\
        SDP4Bit-2bit baseline-bf16 baseline-bf16-a2a --write-results  # simcluster_peers.*
    python -m dev.simcluster --render benchmarks/simcluster.json   # redraw, no root needed

(``benchmarks/simcluster.sh`` sets up ``.venv`` first; inside it, ``python -m dev.simcluster``.)

Two network namespaces stand in for two nodes of 2 ranks each (``netns.py``), joined by a
veth pair shaped with ``tc tbf`` at each link rate. For every rate, the link's real TCP
throughput is measured first (``probe.py``), then baseline, SDP4Bit, qWD only and TLq-HS only
train the same small GPT (``pretrain_gpt.py``, one ``torchrun`` per node, ``launch.py``),
interleaved for ``--rounds`` rounds (the order rotates each round). Each run's time per
iteration is the median of its iterations after ``--warmup``; each method's figure is the
median over the rounds, and its speed-up is the baseline's figure over its own. The bytes
that crossed the link per iteration come from the interface counters (sampled every 20 ms
over the timed iterations), next to what the trainer's own counters say.

``--methods`` with a method beyond the paper's four (a peer: ``SDP4Bit-2bit``,
``baseline-bf16``, ``baseline-bf16-a2a``; see ``METHODS``) writes ``simcluster_peers.*``
(``simcluster_moe_peers.*``), one row per link and method, so the paper's table stays.

``--model moe`` trains a mixture-of-experts GPT instead (``MOE``: 4 experts per layer, top-2,
expert parallelism 2 on the same 4 ranks, so each expert data-parallel group is one rank per
node and its traffic all crosses the link); its results go to ``simcluster_moe.*``, beside
the dense model's.

Needs root and iproute2, and says so in one line otherwise. It removes its namespaces and
ends only its own processes, on success, failure or Ctrl-C. Results are printed; they go to
``benchmarks/simcluster.{md,json,png}`` only with ``--write-results``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dev.simcluster import launch, netns, report

MODEL = ["--num-layers", "2", "--hidden-size", "512", "--num-attention-heads", "8",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "512", "--mock-data", "--bf16", "--use-distributed-optimizer"]
# The MoE model: MODEL's GPT with every MLP a MoE layer, each rank holding 2 of the 4 experts.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "1024",
       "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "1e-2"]
# --model: (flags, what the report says the model is, results file stem)
MODELS = {
    "dense": (MODEL, report.DENSE_MODEL, "simcluster"),
    "moe": (MODEL + MOE, "mixture-of-experts GPT (2 layers, hidden 512, 8 heads, seq 64, "
            "global batch 4, bf16; every MLP a MoE layer of 4 experts of FFN size 1024, "
            "top-2, the alltoall dispatcher, expert parallelism 2: expert data-parallel "
            "groups of one rank per node)", "simcluster_moe"),
}
GRADS = ["--quantized-gradients", "--hadamard-transform", "--gq-group-size-intra", "128",
         "--gq-group-size-inter", "128"]
METHODS = {
    "baseline": [],
    "SDP4Bit": ["--quantized-weights", *GRADS],
    "qWD": ["--quantized-weights"],
    "TLq-HS": GRADS,
    # The peers: fewer inter-node gradient bits, and what a user would pick instead of
    # SDP4Bit (megatron-core's own cheaper gradient collectives). Results: <stem>_peers.*
    "SDP4Bit-2bit": ["--quantized-weights", *GRADS, "--gradient-quantization-bits-inter", "2"],
    "baseline-bf16": ["--grad-reduce-in-bf16"],
    "baseline-bf16-a2a": ["--grad-reduce-in-bf16",
                          "--ddp-reduce-scatter-with-fp32-accumulation"],
}
PAPER_METHODS = report.PAPER_METHODS
# What a user would pass for speed, the same for every method (see --speed-flags).
SPEED_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size",
               "1000000"]
# megatron-core overlaps its all-to-all reduce-scatter (fp32 accumulation) with a single
# gradient bucket only, and the trainer refuses --overlap-grad-reduce with it (and
# --overlap-param-gather needs --overlap-grad-reduce): that method runs without both.
NO_OVERLAP = {"baseline-bf16-a2a"}
PIPELINE = ["--gradient-alltoall-pipeline", "2"]  # quantized gradients only


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def measure_link(cluster: netns.Cluster, seconds: float, port: int) -> float:
    """Bits per second of one TCP stream from node 0 to node 1."""
    here = Path(__file__).resolve().parent
    a, b = cluster.nodes
    server = subprocess.Popen(b.exec_prefix() + [sys.executable, str(here / "probe.py"),
                                                 "serve", b.address, str(port)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        subprocess.run(a.exec_prefix() + [sys.executable, str(here / "probe.py"), "send",
                                          b.address, str(port), str(seconds)],
                       check=True, timeout=seconds + 60, capture_output=True)
        out, _ = server.communicate(timeout=60)
    finally:
        launch._kill([server])
    nbytes, elapsed = out.split()
    return 8 * int(nbytes) / float(elapsed)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="simcluster", description=__doc__.splitlines()[0])
    p.add_argument("rates", nargs="*", default=["none", "1gbit", "300mbit", "100mbit"],
                   help="link rates: none (unshaped) or N kbit/mbit/gbit")
    p.add_argument("--methods", nargs="+", default=PAPER_METHODS, choices=list(METHODS),
                   help=f"default: {' '.join(PAPER_METHODS)}; with any other (a peer), the "
                   "results go to simcluster_peers.* (--model moe: simcluster_moe_peers.*)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per run")
    p.add_argument("--iters", type=int, default=8, help="timed iterations per run")
    p.add_argument("--model", choices=list(MODELS), default="dense",
                   help="dense: the GPT of benchmarks/simcluster.md; moe: its mixture-of-"
                   "experts variant (results in benchmarks/simcluster_moe.*)")
    p.add_argument("--no-speed-flags", dest="speed_flags", action="store_false",
                   help=f"leave out {' '.join(SPEED_FLAGS + PIPELINE)}")
    p.add_argument("--extra-args", default="", help="more pretrain_gpt.py flags, one string")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--workdir", type=Path, help="logs and metrics of every run (default: a "
                   "temporary folder, kept on failure)")
    p.add_argument("--write-results", action="store_true",
                   help="write benchmarks/simcluster.{md,json,png} "
                   "(--model moe: simcluster_moe.*)")
    p.add_argument("--out-dir", type=Path, default=report.ROOT / "benchmarks")
    p.add_argument("--render", type=Path, metavar="JSON",
                   help="only redraw the table and plot of a results file (no root needed)")
    args = p.parse_args(argv)
    try:
        args.rate_bits = [netns.parse_rate(r) for r in args.rates]
    except ValueError as err:
        p.error(str(err))
    if args.rounds < 1 or args.iters < 1 or args.warmup < 1:
        p.error("--rounds, --iters and --warmup must be >= 1")
    if "baseline" not in args.methods:
        p.error("--methods must include baseline: speed-ups are relative to it")
    return args


def trainer_args(method: str, args: argparse.Namespace) -> list[str]:
    flags = MODELS[args.model][0] + METHODS[method]
    if args.speed_flags:
        speed = SPEED_FLAGS[2:] if method in NO_OVERLAP else SPEED_FLAGS
        flags += speed + (PIPELINE if "--quantized-gradients" in flags else [])
    return flags + shlex.split(args.extra_args) + ["--timing-log-level", "1",
                                                   "--no-barrier-with-level-1-timing"]


def results_stem(args: argparse.Namespace) -> str:
    """The model's results name; ``_peers`` appended when a method beyond the paper's runs,
    so that a run of the peers never replaces the paper's table."""
    stem = MODELS[args.model][2]
    return stem + "_peers" if report.is_peers(args.methods) else stem


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:
        result = json.loads(args.render.read_text())
        print(report.markdown(result))
        if args.write_results:
            paths = report.write(result, args.out_dir, result.get("stem", "simcluster"))
            print("wrote " + ", ".join(str(p) for p in paths))
        return 0
    problem = netns.missing_requirements()
    if problem:
        print(f"simcluster: {problem}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _interrupt)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="simcluster-"))
    pid = os.getpid()
    cluster = netns.Cluster(prefix=f"simc{pid % 100000}", subnet=pid % 250 + 1)
    port = 20000 + pid % 20000
    links, runs = [], []
    started, load_before = time.time(), os.getloadavg()[0]
    print(f"simcluster: 2 nodes x 2 ranks, {args.model} model, rates {' '.join(args.rates)}, "
          f"methods {' '.join(args.methods)}, {args.rounds} rounds; logs in {workdir}", flush=True)
    try:
        with cluster:
            for rate_text, rate in zip(args.rates, args.rate_bits):
                cluster.shape(rate)
                measured = measure_link(cluster, 3.0, port)
                port += 1
                links.append({"rate": rate_text, "configured_bits": rate,
                              "measured_bits": measured})
                print(f"link {rate_text}: measured {measured / 1e6:.0f} Mbit/s", flush=True)
                for rnd in range(args.rounds):
                    order = args.methods[rnd % len(args.methods):] + \
                        args.methods[:rnd % len(args.methods)]
                    for method in order:
                        result = launch.run(
                            cluster, method, trainer_args(method, args), warmup=args.warmup,
                            iters=args.iters, workdir=workdir / f"{rate_text}-{rnd}-{method}",
                            port=port, timeout=args.timeout)
                        port += 1
                        runs.append({"rate": rate_text, "round": rnd, **vars(result)})
                        print(f"  round {rnd} {method:9s} {result.median_s:7.3f} s/iter, link "
                              f"{statistics.mean(result.link_bytes_per_iter) / 1e6:6.2f} MB/iter"
                              f" per direction, load {result.load_average:.1f}", flush=True)
    except KeyboardInterrupt:
        print("simcluster: interrupted; namespaces removed, runs ended", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, subprocess.SubprocessError) as err:
        print(f"simcluster: {err}", file=sys.stderr)
        return 1
    result = report.summarize(links, runs, args.methods)
    result.update(command="sudo bash " + shlex.join(
        ["benchmarks/simcluster.sh", *(sys.argv[1:] if argv is None else argv)]),
        trainer_flags={m: trainer_args(m, args) for m in args.methods},
        model=MODELS[args.model][1], stem=results_stem(args),
        minutes=round((time.time() - started) / 60, 1), load_before=load_before,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **report.machine())
    print(report.markdown(result))
    if args.write_results:
        paths = report.write(result, args.out_dir, result["stem"])
        print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
