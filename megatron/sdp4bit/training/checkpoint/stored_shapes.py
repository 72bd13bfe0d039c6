"""The tensors a load asks for, against the shapes a torch_dist checkpoint stores them at.

megatron-core compares every tensor a load asks for with the checkpoint's ``.metadata`` on
every rank, inside its load, and raises there: a shape that differs (a ``.metadata`` that
lies, or that was damaged, while the manifest still records this run's model) ended a resume
in a traceback on every worker. :func:`resume_shape_problem` makes the same comparison first,
on rank 0 for all ranks, and says it in one line naming the tensors. The ``.metadata`` read
is the one the restricted unpickler and ``dcp_entries`` already checked.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron.sdp4bit.training.checkpoint import safe_load


def sharded_tensors(state: Any) -> list[ShardedTensor]:
    """Every ShardedTensor of a sharded state dict, those a factory makes included (SwiGLU's
    ``linear_fc1`` is a factory that saves its two halves under the one key)."""
    out = []
    for value in nested_values(state) if isinstance(state, (dict, list)) else [state]:
        if isinstance(value, ShardedTensor):
            out.append(value)
        elif isinstance(value, ShardedTensorFactory):
            out += sharded_tensors(value.build())
    return out


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def resume_shape_problem(directory: str, state: dict[str, Any]) -> str | None:
    """Collective: the tensors of ``state`` (this rank's sharded state dict to load) whose
    global shape differs from the one the checkpoint stores, or that it lacks; None when
    all agree. Tensors megatron-core loads whatever their stored shape
    (``allow_shape_mismatch``) are left out, as its own check leaves them."""
    mine = {t.key: tuple(t.global_shape) for t in sharded_tensors(state)
            if not t.allow_shape_mismatch}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problem: list = [None]
    if dist.get_rank() == 0:
        wanted = {k: v for part in gathered for k, v in part.items()}
        stored = {k: tuple(m.size) for k, m in
                  safe_load.read_dcp_metadata(directory).state_dict_metadata.items()
                  if isinstance(m, TensorStorageMetadata)}
        wrong = [f"{k} is {_fmt(stored[k])} there, {_fmt(v)} here" if k in stored
                 else f"{k} is missing there"
                 for k, v in sorted(wanted.items()) if stored.get(k) != v]
        if wrong:
            more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
            problem[0] = (f"checkpoint {directory} does not hold the tensors this run loads, "
                          "although its manifest records this run's model: "
                          + "; ".join(wrong[:3]) + more + ": the checkpoint is damaged or was "
                          "altered; load an earlier one")
    dist.broadcast_object_list(problem, src=0)
    return problem[0]
