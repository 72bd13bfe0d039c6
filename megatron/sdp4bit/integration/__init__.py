"""The megatron-core seams of SDP4Bit and megatron-core's CPU mode.

How a loop of one's own uses them (``sdp4bit_padding`` around DDP's construction, the
model config's ``finalize_model_grads_func``, ``install_sdp4bit``, ``handle.set_iteration``
every iteration, ``handle.uninstall``): examples/own_loop.py, which the test suite runs.

``enable_cpu_mode()`` (``cpu_mode.py``) makes megatron-core run on CPU with gloo; it is
never called when CUDA is available. Every megatron-core or torch attribute these replace is
an entry of one table, applied by one engine (``patches.py``); ``check_megatron_core_version``
decides with it whether an untested megatron-core release may run. See docs/integration.md.

The names below are imported on first use (PEP 562), so that importing one module of this
package (the replacement engine, ``patches.py``) imports neither torch nor megatron-core:
the test environment's interpreters apply the Python 3.12 bridge through it at start-up
(``megatron_lm_bridges.py``, [Note: the bridge in every process]).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.sdp4bit.integration.cpu_mode import cpu_mode_active, enable_cpu_mode
    from megatron.sdp4bit.integration.install import SDP4BitHandle, install_sdp4bit
    from megatron.sdp4bit.integration.padding import sdp4bit_padding
    from megatron.sdp4bit.integration.version import (
        TESTED_MEGATRON_CORE_VERSIONS,
        check_megatron_core_version,
    )

_WHERE = {
    "SDP4BitHandle": "install",
    "TESTED_MEGATRON_CORE_VERSIONS": "version",
    "check_megatron_core_version": "version",
    "cpu_mode_active": "cpu_mode",
    "enable_cpu_mode": "cpu_mode",
    "install_sdp4bit": "install",
    "sdp4bit_padding": "padding",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
