"""The megatron-core seams of SDP4Bit and megatron-core's CPU mode.

How a loop of one's own uses them (``sdp4bit_padding`` around DDP's construction, the
model config's ``finalize_model_grads_func``, ``install_sdp4bit``, ``handle.set_iteration``
every iteration, ``handle.uninstall``): examples/own_loop.py, which the test suite runs.

``enable_cpu_mode()`` (``cpu_mode.py``) makes megatron-core run on CPU with gloo; it is
never called when CUDA is available. Every megatron-core or torch attribute these replace is
an entry of one table, applied by one engine (``patches.py``); ``check_megatron_core_version``
decides with it whether an untested megatron-core release may run. See docs/integration.md.
"""

from megatron.sdp4bit.integration.cpu_mode import cpu_mode_active, enable_cpu_mode
from megatron.sdp4bit.integration.install import SDP4BitHandle, install_sdp4bit
from megatron.sdp4bit.integration.padding import sdp4bit_padding
from megatron.sdp4bit.integration.version import (
    TESTED_MEGATRON_CORE_VERSIONS,
    check_megatron_core_version,
)

__all__ = [
    "SDP4BitHandle",
    "TESTED_MEGATRON_CORE_VERSIONS",
    "check_megatron_core_version",
    "cpu_mode_active",
    "enable_cpu_mode",
    "install_sdp4bit",
    "sdp4bit_padding",
]
