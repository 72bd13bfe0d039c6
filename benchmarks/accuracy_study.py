#!/usr/bin/env python
"""A noise-controlled accuracy study of SDP4Bit and its ablations: every method from the same
initialization and sample order, several stochastic-rounding seeds each, evaluated on one
held-out set.

    python -m benchmarks.accuracy_study                         # the CPU study (~1-2 h)
    python -m benchmarks.accuracy_study --methods baseline qWD --rounding-seeds 1 2 \\
        --train-iters 100 --eval-interval 50                    # a pilot
    python -m benchmarks.accuracy_study --from-runs runs/study  # summarize runs done elsewhere
    python -m benchmarks.accuracy_study ... --write-results     # also benchmarks/accuracy_study.*
    python -m benchmarks.accuracy_study --model moe --methods baseline SDP4Bit \\
        --train-iters 500 --write-results                       # benchmarks/accuracy_study_moe.*

Why. ``benchmarks/loss_curves.md`` trains each method once and reads differences of a few
tenths of a percent against a band made by changing ``--seed``, which changes the
initialization *and* the sample order: a 4% spread, far above the effects to be measured.
Here every run of a method shares the study's ``--seed`` (same initialization, same samples in
the same order) and differs only in ``--rounding-seed`` (the stochastic-rounding noise), so the
spread of a method's runs is the method's own noise, and its mean difference to the baseline
is the method's effect with a standard error. The baseline (no rounding, deterministic on
CPU) runs once at the study's seed (``ref``) and again at other ``--seed`` values (context:
the noise a single-seed comparison cannot separate from an effect), then splits that band:
at other ``--seed`` values with the study's seed as ``--train-data-seed`` (``init<S>``:
another initialization, the same sample order) and at the study's ``--seed`` with other
``--train-data-seed`` values (``order<S>``: the same initialization, another order). Every
run passes ``--eval-data-seed``, so the validation samples are the same for every run,
whatever its ``--seed`` or ``--train-data-seed`` (without it Megatron-LM shuffles the
validation split with ``--seed`` too); the split is by documents, so no validation token is
trained on (``tests/unit/test_accuracy_study.py`` checks both on the study's flags).

Methods (``METHODS``): the paper's Table 1 columns (baseline, qW, qWD, TLq, TLq-HS, SDP4Bit),
qWD with its other difference target (``qWD-rounded``: ``--weight-difference-target
rounded-main``, what the authors' code quantizes), ULq (4 bits on both gradient hops), and
SDP4Bit below 4 inter-node bits: with error feedback on the inter-node hop (``SDP4Bit-EF``),
with 2-bit inter-node gradients (``SDP4Bit-2bit``) and both (``SDP4Bit-2bit-EF``).

Rows measured earlier (``--carry-over FILE``, an ``accuracy_study.json``): methods and
baseline ``seed<S>`` runs that this study did not run join its summary from the record, if
this study's baseline ``ref`` run reproduces the record's bit for bit (every evaluation; the
baseline is deterministic on CPU), so new rows are added without training the old ones
again; the report names what was carried and from which record.

The CPU study's settings, and why. The budget (set for the first 24 runs, 3 baseline + 7
quantized methods x 3 rounding seeds): about 90 minutes on an idle 2-core machine at >= 1,000
iterations, i.e. under 4 minutes a run, ~0.2 s an iteration on 4 processes; the default
study is now 37 runs (7 baseline, 10 quantized methods x 3), about 1 to 2 hours at the 1.4
to 3.3 minutes a run of the 2026-11-26 runs (``accuracy_study.md`` records their time and
load). With GPT-2's
50,257-token vocabulary the output layer of a 64-wide model is 3.2 M of its 3.3 M parameters
and most of its time (``loss_curves.md``: ~1 s an iteration), so the study trains a
byte-level BPE of ``VOCAB_SIZE`` = 2,048 tokens on the default corpus (the King James Bible,
``tools/prepare_default_data.py``) with the ``tokenizers`` library and tokenizes the corpus
with it (``tools/preprocess_data.py``): the output layer shrinks 25x and the model's 2
transformer layers carry a fair share of its 0.24 M parameters and of the quantized traffic.
Model and schedule (``model_flags``): 2 layers, hidden 64, 4 heads, sequence 128, micro-batch
4, global batch 16, 1,000 iterations (2.0 M tokens; the corpus is 1.13 M tokens with this
vocabulary, so about 1.9 epochs of its training split),
lr 3e-3 cosine to 3e-4 after 20 warm-up iterations, Adam (0.9, 0.95), weight decay 0.1, clip
1.0, bf16, the distributed optimizer. 4 processes as 2 nodes x 2 (``--dp-ranks-per-node 2``),
so both gradient hops and the weight all-gather carry quantized traffic; gradient groups 128
on both hops, as the paper's scripts. Split 95,5,0 (about 56 k validation tokens); an
evaluation every 100 iterations over 20 batches (320 samples, 41 k tokens; the same samples
for every run at each evaluation). Measured on a shared 2-core machine (1-minute load 17 to
38): 0.15 s an iteration on average over baseline and qWD runs, and 40 to 80 s for a
100-iteration run with its ~25 s of start-up; so a 1,000-iteration run takes about 3 minutes
and the 24 runs about 75, within the budget with room for the evaluations.
``--train-iters`` and the seed lists scale the study up or down.

The MoE study (``--model moe``): the same model, data, schedule and design with every MLP a
MoE layer (``MOE_FLAGS``: 4 experts of the dense FFN size, top-2, the alltoall dispatcher,
expert parallelism 2, load-balancing loss 1e-2). On the 2 x 2 layout each expert
data-parallel group is one rank per node, so the expert gradients take SDP4Bit's 4-bit
inter-node hop alone (no 8-bit hop first): the case to measure. Its runs go to
``runs/accuracy_study_moe`` and its results to ``accuracy_study_moe.*``, beside the dense
study's.

Runs done elsewhere (``--from-runs DIR``): the same summary from ``DIR/<method>/<label>/``,
each holding a ``metrics.jsonl`` (or a console log) anywhere below it, as
``sample_scripts/accuracy/study.sbatch`` lays them out on a SLURM cluster at the paper's
scale (labels: ``ref``, ``rs<R>`` rounding seed, ``seed<S>`` other ``--seed``;
``benchmarks/accuracy_summary.py``).

Writes the summary (``accuracy_study.md``, ``.json``) and two pictures
(``accuracy_study_loss.png``: validation loss against tokens with each method's spread as a
band; ``accuracy_study_diff.png``: the final differences to the baseline with error bars) to
the run folder, and to ``benchmarks/`` only with ``--write-results``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from megatron.sdp4bit.training.cli.methods import METHOD_FLAGS

from benchmarks import accuracy_summary as summary_mod
from benchmarks import results

ROOT = Path(__file__).resolve().parents[1]

METHODS: dict[str, list[str]] = METHOD_FLAGS  # every method of the study

NPROC = 4
DP_RANKS_PER_NODE = 2
VOCAB_SIZE = 2048
EVAL_DATA_SEED = 4321  # any fixed value: the held-out samples of every run
DATA_VERSION = 1  # bump when the tokenizer training or the preprocessing changes
MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size",
             "2", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "1e-2"]
# --model: (flags added to model_flags', results file stem)
MODELS: dict[str, tuple[list[str], str]] = {
    "dense": ([], "accuracy_study"),
    "moe": (MOE_FLAGS, "accuracy_study_moe"),
}


def model_flags(train_iters: int, eval_interval: int, eval_iters: int, seed: int) -> list[str]:
    """The flags every run shares (see the module docstring for the choices)."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(train_iters),
        "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, train_iters // 50)),
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--weight-decay", "0.1",
        "--clip-grad", "1.0", "--bf16", "--seed", str(seed), "--split", "95,5,0",
        "--eval-data-seed", str(EVAL_DATA_SEED),
        "--use-distributed-optimizer", "--dp-ranks-per-node", str(DP_RANKS_PER_NODE),
        "--log-interval", "10", "--eval-interval", str(eval_interval),
        "--eval-iters", str(eval_iters),
    ]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare_data(cache: Path) -> list[str]:
    """The small-vocabulary corpus (built once, then reused): the default corpus's text, a
    byte-level BPE of VOCAB_SIZE tokens trained on it, and the tokenized ``.bin/.idx``.
    Returns the ``pretrain_gpt.py`` data flags."""
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_default_data.py"),
                          "--print-flags"], check=True, capture_output=True, text=True,
                         cwd=ROOT)
    flags = out.stdout.split()
    text = Path(flags[flags.index("--data-path") + 1]).parent / "kjv.jsonl"
    if not text.is_file():
        raise SystemExit(f"accuracy_study: {text} is missing after "
                         "tools/prepare_default_data.py: rerun it with --force")
    cache.mkdir(parents=True, exist_ok=True)
    vocab, merges, prefix = cache / "vocab.json", cache / "merges.txt", cache / "kjv"
    stamp_file = cache / "stamp.json"
    stamp = {"version": DATA_VERSION, "vocab_size": VOCAB_SIZE, "text_sha256": _sha256(text)}
    data = ["--data-path", f"{prefix}_text_document", "--vocab-file", str(vocab),
            "--merge-file", str(merges), "--tokenizer-type", "GPT2BPETokenizer",
            "--data-cache-path", str(cache / "index")]
    if stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return data
    stamp_file.unlink(missing_ok=True)  # an interrupted rebuild must not look finished
    # megatron-core names its cached sample indices by the corpus's path and the tokenizer
    # files' names, not their contents: indices of the old corpus would be read as the new
    # one's (samples cut at the old documents' lengths).
    shutil.rmtree(cache / "index", ignore_errors=True)
    from tokenizers import ByteLevelBPETokenizer

    def documents():
        with open(text, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    print(f"accuracy_study: training a {VOCAB_SIZE}-token byte-level BPE on {text}",
          flush=True)
    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(documents(), vocab_size=VOCAB_SIZE, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(cache))  # vocab.json, merges.txt: GPT2BPETokenizer's files
    subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"),
                    "--input", str(text), "--output-prefix", str(prefix),
                    "--json-keys", "text", "--tokenizer-type", "GPT2BPETokenizer",
                    "--vocab-file", str(vocab), "--merge-file", str(merges), "--append-eod",
                    "--workers", "1", "--log-interval", "100000", "--overwrite"],  # a stale pair
                   check=True, cwd=ROOT)
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")
    return data


def plan(methods: list[str], rounding_seeds: list[int], seeds: list[int], seed: int,
         init_seeds: Sequence[int] = (), order_seeds: Sequence[int] = ()
         ) -> list[tuple[str, str, list[str]]]:
    """(method, label, extra flags) of every run: the baseline once at ``seed`` (``ref``), at
    each of ``seeds``, at each of ``init_seeds`` with ``seed``'s training order and at
    ``seed`` with each of ``order_seeds``' training order; every other method once per
    rounding seed."""
    runs = []
    for method in methods:
        if method == "baseline":
            runs.append((method, "ref", []))
            runs += [(method, f"seed{s}", ["--seed", str(s)]) for s in seeds]
            runs += [(method, f"init{s}", ["--seed", str(s), "--train-data-seed", str(seed)])
                     for s in init_seeds]
            runs += [(method, f"order{s}", ["--train-data-seed", str(s)]) for s in order_seeds]
        else:
            runs += [(method, f"rs{r}", ["--rounding-seed", str(r)]) for r in rounding_seeds]
    return runs


def finished(metrics: Path, train_iters: int) -> bool:
    """Whether ``metrics`` holds a run's last evaluation (so a rerun of the study skips it)."""
    if not metrics.is_file():
        return False
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return any(r.get("iteration") == train_iters and "val_lm_loss" in r for r in lines)


RUN_RECORD = "run.json"  # a run's wall time and the load around it, beside its metrics


def run_one(cmd: list[str], folder: Path) -> float:
    """Trains one run into ``folder`` and records its wall time and the 1-minute load average
    before and after it (``RUN_RECORD``), so that a later study keeping the run reports
    them; returns the seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)  # the trainer appends: start clean
    (folder / RUN_RECORD).unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    load_before, start = os.getloadavg()[0], time.monotonic()
    with open(folder / "train.log", "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"accuracy_study: a run failed (exit {proc.returncode}); see "
                         f"{folder / 'train.log'}")
    seconds = time.monotonic() - start
    (folder / RUN_RECORD).write_text(json.dumps(
        {"seconds": seconds, "load_average": [load_before, os.getloadavg()[0]]}) + "\n")
    return seconds


def run_records(folders: dict[str, Path]) -> dict[str, dict]:
    """``{name: RUN_RECORD's contents}`` of the folders that hold one."""
    return {name: json.loads((f / RUN_RECORD).read_text()) for name, f in folders.items()
            if (f / RUN_RECORD).is_file()}


def machine() -> dict:
    import torch
    from importlib.metadata import version

    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass  # not Linux: the architecture stands
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "megatron_core": version("megatron-core")}


def report(study_dir: Path, out_dirs: list[Path], meta: dict,
           tokens_per_iteration: int | None = None, stem: str = "accuracy_study",
           carry: dict | None = None) -> dict:
    """Summarize ``study_dir`` (with the rows ``carry``, an earlier record, adds) and write
    <stem>.{md,json} and the two pictures (<stem>_loss.png, <stem>_diff.png) into every
    folder of ``out_dirs``; returns the record."""
    summary = summary_mod.summarize(summary_mod.read_study(study_dir, tokens_per_iteration),
                                    carry=carry)
    record = {**meta, "summary": summary}
    text = render(record, stem)
    for out in out_dirs:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
        (out / f"{stem}.md").write_text(text)
        summary_mod.plot(summary, out / f"{stem}_loss.png", out / f"{stem}_diff.png")
    print(text)
    return record


def carried_methods(carry: dict, ran: list[str]) -> dict[str, list[str]]:
    """The flags of the methods a study carries from the record ``carry``: the record's own
    and those it carried itself, but the methods the study ran (``ran``)."""
    return {m: f for m, f in {**carry.get("carried_methods", {}),
                              **carry.get("methods", {})}.items() if m not in ran}


def render(record: dict, stem: str = "accuracy_study") -> str:
    moe = stem == MODELS["moe"][1]
    header = ["# Accuracy study" + (" (mixture of experts, `--model moe`)" if moe else "")
              + ": each method over rounding seeds, from one initialization", "",
              "Made by `benchmarks/accuracy_study.py` (its docstring has the design"
              + (f"; the MoE layers: `{' '.join(MOE_FLAGS)}`" if moe else "") + "). "
              f"Pictures: `{stem}_loss.png`, `{stem}_diff.png`.", "",
              f"- command: `{record['command']}`"]
    if record.get("machine"):
        m = record["machine"]
        header.append(f"- machine: {m['cpu']}, {m['cores']} cores; python {m['python']}, "
                      f"torch {m['torch']}, megatron-core {m['megatron_core']}")
    if record.get("load_average"):
        header.append(f"- 1-minute load average before / after the command: "
                      f"{record['load_average'][0]:.1f} / {record['load_average'][1]:.1f}")
    header.append(f"- date: {record['date']}")
    if record.get("example_run"):
        header.append(f"- a run (the baseline): `{record['example_run']}`")
    if record.get("seconds"):
        total = sum(record["seconds"].values())
        header.append(f"- wall time: {total / 60:.0f} min for {len(record['seconds'])} runs")
    loads = [x for r in (record.get("runs") or {}).values() for x in r["load_average"]]
    if loads:
        header.append(f"- the runs' wall time and load (each run's `{RUN_RECORD}`): "
                      f"{sum(r['seconds'] for r in record['runs'].values()) / 60:.0f} min for "
                      f"{len(record['runs'])} runs, 1-minute load average {min(loads):.1f} to "
                      f"{max(loads):.1f} at their starts and ends")
    carried, by = record["summary"].get("carried"), "this study"
    while carried:  # the record carried from, then the one that record carried from, ...
        was = carried.get("machine") or {}
        load = carried.get("load_average") or [float("nan")] * 2
        header.append(f"- carried over (`--carry-over`) by {by} from the record of "
                      f"{carried['date']} (`{carried['command']}`; "
                      f"{was.get('cpu', 'machine unrecorded')}, {was.get('cores', '?')} "
                      f"cores, torch {was.get('torch', '?')}; load {load[0]:.1f} / "
                      f"{load[1]:.1f}), whose baseline `ref` run {by} reproduced bit for bit: "
                      f"{', '.join(carried['names'])}")
        carried, by = carried.get("earlier"), f"the record of {carried['date']}"
    if record.get("methods"):
        header += ["", "| method | flags (added to the common ones) |", "|---|---|"]
        header += [f"| {k} | `{' '.join(v) or '(none)'}` |" for k, v in
                   {**record["methods"], **record.get("carried_methods", {})}.items()]
    return summary_mod.render(record["summary"], header)


def main(argv: list[str] | None = None) -> int:
    cli = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS),
                        help="methods to run (default: all); the baseline is needed for "
                        "the differences")
    parser.add_argument("--rounding-seeds", nargs="+", type=int, default=[1, 2, 3],
                        metavar="R", help="--rounding-seed of each quantized method's runs")
    parser.add_argument("--seeds", nargs="*", type=int, default=[1235, 1236], metavar="S",
                        help="other --seed values for the baseline (the seed band; none: "
                        "no band)")
    parser.add_argument("--init-seeds", nargs="*", type=int, default=[1235, 1236],
                        metavar="S", help="--seed values for the baseline with the study's "
                        "sample order (--train-data-seed = --seed): the initialization's share "
                        "of the seed band (none: not run)")
    parser.add_argument("--order-seeds", nargs="*", type=int, default=[1235, 1236],
                        metavar="S", help="--train-data-seed values for the baseline at the "
                        "study's --seed: the sample order's share of the seed band (none: not "
                        "run)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="the study's --seed: every method's initialization and order")
    parser.add_argument("--model", choices=list(MODELS), default="dense",
                        help="dense: the study's GPT; moe: the same with MoE layers "
                        "(4 experts, top-2, expert parallelism 2; runs in "
                        "runs/accuracy_study_moe, results in accuracy_study_moe.*)")
    parser.add_argument("--train-iters", type=int, default=1000)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=20)
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="one folder per run, <method>/<label>/, and the summary "
                        "(default: runs/accuracy_study, or runs/accuracy_study_moe)")
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data" / "cache" / "study",
                        help="the small-vocabulary corpus (built on first use)")
    parser.add_argument("--rerun", action="store_true",
                        help="train every run again (default: keep finished runs)")
    parser.add_argument("--from-runs", type=Path, metavar="DIR",
                        help="do not train: summarize DIR/<method>/<label>/ (runs done "
                        "elsewhere, e.g. sample_scripts/accuracy/study.sbatch)")
    parser.add_argument("--tokens-per-iteration", type=int, default=None,
                        help="with --from-runs, for runs that left a console log only "
                        "(global batch x sequence length)")
    parser.add_argument("--carry-over", type=Path, metavar="FILE",
                        help="an earlier accuracy_study.json: its methods and baseline seed<S> "
                        "runs that this study lacks join the summary, if this study's "
                        "baseline ref run reproduces the record's exactly")
    parser.add_argument("--write-results", action="store_true",
                        help="also write benchmarks/accuracy_study.{md,json} and the pictures "
                        "(--model moe: accuracy_study_moe.*)")
    args = parser.parse_args(cli)
    model_extra, stem = MODELS[args.model]
    args.run_dir = args.run_dir or ROOT / "runs" / stem
    outs = [ROOT / "benchmarks"] if args.write_results else []
    base_meta = results.header(__file__, cli, "", os.getloadavg()[0])
    base_meta["command"] = "python -m benchmarks.accuracy_study " + " ".join(cli)
    carry = None
    if args.carry_over:
        try:
            carry = json.loads(args.carry_over.read_text())
        except (OSError, ValueError) as err:
            parser.error(f"--carry-over {args.carry_over}: not a readable accuracy_study.json "
                         f"({err})")
        if not isinstance(carry, dict) or "methods" not in carry.get("summary", {}):
            parser.error(f"--carry-over {args.carry_over}: not an accuracy_study.json record "
                         "(no summary of methods in it)")
    try:
        if args.from_runs:
            meta = {**base_meta, "machine": None, "load_average": None}
            report(args.from_runs, [args.from_runs, *outs], meta, args.tokens_per_iteration,
                   stem, carry)
            return 0
        if args.train_iters % args.eval_interval:
            parser.error(f"--train-iters {args.train_iters} is not a multiple of "
                         f"--eval-interval {args.eval_interval}: the last evaluation would not "
                         "be at the end")
        if "baseline" not in args.methods:
            parser.error("--methods needs the baseline: differences are taken against it")
        for name in ("seeds", "init_seeds", "order_seeds"):
            if args.seed in getattr(args, name):
                parser.error(f"--{name.replace('_', '-')}: {args.seed} is --seed itself (the "
                             "baseline's ref run)")
        data = prepare_data(args.data_dir)
        runs = plan(args.methods, args.rounding_seeds, args.seeds, args.seed, args.init_seeds,
                    args.order_seeds)
        common = model_flags(args.train_iters, args.eval_interval, args.eval_iters,
                             args.seed) + model_extra
        seconds: dict[str, float] = {}
        folders: dict[str, Path] = {}
        example = ""
        for k, (method, label, extra) in enumerate(runs, start=1):
            folder = args.run_dir / method / label
            folders[f"{method}/{label}"] = folder
            cmd = ["torchrun", "--standalone", "--nproc-per-node", str(NPROC), "pretrain_gpt.py",
                   *common, *data, *METHODS[method], *extra,
                   "--metrics-jsonl", str(folder / "metrics.jsonl")]
            example = example or " ".join(cmd).replace(f"{ROOT}/", "")
            if not args.rerun and finished(folder / "metrics.jsonl", args.train_iters):
                print(f"== run {k}/{len(runs)}, {method}/{label}: finished before, kept",
                      flush=True)
                continue
            print(f"== run {k}/{len(runs)}, {method}/{label}", flush=True)
            seconds[f"{method}/{label}"] = run_one(cmd, folder)
            print(f"   {seconds[f'{method}/{label}']:.0f} s", flush=True)
        meta = {**base_meta, "machine": machine(), "load_average": [
                    base_meta["load_average"][0], os.getloadavg()[0]],
                "seconds": seconds, "runs": run_records(folders), "example_run": example,
                "methods": {m: METHODS[m] for m in args.methods},
                **({"carried_methods": carried_methods(carry, args.methods)}
                   if carry else {}),
                "settings": {"train_iters": args.train_iters, "eval_interval": args.eval_interval,
                             "eval_iters": args.eval_iters, "seed": args.seed,
                             "rounding_seeds": args.rounding_seeds, "seeds": args.seeds,
                             "init_seeds": args.init_seeds, "order_seeds": args.order_seeds,
                             "vocab_size": VOCAB_SIZE, "eval_data_seed": EVAL_DATA_SEED,
                             "model": args.model, "model_flags": model_extra}}
        report(args.run_dir, [args.run_dir, *outs], meta, stem=stem, carry=carry)
    except summary_mod.StudyError as err:
        print(f"accuracy_study: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
