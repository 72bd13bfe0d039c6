#!/usr/bin/env python
"""Mutation testing of SDP4Bit's numerics and seams: inject named bugs, check the tests catch them.

Each mutation below is a realistic bug (a wrong seed, a dropped factor, a 32-bit offset, a
biased rounding...) written as exact text edits of the source, and names the test files (or
test ids) expected to catch it. For every mutation the tool applies the edits, runs each
named target with ``pytest -x`` (as ``dev/run_tests.sh`` does: ``TRITON_INTERPRET=1``,
and a private cache for the CPU kernels, which rebuild from the mutated C source), restores
the files, and reports per target whether it failed ("caught"), passed ("SURVIVED") or hit
a timeout. Before the mutations it runs every target once unmutated: a target that already
fails proves nothing, so the tool stops there.

    python -m dev.mutate --list                    # the mutations and their targets
    python -m dev.mutate                           # all of them (about 7 minutes on 2 cores)
    python -m dev.mutate --only seed-without-iteration grad-scaling-factor-dropped
    python -m dev.mutate --write-results           # also record the table in docs/testing.md

It refuses to start when a file it mutates has uncommitted changes (so that ``git checkout``
can always restore it), and restores every file on success, failure or Ctrl-C. It is not
part of CI (``dev/run_tests.sh`` never runs it): it takes far longer than the suite.
Run it on a quiet machine; the distributed tests have timeouts that heavy load can reach.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "megatron/sdp4bit"
DOC = ROOT / "docs" / "testing.md"
BEGIN, END = "<!-- mutate:begin -->", "<!-- mutate:end -->"

U, D, I = "tests/unit/", "tests/distributed/", "tests/distributed/test_integration_exact.py"
EXACT = I + "::test_synced_gradients_and_replicas_match_megatron_core"
TIED = I + "::test_tied_embeddings_stay_bitwise_tied_under_pp"
EVAL_RESUME = "tests/e2e/test_pretrain_gpt.py::test_sdp4bit_resume_matches_uninterrupted"


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str
    count: int = 1  # the exact number of occurrences ``old`` must have


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[Edit, ...]
    targets: tuple[str, ...]


def _m(name: str, what: str, edits: list[Edit], targets: list[str]) -> Mutation:
    return Mutation(name, what, tuple(edits), tuple(targets))


RS, AG = f"{PKG}/comm/reduce_scatter.py", f"{PKG}/comm/all_gather.py"
STATE, PSYNC = f"{PKG}/integration/state.py", f"{PKG}/integration/param_sync.py"
TPDUP = f"{PKG}/integration/tp_duplicates.py"
STEPCHK, INSTALL = f"{PKG}/integration/step_checks.py", f"{PKG}/integration/install.py"
MOE4 = D + "test_integration_moe.py::test_moe_four_ranks_both_dispatchers"
TP2 = D + "test_integration_sdp4bit.py::test_sdp4bit_methods_train_close_to_baseline[tp2xdp2]"
REF, TC, CK = (f"{PKG}/quantization/reference.py", f"{PKG}/quantization/triton_common.py",
               f"{PKG}/quantization/cpu_kernels.c")
SEED_PARTS = "parts = (self.config.seed, iteration, bucket_id, kind, group_id)"
BIAS = {
    "reference": Edit(REF, "u = uniform(seed, stream_start, x.numel(), x.device).view(x.shape)",
                      "u = 0.95 * uniform(seed, stream_start, x.numel(), x.device).view(x.shape)"),
    "triton": Edit(TC, "u = uniform_tile(start, k0, k1, x.shape[1])",
                   "u = 0.95 * uniform_tile(start, k0, k1, x.shape[1])"),
    "cpu": Edit(CK, "return (float)(2u * m + 1u) * 0x1p-17f;",
                "return (float)(2u * m + 1u) * 0x1p-17f * 0.95f;"),
}

MUTATIONS = [
    # --- the review's five surviving bugs
    _m("grad-seed-same-on-every-rank",
       "the gradient reduce-scatter's seeds miss the DP rank",
       [Edit(RS, "seed=derive_seed(seed, HOP_INTRA, 0, topo.rank)",
             "seed=derive_seed(seed, HOP_INTRA, 0, 0)", count=2),
        Edit(RS, "inter_seed = derive_seed(seed, HOP_INTER, i, topo.rank)",
             "inter_seed = derive_seed(seed, HOP_INTER, i, 0)")],
       [D + "test_rounding_noise.py", EXACT]),
    _m("seed-without-iteration", "the iteration is left out of every seed",
       [Edit(STATE, SEED_PARTS, SEED_PARTS.replace("seed, iteration", "seed, 0"))], [EXACT]),
    _m("grad-scaling-factor-dropped", "megatron-core's gradient_scaling_factor (1/DP) is skipped",
       [Edit(f"{PKG}/integration/grad_sync.py",
             "bucket.grad_data *= bucket.gradient_scaling_factor", "pass")], [EXACT]),
    _m("qwd-diff-against-previous-main",
       "qWD sends main - previous main instead of main - replica (the error accumulates)",
       [Edit(AG, "HOP_PARAM = 2  # distinct from the gradient hops' seeds\n",
             "HOP_PARAM = 2  # distinct from the gradient hops' seeds\n_PREVIOUS = {}\n"),
        Edit(AG, "    with timed(stats, \"params-quantize\", replica.device):\n"
                 "        target = main_shard.view(-1)\n",
             "    base = _PREVIOUS.get(replica.data_ptr(),\n"
             "                         replica[rank * shard:(rank + 1) * shard].float())\n"
             "    _PREVIOUS[replica.data_ptr()] = main_shard.detach().float().clone()\n"
             "    with timed(stats, \"params-quantize\", replica.device):\n"
             "        target = main_shard.view(-1)\n"),
        Edit(AG, "        ops.qwd_sender(target,\n"
                 "                       replica[rank * shard:(rank + 1) * shard] if diff else None,",
             "        ops.qwd_sender(target,\n"
             "                       base if diff else None,")],
       [D + "test_comm_all_gather.py", EXACT]),
    _m("qwd-rounded-target-ignored",
       "--weight-difference-target rounded-main parsed but the fp32 main weights still sent",
       [Edit(AG, 'if diff and config.target == "rounded-main":', "if False:")],
       [D + "test_comm_all_gather.py"]),
    _m("rounding-bias-0.95u", "stochastic rounding with 0.95 u in all three backends",
       list(BIAS.values()),
       [U + "test_rounding_statistics.py", D + "test_rounding_noise.py", EXACT]),
    # --- bias in one backend only: bit-exactness against the reference, and the statistics
    _m("rounding-bias-cpu-kernels", "0.95 u in the compiled CPU kernels only", [BIAS["cpu"]],
       [U + "test_cpu_kernels.py", U + "test_rounding_statistics.py"]),
    _m("rounding-bias-reference", "0.95 u in the torch references only", [BIAS["reference"]],
       [U + "test_rounding_statistics.py", U + "test_cpu_kernels.py"]),
    _m("rounding-bias-triton", "0.95 u in the Triton kernels only", [BIAS["triton"]],
       [U + "test_triton_kernels.py"]),
    # --- more seeds: each must keep two streams apart
    _m("hop-seed-shared", "both hops of the reduce-scatter draw the same stream",
       [Edit(RS, "HOP_INTER = 1", "HOP_INTER = 0")], [D + "test_rounding_noise.py"]),
    _m("slice-seed-shared", "the pipeline slices' requantizations draw the same stream",
       [Edit(RS, "inter_seed = derive_seed(seed, HOP_INTER, i, topo.rank)",
             "inter_seed = derive_seed(seed, HOP_INTER, 0, topo.rank)")], [D + "test_rounding_noise.py"]),
    _m("bucket-seed-shared", "the bucket id is left out of every seed",
       [Edit(STATE, SEED_PARTS, SEED_PARTS.replace("bucket_id,", "0,"))], [EXACT]),
    _m("grad-and-param-noise-shared", "gradients and weights of a bucket draw the same stream",
       [Edit(STATE, "KIND_PARAM = 1", "KIND_PARAM = 0"),
        Edit(AG, "HOP_PARAM = 2", "HOP_PARAM = 0")], [EXACT]),
    _m("param-seed-of-the-sync-not-the-step",
       "a qWD all-gather draws the noise of the iteration it runs in, not of the step it sends",
       [Edit(PSYNC, "state.seed(KIND_PARAM, bucket_id, group_id, step) if",
             "state.seed(KIND_PARAM, bucket_id, group_id) if")], [EVAL_RESUME]),
    _m("tied-embedding-seed-per-stage",
       "the stages' copies of a tied embedding get independent qWD noise",
       [Edit(PSYNC, "seed = (state.seed(KIND_PARAM, bucket_id, group_id, step) if tied_key is None\n"
                    "                    else state.seed(KIND_TIED_PARAM, 0, tied_key, step))",
             "seed = state.seed(KIND_PARAM, bucket_id, group_id, step)")], [TIED]),
    # --- offsets, placement, configuration, backend choice
    _m("triton-int32-message-offsets", "k * msg_nbytes in int32 in the Triton kernels",
       [Edit(f"{PKG}/quantization/triton_tlq.py", "base = tl.cast(k, tl.int64) * msg_nbytes",
             "base = k * msg_nbytes")], [U + "test_triton_compile.py"]),
    _m("c-int32-message-offsets", "a 32-bit message offset in the CPU kernels",
       [Edit(CK, "for (int64_t k = 0; k < count; k++) {\n"
                 "        const uint8_t *msg = wire + k * msg_nbytes;",
             "for (int k = 0; k < count; k++) {\n"
             "        const uint8_t *msg = wire + (int)(k * msg_nbytes);")],
       [U + "test_kernel_offsets.py"]),
    _m("placement-unchecked-with-override",
       "ranks_per_node skips the placement check",
       [Edit(f"{PKG}/comm/topology.py", "error = _override_error(ranks, hosts, override)",
             "error = None")],
       [U + "test_comm_config.py", D + "test_topology_placement.py"]),
    _m("group-nesting-unchecked", "intra/inter group sizes that do not divide pass",
       [Edit(f"{PKG}/config.py", "if intra % inter and inter % intra:", "if False:")],
       [U + "training/cli/test_arguments.py"]),
    _m("rng-unchunked-off-cpu", "the references' hash scratch is the whole tensor on CUDA",
       [Edit(f"{PKG}/quantization/rng.py", "    chunk = min(chunk_pairs(device), end - first)\n",
             "    chunk = end - first if torch.device(device).type == \"cuda\" else _CHUNK\n")],
       [U + "test_kernel_backend.py"]),
    _m("silent-reference-on-cuda", "auto falls back to the references on CUDA without triton",
       [Edit(f"{PKG}/quantization/backend.py", "            if not triton_available():\n",
             "            if not triton_available():\n                return KernelBackend.TORCH\n")],
       [U + "test_kernel_backend.py"]),
    # --- numerics and seams of the collectives
    _m("avg-scale-dropped", "ReduceOp.AVG forgets to divide by the DP size",
       [Edit(RS, "scale = 1.0 / topology.world if op == ReduceOp.AVG else 1.0", "scale = 1.0")],
       [D + "test_comm_reduce_scatter.py", EXACT]),
    _m("inverse-hadamard-skipped", "the receiver leaves the sum in the Hadamard domain",
       [Edit(RS, "hadamard_block=config.hadamard_block, scale=scale,",
             "hadamard_block=0, scale=scale,", count=2)], [D + "test_comm_reduce_scatter.py"]),
    _m("inter-hop-group-size-swapped", "the requantization uses the intra hop's group size",
       [Edit(RS, "group_size_out=config.inter_group_size,", "group_size_out=config.intra_group_size,")],
       [D + "test_comm_reduce_scatter.py"]),
    _m("main-shard-placed-by-buffer-offset",
       "main weights placed by their offset in the whole buffer, not in the bucket",
       [Edit(PSYNC, '["gbuf_world_in_bucket"]', '["gbuf_world"]')], [EXACT]),
    _m("main-to-model-copy-kept", "the optimizer's own copy still writes the replica shard",
       [Edit(PSYNC, 'assert not any(self.model_fp32_groups), "qWD installed with fp32 model params"',
             "type(self)._copy_main_params_to_model_params(self)")], [EXACT]),
    _m("scale-over-qmax-plus-one", "the group scale divides absmax by qmax + 1 (all backends)",
       [Edit(REF, "absmax / qm,", "absmax / (qm + 1),"),
        Edit(CK, "bits_to_f32(m) / fqm;", "bits_to_f32(m) / (fqm + 1.0f);"),
        Edit(TC, "tl.full(mag.shape, QMAX, tl.float32)", "tl.full(mag.shape, QMAX + 1, tl.float32)")],
       [U + "test_quantization.py", U + "test_rounding_statistics.py"]),
    _m("reference-sum-order-reversed", "the reference sums incoming messages in reverse order",
       [Edit(REF, "    for row in values:\n", "    for row in values.flip(0):\n")],
       [U + "test_cpu_kernels.py", U + "test_triton_kernels.py"]),
    _m("c-stream-index-restarts-per-message",
       "the CPU sender restarts the random stream in every message",
       [Edit(CK, "(uint32_t)(m * msg_numel + g * G)", "(uint32_t)(g * G)")],
       [U + "test_cpu_kernels.py", D + "test_rounding_noise.py"]),
    _m("tp-duplicate-gradients-not-synced",
       "the TP ranks' duplicated gradients are left as each DP group reduced them",
       [Edit(STEPCHK, "            duplicates.sync_gradients(shards)\n", "            pass\n")],
       [TP2]),
    _m("step-check-blind-to-unreduced-buckets",
       "the optimizer step finds every bucket reduced, whatever the hook did",
       [Edit(STEPCHK, "if state.grad_syncs_since_step[bucket_id] == 0]",
             "if state.grad_syncs_since_step[bucket_id] < 0]")], [MOE4]),
    _m("sync-without-a-step-sends-again",
       "a parameter sync with no optimizer step since the last one sends the residual again "
       "(an evaluation, a save, the second optimizer of a chain)",
       [Edit(PSYNC, "            return  # [Note: a parameter sync sends each step once]",
             "            due = [state.iteration]")], [EXACT, MOE4]),
    _m("expert-bytes-counted-as-dense",
       "the expert buckets' bytes go to the dense counters only",
       [Edit(INSTALL, "stats = state.expert_stats if bg in expert_groups else state.stats",
             "stats = state.stats")], [MOE4]),
    _m("tp-duplicate-weights-not-synced",
       "the TP ranks' duplicated weights are left as each all-gather wrote them",
       [Edit(TPDUP, "            _broadcast_elements(param_data, offsets, self.src, self.group)",
             "            pass")],
       [TP2, "tests/e2e/test_pretrain_gpt.py::test_sdp4bit_under_model_parallelism[TP2-SP]"]),
    _m("tp-duplicate-offsets-in-buffer",
       "duplicated elements located by their offset in the buffer, not in the bucket",
       [Edit(TPDUP, "torch.arange(start - bucket.offset, end - bucket.offset)",
             "torch.arange(start, end)")], [TP2]),
    # --- the batch-size ramp-up: one micro-batch count for the schedule, the data and the LR
    _m("rampup-final-micro-batch-count",
       "during a --rampup-batch-size the loop runs --global-batch-size's micro-batches",
       [Edit(f"{PKG}/training/loop.py", "                                                        "
             "num_microbatches)", "                                                        "
             "args.num_microbatches)")],
       [U + "training/test_batch_rampup.py",
        "tests/e2e/test_pretrain_gpt.py::test_sdp4bit_resume_matches_uninterrupted"]),
    _m("rampup-schedule-steps-by-final-batch",
       "the learning-rate schedule advances by --global-batch-size during a ramp-up",
       [Edit(f"{PKG}/training/step.py",
             "increment=num_microbatches * args.micro_batch_size * args.data_parallel_size)",
             "increment=args.global_batch_size)")],
       [U + "training/test_batch_rampup.py",
        "tests/e2e/test_pretrain_gpt.py::test_sdp4bit_resume_matches_uninterrupted"]),
]


def _apply(edits: tuple[Edit, ...]) -> dict[Path, str]:
    """Apply the edits; returns the original text of every touched file."""
    originals: dict[Path, str] = {}
    texts: dict[Path, str] = {}
    for edit in edits:
        path = ROOT / edit.path
        if path not in texts:
            originals[path] = texts[path] = path.read_text()
        found = texts[path].count(edit.old)
        if found != edit.count:
            raise SystemExit(f"mutate.py: {edit.path}: expected {edit.count} occurrence(s) of "
                             f"{edit.old!r}, found {found}: update the mutation to the source")
        texts[path] = texts[path].replace(edit.old, edit.new)
    for path, text in texts.items():
        path.write_text(text)
    return originals


def _restore(originals: dict[Path, str]) -> None:
    for path, text in originals.items():
        path.write_text(text)


def _run_target(target: str, env: dict[str, str], timeout: int) -> tuple[str, float, str]:
    """(status, seconds, evidence): 'caught' (tests failed), 'error' (pytest could not run
    them), 'SURVIVED' (passed) or 'timeout'; evidence = the first failing test and line."""
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", target]
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.time() - start, f"no result after {timeout} s"
    seconds = time.time() - start
    out = done.stdout + done.stderr
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    # the first exception message (for spawned ranks, the failing rank's own one)
    lines = [line[1:].strip() for line in out.splitlines() if line.startswith("E ")]
    raised = [e for e in lines if re.match(r"^[\w.]+(Error|Exception): ", e)
              and not e.startswith("RuntimeError: rank")]
    reason = (raised or [e for e in lines if "assert" in e] or [""])[0]
    evidence = (failed[0].split("::")[-1] if failed else "") + (f": {reason}" if reason else "")
    if done.returncode == 0:
        return "SURVIVED", seconds, ""
    if re.search(r"^E\s+RuntimeError: timed out after \d+ s waiting for ranks", out, re.M):
        return "timeout", seconds, evidence[:200]
    return ("caught" if done.returncode == 1 else "error"), seconds, evidence[:200]


def _check_clean(paths: set[str]) -> None:
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *sorted(paths)], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        raise SystemExit("mutate.py: these files have uncommitted changes, commit or stash "
                         f"them first (the tool rewrites and restores them):\n{dirty}")


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores, Python "
            f"{platform.python_version()}, load average {load:.1f} at the start")


def _table(rows: list[tuple[Mutation, list[tuple[str, str, float, str]]]]) -> str:
    lines = ["| mutation | what | target | result | time | first failure |",
             "|---|---|---|---|---|---|"]
    for mutation, results in rows:
        for i, (target, status, seconds, evidence) in enumerate(results):
            name, what = (f"`{mutation.name}`", mutation.what) if i == 0 else ("", "")
            short = target.replace("tests/", "").replace("test_integration_exact.py::", "exact::")
            evidence = evidence.replace("|", "\\|")
            lines.append(f"| {name} | {what} | `{short}` | {status} | {seconds:.0f} s | "
                         f"{evidence} |")
    return "\n".join(lines)


def _write_results(table: str, header: str) -> None:
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"mutate.py: {DOC} lacks the {BEGIN} / {END} markers")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{BEGIN}\n{header}\n\n{table}\n{END}{after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the targets")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per target run")
    parser.add_argument("--write-results", action="store_true",
                        help=f"record the table in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    names = {m.name for m in MUTATIONS}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}: see --list")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what}\n    targets: {', '.join(m.targets)}")
        return 0
    _check_clean({e.path for m in chosen for e in m.edits})
    env = dict(os.environ, TRITON_INTERPRET="1",
               SDP4BIT_CACHE_DIR=tempfile.mkdtemp(prefix="sdp4bit-mutate-"))
    started = datetime.datetime.now().isoformat(timespec="minutes")
    machine = _machine()
    t0 = time.time()
    if not args.no_baseline:
        for target in sorted({t for m in chosen for t in m.targets}):
            status, seconds, evidence = _run_target(target, env, args.timeout)
            print(f"baseline {target}: {'passed' if status == 'SURVIVED' else status} "
                  f"({seconds:.0f} s) {evidence}", flush=True)
            if status != "SURVIVED":
                raise SystemExit("mutate.py: a target fails without any mutation; fix it first")
    rows = []
    for mutation in chosen:
        originals = _apply(mutation.edits)
        try:
            results = []
            for target in mutation.targets:
                status, seconds, evidence = _run_target(target, env, args.timeout)
                results.append((target, status, seconds, evidence))
                print(f"{mutation.name} / {target}: {status} ({seconds:.0f} s) {evidence}",
                      flush=True)
        finally:
            _restore(originals)
        rows.append((mutation, results))
    table = _table(rows)
    print(table)
    survived = [m.name for m, results in rows if any(r[1] != "caught" for r in results)]
    header = (f"Measured {started} with `python -m dev.mutate"
              f"{' --only ' + ' '.join(args.only) if args.only else ''}` on {machine}; "
              f"{len(rows)} mutations, {time.time() - t0:.0f} s in all"
              f"{'' if args.no_baseline else ', after an unmutated baseline run of every target'}.")
    if args.write_results:
        _write_results(table, header)
        print(f"wrote {DOC.relative_to(ROOT)}")
    if survived:
        print(f"not caught by every target: {', '.join(survived)}")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
