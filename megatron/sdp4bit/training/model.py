"""Model, DDP wrapper and optimizer from the command line: megatron-core's own classes.

``GPTModel`` with Transformer Engine's layer spec (``--transformer-impl transformer_engine``,
or ``auto`` when it is importable and CUDA is present) or megatron-core's local one (with
norms of its own under ``--sequence-parallel`` and ``--apply-layernorm-1p``,
training/layer_spec.py), wrapped in
``Float16Module`` for bf16/fp16, then in megatron-core's ``DistributedDataParallel``; the
optimizer comes from ``get_megatron_optimizer`` (the distributed optimizer with
``--use-distributed-optimizer``). With the interleaved pipeline every pipeline rank holds
``args.virtual_pipeline_model_parallel_size`` model chunks, each its own GPTModel and DDP
module, as Megatron-LM builds them.

[Note: batched p2p at PP 2]
megatron-core's interleaved schedule without p2p overlap sends and receives both ways in one
``batch_isend_irecv`` (``batch_p2p_comm``), posted in the order send-to-previous,
receive-from-previous, send-to-next, receive-from-next. At PP 2 the previous and the next
stage are the same rank, and messages between a pair of ranks are matched in posting order:
rank A's first send (its gradient for the previous stage) meets rank B's first receive (the
activation from its previous stage). The shapes agree, so the gradient is silently used as
an activation and vice versa (measured on gloo: gradient norm 22.8 instead of 0.945; at PP 4
the two directions go to different ranks and were right). Megatron-LM refuses this setting
(PP must be > 2 without overlap) and sets ``batch_p2p_comm = not overlap_p2p_comm``; so do
this trainer's flags (training/cli/validate.py), and its default, overlap on, sends each
direction in its own call.
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
from megatron.core.optimizer import (
    MegatronOptimizer,
    OptimizerConfig,
    get_megatron_optimizer,
    get_standard_config_overrides,
)
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron.sdp4bit.training.cli.installed import uses_transformer_engine
from megatron.sdp4bit.training.cli.megatron_flags import transformer_config_overrides
from megatron.sdp4bit.training.cli.moe_flags import moe_config_overrides
from megatron.sdp4bit.training.layer_spec import local_layer_spec, with_local_norms

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
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # [Note: batched p2p at PP 2]
        overlap_p2p_comm=args.overlap_p2p_comm,
        batch_p2p_comm=not args.overlap_p2p_comm,
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


def build_model(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                vp_stage: int | None = None) -> GPTModel:
    """The GPTModel chunk ``vp_stage`` of this pipeline stage (None: the stage's only one)."""
    vpp = args.virtual_pipeline_model_parallel_size
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True) and \
        (vp_stage is None or vp_stage == 0)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True) and \
        (vp_stage is None or vp_stage == vpp - 1)
    # pretrain_gpt.py refused --transformer-impl transformer_engine without CUDA and the
    # package before anything started (training/cli/installed.py).
    if uses_transformer_engine(args.transformer_impl):
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        spec = local_layer_spec(config, args.normalization, vp_stage,
                                qk_layernorm=args.qk_layernorm)
    if args.num_experts is not None:
        # megatron-core's MoE block: per layer, --moe-layer-freq picks a MoE or a dense MLP
        # (local spec: sequential experts, one MLP each; TE: grouped GEMM with the flag)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        te = uses_transformer_engine(args.transformer_impl)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                          normalization=args.normalization, vp_stage=vp_stage)
        if not te and (config.sequence_parallel or config.layernorm_zero_centered_gamma):
            spec = with_local_norms(spec)  # as local_layer_spec's
    kwargs = {} if vp_stage is None else {"vp_stage": vp_stage}
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        **kwargs,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_model_chunks(args: argparse.Namespace, config: TransformerConfig,
                       vocab_size: int) -> list[GPTModel]:
    """This pipeline rank's model chunks: one, or one per virtual stage."""
    vpp = args.virtual_pipeline_model_parallel_size
    if vpp is None:
        return [build_model(args, config, vocab_size)]
    return [build_model(args, config, vocab_size, vp_stage=i) for i in range(vpp)]


def wrap_ddp(args: argparse.Namespace, config: TransformerConfig, model: torch.nn.Module,
             chunk: int = 0) -> DistributedDataParallel:
    """``chunk``: the model chunk's index; as Megatron-LM does, every chunk after the first
    is one bucket (``disable_bucketing``: megatron-core splits the first chunk only)."""
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
        # Megatron-LM's default: the interleaved schedule's chunks keep their all-gathers
        # in the schedule's order (param_sync_func); --no-align-param-gather lets each
        # chunk's first forward start its own.
        align_param_gather=args.align_param_gather,
    )
    if args.ddp_bucket_size is not None:
        ddp_kwargs["bucket_size"] = args.ddp_bucket_size
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_kwargs), model,
                                  disable_bucketing=chunk > 0)
    ddp.broadcast_params()  # every DP replica starts from DP rank 0's initialization
    return ddp


def build_optimizer(args: argparse.Namespace, model_chunks: list[DistributedDataParallel],
                    timers=None) -> MegatronOptimizer:
    config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        # --decoupled-lr: megatron-core gives the embedding and output layer (marked
        # is_embedding_or_output_parameter) a parameter group of their own with this max_lr
        # (and min_lr), which the scheduler follows ([Note: the decoupled group on load])
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
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
        log_num_zeros_in_grad=args.log_num_zeros_in_grad,
    )
    if config.decoupled_lr is None:
        return get_megatron_optimizer(config, model_chunks)
    return get_megatron_optimizer(config, model_chunks,
                                  config_overrides=_decoupled_overrides(config))


def _decoupled_overrides(config: OptimizerConfig) -> dict:
    """megatron-core's standard parameter-group overrides (no weight decay on biases and
    1-D weights; ``decoupled_lr`` and ``decoupled_min_lr`` for the embedding and output
    layer), with the decoupled group marked ``is_decoupled_lr``.

    [Note: the decoupled group on load]
    megatron-core 0.16.1's distributed optimizer matches a checkpoint's parameter groups to
    its own by (``wd_mult``, ``lr_mult``, ``is_expert_parallel``, ``is_decoupled_lr``) alone,
    and its standard overrides leave ``is_decoupled_lr`` False: the embedding's group and
    the other weights' then match the same saved group, and a resume gives both one group's
    ``max_lr``/``min_lr`` (the other weights trained at ``--decoupled-lr``; measured in
    tests/distributed/test_integration_loss_fusion.py). 0.19.2 matches by the rates too.
    Marked, the group is told apart on both releases."""
    overrides = get_standard_config_overrides(config)
    return {key: ({**value, "is_decoupled_lr": True}
                  if key.attr == "is_embedding_or_output_parameter" else value)
            for key, value in overrides.items()}
