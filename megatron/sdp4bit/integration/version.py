"""Which megatron-core releases the seams were checked against.

The integration replaces private behaviours of megatron-core (see docs/integration.md):
``_ParamAndGradBucketGroup.start_grad_sync`` / ``start_param_sync``,
``DistributedOptimizer._copy_main_params_to_model_params`` and the bucket-end padding.
Their bodies are re-stated (not copied) in SDP4Bit's replacements, so a megatron-core
release that changes them must be re-checked before it is allowed here. Where the tested
releases differ, ``releases.py`` names the difference.

0.16.1 is the release for Python < 3.12 (CI), 0.19.2 the one for Python >= 3.12 (what a
GPU cluster set up today gets); ``setup.py`` and ``requirements.txt`` choose by interpreter.
"""

from __future__ import annotations

TESTED_MEGATRON_CORE_VERSIONS = ("0.16.1", "0.19.2")


def megatron_core_version() -> str:
    """The installed release, without a local version label.

    megatron-core 0.19.2's ``package_info`` appends ``+<commit>`` of whatever git repository
    its files sit in (e.g. a virtual environment inside a clone of this repository gives
    ``0.19.2+0d43811``): that label names no megatron-core change, so it is dropped.
    """
    from megatron.core import package_info

    return str(package_info.__version__).split("+", 1)[0]


def check_megatron_core_version(*, allow_untested_version: bool = False) -> str:
    """Return the installed version; raise ``RuntimeError`` unless it is a tested one."""
    version = megatron_core_version()
    if version not in TESTED_MEGATRON_CORE_VERSIONS and not allow_untested_version:
        old, new = TESTED_MEGATRON_CORE_VERSIONS
        raise RuntimeError(
            f"SDP4Bit was tested with megatron-core {old} and {new} but megatron-core {version} "
            f"is installed: install megatron-core=={new} (Python >= 3.12) or "
            f"megatron-core=={old} (Python < 3.12), or pass allow_untested_version=True to try "
            "this one (then run tests/distributed/test_integration_sdp4bit.py against it first)"
        )
    return version
