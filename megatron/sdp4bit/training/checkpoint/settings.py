"""The manifest's settings contract: what a checkpoint records about the run that wrote it,
and how a later run is compared with it (a changed tokenizer counts as changed data).

:func:`run_settings` is what the trainer records (``manifest.json``'s ``settings``): the
parallel layout, the model's shape, the data order, the SDP4Bit method, and, not compared,
the tokenizer (its vocabulary size, type, files and special ids) and the megatron-core
release. :func:`settings_problem`
compares a manifest with this run's settings. Settings added after a manifest was written
are read with the value every run had before (:data:`LATER_MODEL_DEFAULTS`,
:data:`LATER_SDP4BIT_SETTINGS`) or left out of the comparison
(:data:`LATER_MODEL_SETTINGS`). A new setting goes here, with its entry for older manifests.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.version import megatron_core_version

# The model flags a checkpoint records, by their ``args`` names.
MODEL_KEYS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
    "group_query_attention", "num_query_groups", "max_position_embeddings",
    "position_embedding_type", "rotary_base", "rotary_percent",
    "untie_embeddings_and_output_weights", "swiglu", "openai_gelu", "normalization",
    "norm_epsilon", "add_bias_linear", "params_dtype", "qk_layernorm", "use_rope_scaling",
    "rope_scaling_factor", "apply_layernorm_1p")

# The mixture-of-experts flags a checkpoint records (what defines the experts' tensors and
# the routing of the forward pass, sinkhorn's included; the coefficients of the auxiliary
# losses are training choices, not the model's). A dense model records them all as None.
MOE_KEYS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
            "moe_shared_expert_intermediate_size", "moe_router_topk",
            "moe_router_score_function", "moe_router_pre_softmax",
            "moe_router_load_balancing_type", "moe_grouped_gemm")

# Model settings recorded since the Llama export (tools/checkpoint/export_hf.py), and the MoE
# settings since they were recorded, with the trainer's defaults: a manifest written before
# lacks them, and such a checkpoint still resumes (they are not compared); the export reads
# them as these defaults (a dense model).
LATER_MODEL_SETTINGS = {"norm_epsilon": 1e-5, "rotary_base": 10000, "rotary_percent": 1.0,
                        **dict.fromkeys(MOE_KEYS)}

# Layout entries recorded only for a MoE model, since they were recorded: a manifest without
# them (a dense model's: then num_experts says so; or an older trainer's MoE checkpoint) is
# compared without them.
LATER_LAYOUT_KEYS = ("ep", "etp")

# Model settings recorded since they were added, with the value every run had before (the
# trainer refused --openai-gelu and --apply-layernorm-1p until then): an older manifest is
# read as having that value, and compared.
LATER_MODEL_DEFAULTS = {"openai_gelu": False, "qk_layernorm": False, "use_rope_scaling": False,
                        "rope_scaling_factor": 8.0, "apply_layernorm_1p": False}

# SDP4Bit settings recorded since they were added, with the value every run had before:
# an older manifest lacks them and is read as having that value.
LATER_SDP4BIT_SETTINGS = {"weight_difference_target": "main"}

# Error feedback, part of the method since it was recorded (before, switching it on or off,
# or its storage, rounding, decay or reset, on resume went unnoticed): a manifest without
# gradient_error_feedback is an older trainer's, whose runs may have had it, so these are
# not compared with it.
ERROR_FEEDBACK_KEYS = ("gradient_error_feedback", "gradient_error_feedback_decay",
                       "gradient_error_feedback_reset_interval",
                       "gradient_error_feedback_storage", "gradient_error_feedback_rounding")


def run_settings(args: argparse.Namespace, sdp4bit_config: SDP4BitConfig,
                 vocab: int, tokenizer_vocab: int | None = None,
                 tokenizer: dict | None = None) -> dict:
    """What a checkpoint must agree with to be resumed by this run (recorded in its
    manifest): the parallel layout, the model's shape and the SDP4Bit method; and, not
    compared, the tokenizer's vocabulary size before padding (the HF export cuts the
    padding rows off with it), the tokenizer (``tokenizers.registry.record``: its type,
    files and special ids, which the HF export ships) and the megatron-core release writing
    it (``checkpoint.formats.release_problem``)."""
    layout = {"world_size": args.world_size, "tp": args.tensor_model_parallel_size,
              "pp": args.pipeline_model_parallel_size, "dp": args.data_parallel_size,
              "ddp_bucket_size": args.ddp_bucket_size if args.overlap_grad_reduce else None}
    if getattr(args, "virtual_pipeline_model_parallel_size", None):  # recorded only when used, so
        # the checkpoints of runs without it compare as before
        layout["vpp"] = args.virtual_pipeline_model_parallel_size
    model = {k: getattr(args, k) for k in MODEL_KEYS}
    model["padded_vocab_size"] = vocab
    model.update(moe_settings(args))
    if model["num_experts"] is not None:
        layout["ep"] = args.expert_model_parallel_size
        layout["etp"] = args.expert_tensor_parallel_size
    return {"layout": layout, "model": model, "data": data_settings(args),
            "sdp4bit": method_settings(sdp4bit_config), "vocab_size": tokenizer_vocab,
            "tokenizer": tokenizer,
            "megatron_core": megatron_core_version()}  # the release that wrote it


def moe_settings(args: argparse.Namespace) -> dict:
    """The mixture-of-experts part of the model settings (:data:`MOE_KEYS`); ``moe_layer_freq``
    as its per-layer pattern (megatron-core's reading of an integer N: layer i is a MoE layer
    when i % N == 0), so that ``2`` and ``[1,0,1,0]`` compare equal."""
    if getattr(args, "num_experts", None) is None:
        return dict.fromkeys(MOE_KEYS)
    freq = args.moe_layer_freq
    pattern = list(freq) if isinstance(freq, list) else [
        int(i % freq == 0) for i in range(args.num_layers)]
    return {**{k: getattr(args, k) for k in MOE_KEYS}, "moe_layer_freq": pattern}


def same_layout(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a manifest's layout is this run's (what per-rank state, the RNG streams and
    the error-feedback state, needs), entries a manifest may lack left out."""
    return _comparable(saved.get("layout") or {}, current["layout"]) == \
        _comparable(current["layout"], saved.get("layout") or {})


def _comparable(layout: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``layout`` without the :data:`LATER_LAYOUT_KEYS` that the ``other`` layout lacks."""
    return {k: v for k, v in layout.items() if k not in LATER_LAYOUT_KEYS or k in other}


def data_settings(args: argparse.Namespace) -> dict:
    """What decides which samples a run reads and in which order: the blend (absolute
    prefixes and their weights), the split and the seed."""
    def blend(values: list[str] | None) -> str | None:
        if not values:
            return None
        if len(values) == 1:
            return os.path.abspath(values[0])
        return " ".join(f"{float(w):g} {os.path.abspath(p)}"
                        for w, p in zip(values[0::2], values[1::2]))

    if args.mock_data:
        data = {"data_path": "mock"}
    elif args.data_path:
        data = {"data_path": blend(args.data_path)}
    else:  # --train-data-path, --valid-data-path, --test-data-path
        data = {f"{s}_data_path": blend(getattr(args, f"{s}_data_path"))
                for s in ("train", "valid", "test")}
    if args.split_vector is not None:  # '98,2,0' and '98, 2, 0' agree
        data["split"] = ",".join(f"{x:.6g}" for x in args.split_vector)
    for key in ("eval_data_seed", "train_data_seed"):  # absent: that split uses --seed
        if getattr(args, key, None) is not None:
            data[key] = getattr(args, key)
    return {**data, "seed": args.seed}


def method_settings(config: SDP4BitConfig) -> dict:
    """The SDP4Bit flags that define the method (those of a part that is off do not)."""
    c = dataclasses.asdict(config)
    keys = ["quantized_weights", "quantized_gradients"]
    if config.quantized_weights:
        keys += ["weight_quantization_bits", "wq_group_size", "weight_quantization_mode"]
        if config.weight_quantization_mode == "diff":
            keys.append("weight_difference_target")
    if config.quantized_gradients:
        keys += ["gradient_quantization_bits_intra", "gq_group_size_intra",
                 "gradient_quantization_bits_inter", "gq_group_size_inter",
                 "hadamard_transform", "gradient_alltoall_pipeline",
                 "gradients_quantization_start_iteration"]
        if config.hadamard_transform:
            keys.append("hadamard_block_size")
        keys += ERROR_FEEDBACK_KEYS if config.gradient_error_feedback else \
            ERROR_FEEDBACK_KEYS[:1]
    if config.enabled:
        keys.append("quantization_rounding")
    return {k: c[k] for k in keys}


def describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items())


def saved_model_settings(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """A manifest's model settings, with :data:`LATER_MODEL_DEFAULTS` for what it lacks and
    this run's settings (``current["model"]``) record."""
    return {**{k: v for k, v in LATER_MODEL_DEFAULTS.items() if k in current["model"]},
            **saved.get("model", {})}


# What makes a tokenizer another one for the model (not where its files are).
TOKENIZER_KEYS = ("type", "vocab_size", "eod")


def _tokenizer_problem(saved: dict | None, current: dict | None, directory: str) -> str | None:
    """A changed tokenizer (both manifests record one: an older one does not)."""
    if not saved or not current:
        return None
    diff = [k for k in TOKENIZER_KEYS if saved.get(k) != current.get(k)]
    if not diff:
        return None
    return (f"checkpoint {directory} was trained with tokenizer "
            f"{describe({k: saved.get(k) for k in diff})}; this run has "
            f"{describe({k: current.get(k) for k in diff})}: pass the checkpoint's "
            "--tokenizer-type and tokenizer files, or --allow-changed-data to continue with "
            "another tokenizer")


def settings_problem(saved: dict[str, Any], current: dict[str, Any], directory: str,
                     allow_sdp4bit_change: bool, allow_data_change: bool = False) -> str | None:
    """What forbids resuming a checkpoint whose manifest recorded ``saved`` with this run's
    ``current`` settings, in one line (None: nothing)."""
    if "model" in saved:
        saved = {**saved, "model": saved_model_settings(saved, current)}
        unrecorded = [k for k in LATER_MODEL_SETTINGS if k not in saved["model"]]
        current = {**current, "model": {k: v for k, v in current["model"].items()
                                        if k not in unrecorded}}
        experts = saved["model"].get("num_experts"), current["model"].get("num_experts")
        if "num_experts" in saved["model"] and (experts[0] is None) != (experts[1] is None):
            # a dense model against a mixture of experts: that one difference says it all
            return (f"checkpoint {directory} was saved with model num_experts {experts[0]}; "
                    f"this run has num_experts {experts[1]}: resume with the same model "
                    "flags (--num-experts and the other MoE flags)")
    saved_layout = saved.get("layout") or {}
    saved = {**saved, "layout": _comparable(saved_layout, current["layout"])}
    current = {**current, "layout": _comparable(current["layout"], saved_layout)}
    for part, fix in (("layout", "resume with the same layout (or start a new run)"),
                      ("model", "resume with the same model flags")):
        if saved.get(part) != current[part]:
            diff = {k for k in set(saved.get(part, {})) | set(current[part])
                    if saved.get(part, {}).get(k) != current[part].get(k)}
            was = {k: saved.get(part, {}).get(k) for k in sorted(diff)}
            now = {k: current[part].get(k) for k in sorted(diff)}
            return (f"checkpoint {directory} was saved with {part} {describe(was)}; this run "
                    f"has {describe(now)}: {fix}")
    if "data" in current and saved.get("data") != current["data"] and not allow_data_change:
        old, new = saved.get("data") or {}, current["data"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        was = {k: old.get(k, "unrecorded") for k in diff}
        now = {k: new.get(k) for k in diff}
        return (f"checkpoint {directory} was trained with {describe(was)}; this run has "
                f"{describe(now)}: resume with the checkpoint's --data-path, --split and "
                "--seed (and --train-data-seed / --eval-data-seed), or pass --allow-changed-data to continue on other data")
    problem = _tokenizer_problem(saved.get("tokenizer"), current.get("tokenizer"), directory)
    if problem is not None and not allow_data_change:
        return problem
    if "sdp4bit" in saved:
        saved = {**saved, "sdp4bit": {**{k: v for k, v in LATER_SDP4BIT_SETTINGS.items()
                                         if k in current["sdp4bit"]}, **saved["sdp4bit"]}}
        if ERROR_FEEDBACK_KEYS[0] not in saved["sdp4bit"]:  # an older trainer's manifest
            current = {**current, "sdp4bit": {k: v for k, v in current["sdp4bit"].items()
                                               if k not in ERROR_FEEDBACK_KEYS}}
    if saved.get("sdp4bit") != current["sdp4bit"] and not allow_sdp4bit_change:
        old, new = saved.get("sdp4bit", {}), current["sdp4bit"]
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        switches = [k for k in ("quantized_weights", "quantized_gradients") if k in diff] or [
            k for k in ERROR_FEEDBACK_KEYS[:1] if k in diff]
        diff = switches or diff  # a part switched on or off: its own flags follow it
        was = {k: old.get(k, "off") for k in diff}
        now = {k: new.get(k, "off") for k in diff}
        return (f"checkpoint {directory} was trained with SDP4Bit {describe(was)}; this run "
                f"has {describe(now)}: use the same SDP4Bit flags, or pass "
                "--allow-changed-sdp4bit-settings to change the method on resume")
    return None
