"""SDP4Bit in your own megatron-core training loop: the whole public API in one file.

    torchrun --nproc-per-node 4 examples/own_loop.py --dp-ranks-per-node 2   # CPU: 2 "nodes"

A tiny GPT on counting sequences (each sample counts up from a random token by a random
stride, so the loss falls within a few iterations) with megatron-core's GPTModel, DDP, distributed optimizer and
pipeline schedule; SDP4Bit quantizes both collectives (qWD weights, TLq-HS gradients). The
lines marked "SDP4Bit" are all it takes; the lines marked "megatron-core" are what any
megatron-core loop needs and SDP4Bit relies on (see docs/api.md).
"""

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration import enable_cpu_mode, install_sdp4bit, sdp4bit_padding

SEQ, VOCAB = 64, 512

p = argparse.ArgumentParser()
p.add_argument("--iterations", type=int, default=20)
p.add_argument("--micro-batch-size", type=int, default=4)
p.add_argument("--micro-batches", type=int, default=2)  # gradient accumulation per iteration
p.add_argument("--dp-ranks-per-node", type=int, default=None)  # default: from the hosts
args = p.parse_args()

cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
else:
    enable_cpu_mode()  # SDP4Bit: megatron-core on CPU tensors and gloo (before anything else)
dist.init_process_group("nccl" if cuda else "gloo")
parallel_state.initialize_model_parallel()  # TP = PP = 1: every rank is a DP rank
torch.manual_seed(1)
tensor_parallel.model_parallel_cuda_manual_seed(1)  # the same init on every DP rank

config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                           params_dtype=torch.float32, pipeline_dtype=torch.bfloat16,
                           use_cpu_initialization=True, masked_softmax_fusion=False,
                           bias_activation_fusion=False, bias_dropout_fusion=False,
                           gradient_accumulation_fusion=False)
model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), VOCAB, SEQ))
sdp4bit = SDP4BitConfig(quantized_weights=True, quantized_gradients=True,
                        hadamard_transform=True, dp_ranks_per_node=args.dp_ranks_per_node)
with sdp4bit_padding(sdp4bit):  # SDP4Bit: buckets padded to whole quantization groups
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True), model)
optimizer = get_megatron_optimizer(OptimizerConfig(
    optimizer="adam", lr=3e-3, bf16=True, params_dtype=torch.bfloat16,
    use_distributed_optimizer=True), [ddp])
# megatron-core: the schedule reduces the gradients through this hook; without it nothing is
# reduced across ranks (install_sdp4bit refuses such a model).
config.finalize_model_grads_func = finalize_model_grads
config.grad_scale_func = optimizer.scale_loss
handle = install_sdp4bit([ddp], optimizer, sdp4bit)  # SDP4Bit: the quantized collectives

gen = torch.Generator().manual_seed(100 + parallel_state.get_data_parallel_rank())
device = torch.cuda.current_device() if cuda else "cpu"


def forward_step(batch_iterator, model):
    tokens = next(batch_iterator)
    position_ids = torch.arange(SEQ, device=device).expand(tokens.shape[0], SEQ)
    loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float()
    # megatron-core: the schedule divides the returned loss by the number of micro-batches
    # *in place*, and detach() shares its storage: log a copy.
    return loss.mean(), lambda out: (out, {"lm loss": out.detach().clone()})


for iteration in range(1, args.iterations + 1):
    handle.set_iteration(iteration)  # SDP4Bit: every iteration: seeds, handle.step_stats
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    samples = args.micro_batch_size * args.micro_batches  # this rank's share of the batch
    start = torch.randint(0, VOCAB, (samples, 1), generator=gen)
    stride = torch.randint(1, 4, (samples, 1), generator=gen)
    batch = ((start + stride * torch.arange(SEQ + 1)) % VOCAB).to(device)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batch.split(args.micro_batch_size)),
        model=[ddp], num_microbatches=args.micro_batches, seq_length=SEQ,
        micro_batch_size=args.micro_batch_size, forward_only=False)
    ok, grad_norm, _ = optimizer.step()  # the distributed optimizer's all-gather: qWD
    # the iteration's loss: the mean over its micro-batches and the data-parallel ranks
    loss = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    loss /= parallel_state.get_data_parallel_world_size()
    if dist.get_rank() == 0:
        s = handle.step_stats()
        print(f"iteration {iteration} | loss {loss.item():.4f} | grad norm "
              f"{grad_norm:.3f} | bytes sent (unquantized): weights to the node "
              f"{s['param_intra_bytes']} ({s['param_intra_bytes_baseline']}), to other nodes "
              f"{s['param_inter_bytes']} ({s['param_inter_bytes_baseline']}), gradients intra "
              f"{s['grad_intra_bytes']} ({s['grad_intra_bytes_baseline']}), inter "
              f"{s['grad_inter_bytes']} ({s['grad_inter_bytes_baseline']})", flush=True)

handle.uninstall()
dist.destroy_process_group()
