"""Model, DDP wrapper and optimizer from the command line: megatron-core's own classes.

``GPTModel`` with Transformer Engine's layer spec (``--transformer-impl transformer_engine``,
or ``auto`` when it is importable and CUDA is present) or megatron-core's local one, wrapped in ``Float16Module`` for bf16/fp16, then in megatron-core's
``DistributedDataParallel``; the optimizer comes from ``get_megatron_optimizer`` (the
distributed optimizer with ``--use-distributed-optimizer``).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.sdp4bit.training.cli.installed import uses_transformer_engine
from megatron.sdp4bit.training.cli.megatron_flags import transformer_config_overrides
from megatron.sdp4bit.training.cli.moe_flags import moe_config_overrides

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """``--openai-gelu``: GeLU's tanh approximation,
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as OpenAI's GPT-2 computes it."""
    return F.gelu(x, approximate="tanh")


def transformer_config_from_args(args: argparse.Namespace, timers=None) -> TransformerConfig:
    """``timers``: megatron-core times its phases with it (``--timing-log-level``)."""
    cuda = torch.cuda.is_available()
    kwargs = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.norm_epsilon,
        normalization=args.normalization,
        add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu,
        init_method_std=args.init_method_std,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=_DTYPES[args.params_dtype],
        pipeline_dtype=_DTYPES[args.params_dtype],
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        # CPU mode builds weights on the host; fused CUDA kernels do not exist there.
        use_cpu_initialization=not cuda,
        # megatron-core's fused softmax imports Megatron-LM's/Apex's compiled extension
        # (scaled_masked_softmax_cuda), which pip's megatron-core does not ship: without it
        # the first forward on a GPU would stop with ModuleNotFoundError.
        masked_softmax_fusion=cuda and importlib.util.find_spec("scaled_masked_softmax_cuda")
        is not None,
        # megatron-core's fused bias + activation kernel knows the exact GeLU and SiLU only
        # (TransformerConfig refuses any other function with it).
        bias_activation_fusion=cuda and not args.swiglu and not args.openai_gelu,
        bias_dropout_fusion=cuda,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # batch_p2p_sync's torch.cuda.synchronize() (a guard for old PyTorch) has no CPU
        # counterpart; pipeline sends on gloo need no such guard.
        batch_p2p_sync=cuda,
        timers=timers,
        barrier_with_L1_time=args.barrier_with_L1_time,
    )
    if args.swiglu:
        kwargs["activation_func"] = F.silu
    elif args.openai_gelu:
        kwargs["activation_func"] = openai_gelu
    kwargs.update(transformer_config_overrides(args))  # Megatron-LM's switches, when given
    kwargs.update(moe_config_overrides(args))  # mixture of experts, with --num-experts
    return TransformerConfig(**kwargs)


def build_model(args: argparse.Namespace, config: TransformerConfig, vocab_size: int) -> GPTModel:
    """One GPTModel chunk for this pipeline stage (no virtual pipeline)."""
    # pretrain_gpt.py refused --transformer-impl transformer_engine without CUDA and the
    # package before anything started (training/cli/installed.py).
    if uses_transformer_engine(args.transformer_impl):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization,
                                        qk_layernorm=args.qk_layernorm)
    if args.num_experts is not None:
        # megatron-core's MoE block: per layer, --moe-layer-freq picks a MoE or a dense MLP
        # (local spec: sequential experts, one MLP each; TE: grouped GEMM with the flag)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=uses_transformer_engine(args.transformer_impl),
            normalization=args.normalization)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def wrap_ddp(args: argparse.Namespace, config: TransformerConfig, model: torch.nn.Module,
             ) -> DistributedDataParallel:
    if args.fp16 or args.bf16:
        model = Float16Module(config, model)
    ddp_kwargs = dict(
        # Megatron-LM reduces gradients in fp32 with bf16 unless --grad-reduce-in-bf16 (only
        # with --bf16, validation says); SDP4Bit sums its dequantized gradients in fp32 and
        # writes them into buffers of either dtype.
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # Non-finite gradients skip the step on every rank (training/step.py) instead of
        # megatron-core's per-rank exception.
        check_for_nan_in_grad=False,
    )
    if args.ddp_bucket_size is not None:
        ddp_kwargs["bucket_size"] = args.ddp_bucket_size
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_kwargs), model)
    ddp.broadcast_params()  # every DP replica starts from DP rank 0's initialization
    return ddp


def build_optimizer(args: argparse.Namespace, model_chunks: list[DistributedDataParallel],
                    timers=None) -> MegatronOptimizer:
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        fp16=args.fp16,
        bf16=args.bf16,
        params_dtype=_DTYPES[args.params_dtype],
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        clip_grad=args.clip_grad,
        timers=timers,
        barrier_with_L1_time=args.barrier_with_L1_time,
    )
    return get_megatron_optimizer(config, model_chunks)
