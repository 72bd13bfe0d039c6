"""A tiny megatron-core GPT trained with DDP + the distributed optimizer, for gloo tests.

Test code only (the trainer builds its own model in ``megatron.sdp4bit.training``).
Every function runs inside a rank started by ``tests.helpers.spawn.spawn``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration import enable_cpu_mode, sdp4bit_padding

SEQ = 32
VOCAB = 128
MICRO_BATCH = 2
HIDDEN = 64


@dataclass(frozen=True)
class Setup:
    """One training configuration of the tiny GPT."""

    bf16: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None  # None = one bucket per buffer
    num_microbatches: int = 1
    lr: float = 3e-3
    tied_embeddings: bool = False  # share the input embedding with the output layer
    average_in_collective: bool = False  # AVG in the reduce-scatter instead of scaling by 1/DP
    grad_reduce_in_fp32: bool = True  # False: gradient buffers in the parameters' dtype
    ddp_options: tuple[tuple[str, object], ...] = ()  # more DistributedDataParallelConfig fields
    moe_dispatcher: str | None = None  # a MoE GPT (4 experts, top-2) with this token dispatcher


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1) -> None:
    """CPU mode (no CUDA here) and megatron's TP/PP/DP (and expert-parallel ``ep``) groups on
    the default gloo group."""
    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        enable_cpu_mode()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
    )


def transformer_config(**kwargs):
    """megatron-core's TransformerConfig for the tests' CPU models: built on the CPU, no
    dropout, none of the fused CUDA kernels; ``kwargs`` give the shape and the rest. The one
    place the tests make a TransformerConfig (the trainer's is training/model.py's)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{
        "use_cpu_initialization": True, "hidden_dropout": 0.0, "attention_dropout": 0.0,
        "masked_softmax_fusion": False, "bias_activation_fusion": False,
        "bias_dropout_fusion": False, "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False, **kwargs})


def build(setup: Setup, seed: int = 1, padding_for=None):
    """GPTModel (2 layers, hidden 64) -> [Float16Module] -> DDP, and its distributed optimizer.

    ``padding_for``: an ``SDP4BitConfig`` whose bucket padding the DDP buffers get (they
    must, to install SDP4Bit). Returns ``(ddp_model, optimizer)``. The same seed gives the same initial weights on
    every DP rank (megatron relies on that; it does not broadcast them).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    dtype = torch.bfloat16 if setup.bf16 else torch.float32
    config = transformer_config(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
        params_dtype=torch.float32,
        bf16=setup.bf16,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() guards an old-PyTorch race only
        **(_moe_options(setup) if setup.moe_dispatcher else {}),
    )
    # Seeds the RNG tracker as Megatron-LM does; same init on every DP rank (megatron-core
    # relies on that and does not broadcast), distinct per PP stage.
    torch.manual_seed(seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed + 100 * parallel_state.get_pipeline_model_parallel_rank(), force_reset_rng=True
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=setup.tied_embeddings,
    )
    if setup.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=setup.grad_reduce_in_fp32,
        use_distributed_optimizer=True,
        overlap_grad_reduce=setup.overlap_grad_reduce,
        overlap_param_gather=setup.overlap_param_gather,
        bucket_size=setup.bucket_size,
        average_in_collective=setup.average_in_collective,
        **dict(setup.ddp_options),
    )
    with sdp4bit_padding(padding_for or SDP4BitConfig()):
        ddp = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=setup.lr,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        clip_grad=1.0,
        bf16=setup.bf16,
        params_dtype=dtype,
        use_distributed_optimizer=True,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    # The schedule calls these, as Megatron-LM's training loop wires them.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if setup.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
    return ddp, optimizer


def _moe_options(setup: Setup) -> dict:
    """4 sequential experts (FFN 128), top-2, over the expert-parallel group."""
    from megatron.core import parallel_state

    return dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128,
                ffn_hidden_size=128, moe_token_dispatcher_type=setup.moe_dispatcher,
                moe_aux_loss_coeff=0.01,
                expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size())


def batch(step: int, micro: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """Fixed synthetic data: a noisy affine sequence rule the model can learn quickly."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * micro + dp_rank)
    start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (MICRO_BATCH, 1), generator=gen)
    tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous(),
    }


def _loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()
    # clone: the schedule divides the returned loss in place by the number of microbatches
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    data = next(data_iterator)
    output = model(
        data["tokens"], data["position_ids"], attention_mask=None, labels=data["labels"]
    )
    return output, _loss_func


def train_step(ddp, optimizer, setup: Setup, step: int, before_update=None) -> float | None:
    """One iteration as Megatron-LM runs it; the mean loss on the last PP stage, else None.

    ``before_update()`` runs between backward and the optimizer step: there the parameter
    all-gather of the previous step has completed even with ``overlap_param_gather`` (the
    forward pass waited for every bucket).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank = parallel_state.get_data_parallel_rank()
    data = iter([batch(step, m, dp_rank) for m in range(setup.num_microbatches)])
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=data,
        model=[ddp],
        num_microbatches=setup.num_microbatches,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    if before_update is not None:
        before_update()
    ok, _, _ = optimizer.step()
    assert ok, "optimizer step skipped"
    if not parallel_state.is_pipeline_last_stage():
        return None
    local = torch.stack([x["lm loss"] for x in losses]).mean()
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group())
    return local.item() / parallel_state.get_data_parallel_world_size()


def param_buffers(ddp) -> list[torch.Tensor]:
    """The model replica: the flat parameter buffers of the DDP module."""
    return [buf.param_data for buf in ddp.buffers + ddp.expert_parallel_buffers]


def _gathered_bytes(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` of ``group``, as raw bytes (gloo has no int16)."""
    bits = tensor.detach().contiguous().view(torch.uint8)
    gathered = [torch.empty_like(bits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, bits, group=group)
    return gathered


def assert_replicas_identical(ddp) -> None:
    """Every DP rank holds bitwise the same parameter buffers (compared as raw bits); the
    expert-parallel buffers (MoE) on their expert data-parallel group."""
    from megatron.core import parallel_state

    dense = parallel_state.get_data_parallel_group()
    groups = [dense] * len(ddp.buffers) + [parallel_state.get_expert_data_parallel_group()] * len(
        ddp.expert_parallel_buffers)
    for i, (buf, group) in enumerate(zip(param_buffers(ddp), groups)):
        gathered = _gathered_bytes(buf, group)
        for r, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                n = int((other != gathered[0]).sum())
                raise AssertionError(f"buffer {i}: DP rank {r} differs from rank 0 in {n} elements")


def assert_tp_copies_identical(ddp, optimizer) -> None:
    """With TP > 1, the parameters TP does not split (megatron-core leaves
    ``tensor_model_parallel`` unset) are bitwise the same on every TP rank, in the replica
    and in the distributed optimizer's fp32 main weights (each DP rank's shard of a bucket
    covers the same elements on every TP rank: the layouts are the same)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return

    def duplicated(param) -> bool:
        return not getattr(param, "tensor_model_parallel", False)

    replica = [p.detach().float().view(-1) for p in ddp.module.parameters() if duplicated(p)]
    main = [m.detach().view(-1)
            for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for model_group, main_group in zip(opt.model_float16_groups,
                                               opt.shard_fp32_from_float16_groups)
            for p, m in zip(model_group, main_group) if duplicated(p)]
    assert replica, "no TP-duplicated parameter: nothing checked"
    for what, pieces in (("replica", replica), ("fp32 main weights", main)):
        gathered = _gathered_bytes(torch.cat(pieces) if pieces else torch.zeros(0), group)
        for r, other in enumerate(gathered):
            if not torch.equal(other, gathered[0]):
                diff = (other.view(torch.float32) - gathered[0].view(torch.float32)).abs()
                raise AssertionError(f"TP-duplicated {what}: TP rank {r} differs from TP rank "
                                     f"0 in {int((diff != 0).sum())} elements (max "
                                     f"{float(diff.max()):.3g})")


def replica_snapshot(ddp) -> list[torch.Tensor]:
    return [b.detach().clone() for b in param_buffers(ddp)]


def finish_param_sync(ddp) -> None:
    """Complete an all-gather left in flight by ``overlap_param_gather`` (end of training)."""
    if ddp.ddp_config.overlap_param_gather:
        ddp.start_param_sync(force_sync=True)


def train_checking_replicas(ddp, optimizer, setup: Setup, steps: int,
                            before_step=None) -> list[float | None]:
    """Run ``steps`` iterations; replicas must be bitwise identical before every update,
    after every step (without overlapped param gathers) and once the last gather lands; so
    must the TP ranks' copies of what TP does not split (after steps and at the end).
    ``before_step(step)`` runs first in each iteration (e.g. SDP4Bit's set_iteration)."""
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        check = lambda: assert_replicas_identical(ddp)  # noqa: E731
        losses.append(train_step(ddp, optimizer, setup, step, before_update=check))
        if not setup.overlap_param_gather:
            assert_replicas_identical(ddp)
            assert_tp_copies_identical(ddp, optimizer)
    finish_param_sync(ddp)
    assert_replicas_identical(ddp)
    assert_tp_copies_identical(ddp, optimizer)
    return losses
