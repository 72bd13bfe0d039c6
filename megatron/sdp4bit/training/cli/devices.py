"""Which process-group backend and which CUDA device each rank uses (``--distributed-backend``).

The rule, decided from torchrun's environment before ``torch.distributed`` starts:

* The backend is ``--distributed-backend``, by default NCCL with CUDA and gloo without.
  ``nccl`` without a CUDA device is refused.
* With CUDA, ``L`` local ranks (torchrun's ``LOCAL_WORLD_SIZE``) and ``D`` visible devices
  (``torch.cuda.device_count()``): when ``L <= D`` local rank ``r`` uses ``cuda:r``, as
  Megatron-LM does. When ``L > D`` the ranks share devices, local rank ``r`` on
  ``cuda:(r mod D)``: allowed with gloo only. NCCL refuses two ranks of one communicator
  on one device (``ncclInvalidUsage``), so with NCCL it is refused here, in one line,
  instead of failing inside the first collective.

[Note: several ranks on one GPU]
``--distributed-backend gloo`` on CUDA is the shared-device mode: every process group is
gloo (megatron-core creates its groups with the default backend, or with gloo explicitly
for its ``*_GLOO`` groups, in 0.16.1 and 0.19.2: nothing of it is replaced), every tensor
stays on the GPU, and gloo copies each collective's tensors through host memory. SDP4Bit's
quantizers then run their CUDA kernels on real messages between processes, with
``--dp-ranks-per-node`` making a few ranks of one GPU act as several nodes, so that one GPU
exercises both hops of the gradient reduce-scatter and the weight all-gather
(``tests/gpu/test_training_cuda.py``). It is a test mode, not a fast one: gloo moves the
bytes through host memory, and the ranks share the device's compute and memory.
"""

from __future__ import annotations

import argparse
import os

from megatron.sdp4bit.training.cli.errors import ArgumentsError

__all__ = ["BACKENDS", "check_backend", "local_device", "sharing_note"]

BACKENDS = ("nccl", "gloo")


def _local_world() -> tuple[int, int]:
    """(local rank, local world size) from torchrun's environment; a world of one without it."""
    return (int(os.environ.get("LOCAL_RANK", "0")),
            max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))


def check_backend(args: argparse.Namespace, cuda: bool, devices: int) -> None:
    """Set ``args.distributed_backend`` to the backend this run uses, or refuse (one
    :class:`ArgumentsError` line) what this machine cannot do. ``devices``: the CUDA devices
    this process sees (0 without CUDA)."""
    backend = args.distributed_backend or ("nccl" if cuda else "gloo")
    if backend not in BACKENDS:
        raise ArgumentsError(f"--distributed-backend {backend}: accepted: "
                             + ", ".join(BACKENDS))
    if backend == "nccl" and not cuda:
        raise ArgumentsError("--distributed-backend nccl needs CUDA devices and there is none "
                             "here: drop the flag (without CUDA the ranks use gloo)")
    _, local_world = _local_world()
    if backend == "nccl" and local_world > devices:
        raise ArgumentsError(
            f"{local_world} ranks on this node and {devices} CUDA device(s): NCCL cannot put "
            "two ranks on one device (ncclInvalidUsage): start at most one rank per device "
            f"(torchrun --nproc-per-node {devices}), or pass --distributed-backend gloo to let "
            "ranks share the devices (collectives through host memory: for tests, not speed)")
    args.distributed_backend = backend


def local_device(devices: int) -> int:
    """The CUDA device of this rank: its local rank, or its local rank modulo ``devices``
    when there are more local ranks than devices (gloo only, :func:`check_backend`)."""
    local_rank, _ = _local_world()
    return local_rank % devices


def sharing_note(devices: int) -> str | None:
    """One line saying how the local ranks share the devices, or None when they do not."""
    _, local_world = _local_world()
    if local_world <= devices:
        return None
    return (f"{local_world} ranks share {devices} CUDA device(s) (--distributed-backend gloo): "
            f"local rank r runs on cuda:(r mod {devices}), every collective goes through gloo")
