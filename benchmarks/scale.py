"""The paper's model sizes, on paper: per-GPU buffers, messages and bytes per step, no GPU.

For each model of the paper's Table 2 (GPT 1.3B, 6.7B, 13B with the speed scripts' TP/PP)
and each data-parallel size W (16, 64, 1024, and the paper's 16 nodes), this builds in ONE
process the real megatron-core model chunk of a rank (GPTModel, Float16Module, megatron-core
DDP and the distributed optimizer, as ``training/model.py`` builds them) under
``FakeTensorMode``, so no tensor takes memory, inside a fake world of W x TP x PP ranks (a
process group that only knows its rank and size: nothing is ever sent). It is built twice:
as the baseline lays its buckets out, and inside ``sdp4bit_padding`` as SDP4Bit does. It then
reads off the buckets, sizes SDP4Bit's wire buffers with the comm layer's own functions
(``reduce_scatter.hops``, ``format.message_nbytes``), counts bytes per step with the
project's accounting (``CommStats``, ``integration.accounting``), and evaluates a stated
*model* of step time against link bandwidth next to the paper's Table 2.

    python -m benchmarks.scale                  # prints the report (a few minutes)
    python -m benchmarks.scale --write-results  # also benchmarks/scale.{md,json}
    python -m benchmarks.scale --models 1.3B --worlds 16 --cluster a100   # one case
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (layers, hidden, heads): sample_scripts/common.sh's model cards.
MODELS = {"1.3B": (24, 2048, 16), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40)}
# Per cluster: GPUs per node, (TP, PP) per model as sample_scripts/common.sh's speed_args,
# nominal links (inter-node: per node, one direction; intra-node: per GPU, one direction)
# and the dense bf16 peak per GPU.
CLUSTERS = {
    "a100": dict(gpus_per_node=4, tp_pp={"1.3B": (1, 1), "6.7B": (4, 1), "13B": (4, 2)},
                 inter_gbps=100.0, intra_gbyte_s=300.0, peak_tflops=312.0,
                 what="4 x A100-40GB per node, 100 Gbps Slingshot-10"),
    "h800": dict(gpus_per_node=8, tp_pp={"1.3B": (1, 1), "6.7B": (4, 1), "13B": (8, 1)},
                 inter_gbps=3200.0, intra_gbyte_s=200.0, peak_tflops=989.0,
                 what="8 x H800 per node, 3.2 Tbps InfiniBand"),
}
# The paper's Table 2: TFLOP/s per GPU (baseline, SDP4Bit), 16 nodes.
PAPER = {("1.3B", "a100"): (24.1, 57.6), ("1.3B", "h800"): (69.1, 106.0),
         ("6.7B", "a100"): (10.8, 37.1), ("6.7B", "h800"): (26.2, 77.9),
         ("13B", "a100"): (9.7, 26.0), ("13B", "h800"): (13.9, 53.5)}
PAPER_NODES = 16
SEQ, VOCAB = 2048, 50257
# sample_scripts/common.sh: qWD groups of 2048 at 4 bits, TLq-HS 8/4 bits, groups of 128,
# Hadamard 32; --gradient-alltoall-pipeline 8 for 1.3B, 2.7B and 6.7B only.
SLICES = {"1.3B": 8, "6.7B": 8, "13B": 1}
COMPUTE_EFFICIENCY = 0.5  # the model's assumed fraction of peak (stated, not fitted)


def sdp4bit_config(model: str):
    from megatron.sdp4bit.config import SDP4BitConfig

    return SDP4BitConfig(quantized_weights=True, weight_quantization_bits=4, wq_group_size=2048,
                         quantized_gradients=True, gradient_quantization_bits_intra=8,
                         gq_group_size_intra=128, gradient_quantization_bits_inter=4,
                         gq_group_size_inter=128, hadamard_transform=True,
                         gradient_alltoall_pipeline=SLICES[model])


# ---------------------------------------------------------------- the fake world
def _fake_world(world: int, rank: int) -> None:
    """A default process group of ``world`` ranks on which this process is ``rank``; it
    answers rank and size and would refuse any collective (none is issued)."""
    import torch.distributed as dist

    if "sdp4bit_scale_fake" not in dist.Backend.backend_list:
        class _SizeOnlyGroup(dist.ProcessGroup):
            def getBackendName(self) -> str:
                return "sdp4bit_scale_fake"

        dist.Backend.register_backend(
            "sdp4bit_scale_fake", lambda store, r, size, timeout: _SizeOnlyGroup(r, size),
            devices=["cpu"])
    dist.init_process_group("sdp4bit_scale_fake", store=dist.HashStore(), rank=rank,
                            world_size=world)


@dataclass
class Layout:
    """What one rank's DDP + distributed optimizer hold (one layout: baseline or SDP4Bit)."""

    bucket_numels: list[int]
    bucket_unpadded: list[int]
    param_bytes: int
    grad_bytes: int
    main_shard_numel: int
    params: int
    comm: dict = field(default_factory=dict)


def build_rank(model: str, tp: int, pp: int, dp: int, rank: int, ranks_per_node: int) -> dict:
    """Both layouts of global ``rank`` in a world of dp x tp x pp (TP fastest, as
    megatron-core orders ranks), built under FakeTensorMode."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.sdp4bit.comm import CommStats, DPTopology, GradientQuantConfig, WeightQuantConfig
    from megatron.sdp4bit.comm.reduce_scatter import hops, record_bytes
    from megatron.sdp4bit.integration import sdp4bit_padding
    from megatron.sdp4bit.integration.buckets import main_shard_numel
    from megatron.sdp4bit.quantization.format import message_nbytes
    from megatron.sdp4bit.integration.accounting import add_unquantized_iteration
    from megatron.sdp4bit.integration.topologies import ModelTopologies
    from megatron.sdp4bit.training.tokenizers import padded_vocab_size

    layers, hidden, heads = MODELS[model]
    _fake_world(dp * tp * pp, rank)
    try:
        parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
        assert parallel_state.get_data_parallel_world_size() == dp
        vocab = padded_vocab_size(VOCAB, 128, tp)
        config = TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads, bf16=True,
            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            use_cpu_initialization=True, perform_initialization=False,
            masked_softmax_fusion=False, bias_activation_fusion=False,
            bias_dropout_fusion=False, gradient_accumulation_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False)
        out = {"stage": parallel_state.get_pipeline_model_parallel_rank()}
        sdp = sdp4bit_config(model)
        for name, padding in (("baseline", None), ("sdp4bit", sdp)):
            with FakeTensorMode(allow_non_fake_inputs=True):
                gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                               vocab_size=vocab, max_sequence_length=SEQ,
                               pre_process=parallel_state.is_pipeline_first_stage(),
                               post_process=parallel_state.is_pipeline_last_stage())
                params = sum(p.numel() for p in gpt.parameters())
                ddp_config = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                    check_for_nan_in_grad=False)  # no --overlap-grad-reduce: Table 2's runs
                # Float16Module casts with module.bfloat16(), which would swap every fake
                # parameter (refused); they are bf16 already (params_dtype), so skip the cast.
                gpt.bfloat16 = lambda: gpt
                with sdp4bit_padding(padding) if padding else _nothing():
                    ddp = DistributedDataParallel(config, ddp_config, Float16Module(config, gpt))
                # Every buffer, as integration/accounting.py counts them; this rank's fp32 main
                # parameters are the distributed optimizer's shard ranges of them.
                buffers = list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))
                main = main_shard_numel(buffers)
            buckets = [b for buf in buffers for b in buf.buckets]
            layout = Layout(
                bucket_numels=[b.grad_data.numel() for b in buckets],
                bucket_unpadded=[b.numel_unpadded for b in buckets],
                param_bytes=sum(buf.param_data.numel() * buf.param_data.element_size()
                                for buf in buffers),
                grad_bytes=sum(buf.grad_data.numel() * buf.grad_data.element_size()
                               for buf in buffers),
                main_shard_numel=main, params=params)
            stats = CommStats()
            if padding is None:
                topology = DPTopology(group=None, world=dp, ranks_per_node=ranks_per_node,
                                      nodes=dp // ranks_per_node, rank=0, node=0, local=0,
                                      intra_group=None, inter_group=None)
                add_unquantized_iteration(stats, [ddp], ModelTopologies(dense=topology),
                                          params=True, grads=True)
            else:
                wq, gq = WeightQuantConfig.from_sdp4bit(sdp), GradientQuantConfig.from_sdp4bit(sdp)
                extra, messages = 0, []
                for numel in layout.bucket_numels:
                    shard = numel // dp
                    wmsg = message_nbytes(shard, wq.bits, wq.group_size)
                    stats.add_param_bytes(wmsg, shard * 2, dp, ranks_per_node)
                    grad_hops = hops(ranks_per_node, dp // ranks_per_node, shard, gq)
                    # The collective's own byte counter (it reads only N and M).
                    record_bytes(stats, ranks_per_node, dp // ranks_per_node, gq, shard, 4)
                    # qWD: message + wire of W messages + the fp32 main-shard scratch;
                    # TLq-HS: send and receive buffers of every hop.
                    extra_qwd = wmsg + dp * wmsg + 4 * shard
                    extra_tlq = sum(2 * hop.buffer_nbytes for hop in grad_hops)
                    extra += extra_qwd + extra_tlq
                    messages.append({
                        "shard": shard, "qwd_message_bytes": wmsg,
                        "qwd_wire_bytes": dp * wmsg, "qwd_scratch_bytes": 4 * shard,
                        "hops": [{"hop": h.name, "peers": h.peers,
                                  "collectives": h.collectives, "message_numel": h.message_numel,
                                  "message_bytes": h.message_nbytes,
                                  "send_buffer_bytes": h.buffer_nbytes,
                                  "sent_bytes": h.sent_nbytes} for h in grad_hops],
                        "qwd_extra_bytes": extra_qwd, "tlq_extra_bytes": extra_tlq})
                layout.comm["buckets"] = messages
                layout.comm["extra_bytes"] = extra
            layout.comm["bytes"] = stats.snapshot()
            out[name] = layout.__dict__
            del ddp, gpt
        return out
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- the step-time model
def model_flops_per_gpu(model: str, tp: int, pp: int) -> float:
    """Forward + backward FLOPs of one step per GPU, micro-batch 1 per DP rank and no
    accumulation (the speed scripts): 72 s l h^2 (1 + s/(6h) + V/(12 l h)) per sequence
    (Narayanan et al. 2021, without recomputation), split over the TP x PP GPUs."""
    layers, hidden, _ = MODELS[model]
    per_seq = 72 * SEQ * layers * hidden ** 2 * (
        1 + SEQ / (6 * hidden) + VOCAB / (12 * layers * hidden))
    return per_seq / (tp * pp)


def step_model(model: str, cluster: str, tp: int, pp: int, nbytes: dict, inter_gbps: float
               ) -> dict:
    """The MODEL (not a measurement): compute + intra bytes / intra bandwidth + inter bytes
    x GPUs per node / the node's inter-node bandwidth, nothing overlapped (Table 2's runs
    overlap neither collective). Compute = PP x (FLOPs per GPU / (efficiency x peak)): one
    micro-batch, so the PP stages run one after the other."""
    c = CLUSTERS[cluster]
    flops = model_flops_per_gpu(model, tp, pp)
    compute = pp * flops / (COMPUTE_EFFICIENCY * c["peak_tflops"] * 1e12)
    intra = (nbytes["param_intra_bytes"] + nbytes["grad_intra_bytes"]) / (c["intra_gbyte_s"] * 1e9)
    inter = ((nbytes["param_inter_bytes"] + nbytes["grad_inter_bytes"]) * c["gpus_per_node"]
             / (inter_gbps * 1e9 / 8))
    step = compute + intra + inter
    return {"compute_s": compute, "intra_s": intra, "inter_s": inter, "step_s": step,
            "tflops_per_gpu": flops / step / 1e12}


# ---------------------------------------------------------------- the report
def cases(models: list[str], clusters: list[str], worlds: list[int]) -> list[dict]:
    """(model, cluster, TP, PP, DP, DP ranks per node, paper?) for every requested world and
    the paper's 16 nodes."""
    out = []
    for cluster in clusters:
        g = CLUSTERS[cluster]["gpus_per_node"]
        for model in models:
            tp, pp = CLUSTERS[cluster]["tp_pp"][model]
            paper_dp = PAPER_NODES * g // (tp * pp)
            for dp in sorted(set(worlds) | {paper_dp}):
                out.append(dict(model=model, cluster=cluster, tp=tp, pp=pp, dp=dp,
                                ranks_per_node=max(g // tp, 1), paper=dp == paper_dp,
                                requested=dp in worlds))
    return out


def run(models, clusters, worlds, log) -> list[dict]:
    """Build every distinct (model, TP, PP, DP, N, stage) once; ranks 0 and the last rank of
    the world (first and last pipeline stage)."""
    from megatron.sdp4bit.integration.cpu_mode import enable_cpu_mode

    enable_cpu_mode()  # megatron-core's CUDA calls -> CPU (fake tensors on the CPU device)
    built: dict[tuple, dict] = {}
    results = []
    for case in cases(models, clusters, worlds):
        tp, pp, dp, n = case["tp"], case["pp"], case["dp"], case["ranks_per_node"]
        gpus = tp * pp * dp
        ranks = {}
        for rank in sorted({0, gpus - 1}):
            stage = rank // (tp * dp)
            key = (case["model"], tp, pp, dp, n, stage)
            if key not in built:
                start = time.perf_counter()
                built[key] = build_rank(case["model"], tp, pp, dp, rank, n)
                log(f"built {case['model']} TP{tp} PP{pp} DP{dp} N{n} rank {rank} (stage "
                    f"{stage}) in {time.perf_counter() - start:.1f} s")
            ranks[str(rank)] = built[key]
        case = dict(case, gpus=gpus, ranks=ranks)
        worst = max(ranks.values(), key=lambda r: sum(r["sdp4bit"]["comm"]["bytes"].values()))
        case["model_step"] = {
            method: {str(bw): step_model(case["model"], case["cluster"], tp, pp,
                                         worst[method]["comm"]["bytes"], bw)
                     for bw in BANDWIDTHS_GBPS + [CLUSTERS[case["cluster"]]["inter_gbps"]]}
            for method in ("baseline", "sdp4bit")}
        results.append(case)
    return results


BANDWIDTHS_GBPS = [25.0, 100.0, 400.0, 1600.0, 3200.0]


def _gib(x: float) -> str:
    return f"{x / 2 ** 30:.2f}"


def _mib(x: float) -> str:
    return f"{x / 2 ** 20:.1f}"


def markdown(results: list[dict], meta: dict) -> str:
    """The report: memory, messages, bytes per step, the step-time model beside Table 2."""
    lines = [
        "# The paper's sizes, on paper (a dry run, not a measurement on GPUs)", "",
        "Written by `benchmarks/scale.py` (do not edit by hand).", "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; date {meta['date']}; load average {meta['load']}; "
        f"{meta['seconds']:.0f} s.", "",
        "Every figure below is read off megatron-core 0.16.1's real GPTModel, DDP buffers and "
        "the distributed optimizer's shard ranges, built for one rank under FakeTensorMode in "
        "a fake world of DP x TP x PP ranks (GPUs = DP x TP x PP), once as the baseline lays "
        "out its buckets and once padded for SDP4Bit (qWD 4 bits, groups 2048; TLq-HS 8/4 "
        "bits, groups 128, Hadamard 32; `--gradient-alltoall-pipeline` 8 for 1.3B and 6.7B, 1 "
        "for 13B: the speed scripts). DP worlds are data-parallel ranks; N = DP ranks per node "
        "= GPUs per node / TP (megatron-core puts TP innermost), so with TP = GPUs per node "
        "every DP rank is alone on its node and TLq-HS runs its single 4-bit inter-node hop. "
        "No `--overlap-grad-reduce`: one bucket per buffer (plus the ones megatron-core "
        "splits off). Ranks 0 and the last rank were built (first and last pipeline stage); "
        "bytes below are the larger of the two.", "",
        "## Per-GPU memory (GiB)", "",
        "Baseline: bf16 param buffer + fp32 grad buffer + fp32 main-parameter shard + Adam's "
        "two fp32 moments of the shard. SDP4Bit extra: qWD's fp32 main-shard scratch "
        "(persistent) and its message + wire of W messages (transient, while the all-gather "
        "runs), TLq-HS's send + receive buffers of both hops (transient, while the "
        "reduce-scatter runs), summed over buckets; plus the larger padded buffers "
        "(the difference in the param + grad columns).", "",
        "| model | cluster | TP/PP | DP | GPUs | N | rank | params | baseline param+grad | "
        "baseline optimizer shard | SDP4Bit param+grad | qWD extra | TLq-HS extra |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        for rank, r in case["ranks"].items():
            b, s = r["baseline"], r["sdp4bit"]
            qwd = sum(x["qwd_extra_bytes"] for x in s["comm"]["buckets"])
            tlq = sum(x["tlq_extra_bytes"] for x in s["comm"]["buckets"])
            lines.append(
                f"| {case['model']} | {case['cluster']} | {case['tp']}/{case['pp']} | "
                f"{case['dp']} | {case['gpus']} | {case['ranks_per_node']} | {rank} | "
                f"{b['params'] / 1e6:.0f} M | {_gib(b['param_bytes'] + b['grad_bytes'])} | "
                f"{_gib(12 * b['main_shard_numel'])} | "
                f"{_gib(s['param_bytes'] + s['grad_bytes'])} | {_gib(qwd)} | {_gib(tlq)} |")
    lines += ["", "## Messages per step, per hop (rank 0, SDP4Bit)", "",
              "Per bucket: the shard S, the qWD message (one all-gather of W messages) and "
              "each TLq-HS hop's all-to-alls (collectives x peers messages of the given size).",
              "", "| model | cluster | DP | N | bucket | S | qWD msg (B) | hop: collectives x "
              "peers x message bytes |", "|---|---|---|---|---|---|---|---|"]
    for case in results:
        s = case["ranks"]["0"]["sdp4bit"]
        for i, (numel, bk) in enumerate(zip(s["bucket_numels"], s["comm"]["buckets"])):
            hops_txt = "; ".join(f"{h['hop']}: {h['collectives']} x {h['peers']} x "
                                 f"{h['message_bytes']}" for h in bk["hops"])
            lines.append(f"| {case['model']} | {case['cluster']} | {case['dp']} | "
                         f"{case['ranks_per_node']} | {i} ({numel:,} el.) | {bk['shard']:,} | "
                         f"{bk['qwd_message_bytes']:,} | {hops_txt} |")
    lines += ["", "## Bytes per step per GPU by hop (MiB, sent, rank with the most)", "",
              "Computed with the project's accounting: megatron-core's collectives by "
              "`integration.accounting.add_unquantized_iteration`, SDP4Bit's by `CommStats` and "
              "the reduce-scatter's own counter (ideal collectives: a backend may send more).",
              "", "| model | cluster | DP | N | params intra | params inter | grads intra | "
              "grads inter | total | reduction |", "|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        r = max(case["ranks"].values(),
                key=lambda x: sum(x["sdp4bit"]["comm"]["bytes"].values()))
        b, s = r["baseline"]["comm"]["bytes"], r["sdp4bit"]["comm"]["bytes"]
        keys = ("param_intra_bytes", "param_inter_bytes", "grad_intra_bytes", "grad_inter_bytes")
        cells = " | ".join(f"{_mib(b[k])} -> {_mib(s[k])}" for k in keys)
        tb, ts = sum(b[k] for k in keys), sum(s[k] for k in keys)
        lines.append(f"| {case['model']} | {case['cluster']} | {case['dp']} | "
                     f"{case['ranks_per_node']} | {cells} | {_mib(tb)} -> {_mib(ts)} | "
                     f"{tb / ts:.2f}x |")
    lines += ["", "## A MODEL of step time against link bandwidth, beside Table 2", "",
              "**This is a model, not a measurement.** step time = compute + intra-node bytes "
              "/ intra-node bandwidth + inter-node bytes x GPUs per node / the node's "
              "inter-node bandwidth, nothing overlapped. Compute = PP x model FLOPs per GPU / "
              f"({COMPUTE_EFFICIENCY:g} x dense bf16 peak), with model FLOPs = 72 s l h^2 (1 + "
              "s/6h + V/12lh) per sequence, one sequence per DP rank, split over TP x PP "
              "(PP x: one micro-batch, so the stages run in turn). Assumed, not fitted: "
              f"{COMPUTE_EFFICIENCY:.0%} of peak (A100 312, H800 989 TFLOP/s), intra-node 300 "
              "GB/s (A100 NVLink) and 200 GB/s (H800 NVLink) per GPU per direction. Left out: "
              "tensor-parallel traffic, quantization kernels' time, latency, congestion. "
              "The paper's runs: 16 nodes (A100: 4 GPUs, 100 Gbps; H800: 8 GPUs, 3.2 Tbps).",
              "", "| model | cluster | DP | inter-node Gbps per node | compute s | baseline "
              "step s | SDP4Bit step s | model speed-up | model TFLOP/s base -> SDP4Bit | "
              "Table 2 TFLOP/s | Table 2 speed-up |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in results:
        if not case["paper"]:
            continue
        paper = PAPER[(case["model"], case["cluster"])]
        nominal = CLUSTERS[case["cluster"]]["inter_gbps"]
        for bw in sorted({*BANDWIDTHS_GBPS, nominal}):
            b = case["model_step"]["baseline"][str(bw)]
            s = case["model_step"]["sdp4bit"][str(bw)]
            mark = " (the paper's)" if bw == nominal else ""
            lines.append(
                f"| {case['model']} | {case['cluster']} | {case['dp']} | {bw:g}{mark} | "
                f"{b['compute_s']:.2f} | {b['step_s']:.2f} | {s['step_s']:.2f} | "
                f"{b['step_s'] / s['step_s']:.2f}x | {b['tflops_per_gpu']:.1f} -> "
                f"{s['tflops_per_gpu']:.1f} | "
                + (f"{paper[0]} -> {paper[1]} | {paper[1] / paper[0]:.2f}x |" if mark else
                   "| |"))
    return "\n".join(lines) + "\n"


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {cpu}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--cluster", nargs="+", default=list(CLUSTERS), choices=list(CLUSTERS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[16, 64, 1024],
                        help="data-parallel sizes (the paper's 16 nodes are always added)")
    parser.add_argument("--write-results", action="store_true",
                        help="write benchmarks/scale.md and benchmarks/scale.json")
    args = parser.parse_args(argv)
    for w in args.worlds:
        if w < 1:
            parser.error(f"--worlds: {w} is not a positive data-parallel size")
    import warnings

    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    results = run(args.models, args.cluster, args.worlds,
                  lambda msg: print(msg, file=sys.stderr, flush=True))
    meta = {"command": "python -m benchmarks.scale " + " ".join(sys.argv[1:] if argv is None
                                                                     else argv),
            "machine": machine(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg()),
            "seconds": time.perf_counter() - start}
    report = markdown(results, meta)
    print(report)
    if args.write_results:
        out = ROOT / "benchmarks"
        (out / "scale.md").write_text(report)
        (out / "scale.json").write_text(json.dumps({"meta": meta, "cases": results}, indent=1))
        print(f"wrote {out / 'scale.md'} and {out / 'scale.json'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
