"""The L2 norm of the model's parameters, computed as Megatron-LM's ``calc_params_l2_norm``
(``megatron/training/utils``, which megatron-core does not ship).

[Note: which copy of a parameter]
With ``--bf16`` the norm is over the optimizer's fp32 main parameters, the copy the optimizer
updates (``param.main_param``, which megatron-core's optimizers set): with the distributed
optimizer each data-parallel rank holds one shard of them (``main_param_sharded``), so the
squares are summed over the data-parallel group (the expert data-parallel group for expert
parameters); without it each rank holds them whole. Otherwise (fp32, fp16) the norm is over
the model's own parameters, whole on every data-parallel rank. Parameters that tensor
parallelism leaves whole count on (expert) tensor-parallel rank 0 only and a parameter shared
between pipeline stages (the tied output layer) on its first stage only; the remaining sums
are taken over the model-parallel group (tensor x pipeline; expert parameters over the
expert tensor x expert x pipeline group). Every rank must call it: it is collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

__all__ = ["params_l2_norm"]


def _counted_here(param: torch.nn.Parameter, expert: bool) -> bool:
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    tp_rank = ps.get_expert_tensor_parallel_rank() if expert \
        else ps.get_tensor_model_parallel_rank()
    return tp_rank == 0


def _data(param: torch.nn.Parameter, bf16: bool) -> tuple[torch.Tensor | None, bool]:
    """(the values this rank counts, whether they are a data-parallel shard)."""
    if bf16 and hasattr(param, "main_param"):
        return param.main_param, bool(getattr(param, "main_param_sharded", False))
    return (param.data.float() if bf16 else param.data), False


def _squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for t in tensors:
        if t.numel():
            total += t.detach().float().pow(2).sum()
    return total


def _same_ranks(a, b) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def params_l2_norm(model_chunks: list, bf16: bool) -> float:
    """The parameters' L2 norm ([Note: which copy of a parameter]); collective."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    # (expert, sharded) -> tensors
    parts: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (e, s): [] for e in (False, True) for s in (False, True)}
    for chunk in model_chunks:
        for param in chunk.parameters():
            expert = not getattr(param, "allreduce", True)
            if not _counted_here(param, expert):
                continue
            data, sharded = _data(param, bf16)
            if data is not None:  # a distributed optimizer's rank may hold none of it
                parts[(expert, sharded)].append(data)
    sq = {key: _squares(tensors, device) for key, tensors in parts.items()}
    dist.all_reduce(sq[(False, True)],
                    group=ps.get_data_parallel_group(with_context_parallel=True))
    dist.all_reduce(sq[(True, True)], group=ps.get_expert_data_parallel_group())
    dense = sq[(False, False)] + sq[(False, True)]
    expert = sq[(True, False)] + sq[(True, True)]
    dense_group = ps.get_model_parallel_group()
    expert_group = ps.get_expert_tensor_model_pipeline_parallel_group()
    if _same_ranks(dense_group, expert_group):
        dense += expert
        dist.all_reduce(dense, group=dense_group)
    else:
        dist.all_reduce(dense, group=dense_group)
        dist.all_reduce(expert, group=expert_group)
        dense += expert
    return dense.item() ** 0.5
