"""Run dev/cuda_dryrun.py with one planted GPU-only bug (tests/e2e/test_cuda_dryrun.py).

    torchrun ... tests/helpers/dryrun_plant.py <bug> <pretrain_gpt.py flags>

Each bug is put back by monkeypatching in this process only; no file changes.
"""

from __future__ import annotations

import sys

from dev import cuda_dryrun as tool


def _mean_loss_copied_to_host() -> None:
    """training/step.py's mean_loss as it was: the losses copied to the host, then
    all-reduced on the data-parallel group."""
    import torch
    import torch.distributed as dist

    from megatron.sdp4bit.training import step

    def mean_loss(losses, group):
        if losses:
            value = torch.stack([d["lm loss"].float() for d in losses]).mean().reshape(1).cpu()
        else:
            value = torch.zeros(1)
        dist.all_reduce(value, group=group)
        return value.item() / dist.get_world_size(group)

    step.mean_loss = mean_loss


def _finite_flag_on_host() -> None:
    """The finiteness check's verdict reduced as a host scalar (the save check's old bug)."""
    import torch
    import torch.distributed as dist

    from megatron.sdp4bit.training import step
    from megatron.sdp4bit.training.checkpoint import common
    from megatron.sdp4bit.training.guards import finite

    def all_finite(tensors):
        bad = torch.tensor([float(any(bool((~torch.isfinite(t)).any()) for t in tensors))])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bool(bad.item())

    for module in (finite, step, common):
        if hasattr(module, "all_finite"):
            module.all_finite = all_finite


def _param_gather_staged_on_host() -> None:
    """The qWD all-gather sending its message from a buffer allocated on the host."""
    import torch

    from megatron.sdp4bit.comm import all_gather

    original = all_gather._all_gather

    def staged(output, input, group):
        host = torch.empty(input.numel(), dtype=input.dtype)  # the bug: no device=
        host.copy_(input)
        return original(output, host, group)

    all_gather._all_gather = staged


BUGS = {
    "mean-loss-cpu": _mean_loss_copied_to_host,
    "finite-host-scalar": _finite_flag_on_host,
    "param-gather-host-buffer": _param_gather_staged_on_host,
}

if __name__ == "__main__":
    sys.exit(tool.run(sys.argv[2:], before_main=BUGS[sys.argv[1]]))
