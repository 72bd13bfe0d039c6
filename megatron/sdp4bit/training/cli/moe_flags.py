"""Megatron-LM's mixture-of-experts flags, with Megatron-LM's meanings and defaults.

The defaults are those of Megatron-LM's ``megatron/training/arguments.py`` (``_add_moe_args``
and the flags it generates from megatron-core's ``TransformerConfig``): no experts unless
``--num-experts``; top-2 routing with softmax scores and the GShard/Switch auxiliary loss at
coefficient 0 (so no loss unless ``--moe-aux-loss-coeff``); no z-loss; the allgather token
dispatcher; every layer a MoE layer (``--moe-layer-freq 1``); the expert FFN as wide as the
dense one; expert tensor parallelism equal to ``--tensor-model-parallel-size``. Experts are
megatron-core's sequential local experts (one MLP each); grouped GEMM and the MoE fusions
need Transformer Engine's CUDA kernels and are refused elsewhere, as is the flex dispatcher
(DeepEP / HybridEP kernels).
"""

from __future__ import annotations

import argparse

from megatron.sdp4bit.training.cli.errors import ArgumentsError
from megatron.sdp4bit.training.cli.layer_pattern import PatternError, parse_layer_pattern

__all__ = ["add_moe_flags", "check_moe_flags", "moe_config_overrides", "moe_track_names",
           "parse_moe_layer_freq"]

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
DISPATCHERS = ("allgather", "alltoall", "flex")
# Megatron-LM's metric name of each auxiliary loss (console and TensorBoard tag).
_TRACK_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                "global_aux_loss": "global_load_balancing_loss"}
# Flags that need Transformer Engine's CUDA kernels: flag -> what they would run.
_TE_ONLY = {
    "moe_grouped_gemm": ("--moe-grouped-gemm", "Transformer Engine's grouped GEMM"),
    "moe_permute_fusion": ("--moe-permute-fusion", "Transformer Engine's fused token permute"),
    "moe_router_fusion": ("--moe-router-fusion", "Transformer Engine's fused router top-k"),
}


def _fail(message: str) -> None:
    raise ArgumentsError(message)


def parse_moe_layer_freq(text: str) -> int | list[int]:
    """``--moe-layer-freq``: an integer N (one MoE layer every N layers) or a list pattern of
    0/1 per layer such as ``"([1]*3+[0]*1)*3"`` (Megatron-LM's ``moe_freq_type``), read by
    :func:`~.layer_pattern.parse_layer_pattern`'s bounded grammar, never evaluated."""
    text = str(text).strip()
    if "[" not in text:
        try:
            value = int(text) if len(text) <= 12 else None
        except ValueError:
            value = None
        if value is None:
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r} is neither an integer nor a list pattern such as "
                "\"([1]*3+[0]*1)*3\"")
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} must be >= 1")
        return value
    try:
        return parse_layer_pattern(text)
    except PatternError as err:
        raise argparse.ArgumentTypeError(f"{text[:60]!r}{'...' if len(text) > 60 else ''} is "
                                         f"not a layer pattern: {err}") from None


parse_moe_layer_freq.__name__ = "int or pattern"  # what docs/flags.md says the flag takes


def add_moe_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Megatron-LM: mixture of experts")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: none, a dense model)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism: the experts are split over this many ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallelism inside an expert (default "
                   "--tensor-model-parallel-size)")
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
                   help="N: every N-th layer is a MoE layer; or a 0/1 pattern per layer, "
                   "e.g. \"([1]*3+[0]*1)*3\"")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="FFN size of the shared expert(s) every token also goes through "
                   "(default: none)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"], help="how the router scores the experts")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (default: after)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=list(LOAD_BALANCING),
                   help="aux_loss: GShard/Switch loss per micro-batch; seq_aux_loss: per "
                   "sequence (DeepSeek-V2); global_aux_loss: over the global batch; sinkhorn: "
                   "S-BASE balancing (top-1); none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="scale of the load-balancing loss (1e-2 is a usual start)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="scale of the router z-loss (default: none)")
    g.add_argument("--moe-token-dispatcher-type", default="allgather", choices=list(DISPATCHERS),
                   help="how tokens reach their experts' ranks: all-gather, or all-to-all; "
                   "flex is refused (DeepEP / HybridEP kernels)")
    for dest, (flag, kernel) in _TE_ONLY.items():
        g.add_argument(flag, dest=dest, action="store_true",
                       help=f"use {kernel}: CUDA and Transformer Engine only (refused "
                       "elsewhere)")


def check_moe_flags(args: argparse.Namespace, *, transformer_engine: bool) -> None:
    """Check the MoE flags against each other and the parallel layout (after
    ``data_parallel_size`` is known); fill Megatron-LM's derived defaults.
    ``transformer_engine``: whether the layers use Transformer Engine (CUDA and the package)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp  # Megatron-LM's default
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if args.num_experts is None:
        given = [flag for flag, on in (
            ("--expert-model-parallel-size", ep != 1),
            ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size is not None),
            ("--moe-shared-expert-intermediate-size",
             args.moe_shared_expert_intermediate_size is not None),
            ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff != 0.0),
            ("--moe-z-loss-coeff", args.moe_z_loss_coeff is not None)) if on]
        given += [flag for dest, (flag, _) in _TE_ONLY.items() if getattr(args, dest)]
        if given:
            _fail(f"{given[0]} configures mixture-of-experts layers: add --num-experts")
        return
    if args.num_experts < 1:
        _fail(f"--num-experts={args.num_experts} must be >= 1")
    for flag, value in (("--expert-model-parallel-size", ep),
                        ("--expert-tensor-parallel-size", etp),
                        ("--moe-router-topk", args.moe_router_topk)):
        if value < 1:
            _fail(f"{flag}={value} must be >= 1")
    if args.num_experts % ep:
        _fail(f"--num-experts={args.num_experts} is not divisible by "
              f"--expert-model-parallel-size={ep}")
    if args.moe_router_topk > args.num_experts:
        _fail(f"--moe-router-topk={args.moe_router_topk} exceeds --num-experts="
              f"{args.num_experts}")
    if args.moe_router_load_balancing_type == "sinkhorn" and args.moe_router_topk != 1:
        _fail("--moe-router-load-balancing-type sinkhorn routes each token to one expert: "
              "pass --moe-router-topk 1")
    if args.moe_aux_loss_coeff < 0 or (args.moe_z_loss_coeff or 0.0) < 0:
        _fail("--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0")
    if args.world_size % (etp * ep * pp):
        _fail(f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size "
              f"x --expert-model-parallel-size x --pipeline-model-parallel-size = "
              f"{etp} x {ep} x {pp}")
    if tp > 1 and not args.sequence_parallel:
        _fail("--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel "
              "(megatron-core's rule for MoE layers)")
    if isinstance(args.moe_layer_freq, list) and len(args.moe_layer_freq) != args.num_layers:
        _fail(f"--moe-layer-freq gives {len(args.moe_layer_freq)} layers, but --num-layers is "
              f"{args.num_layers}")
    if args.moe_shared_expert_intermediate_size is not None and args.add_bias_linear:
        _fail("--moe-shared-expert-intermediate-size needs --disable-bias-linear "
              "(megatron-core's shared experts have no biases)")
    if args.moe_token_dispatcher_type == "flex":
        _fail("--moe-token-dispatcher-type flex runs DeepEP or HybridEP kernels (CUDA, "
              "separate packages) that this trainer does not drive: use alltoall or allgather")
    for dest, (flag, kernel) in _TE_ONLY.items():
        if getattr(args, dest) and not transformer_engine:
            _fail(f"{flag} needs {kernel} (CUDA and Transformer Engine, with --transformer-impl "
                  "transformer_engine); without them experts run as sequential local MLPs: "
                  "drop the flag")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # Megatron-LM's default


def moe_config_overrides(args: argparse.Namespace) -> dict:
    """TransformerConfig keywords of the MoE flags ({} for a dense model)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_grouped_gemm=args.moe_grouped_gemm,
        moe_permute_fusion=args.moe_permute_fusion,
        moe_router_fusion=args.moe_router_fusion,
    )


def moe_track_names(args: argparse.Namespace) -> list[str]:
    """The auxiliary losses Megatron-LM's trainer logs for these flags, by its names."""
    if args.num_experts is None:
        return []
    names = []
    if args.moe_router_load_balancing_type in _TRACK_NAMES:
        names.append(_TRACK_NAMES[args.moe_router_load_balancing_type])
    if args.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names
