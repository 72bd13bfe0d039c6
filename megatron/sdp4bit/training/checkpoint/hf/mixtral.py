"""``MixtralForCausalLM``: a Llama (:mod:`.llama`: RoPE, RMSNorm, no biases, grouped-query
attention) whose every MLP is a mixture of SwiGLU experts with a softmax top-k router.

[Note: megatron-core's MoE layer as Mixtral's]
megatron-core's router (``--moe-router-score-function softmax``, without
``--moe-router-pre-softmax``) takes the top k of the logits and a softmax over those k;
Mixtral's takes a softmax over all experts, the top k of it, and divides by their sum: the
same weights (softmax is monotonic, and the renormalized top k of a softmax is the softmax of
the top k logits). Each expert is megatron-core's SwiGLU MLP, ``linear_fc1`` = [gate; up]
(Mixtral's ``w1`` and ``w3``), ``linear_fc2`` its ``w2``; the router's weight is Mixtral's
``gate``; the norm before the MLP is ``post_attention_layernorm``, as in Llama. What maps
thus: every layer a MoE layer (``--moe-layer-freq`` all 1s), no shared expert, megatron-core's
sequential local experts (not Transformer Engine's grouped GEMM, which names its tensors
otherwise), dropless routing (the trainer has no capacity factor) and a router that is not
sinkhorn (whose inference routing is a sigmoid of the top-1 logit). The weights are written
as Mixtral's checkpoints on the Hub name them (``block_sparse_moe.experts.{e}.w1.weight``),
which transformers 4 reads as they are and 5 converts to its fused ``experts.gate_up_proj``
while loading.

Export only: ``tools/checkpoint/import_hf.py`` refuses a Mixtral (the trainer's import builds
one parameter per megatron-core tensor; its experts are one sharded tensor per layer).
"""

from __future__ import annotations

import torch

from megatron.sdp4bit.training.checkpoint.hf import llama
from megatron.sdp4bit.training.checkpoint.hf.common import differences
from megatron.sdp4bit.training.checkpoint.hf.tensors import L, Rule, Tensors

NAME = "MixtralForCausalLM"

# Settings an older manifest may lack that this architecture's config reads.
READS = llama.READS


def mismatches(model: dict) -> list[str]:
    """What keeps the settings from being a MixtralForCausalLM (empty: nothing)."""
    wrong = llama.mismatches({**model, "num_experts": None})
    if model.get("num_experts") is None:
        return wrong + ["num_experts is None (needs a mixture of experts, --num-experts)"]
    wrong += differences(model, {"moe_shared_expert_intermediate_size": None,
                                 "moe_router_score_function": "softmax",
                                 "moe_router_pre_softmax": False, "moe_grouped_gemm": False,
                                 "use_rope_scaling": False})
    if model.get("moe_router_load_balancing_type") == "sinkhorn":
        wrong.append("moe_router_load_balancing_type is 'sinkhorn' (needs another: "
                     "sinkhorn routes by a sigmoid at inference)")
    pattern = model.get("moe_layer_freq")
    if not isinstance(pattern, list) or not all(x == 1 for x in pattern):
        wrong.append(f"moe_layer_freq is {pattern!r} (needs every layer a MoE layer)")
    return wrong


def hf_config(model: dict) -> dict:
    """The Mixtral fields of ``config.json`` (fp32 weights, dropout off, no router noise)."""
    config = {k: v for k, v in llama.hf_config(model).items()
              if k not in ("attention_bias", "mlp_bias")}
    return {**config, "model_type": "mixtral",
            "intermediate_size": model["moe_ffn_hidden_size"],
            "num_local_experts": model["num_experts"],
            "num_experts_per_tok": model["moe_router_topk"],
            "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}


def trainer_flags(config) -> tuple[list[str], list[str]]:
    """Not imported (see the module's docstring)."""
    return [], ["a mixture of experts is exported by export_hf.py but not imported (only "
                "GPT2LMHeadModel and LlamaForCausalLM are)"]


def normalize(tensors: Tensors) -> Tensors:
    return tensors


def _fc1_to_hf(w: torch.Tensor, m: dict) -> tuple[torch.Tensor, ...]:
    # [experts, 2 x ffn, hidden], each expert's rows [gate; up]: every w1, then every w3
    ffn = m["moe_ffn_hidden_size"]
    return tuple(w[:, :ffn].unbind(0)) + tuple(w[:, ffn:].unbind(0))


def _fc1_from_hf(ts: tuple[torch.Tensor, ...], m: dict) -> torch.Tensor:
    experts = m["num_experts"]
    return torch.cat([torch.stack(ts[:experts]), torch.stack(ts[experts:])], dim=1)


LL, MOE = llama.LL, llama.LL + "block_sparse_moe."
_DENSE_MLP = (L + "{i}.mlp.linear_fc1.weight", L + "{i}.mlp.linear_fc2.weight")
RULES = tuple(r for r in llama.RULES if r.megatron not in _DENSE_MLP) + (
    Rule(L + "{i}.mlp.router.weight", (MOE + "gate.weight",)),
    Rule(L + "{i}.mlp.experts.experts.linear_fc1.weight",
         (MOE + "experts.{e}.w1.weight", MOE + "experts.{e}.w3.weight"),
         _fc1_to_hf, _fc1_from_hf),
    Rule(L + "{i}.mlp.experts.experts.linear_fc2.weight", (MOE + "experts.{e}.w2.weight",),
         lambda w, m: tuple(w.unbind(0)), lambda ts, m: torch.stack(ts)),
)
