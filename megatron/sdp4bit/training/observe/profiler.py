"""``--profile``: Megatron-LM's profiling window around iterations ``--profile-step-start``
to ``--profile-step-end`` on the ``--profile-ranks``.

The calls and their places follow Megatron-LM's ``train()``: with ``--use-pytorch-profiler``
a ``torch.profiler.profile`` started before the first iteration, stepped at the top of each
one, on the schedule wait ``start - 1``, warm-up 1, active ``end - start`` (shapes and call
stacks with ``--pytorch-profiler-collect-shapes`` and ``-callstack``), and stopped after
iteration ``end``; without it (CUDA only, argument checking refuses it on CPU)
``cudaProfilerStart`` and NVTX ranges (``torch.autograd.profiler.emit_nvtx``, with the
shapes under ``--record-shapes``) from the top of
the iteration after ``start`` to ``cudaProfilerStop`` after iteration ``end``, the capture
range of ``nsys profile --capture-range=cudaProfilerApi``.

[Note: where the trace goes]
Megatron-LM 0.19 writes a Chrome trace to ``<tensorboard-dir>/../torch_profile/rank-N.json.gz``
(outside the TensorBoard folder); its earlier versions, which documented the flag as "view
profiles in tensorboard", used ``torch.profiler.tensorboard_trace_handler(tensorboard_dir)``.
This trainer does the latter: ``<tensorboard-dir>/rank-N.<time>.pt.trace.json``, the file
TensorBoard's PyTorch profiler plugin lists next to the run's scalars. A run that ends inside
the window stops the profiler at its end, so the trace is still written.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

__all__ = ["ProfileWindow"]


class ProfileWindow:
    """Start, step and stop the profiler of ``--profile`` (a no-op on a rank not profiled)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self._start, self._end = args.profile_step_start, args.profile_step_end
        ranks = args.profile_ranks
        self._on = args.profile and (not ranks or dist.get_rank() in ranks)
        self._torch = None
        self._nvtx = None
        self._nvtx_shapes = args.record_shapes
        self._running = False
        if self._on and args.use_pytorch_profiler:
            self._torch = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(self._start - 1, 0), warmup=1 if self._start > 0 else 0,
                    active=self._end - self._start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    args.tensorboard_dir, worker_name=f"rank-{dist.get_rank()}"),
                record_shapes=args.pytorch_profiler_collect_shapes,
                with_stack=args.pytorch_profiler_collect_callstack)
            self._torch.start()
            self._running = True

    def before_iteration(self, iteration: int) -> None:
        """At the top of the loop; ``iteration`` iterations are done."""
        if not self._on:
            return
        if self._torch is not None:
            if self._running:
                self._torch.step()
        elif iteration == self._start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=self._nvtx_shapes)
            self._nvtx.__enter__()
            self._running = True

    def after_iteration(self, iteration: int) -> None:
        """After iteration number ``iteration`` (counted from 1) is done."""
        if self._on and iteration == self._end:
            self.close()

    def close(self) -> None:
        """Stop now (the window's end, or the end of the run inside the window)."""
        if not self._running:
            return
        self._running = False
        if self._torch is not None:
            self._torch.stop()
        else:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self._nvtx.__exit__(None, None, None)
            self._nvtx = None
