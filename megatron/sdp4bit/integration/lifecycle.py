"""SDP4Bit's part of a training run, for both trainers: :class:`SDP4BitLifecycle`.

Our trainer (``pretrain_gpt.py``, through ``training/sdp4bit_setup.py``) and Megatron-LM's
(through the plug-in, ``megatron_lm.py``) do the same things for SDP4Bit, here, in the same
words; each keeps only the adapter that calls them at its own points:

* the flags, Megatron-LM's names, to the settings checked before anything is built:
  :func:`config_of_args` (:func:`setup_of_args` reads every attribute by its Megatron-LM
  name, no defaults: our trainer's parser defines each one too, so a misspelled name fails
  in both, and a test feeds both parsers' arguments through it);
* the install on the built model chunks and distributed optimizer, and the start-up lines
  (:meth:`SDP4BitLifecycle.install`);
* every iteration: :meth:`~SDP4BitLifecycle.start_iteration` before the step (the rounding
  streams, ``--gradients-quantization-start-iteration``), and
  :meth:`~SDP4BitLifecycle.finish_iteration` after it; the bytes since the last look,
  :meth:`~SDP4BitLifecycle.take_bytes` ([Note: one byte-accounting path], accounting.py);
* the end line, with the replica check of ``replicas.py`` (:meth:`~SDP4BitLifecycle.end_line`);
  it and the start-up line name what the byte ratios compare against (``accounting.references``:
  megatron-core's collectives in this run's buffer dtypes, e.g. bf16 gradient reduction with
  ``--grad-reduce-in-bf16``);
* ``--gradient-error-feedback``'s state in a checkpoint: taken for a save, restored from a
  load, kept until the install when the trainer loads first (Megatron-LM's does), and the
  one line that says when the error starts from zero instead.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch.distributed as dist

from megatron.sdp4bit.comm.stats import CommStats
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.config_flags import in_flag_words, sdp4bit_config_from_args
from megatron.sdp4bit.comm.byte_counts import ByteCounts
from megatron.sdp4bit.integration.accounting import add_unquantized_iteration, references
from megatron.sdp4bit.integration.support import Setup, check_supported
from megatron.sdp4bit.integration.topologies import ModelTopologies

ARGS_READ = (
    "use_distributed_optimizer", "bf16", "fp16", "num_distributed_optimizer_instances",
    "ddp_reduce_scatter_with_fp32_accumulation", "use_megatron_fsdp", "use_torch_fsdp2",
    "reuse_grad_buf_for_mxfp8_param_ag", "num_experts", "expert_tensor_parallel_size",
    "tensor_model_parallel_size", "fp8_param_gather", "fp4_param_gather",
    "use_precision_aware_optimizer",
)
"""The Megatron-LM arguments :func:`setup_of_args` reads (megatron-core 0.19.2's
``megatron/training/arguments.py`` names), besides SDP4Bit's own flag group."""


def setup_of_args(args: argparse.Namespace) -> Setup:
    """The :class:`Setup` that parsed flags with Megatron-LM's names ask for."""
    # Megatron-LM leaves --expert-tensor-parallel-size unset (None) for the TP size
    expert_tp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    return Setup(
        distributed_optimizer=bool(args.use_distributed_optimizer),
        fp32_params=not (args.bf16 or args.fp16),
        distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        reduce_scatter_with_fp32_accumulation=bool(args.ddp_reduce_scatter_with_fp32_accumulation),
        megatron_fsdp=bool(args.use_megatron_fsdp or args.use_torch_fsdp2),
        reuse_grad_buf_for_mxfp8_param_ag=bool(args.reuse_grad_buf_for_mxfp8_param_ag),
        expert_tensor_parallel=bool(args.num_experts) and expert_tp > 1,
        fp8_param_gather=bool(args.fp8_param_gather),
        fp4_param_gather=bool(args.fp4_param_gather),
        precision_aware_optimizer=bool(args.use_precision_aware_optimizer),
    )


def config_of_args(args: argparse.Namespace) -> SDP4BitConfig:
    """The :class:`SDP4BitConfig` of parsed flags, checked against the setup they ask for
    (``check_supported``, in the flags' words): ``ValueError`` with one line otherwise."""
    try:
        config = sdp4bit_config_from_args(args)
    except ValueError as err:
        raise ValueError(in_flag_words(err)) from None
    check_supported(config, setup_of_args(args), command_line=True)
    return config


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def describe_experts(handle) -> str:
    """The start-up line's words on the expert-parallel buckets (MoE), or nothing."""
    size = handle.expert_data_parallel_size
    if size is None:
        return ""
    count = len(handle.expert_buckets)
    if size == 1:
        return (f" | {count} expert bucket(s) on an expert data-parallel group of 1 rank "
                "(expert parallelism = data parallelism): nothing to send, nothing quantized "
                "there")
    return f" | {count} of them expert bucket(s), on the expert data-parallel group of {size}"


class SDP4BitLifecycle:
    """SDP4Bit in one run (module docstring). With a ``config`` that quantizes nothing it
    installs nothing and counts megatron-core's collectives only (our trainer's baseline
    runs log the same fields)."""

    def __init__(self, config: SDP4BitConfig | None = None) -> None:
        self.config = SDP4BitConfig() if config is None else config
        self.handle = None  # the SDP4BitHandle once installed
        self.model: list = []
        self.topologies = ModelTopologies(dense=None)
        self.iterations = 0
        """Iterations started since the install."""
        self._iteration: int | None = None
        # megatron-core's collectives that SDP4Bit does not replace, counted by rule
        self._unquantized = CommStats()
        self._unquantized_expert = self._unquantized.part()
        self._taken = ByteCounts.zero()
        self._error_feedback: tuple[Any, str | None, str | None] | None = None

    # --- install ------------------------------------------------------------------------

    def install(self, model_chunks: list, optimizer, *, allow_untested_version: bool = False,
                timing: bool = False):
        """Collective: install SDP4Bit on the built model chunks (megatron-core DDP modules,
        built inside ``sdp4bit_padding``) and distributed optimizer when the config
        quantizes, print the start-up lines (rank 0), restore an error state a load brought
        before; returns the handle (None when nothing quantizes). ``ValueError`` (one line)
        for what the built model shows SDP4Bit cannot run with. ``timing``: time the
        collectives' phases (:meth:`take_seconds`)."""
        from megatron.sdp4bit.integration.install import install_sdp4bit
        from megatron.sdp4bit.integration.topologies import model_topologies

        self.model = list(model_chunks)
        if not self.config.enabled:
            self.topologies = model_topologies(self.model, self.config.dp_ranks_per_node)
            self._taken = self.totals()
            return None
        handle = install_sdp4bit(self.model, optimizer, self.config,
                                 allow_untested_version=allow_untested_version)
        handle.stats.timing = timing
        self.handle, self.topologies = handle, handle.topologies
        self._taken = self.totals()
        if _rank() == 0:
            config = self.config
            words = references(self.model)
            print(f"SDP4Bit installed on {len(handle.buckets)} bucket(s): "
                  f"{config.describe()}{describe_experts(handle)} | bytes counted against "
                  f"megatron-core's {words['params']} and {words['grads']}", flush=True)
            if config.gradient_error_feedback:
                print(f"SDP4Bit error feedback on the inter-node hop: "
                      f"{handle.error_feedback_nbytes / 2**20:.2f} MiB of error state on this "
                      f"rank ({config.gradient_error_feedback_storage}, 1/N of the gradient "
                      "buckets)", flush=True)
        if self._error_feedback is not None:
            saved, skipped, where = self._error_feedback
            self._error_feedback = None
            self.restore_error_feedback(saved, skipped=skipped, where=where)
        return handle

    def uninstall(self, *, finish_param_sync: bool) -> None:
        """Back to megatron-core's collectives (the counters stay). ``finish_param_sync``
        (``--overlap-param-gather``): the all-gather left to the next forward pass runs
        first, so that the replicas are complete."""
        if self.handle is None or not self.handle.installed:
            return
        if finish_param_sync:
            for chunk in self.model:
                chunk.start_param_sync(force_sync=True)
        self.handle.uninstall()

    # --- every iteration ----------------------------------------------------------------

    def start_iteration(self, iteration: int) -> None:
        """Before the step of ``iteration`` (the trainer's counter, restored on resume)."""
        if self.handle is not None:
            self.handle.set_iteration(iteration)
        self._iteration = iteration
        self.iterations += 1

    def finish_iteration(self) -> None:
        """After the step: count megatron-core's collectives of the iteration that SDP4Bit
        did not replace ([Note: one byte-accounting path])."""
        if self._iteration is None or self.topologies.dense is None:
            return
        config = self.config
        add_unquantized_iteration(
            self._unquantized, self.model, self.topologies,
            params=not config.quantized_weights,
            grads=not config.quantized_gradients
            or self._iteration < config.gradients_quantization_start_iteration,
            expert_stats=self._unquantized_expert)

    def totals(self) -> ByteCounts:
        """Every byte counted since the install."""
        parts = (self._unquantized,) if self.handle is None else (self._unquantized,
                                                                    self.handle.stats)
        expert = None
        if self.topologies.expert is not None:
            expert = (self._unquantized_expert,) if self.handle is None else (
                self._unquantized_expert, self.handle.expert_stats)
        return ByteCounts.of(*parts, expert=expert)

    def take_bytes(self) -> ByteCounts:
        """The bytes counted since the previous call (or the install)."""
        now = self.totals()
        taken, self._taken = now.minus(self._taken), now
        return taken

    def take_seconds(self) -> dict[str, float]:
        """The collectives' phase times since the previous call (``timing``; zeros without
        SDP4Bit: megatron-core's collectives are not timed here)."""
        stats = self._unquantized if self.handle is None else self.handle.stats
        return stats.take_seconds()

    # --- the end ------------------------------------------------------------------------

    def end_line(self) -> str | None:
        """Collective (every rank of the run, SDP4Bit installed): the end line for the last
        rank (the one that prints Megatron-LM's log line), None on the others and when
        nothing was installed. The replicas are compared first: call it once the last
        parameter all-gather has run."""
        if self.handle is None:
            return None
        from megatron.sdp4bit.integration.replicas import compare_replicas

        report = compare_replicas(self.model)
        # every rank's groups (the last rank is in one expert data-parallel group of several)
        differences: list = [None] * dist.get_world_size()
        dist.all_gather_object(differences, report.difference)
        if _rank() != dist.get_world_size() - 1:
            return None
        state, totals, words = self.handle.state, self.totals(), references(self.model)
        verdict = "bitwise identical"
        found = next((d for d in differences if d is not None), None)
        if found is not None:
            verdict = (f"DIFFERENT ({found.what} differs between {found.group} ranks 0 and "
                       f"{found.other})")
        return (f"SDP4Bit on this rank: {sum(state.grad_calls.values())} quantized gradient "
                f"reduce-scatters, {sum(state.param_calls.values())} quantized parameter "
                f"all-gathers, {sum(state.unquantized_grad_calls.values())} unquantized "
                f"(before --gradients-quantization-start-iteration) in {self.iterations} "
                f"iterations; bytes sent / unquantized: params {totals.ratio('params')} "
                f"against {words['params']}, grads {totals.ratio('grads')} against "
                f"{words['grads']}; model replicas on the "
                f"{report.data_parallel_size} data-parallel ranks: {verdict}, checksum "
                f"{report.checksum:016x}")

    # --- the error-feedback state in checkpoints ----------------------------------------

    def error_feedback_state(self) -> dict[str, Any] | None:
        """This rank's ``--gradient-error-feedback`` state for a checkpoint (a copy: an
        asynchronous save writes the iteration it was taken at), None without it."""
        return self.handle.error_feedback_state() if self.handle is not None else None

    def restore_error_feedback(self, saved: dict[str, Any] | None, *, skipped: str | None = None,
                               where: str | None = None) -> None:
        """Restore this rank's error state from ``saved`` (a checkpoint's), now or, when the
        trainer loads before it installs, at the install. Where it cannot be (``skipped``:
        why the checkpoint's state was not read; or it does not fit), the error starts from
        zero and rank 0 says so in one line, naming the checkpoint ``where`` when given
        (the resume is then not bit-exact)."""
        if not self.config.gradient_error_feedback:
            return
        if self.handle is None:
            self._error_feedback = (saved, skipped, where)
            return
        if not self.handle.error_feedback_nbytes:
            return
        reason = skipped or self.handle.load_error_feedback_state(saved)
        if reason is not None and _rank() == 0:
            place = f" ({where})" if where else ""
            print(f"note: --gradient-error-feedback starts from zero error: {reason}{place}",
                  flush=True)
