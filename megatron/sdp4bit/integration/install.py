"""``install_sdp4bit``: the one entry point that puts SDP4Bit into megatron-core.

It binds replacements on *instances* (each bucket group's ``start_grad_sync`` /
``start_param_sync``, each distributed optimizer's ``_copy_main_params_to_model_params``),
never on classes or modules, so a baseline model in the same process is untouched and
``handle.uninstall()`` restores megatron-core's behaviour exactly (the instance attributes
are deleted; the class methods were never changed). See docs/integration.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.distributed as dist

from megatron.sdp4bit.comm import (
    CommStats,
    GradientQuantConfig,
    WeightQuantConfig,
    build_topology,
    check_padded,
    divisor_from_config,
)
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.grad_sync import make_start_grad_sync
from megatron.sdp4bit.integration.param_sync import (
    MainShard,
    main_shards,
    make_copy_main_params_to_model_params,
    make_start_param_sync,
)
from megatron.sdp4bit.integration.state import RunState
from megatron.sdp4bit.integration.tp_duplicates import (
    make_copy_model_grads_to_main_grads,
    tp_duplicates,
)
from megatron.sdp4bit.integration.version import check_megatron_core_version

_INSTALLED_ATTR = "_sdp4bit_installed"


@dataclasses.dataclass
class SDP4BitHandle:
    """What :func:`install_sdp4bit` returns: counters, the iteration hook, ``uninstall()``."""

    state: RunState
    _patched: list[tuple[object, str]]
    bucket_numels: dict[int, int]
    """Bucket id -> elements in the bucket (padded), for byte accounting."""

    @property
    def config(self) -> SDP4BitConfig:
        return self.state.config

    @property
    def stats(self) -> CommStats:
        """Bytes sent by the quantized collectives and their unquantized equivalents."""
        return self.state.stats

    def set_iteration(self, iteration: int) -> None:
        """Call at the start of every iteration: it seeds the rounding noise (reproducible,
        resumable) and decides when ``gradients_quantization_start_iteration`` is reached."""
        if iteration < 0:
            raise ValueError(f"iteration={iteration} must be >= 0")
        self.state.iteration = iteration

    @property
    def installed(self) -> bool:
        return bool(self._patched)

    def uninstall(self) -> None:
        """Give megatron-core its own collectives and copy back. In-flight collectives must
        have been waited for (call between iterations, after a forced param sync)."""
        for obj, name in self._patched:
            handle = getattr(obj, "grad_reduce_handle", None) or getattr(
                obj, "param_gather_handle", None)
            if handle is not None:
                raise RuntimeError("uninstall() with a collective in flight: finish the "
                                   "iteration (and ddp.start_param_sync(force_sync=True)) first")
        for obj, name in self._patched:
            delattr(obj, name)
            if hasattr(obj, _INSTALLED_ATTR):
                delattr(obj, _INSTALLED_ATTR)
        self._patched = []


def _refuse(condition: bool, message: str) -> None:
    if condition:
        raise ValueError(message)


def _check_supported(model_chunks: Sequence, optimizers: Sequence, config: SDP4BitConfig) -> None:
    for chunk in model_chunks:
        ddp_config = chunk.ddp_config
        _refuse(not ddp_config.use_distributed_optimizer,
                "SDP4Bit needs the distributed optimizer: build DistributedDataParallelConfig"
                "(use_distributed_optimizer=True) (--use-distributed-optimizer)")
        _refuse(ddp_config.num_distributed_optimizer_instances != 1,
                "num_distributed_optimizer_instances > 1 is not supported by SDP4Bit: use 1")
        _refuse(ddp_config.reduce_scatter_with_fp32_accumulation,
                "reduce_scatter_with_fp32_accumulation replaces the same collective as TLq: "
                "turn it off")
        _refuse(ddp_config.use_megatron_fsdp or ddp_config.use_custom_fsdp,
                "Megatron-FSDP (use_megatron_fsdp / use_custom_fsdp) is not supported by "
                "SDP4Bit: it shards parameters with its own collectives; use "
                "DistributedDataParallel with the distributed optimizer")
        _refuse(ddp_config.reuse_grad_buf_for_mxfp8_param_ag,
                "reuse_grad_buf_for_mxfp8_param_ag is not supported by SDP4Bit: turn it off")
        _refuse(bool(chunk.expert_parallel_bucket_groups),
                "expert-parallel (MoE) buffers are not supported by SDP4Bit yet")
        if getattr(chunk, _INSTALLED_ATTR, False):
            raise ValueError("SDP4Bit is already installed on this model: call "
                             "handle.uninstall() before installing again")
    if config.quantized_weights:
        for chunk in model_chunks:
            for flag in ("fp8_param_gather", "fp4_param_gather"):  # fp4: 0.19.2 only
                _refuse(getattr(chunk.ddp_config, flag, False),
                        f"qWD needs 16-bit model parameters, but {flag} keeps the replica as "
                        "quantized bytes with no weights to take a difference of: turn "
                        f"{flag} off, or quantize only the gradients (quantized_gradients)")
        for opt in optimizers:
            _refuse(opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    "qWD needs the fp32 main params of the distributed optimizer: turn off "
                    "use_precision_aware_optimizer")
            _refuse(any(opt.model_fp32_groups),
                    "qWD needs 16-bit model parameters (--bf16 or --fp16): with fp32 parameters "
                    "the optimizer updates the replica in place (main params are views of it), so "
                    "there is no separate main copy to take the weight difference against")


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for opt in optimizers:
        if not isinstance(opt, DistributedOptimizer):
            raise ValueError(f"SDP4Bit needs megatron-core's DistributedOptimizer, got "
                             f"{type(opt).__name__}: pass use_distributed_optimizer=True to "
                             "OptimizerConfig")
    return optimizers


def install_sdp4bit(model_chunks, optimizer, config: SDP4BitConfig, *,
                    allow_untested_version: bool = False) -> SDP4BitHandle:
    """Quantize the collectives of ``model_chunks`` (megatron-core DDP modules) and
    ``optimizer`` (what ``get_megatron_optimizer`` returned) as ``config`` says.

    Collective over the default process group (it builds the DP topology): every rank calls
    it at the same point. The DDP modules must have been built inside
    :func:`~megatron.sdp4bit.integration.sdp4bit_padding` with the same ``config``;
    otherwise the bucket check raises ``ValueError`` with the fix.
    """
    check_megatron_core_version(allow_untested_version=allow_untested_version)
    if not isinstance(config, SDP4BitConfig):
        raise ValueError(f"config must be an SDP4BitConfig, got {type(config).__name__}")
    if not config.enabled:
        raise ValueError("config quantizes nothing: set quantized_weights and/or "
                         "quantized_gradients, or do not install SDP4Bit")
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    optimizers = _distributed_optimizers(optimizer)
    _check_supported(model_chunks, optimizers, config)

    state = RunState(config=config, grad_config=GradientQuantConfig.from_sdp4bit(config),
                     weight_config=WeightQuantConfig.from_sdp4bit(config))
    bucket_groups = [bg for chunk in model_chunks for bg in chunk.bucket_groups]
    # Stable bucket ids, identical on the DP ranks of a group (same layout everywhere).
    bucket_ids: dict[int, int] = {}
    dp_rank_of: dict[int, int] = {}
    world_of: dict[int, int] = {}
    numels: dict[int, int] = {}
    for bg in bucket_groups:
        for bucket in bg.buckets:
            bid = len(bucket_ids)
            bucket_ids[id(bucket)] = bid
            dp_rank_of[id(bucket)] = bg.intra_distributed_optimizer_instance_rank
            world_of[id(bucket)] = bg.intra_distributed_optimizer_instance_size
            numels[bid] = bucket.grad_data.numel()
            divisor = divisor_from_config(config, world_of[id(bucket)])
            check_padded(numels[bid], divisor,
                         f"bucket {bid} (build DistributedDataParallel inside "
                         "megatron.sdp4bit.integration.sdp4bit_padding(config) to pad it)")

    # One topology per DP group; build_topology is collective over the world, and every
    # rank has the same number of (dense) bucket-group DP groups, met in the same order.
    groups = {}
    for bg in bucket_groups:
        groups.setdefault(id(bg.intra_distributed_optimizer_instance_group),
                          bg.intra_distributed_optimizer_instance_group)
    topologies = {key: build_topology(group, config.dp_ranks_per_node)
                  for key, group in groups.items()}

    shards: dict[int, MainShard] = {}
    if config.quantized_weights:
        shards = main_shards(optimizers, bucket_ids, dp_rank_of, world_of)
        for bg in bucket_groups:
            for bucket in bg.buckets:
                shard = bucket.param_data.numel() // world_of[id(bucket)]
                shards.setdefault(bucket_ids[id(bucket)],
                                  MainShard(shard, bucket.param_data.device, []))

    # TP > 1: the weights TP does not split stay equal on all TP ranks (tp_duplicates.py)
    duplicates = tp_duplicates(model_chunks, bucket_ids, dp_rank_of, world_of)

    patched: list[tuple[object, str]] = []
    for bg in bucket_groups:
        group = bg.intra_distributed_optimizer_instance_group
        group_id = min(dist.get_process_group_ranks(group))
        ids = [bucket_ids[id(b)] for b in bg.buckets]
        if config.quantized_gradients:
            bg.start_grad_sync = make_start_grad_sync(
                bg, bucket_ids=ids, topology=topologies[id(group)], group_id=group_id,
                state=state)
            patched.append((bg, "start_grad_sync"))
        if config.quantized_weights:
            bg.start_param_sync = make_start_param_sync(
                bg, bucket_ids=ids, shards=shards, group_id=group_id,
                ranks_per_node=topologies[id(group)].ranks_per_node, state=state,
                duplicates=duplicates)
            patched.append((bg, "start_param_sync"))
    if config.quantized_gradients and duplicates is not None:
        for opt in optimizers:
            opt._copy_model_grads_to_main_grads = make_copy_model_grads_to_main_grads(
                opt, duplicates, bucket_ids, dp_rank_of, world_of)
            patched.append((opt, "_copy_model_grads_to_main_grads"))
    if config.quantized_weights:
        for opt in optimizers:
            opt._copy_main_params_to_model_params = make_copy_main_params_to_model_params(opt)
            patched.append((opt, "_copy_main_params_to_model_params"))
    for chunk in model_chunks:
        setattr(chunk, _INSTALLED_ATTR, True)
        patched.append((chunk, _INSTALLED_ATTR))
    return SDP4BitHandle(state=state, _patched=patched, bucket_numels=numels)
