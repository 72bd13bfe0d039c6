"""Whether SDP4Bit runs on the installed megatron-core: the releases it was tested on, and
the table of replacements for any other.

SDP4Bit replaces attributes of megatron-core and torch (``patches.py``: the table, each
entry with the releases it was checked on and the signature it was checked with), and its
replacements re-state or wrap what they replace. Where the tested releases differ,
``releases.py`` names the difference.

[Note: an untested megatron-core release]
On 0.16.1 and 0.19.2 every entry was checked by hand and by the release walk
(tests/distributed/test_integration_replacements.py). On any other release,
:func:`check_megatron_core_version` walks the entries of the scopes its caller applies
(``install_sdp4bit``: seam and padding; the trainer: those, the checkpoint writer's and,
without CUDA, CPU mode's; [Note: scopes] in ``patches.py``) with the engine's own check
(``patches.first_problem``): if every target is present with the signature it was checked
with, SDP4Bit runs, with one warning line naming the release; otherwise it refuses, naming
the first target that moved, unless the user accepts that (``allow_untested_version=True``,
the trainer's ``--allow-untested-megatron-core``): then it runs with one warning line naming
the moved target, and the engine lets the moved (not the missing) targets be replaced.
A target of a scope the caller does not apply is not looked at: it cannot refuse the call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.releases import (
    TESTED_MEGATRON_CORE_VERSIONS,
    megatron_core_version,
)

__all__ = ["TESTED_MEGATRON_CORE_VERSIONS", "check_megatron_core_version",
           "megatron_core_version"]

_log = logging.getLogger("megatron.sdp4bit")
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _log.warning(message)


def check_megatron_core_version(*, scopes: Iterable[str] = (patches.SEAM, patches.PADDING),
                                allow_untested_version: bool = False,
                                how_to_allow: str = "pass allow_untested_version=True") -> str:
    """Return the installed release if SDP4Bit may run on it; raise ``RuntimeError`` (one
    line) if not. See [Note: an untested megatron-core release]. ``scopes``: the scopes of
    the replacement table the caller will apply (default: ``install_sdp4bit``'s);
    ``how_to_allow`` is the override the refusal names (the trainer names its flag)."""
    scopes = patches.checked_scopes(scopes)
    version = megatron_core_version()
    if version in TESTED_MEGATRON_CORE_VERSIONS:
        return version
    old, new = TESTED_MEGATRON_CORE_VERSIONS
    entries = patches.in_scopes(scopes)
    moved = patches.first_problem(entries)
    if moved is None:
        _warn_once(version, f"SDP4Bit: warning: megatron-core {version} was never tested (tested: "
                   f"{old}, {new}); every attribute SDP4Bit replaces here ({', '.join(scopes)}) "
                   "is present with the signature it was checked with, so it runs")
        return version
    if allow_untested_version:
        patches.accept_changed(e for e in entries if patches.problem(e) is not None)
        _warn_once(version, f"SDP4Bit: warning: megatron-core {version} was never tested "
                   f"(tested: {old}, {new}) and {moved}; running anyway as asked")
        return version
    raise RuntimeError(
        f"SDP4Bit was tested with megatron-core {old} and {new} but megatron-core {version} "
        f"is installed, and {moved}: install megatron-core=={new} (Python >= 3.12) or "
        f"megatron-core=={old} (Python < 3.12), or {how_to_allow} to try this one (then "
        "run tests/distributed/test_integration_sdp4bit.py against it first)"
    )
