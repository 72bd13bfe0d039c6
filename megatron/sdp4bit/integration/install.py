"""``install_sdp4bit``: the one entry point that puts SDP4Bit into megatron-core.

It binds replacements on *instances* (each bucket group's ``start_grad_sync`` /
``start_param_sync``, each distributed optimizer's ``_copy_main_params_to_model_params``
and, with TP > 1, ``_copy_model_grads_to_main_grads``), never on classes or modules, so a
baseline model in the same process is untouched and ``handle.uninstall()`` restores
megatron-core's behaviour exactly (the instance attributes are deleted; the class methods
were never changed). The four are entries of the replacement table (``patches.py``),
declared below. See docs/integration.md.

Every optimizer step checks first that each of its buckets was reduced: step_checks.py,
[Note: a loop that never reduces its gradients]. Expert-parallel buffers (MoE) are
quantized on their own data-parallel group: [Note: expert-parallel buckets].

[Note: expert-parallel buckets]
megatron-core keeps the expert parameters of a MoE model in buffers of their own
(``expert_parallel_buffers``), whose bucket groups (``expert_parallel_bucket_groups``) run
their reduce-scatter and all-gather on the expert data-parallel group
(``intra_expt_dp_group``: the ranks holding the same experts, world / (expert TP x EP x PP)
of them), and builds a second distributed optimizer over them (a ``ChainedOptimizer``).
SDP4Bit installs on both kinds of bucket group alike, each on its own group with that
group's own two-level topology: which of the group's ranks share a node follows from the
node layout the dense group sees (``--dp-ranks-per-node`` cuts nodes out of the dense data-
parallel ranks; a rank's node is then its dense DP rank // N), so with the experts spread
inside a node (EP <= ranks per node) the expert group has one rank per node and its
gradients take the 4-bit inter-node hop alone. An expert group of one rank (EP = DP) sends
nothing: megatron-core's collectives stay (no quantization error for nothing), counted for
the step check only. Bucket ids run over the dense buckets, then the expert ones, the same
on every rank; the bytes of the expert buckets are counted in ``handle.expert_stats`` as
well as in ``handle.stats``.

[Note: an iteration without set_iteration]
``handle.set_iteration(it)`` seeds the iteration's rounding noise and starts the counters of
``step_stats()``. A loop that forgets it, for one iteration or for all, would still train: the
noise of the last iteration repeats (or iteration 0's forever) and ``step_stats()`` becomes
cumulative, with nothing said. So an iteration is *opened* by ``set_iteration`` and *closed*
by the optimizer step (the replaced ``_copy_main_params_to_model_params``, which every
successful step calls after its update and before its all-gather; in a chain of distributed
optimizers, the last one's), and both the gradient
reduce-scatter (``start_grad_sync``, quantized or not yet) and the step itself raise one line
when the iteration is not open. The first of them is the iteration's first collective that
SDP4Bit issues: with quantized gradients the reduce-scatter, with qWD alone the step's
all-gather (behind the step). Parameter all-gathers are not checked themselves: an evaluation
or a checkpoint save forces them between iterations, legitimately without a new
``set_iteration``, and an all-gather draws the noise of the step it sends anyway
(param_sync.py, [Note: a parameter sync sends each step once]).
A step skipped for non-finite gradients never reaches the copy and leaves the iteration open.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
import torch.distributed as dist

from megatron.sdp4bit.comm import (
    CommStats,
    ErrorFeedback,
    ErrorFeedbackConfig,
    GradientQuantConfig,
    WeightQuantConfig,
)
from megatron.sdp4bit.comm.error_feedback import first_damaged
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.buckets import BucketInfo, bucket_infos
from megatron.sdp4bit.integration.grad_sync import make_start_grad_sync
from megatron.sdp4bit.integration.param_sync import (
    main_shards,
    make_copy_main_params_to_model_params,
    make_start_param_sync,
)
from megatron.sdp4bit.integration.patches import INSTANCE, PADDING, SEAM, both, declare
from megatron.sdp4bit.integration.state import RunState
from megatron.sdp4bit.integration.support import check_supported, setup_of
from megatron.sdp4bit.integration.step_checks import (
    make_copy_model_grads_to_main_grads,
    optimizer_bucket_ids,
)
from megatron.sdp4bit.integration.topologies import ModelTopologies, model_topologies
from megatron.sdp4bit.integration.tp_duplicates import tp_duplicates
from megatron.sdp4bit.integration.version import check_megatron_core_version

_BUCKET_GROUP = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_DIST_OPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
START_GRAD_SYNC = declare(
    "install.start_grad_sync", _BUCKET_GROUP, "start_grad_sync", INSTANCE, make_start_grad_sync,
    note="[Note: the replaced start_grad_sync] (integration/grad_sync.py)",
    checked=both("(self, force_all_reduce)"), scope=SEAM)
START_PARAM_SYNC = declare(
    "install.start_param_sync", _BUCKET_GROUP, "start_param_sync", INSTANCE,
    make_start_param_sync,
    note="[Note: qWD keeps the replica until the all-gather] (integration/param_sync.py)",
    checked=both("(self, force_sync)"), scope=SEAM)
COPY_MAIN_PARAMS = declare(
    "install.copy_main_params_to_model_params", _DIST_OPT, "_copy_main_params_to_model_params",
    INSTANCE, make_copy_main_params_to_model_params,
    note="[Note: an iteration without set_iteration] (integration/install.py)",
    checked=both("(self)"), scope=SEAM)
COPY_MODEL_GRADS = declare(
    "install.copy_model_grads_to_main_grads", _DIST_OPT, "_copy_model_grads_to_main_grads",
    INSTANCE, make_copy_model_grads_to_main_grads,
    note="[Note: a loop that never reduces its gradients] (integration/step_checks.py)",
    checked=both("(self)"), scope=SEAM)

def _misfit(efs: dict[int, ErrorFeedback], saved: dict[str, Any] | None) -> str | None:
    """Why a saved error-feedback state does not fit this rank's buckets (None: it fits)."""
    if saved is None:
        return "the checkpoint holds no error-feedback state"
    buckets = saved.get("buckets") if isinstance(saved, dict) else None
    if not isinstance(buckets, dict) or set(buckets) != set(efs):
        return "the checkpoint's error-feedback state is for other buckets"
    for bucket_id, ef in efs.items():
        entry = buckets[bucket_id]
        tensor = entry.get("state") if isinstance(entry, dict) else None
        if not isinstance(tensor, torch.Tensor) or tensor.shape != ef.state.shape or \
                tensor.dtype != ef.state.dtype:
            return (f"the checkpoint's error-feedback state of bucket {bucket_id} does not "
                    "fit this run's (another bucket size or --gradient-error-feedback-storage)")
        calls = entry.get("calls")
        if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
            return (f"the checkpoint's error-feedback state of bucket {bucket_id} has no "
                    f"call count (calls {calls!r})")
    return None


# The DDP modules SDP4Bit is installed on (weakly: a dropped model leaves the set).
_INSTALLED_ON: "weakref.WeakSet" = weakref.WeakSet()


@dataclasses.dataclass
class SDP4BitHandle:
    """What :func:`install_sdp4bit` returns: counters, the iteration hook, ``uninstall()``."""

    state: RunState
    _applied: patches.Applied
    buckets: tuple[BucketInfo, ...]
    """Every bucket of the install, in id order."""
    _model_chunks: list = dataclasses.field(default_factory=list)
    _step_start: dict = dataclasses.field(default_factory=dict)
    expert_buckets: tuple[BucketInfo, ...] = ()
    """The buckets of the expert-parallel buffers (MoE), on their expert data-parallel
    group; also in :attr:`buckets`."""
    topologies: ModelTopologies = ModelTopologies(dense=None)
    """Where the dense and the expert data-parallel groups run (topologies.py): the
    buckets are quantized on these."""

    @property
    def bucket_numels(self) -> dict[int, int]:
        """Bucket id -> elements in the bucket (padded), for byte accounting."""
        return {info.id: info.numel for info in self.buckets}

    @property
    def error_feedback_nbytes(self) -> int:
        """Bytes of this rank's error-feedback state, every bucket together (0 without)."""
        return sum(ef.nbytes for ef in self.state.error_feedback.values())

    def error_feedback_state(self) -> dict[str, Any] | None:
        """This rank's error-feedback state, for a checkpoint (None without
        ``--gradient-error-feedback``): per bucket id its state tensor (on the CPU) and call
        count, plain tensors and numbers that the checkpoints' restricted loaders admit. It
        belongs to this rank alone (the error of what this rank sent on the inter hop)."""
        efs = self.state.error_feedback
        if not efs:
            return None
        return {"storage": self.state.config.gradient_error_feedback_storage,
                "buckets": {bucket_id: ef.state_dict() for bucket_id, ef in sorted(efs.items())}}

    def load_error_feedback_state(self, saved: dict[str, Any] | None) -> str | None:
        """Restore :meth:`error_feedback_state`'s dict (from a checkpoint of the same layout).
        Returns None when restored (or when this run has no error feedback); otherwise the
        reason the error starts from zero instead, which the caller reports in one line.
        Nothing is changed unless every bucket fits. A state that decodes to NaN or Inf on
        any rank is loaded on none: every rank returns the same reason, naming that rank
        ([Note: a non-finite saved error] in comm/error_feedback.py); so with
        ``torch.distributed`` initialized this is collective over the default group (both
        trainers call it on every rank)."""
        efs = self.state.error_feedback
        if not efs:
            return None
        reason = _misfit(efs, saved)
        damaged = None
        if reason is None:
            damaged = next((bucket_id for bucket_id, ef in sorted(efs.items())
                            if not ef.is_finite(saved["buckets"][bucket_id]["state"])), None)
        first = first_damaged(damaged, next(iter(efs.values())).state.device)
        if first is not None:
            return (f"rank {first[0]}'s saved error state of bucket {first[1]} holds NaN or Inf "
                    "(a run never saves one: the checkpoint was changed after it was written)")
        if reason is not None:
            return reason
        for bucket_id, ef in efs.items():
            ef.load_state_dict(saved["buckets"][bucket_id])
        return None

    @property
    def config(self) -> SDP4BitConfig:
        return self.state.config

    @property
    def stats(self) -> CommStats:
        """Bytes sent by the quantized collectives and their unquantized equivalents."""
        return self.state.stats

    @property
    def expert_stats(self) -> CommStats:
        """The part of :attr:`stats` sent for the expert-parallel buckets (MoE)."""
        return self.state.expert_stats

    @property
    def expert_data_parallel_size(self) -> int | None:
        """The expert data-parallel group's size; None without expert-parallel buckets.
        At 1 nothing is sent for the experts, and nothing there is quantized."""
        return self.expert_buckets[0].world if self.expert_buckets else None

    def set_iteration(self, iteration: int) -> None:
        """Call at the start of every iteration: it seeds the rounding noise (reproducible,
        resumable), decides when ``gradients_quantization_start_iteration`` is reached, and
        starts the counters of :meth:`step_stats`."""
        if iteration < 0:
            raise ValueError(f"iteration={iteration} must be >= 0")
        self.state.iteration = iteration
        self.state.iteration_open = self.state.iteration_ever_set = True
        self._step_start = self.stats.snapshot()

    def step_stats(self) -> dict[str, int]:
        """Bytes sent since the last :meth:`set_iteration` (the iteration in progress, or the
        one just finished), per counter of ``handle.stats`` (which keeps the totals since
        install)."""
        now = self.stats.snapshot()
        return {name: now[name] - self._step_start.get(name, 0) for name in now}

    @property
    def installed(self) -> bool:
        return self._applied.active

    def uninstall(self) -> None:
        """Give megatron-core its own collectives and copy back. In-flight collectives must
        have been waited for (call between iterations, after a forced param sync)."""
        for obj in self._applied.objects():
            handle = getattr(obj, "grad_reduce_handle", None) or getattr(
                obj, "param_gather_handle", None)
            if handle is not None:
                raise RuntimeError("uninstall() with a collective in flight: finish the "
                                   "iteration (and ddp.start_param_sync(force_sync=True)) first")
        self._applied.revert()
        for chunk in self._model_chunks:
            _INSTALLED_ON.discard(chunk)
        self._model_chunks = []


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    for opt in optimizers:
        if not isinstance(opt, DistributedOptimizer):
            raise ValueError(f"SDP4Bit needs megatron-core's DistributedOptimizer, got "
                             f"{type(opt).__name__}: pass use_distributed_optimizer=True to "
                             "OptimizerConfig")
    return optimizers


def _check_gradients_are_reduced(model_chunks) -> None:
    """Refuse a model whose schedule would never reduce its gradients ([Note: a loop that
    never reduces its gradients])."""
    for chunk in model_chunks:
        config = getattr(chunk, "config", None)
        if config is not None and getattr(config, "finalize_model_grads_func", None) is None:
            raise ValueError(
                "the model's TransformerConfig has no finalize_model_grads_func, so "
                "megatron-core's schedule never reduces the gradients across data-parallel "
                "ranks (quantized or not): set config.finalize_model_grads_func = "
                "megatron.core.distributed.finalize_model_grads before install_sdp4bit")


def _step_check(state: RunState, *, optimizers: int = 1):
    """What every optimizer step's copy runs first ([Note: an iteration without
    set_iteration]): a step of a chain of ``optimizers`` copies once per optimizer; the first
    copy checks that the iteration is open, the last closes it. (Whether the gradients were
    reduced, each optimizer checks for its own buckets before its update: step_checks.py.)"""
    copies = 0

    def check_step() -> None:
        nonlocal copies
        if copies == 0:
            state.require_iteration("an optimizer step")
        copies += 1
        if copies == optimizers:
            copies = 0
            state.iteration_open = False

    return check_step


def install_sdp4bit(model_chunks, optimizer, config: SDP4BitConfig, *,
                    allow_untested_version: bool = False) -> SDP4BitHandle:
    """Quantize the collectives of ``model_chunks`` (megatron-core DDP modules) and
    ``optimizer`` (what ``get_megatron_optimizer`` returned) as ``config`` says.

    Collective over the default process group (it builds the DP topology): every rank calls
    it at the same point. The DDP modules must have been built inside
    :func:`~megatron.sdp4bit.integration.sdp4bit_padding` with the same ``config``;
    otherwise the bucket check raises ``ValueError`` with the fix.
    """
    check_megatron_core_version(scopes=(SEAM, PADDING),
                                allow_untested_version=allow_untested_version)
    if not isinstance(config, SDP4BitConfig):
        raise ValueError(f"config must be an SDP4BitConfig, got {type(config).__name__}")
    if not config.enabled:
        raise ValueError("config quantizes nothing: set quantized_weights and/or "
                         "quantized_gradients, or do not install SDP4Bit")
    if not isinstance(model_chunks, (list, tuple)):
        model_chunks = [model_chunks]
    optimizers = _distributed_optimizers(optimizer)
    check_supported(config, setup_of(model_chunks, optimizers))
    _check_gradients_are_reduced(model_chunks)
    if any(chunk in _INSTALLED_ON for chunk in model_chunks):
        raise ValueError("SDP4Bit is already installed on this model: call "
                         "handle.uninstall() before installing again")

    state = RunState(config=config, grad_config=GradientQuantConfig.from_sdp4bit(config),
                     weight_config=WeightQuantConfig.from_sdp4bit(config))
    state.expert_stats = state.stats.part()
    dense_groups = [bg for chunk in model_chunks for bg in chunk.bucket_groups]
    expert_groups = [bg for chunk in model_chunks
                     for bg in getattr(chunk, "expert_parallel_bucket_groups", [])]
    bucket_groups = dense_groups + expert_groups
    buckets = bucket_infos(bucket_groups, config)  # checks the padding of every bucket
    topologies = model_topologies(model_chunks, config.dp_ranks_per_node)

    def topology_of(bg):
        return topologies.expert if bg in expert_groups else topologies.dense

    shards = main_shards(optimizers, buckets) if config.quantized_weights else {}
    # TP > 1: the weights TP does not split stay equal on all TP ranks (tp_duplicates.py)
    duplicates = tp_duplicates(model_chunks, buckets)

    ef_config = ErrorFeedbackConfig.from_sdp4bit(config)
    if ef_config is not None:  # one state per bucket, sized now: memory known at start-up
        for bg in bucket_groups:
            topo = topology_of(bg)
            for bucket in bg.buckets:
                state.error_feedback[buckets.of(bucket).id] = ErrorFeedback(
                    bucket.grad_data.numel(), topo.ranks_per_node, topo.nodes,
                    state.grad_config, ef_config, device=bucket.grad_data.device)

    planned: list[patches.Patch] = []
    for bg in bucket_groups:
        topology = topology_of(bg)
        group_id = min(dist.get_process_group_ranks(topology.group))
        ids = [buckets.of(b).id for b in bg.buckets]
        stats = state.expert_stats if bg in expert_groups else state.stats
        if config.quantized_gradients:
            planned.append(START_GRAD_SYNC.on(
                bg, bucket_ids=ids, topology=topology, group_id=group_id, state=state,
                stats=stats))
        if config.quantized_weights and topology.world > 1:
            planned.append(START_PARAM_SYNC.on(
                bg, bucket_ids=ids, shards=shards, group_id=group_id,
                ranks_per_node=topology.ranks_per_node, state=state, stats=stats,
                duplicates=duplicates))
    # Every optimizer that steps (not megatron-core's stubs, which have no parameters and
    # never copy) closes the iteration at its copy once they all have.
    check = _step_check(state, optimizers=sum(
        1 for opt in optimizers if not getattr(opt, "is_stub_optimizer", False)))
    for opt in optimizers:
        if config.quantized_gradients:
            planned.append(COPY_MODEL_GRADS.on(opt, state=state, buckets=buckets, check=True,
                                               duplicates=duplicates))
        ids = optimizer_bucket_ids(opt, buckets)
        # qWD leaves the copy to the all-gather; a group of one rank keeps megatron-core's.
        qwd = config.quantized_weights and all(buckets.by_id(i).world > 1 for i in ids)
        planned.append(COPY_MAIN_PARAMS.on(opt, state=state, bucket_ids=ids, qwd=qwd,
                                           check_step=check))
    applied = patches.apply(planned)
    for chunk in model_chunks:
        _INSTALLED_ON.add(chunk)
    return SDP4BitHandle(state=state, _applied=applied, buckets=tuple(buckets),
                         _model_chunks=list(model_chunks),
                         expert_buckets=tuple(buckets.of(b) for bg in expert_groups
                                              for b in bg.buckets),
                         topologies=topologies)

