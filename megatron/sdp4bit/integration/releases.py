"""Where megatron-core 0.16.1 and 0.19.2 differ at SDP4Bit's seams, each difference by name.

Everything else in ``integration/`` is one code path for both releases. Checked against
the installed sources of both wheels (docs/integration.md lists the lines):

* **Bucket-end padding** (:func:`bucket_padding_module`). 0.16.1 pads inside
  ``_ParamAndGradBuffer.__init__`` (a closure calling ``math.lcm`` of
  ``distributed/param_and_grad_buffer.py``); 0.19.2 moved the layout to
  ``optimizer/param_layout.py`` (``pad_bucket_end`` -> ``bucket_end_divisor`` ->
  ``math.lcm`` of that module), which ``DistributedOptimizer.compute_full_param_layout``
  calls, from DDP's constructor or from the caller. Both call ``lcm(dp_size, 128[, 2**16])``
  with the DP size first, so the same replacement ``math`` serves both; only the module
  whose global is swapped differs.
* **Before the gradient collective** (:func:`prepare_grads_for_sync`). 0.19.2's
  ``start_grad_sync`` first waits on CUDA-graph weight-gradient events
  (``param._cudagraph_wgrad_ready_event``) and copies the fp32 local accumulators of
  ``param_name_patterns_for_fp32_local_accumulation`` into the communication buffer
  (``finish_grad_sync``, not replaced, copies the result back). 0.16.1 has neither:
  no parameter carries the event and buckets have no ``params_with_extra_main_grads``, so
  the helper does nothing there.
* **After a forced parameter sync** (:func:`post_param_sync`). 0.19.2's
  ``start_param_sync`` runs ``_post_param_sync()`` (FP8/NVFP4 post-all-gather processing)
  after waiting a forced sync and after a synchronous sync with ``overlap_param_gather``;
  0.16.1 has no such method (its ``finish_param_sync`` did the FP8 work inline). For
  16-bit parameters, the only ones qWD accepts, it does nothing in 0.19.2 either.

Why features rather than version strings: ``install_sdp4bit(allow_untested_version=True)``
lets a user try another release, and a feature test then picks the nearer behaviour.
"""

from __future__ import annotations

import types

TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")
"""0.16.1 is the release for Python < 3.12 (CI), 0.19.2 the one for Python >= 3.12 (what a
GPU cluster set up today gets); ``setup.py`` and ``requirements.txt`` choose by interpreter."""


TESTED_TORCH_VERSIONS = ("2.13.0",)
"""The torch release ``requirements.txt`` and ``setup.py`` pin (both megatron-core releases
were tested with it): the torch targets of the replacement table were checked on it."""


def torch_version() -> str:
    """The installed torch release, without a local version label (``2.13.0+cpu`` and
    ``2.13.0+cu128`` are both 2.13.0: the build, not the Python API, differs)."""
    import torch

    return str(torch.__version__).split("+", 1)[0]


def megatron_core_version() -> str:
    """The installed release, without a local version label.

    megatron-core 0.19.2's ``package_info`` appends ``+<commit>`` of whatever git repository
    its files sit in (e.g. a virtual environment inside a clone of this repository gives
    ``0.19.2+0d43811``): that label names no megatron-core change, so it is dropped.
    """
    from megatron.core import package_info

    return str(package_info.__version__).split("+", 1)[0]


def bucket_padding_module() -> types.ModuleType:
    """The megatron-core module whose global ``math.lcm`` gives the bucket-end divisor."""
    try:  # 0.19.2: the layout is the optimizer's
        from megatron.core.optimizer import param_layout
    except ImportError:  # 0.16.1: a closure inside _ParamAndGradBuffer.__init__
        param_layout = None
    if param_layout is not None and hasattr(param_layout, "bucket_end_divisor"):
        return param_layout
    from megatron.core.distributed import param_and_grad_buffer

    return param_and_grad_buffer


def prepare_grads_for_sync(bucket_group) -> None:
    """What 0.19.2's ``start_grad_sync`` does to the buckets before its checks and scaling."""
    import torch

    waited: set[int] = set()
    for bucket in bucket_group.buckets:
        for param in bucket.params_list:
            event = getattr(param, "_cudagraph_wgrad_ready_event", None)
            if event is not None and id(event) not in waited:
                torch.cuda.current_stream().wait_event(event)
                waited.add(id(event))
    for bucket in bucket_group.buckets:
        for param in getattr(bucket, "params_with_extra_main_grads", ()):
            in_buffer = getattr(param, "main_grad_copy_in_grad_buffer", None)
            if in_buffer is not None:
                in_buffer.copy_(param.main_grad)


def post_param_sync(bucket_group) -> None:
    """0.19.2's post-all-gather processing of quantized (FP8/NVFP4) parameters, if any."""
    post = getattr(bucket_group, "_post_param_sync", None)
    if post is not None:
        post()
