"""``install_sdp4bit``: the one entry point that puts SDP4Bit into megatron-core.

It binds replacements on *instances* (each bucket group's ``start_grad_sync`` /
``start_param_sync``, each distributed optimizer's ``_copy_main_params_to_model_params``
and, with TP > 1, ``_copy_model_grads_to_main_grads``), never on classes or modules, so a
baseline model in the same process is untouched and ``handle.uninstall()`` restores
megatron-core's behaviour exactly (the instance attributes are deleted; the class methods
were never changed). The four are entries of the replacement table (``patches.py``),
declared below. See docs/integration.md.

[Note: a loop that never reduces its gradients]
megatron-core's DDP reduces the gradients when something calls its ``finish_grad_sync``:
megatron-core's pipeline schedules do, through ``config.finalize_model_grads_func`` (both
tested releases call it after the last micro-batch's backward when it is set, and skip it
when it is ``None``), and with ``overlap_grad_reduce`` the backward hooks only *start* the
reduce-scatters that it waits for. A loop of one's own that leaves the hook unset trains
with every rank stepping on its own unreduced gradients: the loss falls, nothing fails, and
no collective of SDP4Bit's (or megatron-core's) ever runs. So the loop cannot skip it
silently: ``install_sdp4bit`` refuses a model whose config has no
``finalize_model_grads_func``, and every optimizer step (megatron-core's
``_copy_main_params_to_model_params``, which each successful step calls after its update)
raises if no gradient reduce-scatter was issued since the previous step, which also catches
a hook set to something that does not reduce. With quantized weights only, SDP4Bit does not
see megatron-core's own reduce-scatter, so there the install-time refusal is the guard.

[Note: an iteration without set_iteration]
``handle.set_iteration(it)`` seeds the iteration's rounding noise and starts the counters of
``step_stats()``. A loop that forgets it, for one iteration or for all, would still train: the
noise of the last iteration repeats (or iteration 0's forever) and ``step_stats()`` becomes
cumulative, with nothing said. So an iteration is *opened* by ``set_iteration`` and *closed*
by the optimizer step (the replaced ``_copy_main_params_to_model_params``, which every
successful step calls after its update and before its all-gather), and both the gradient
reduce-scatter (``start_grad_sync``, quantized or not yet) and the step itself raise one line
when the iteration is not open. The first of them is the iteration's first collective that
SDP4Bit issues: with quantized gradients the reduce-scatter, with qWD alone the step's
all-gather (behind the step). Parameter all-gathers are not checked themselves: an evaluation
or a checkpoint save forces them between iterations, legitimately without a new
``set_iteration``, and each forced gather draws fresh noise anyway (``RunState.next_param_call``).
A step skipped for non-finite gradients never reaches the copy and leaves the iteration open.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch.distributed as dist

from megatron.sdp4bit.comm import (
    CommStats,
    GradientQuantConfig,
    WeightQuantConfig,
    build_topology,
)
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
from megatron.sdp4bit.integration.tp_duplicates import (
    make_copy_model_grads_to_main_grads,
    tp_duplicates,
)
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
    note="[Note: qWD keeps the replica until the all-gather] (integration/param_sync.py)",
    checked=both("(self)"), scope=SEAM)
COPY_MODEL_GRADS = declare(
    "install.copy_model_grads_to_main_grads", _DIST_OPT, "_copy_model_grads_to_main_grads",
    INSTANCE, make_copy_model_grads_to_main_grads,
    note="[Note: TP-duplicated weights] (integration/tp_duplicates.py)",
    checked=both("(self)"), scope=SEAM)

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

    @property
    def bucket_numels(self) -> dict[int, int]:
        """Bucket id -> elements in the bucket (padded), for byte accounting."""
        return {info.id: info.numel for info in self.buckets}

    @property
    def config(self) -> SDP4BitConfig:
        return self.state.config

    @property
    def stats(self) -> CommStats:
        """Bytes sent by the quantized collectives and their unquantized equivalents."""
        return self.state.stats

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


def _step_check(state: RunState, *, gradients: bool, optimizers: int = 1):
    """The checks every optimizer step runs before its copy ([Note: an iteration without
    set_iteration]; with quantized ``gradients``, [Note: a loop that never reduces its
    gradients]). A step of a chain of ``optimizers`` copies once per optimizer: the first
    copy checks, the last closes the iteration."""
    copies = 0

    def check_step() -> None:
        nonlocal copies
        if copies == 0:
            state.require_iteration("an optimizer step")
            if gradients and state.grad_syncs_since_step == 0:
                raise RuntimeError(
                    f"SDP4Bit: an optimizer step at iteration {state.iteration} found no "
                    "gradient reduce-scatter since the previous step: its gradients were never "
                    "reduced across data-parallel ranks. megatron-core's schedule reduces them "
                    "through config.finalize_model_grads_func (set it to "
                    "megatron.core.distributed.finalize_model_grads); a loop without the "
                    "schedule calls ddp.finish_grad_sync() before optimizer.step()")
        copies += 1
        if copies == optimizers:
            copies = 0
            state.iteration_open = False
            state.grad_syncs_since_step = 0

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
    bucket_groups = [bg for chunk in model_chunks for bg in chunk.bucket_groups]
    buckets = bucket_infos(bucket_groups, config)  # checks the padding of every bucket

    # One topology per DP group; build_topology is collective over the world, and every
    # rank has the same number of (dense) bucket-group DP groups, met in the same order.
    groups = {}
    for bg in bucket_groups:
        groups.setdefault(id(bg.intra_distributed_optimizer_instance_group),
                          bg.intra_distributed_optimizer_instance_group)
    topologies = {key: build_topology(group, config.dp_ranks_per_node)
                  for key, group in groups.items()}

    shards = main_shards(optimizers, buckets) if config.quantized_weights else {}
    # TP > 1: the weights TP does not split stay equal on all TP ranks (tp_duplicates.py)
    duplicates = tp_duplicates(model_chunks, buckets)

    planned: list[patches.Patch] = []
    for bg in bucket_groups:
        group = bg.intra_distributed_optimizer_instance_group
        group_id = min(dist.get_process_group_ranks(group))
        ids = [buckets.of(b).id for b in bg.buckets]
        if config.quantized_gradients:
            planned.append(START_GRAD_SYNC.on(
                bg, bucket_ids=ids, topology=topologies[id(group)], group_id=group_id,
                state=state))
        if config.quantized_weights:
            planned.append(START_PARAM_SYNC.on(
                bg, bucket_ids=ids, shards=shards, group_id=group_id,
                ranks_per_node=topologies[id(group)].ranks_per_node, state=state,
                duplicates=duplicates))
    if config.quantized_gradients and duplicates is not None:
        planned += [COPY_MODEL_GRADS.on(opt, duplicates=duplicates, buckets=buckets)
                    for opt in optimizers]
    # Every step's copy: qWD leaves it to the all-gather; the step checks that its iteration
    # called set_iteration and, with quantized gradients, that they were reduced.
    check = _step_check(state, gradients=config.quantized_gradients,
                        optimizers=len(optimizers))
    planned += [COPY_MAIN_PARAMS.on(opt, qwd=config.quantized_weights, check_step=check)
                for opt in optimizers]
    applied = patches.apply(planned)
    for chunk in model_chunks:
        _INSTALLED_ON.add(chunk)
    return SDP4BitHandle(state=state, _applied=applied, buckets=tuple(buckets),
                         _model_chunks=list(model_chunks))
