"""Which megatron-core setups SDP4Bit accepts: one check for the library and the trainer.

``install_sdp4bit`` reads the facts from the built DDP modules and optimizers
(:func:`setup_of`); the trainer's command line reads them from its flags before anything is
built. Both call :func:`check_supported`, which raises ``ValueError`` with one line: the
library's wording names the megatron-core option, the command line's the flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron.sdp4bit.config import SDP4BitConfig


@dataclasses.dataclass(frozen=True)
class Setup:
    """The facts about a megatron-core setup that decide whether SDP4Bit can run in it."""

    distributed_optimizer: bool
    fp32_params: bool = False
    """Parameters kept in fp32 (no --bf16 / --fp16): the optimizer's main params are views
    of the replica."""
    distributed_optimizer_instances: int = 1
    reduce_scatter_with_fp32_accumulation: bool = False
    megatron_fsdp: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    expert_tensor_parallel: bool = False
    """Expert tensor parallelism (expert TP > 1) in the expert-parallel buffers."""
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False  # 0.19.2 only
    precision_aware_optimizer: bool = False


def setup_of(model_chunks: Sequence, optimizers: Sequence) -> Setup:
    """The :class:`Setup` of built megatron-core DDP modules and distributed optimizers."""
    configs = [chunk.ddp_config for chunk in model_chunks]
    return Setup(
        distributed_optimizer=all(c.use_distributed_optimizer for c in configs),
        fp32_params=any(any(opt.model_fp32_groups) for opt in optimizers),
        distributed_optimizer_instances=max(c.num_distributed_optimizer_instances
                                            for c in configs),
        reduce_scatter_with_fp32_accumulation=any(c.reduce_scatter_with_fp32_accumulation
                                                  for c in configs),
        megatron_fsdp=any(c.use_megatron_fsdp or c.use_custom_fsdp for c in configs),
        reuse_grad_buf_for_mxfp8_param_ag=any(c.reuse_grad_buf_for_mxfp8_param_ag
                                              for c in configs),
        expert_tensor_parallel=_expert_tensor_parallel(model_chunks),
        fp8_param_gather=any(getattr(c, "fp8_param_gather", False) for c in configs),
        fp4_param_gather=any(getattr(c, "fp4_param_gather", False) for c in configs),
        precision_aware_optimizer=any(opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                                      for opt in optimizers),
    )


def _expert_tensor_parallel(model_chunks: Sequence) -> bool:
    if not any(getattr(chunk, "expert_parallel_bucket_groups", None) for chunk in model_chunks):
        return False
    from megatron.core import parallel_state

    return parallel_state.get_expert_tensor_parallel_world_size() > 1


def check_supported(config: SDP4BitConfig, setup: Setup, *, command_line: bool = False) -> None:
    """Raise ``ValueError`` (one line) for the first thing in ``setup`` SDP4Bit cannot run
    with as ``config`` asks; nothing when ``config`` quantizes nothing. ``command_line``:
    word it with the trainer's flags."""
    if not config.enabled:
        return

    def refuse(library: str, flags: str | None = None) -> None:
        raise ValueError(flags if command_line and flags else library)

    if not setup.distributed_optimizer:
        on = "--quantized-weights" if config.quantized_weights else "--quantized-gradients"
        refuse("SDP4Bit needs the distributed optimizer: build DistributedDataParallelConfig"
               "(use_distributed_optimizer=True) (--use-distributed-optimizer)",
               f"{on} requires --use-distributed-optimizer")
    if setup.distributed_optimizer_instances != 1:
        refuse("num_distributed_optimizer_instances > 1 is not supported by SDP4Bit: use 1",
               "--num-distributed-optimizer-instances > 1 is not supported by SDP4Bit: use 1")
    if setup.reduce_scatter_with_fp32_accumulation:
        refuse("reduce_scatter_with_fp32_accumulation replaces the same collective as TLq: "
               "turn it off",
               "--ddp-reduce-scatter-with-fp32-accumulation replaces the reduce-scatter that "
               "SDP4Bit replaces (whose quantized gradients are already summed in fp32): drop it")
    if setup.megatron_fsdp:
        refuse("Megatron-FSDP (use_megatron_fsdp / use_custom_fsdp) is not supported by "
               "SDP4Bit: it shards parameters with its own collectives; use "
               "DistributedDataParallel with the distributed optimizer",
               "--use-megatron-fsdp and --use-torch-fsdp2 are not supported by SDP4Bit: they "
               "shard the parameters with their own collectives; use "
               "--use-distributed-optimizer instead")
    if setup.reuse_grad_buf_for_mxfp8_param_ag:
        refuse("reuse_grad_buf_for_mxfp8_param_ag is not supported by SDP4Bit: turn it off",
               "--reuse-grad-buf-for-mxfp8-param-ag is not supported by SDP4Bit: drop it")
    if setup.expert_tensor_parallel:
        refuse("expert tensor parallelism (expert_tensor_parallel_size > 1) is not supported "
               "by SDP4Bit: the weights expert TP does not split would drift apart across the "
               "expert-TP ranks; use expert_tensor_parallel_size=1",
               "SDP4Bit does not support --expert-tensor-parallel-size > 1: use 1")
    if not config.quantized_weights:
        return
    for flag, on in (("fp8_param_gather", setup.fp8_param_gather),
                     ("fp4_param_gather", setup.fp4_param_gather)):
        if on:
            option = "--" + flag.replace("_", "-")
            refuse(f"qWD needs 16-bit model parameters, but {flag} keeps the replica as "
                   "quantized bytes with no weights to take a difference of: turn "
                   f"{flag} off, or quantize only the gradients (quantized_gradients)",
                   f"--quantized-weights cannot be combined with {option}, which keeps the "
                   "replica as quantized bytes with no weights to take a difference of: drop "
                   f"{option}, or quantize only the gradients (--quantized-gradients alone)")
    if setup.precision_aware_optimizer:
        refuse("qWD needs the fp32 main params of the distributed optimizer: turn off "
               "use_precision_aware_optimizer",
               "--quantized-weights needs the fp32 main params of the distributed optimizer, "
               "which --use-precision-aware-optimizer does not keep: drop it")
    if setup.fp32_params:
        refuse("qWD needs 16-bit model parameters (--bf16 or --fp16): with fp32 parameters "
               "the optimizer updates the replica in place (main params are views of it), so "
               "there is no separate main copy to take the weight difference against",
               "--quantized-weights requires 16-bit parameters: add --bf16 (or --fp16)")
