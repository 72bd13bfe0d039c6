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
project's accounting (``CommStats``, ``observe.comm_counters``), and evaluates a stated
*model* of step time against link bandwidth next to the paper's Table 2.

    python tools/scale_dryrun.py                  # prints the report (a few minutes)
    python tools/scale_dryrun.py --write-results  # also benchmarks/scale.{md,json}
    python tools/scale_dryrun.py --models 1.3B --worlds 16 --cluster a100   # one case
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
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.sdp4bit.comm import CommStats, GradientQuantConfig, WeightQuantConfig
    from megatron.sdp4bit.comm.reduce_scatter import _record, hops
    from megatron.sdp4bit.integration import sdp4bit_padding
    from megatron.sdp4bit.quantization.format import message_nbytes
    from megatron.sdp4bit.training.observe.comm_counters import add_unquantized_iteration
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
                # The distributed optimizer's own shard ranges (its classmethod, no
                # collective): this rank's fp32 main parameters are these pieces.
                main = sum(r["param"].size for buf in ddp.buffers
                           for ranges in DistributedOptimizer._build_gbuf_range_map(buf).values()
                           for bucket in ranges for r in bucket["param_map"].values())
            buckets = [b for buf in ddp.buffers for b in buf.buckets]
            layout = Layout(
                bucket_numels=[b.grad_data.numel() for b in buckets],
                bucket_unpadded=[b.numel_unpadded for b in buckets],
                param_bytes=sum(buf.param_data.numel() * buf.param_data.element_size()
                                for buf in ddp.buffers),
                grad_bytes=sum(buf.grad_data.numel() * buf.grad_data.element_size()
                               for buf in ddp.buffers),
                main_shard_numel=main, params=params)
            stats = CommStats()
            if padding is None:
                add_unquantized_iteration(stats, [ddp], dp_size=dp,
                                          ranks_per_node=ranks_per_node,
                                          distributed_optimizer=True)
            else:
                wq, gq = WeightQuantConfig.from_sdp4bit(sdp), GradientQuantConfig.from_sdp4bit(sdp)
                extra, messages = 0, []
                for numel in layout.bucket_numels:
                    shard = numel // dp
                    wmsg = message_nbytes(shard, wq.bits, wq.group_size)
                    stats.add_param_bytes(wmsg, shard * 2, dp, ranks_per_node)
                    grad_hops = hops(ranks_per_node, dp // ranks_per_node, shard, gq)
                    # The collective's own byte counter (it reads only N and M).
                    _record(stats, SimpleNamespace(ranks_per_node=ranks_per_node,
                                                   nodes=dp // ranks_per_node), gq, shard, 4)
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
