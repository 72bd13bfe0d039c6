"""Which megatron-core releases the seams were checked against.

The integration replaces three private behaviours of megatron-core (see docs/integration.md):
``_ParamAndGradBucketGroup.start_grad_sync`` / ``start_param_sync``,
``DistributedOptimizer._copy_main_params_to_model_params`` and the bucket-end padding of
``_ParamAndGradBuffer``. Their bodies are re-stated (not copied) in SDP4Bit's replacements,
so a megatron-core release that changes them must be re-checked before it is allowed here.
"""

from __future__ import annotations

TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1",)


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_megatron_core_version(*, allow_untested_version: bool = False) -> str:
    """Return the installed version; raise ``RuntimeError`` unless it is a tested one."""
    version = megatron_core_version()
    if version not in TESTED_MEGATRON_CORE_VERSIONS and not allow_untested_version:
        raise RuntimeError(
            f"SDP4Bit was tested with megatron-core {', '.join(TESTED_MEGATRON_CORE_VERSIONS)} "
            f"but megatron-core {version} is installed: install megatron-core=="
            f"{TESTED_MEGATRON_CORE_VERSIONS[-1]}, or pass allow_untested_version=True to try "
            "this one (then run tests/distributed/test_integration_sdp4bit.py against it first)"
        )
    return version
