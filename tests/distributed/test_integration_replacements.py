"""The release walk: every entry of the replacement table against the installed megatron-core
(and torch, for torch's attributes), the dry run's entries included.

No processes: it imports the table's modules (and the dry run's tool, which registers its
own) and reads megatron-core's and torch's attributes. It is here, among the integration
tests, so that dev/run_tests.sh runs it in both passes (0.16.1 in .venv, 0.19.2 in
.venv-mcore019).
"""

from __future__ import annotations

import os
import sys

from dev import cuda_dryrun  # noqa: F401 - registers the dry run's entries
from megatron.sdp4bit.integration import TESTED_MEGATRON_CORE_VERSIONS, patches
from megatron.sdp4bit.integration.releases import TESTED_TORCH_VERSIONS, torch_version


def _release() -> str:
    expected = (os.environ.get("SDP4BIT_EXPECT_MEGATRON_CORE")
                or TESTED_MEGATRON_CORE_VERSIONS[int(sys.version_info >= (3, 12))])
    assert patches.megatron_core_version() == expected
    return expected


def walk(release: str) -> list[str]:
    """One line per entry that does not hold on megatron-core ``release`` (a torch entry: on
    the installed torch, a tested one): a target missing or changed, or an entry whose
    feature test disagrees with the releases it was checked on."""
    problems = []
    for entry in patches.all_replacements():
        applies = patches.applies(entry)
        mine = release if patches.library(entry) == "megatron-core" else torch_version()
        if applies != (mine in entry.checked):
            problems.append(f"{entry.name}: applies={applies} but checked on "
                            f"{patches.library(entry)} {', '.join(sorted(entry.checked))}")
        elif applies:
            found = patches.problem(entry, mine)
            if found is not None:
                problems.append(found)
    return problems


def test_every_replacement_holds_on_the_installed_release() -> None:
    release = _release()
    entries = patches.all_replacements()
    problems = walk(release)
    assert not problems, "\n".join(problems)
    # The table is the whole of it: every kind of seam is in it.
    names = {e.name for e in entries}
    assert {"install.start_grad_sync", "install.start_param_sync", "cuda.current_device",
            "cpu.fused_softmax.get_default_causal_mask", "dryrun.dist.all_reduce",
            "checkpoint.save_callbacks", "checkpoint.get_parameter_state_dp_zero"} <= names
    assert sum(patches.applies(e) and e.name.startswith("padding.") for e in entries) == 1
    assert len(entries) > 100
    assert torch_version() in TESTED_TORCH_VERSIONS  # the torch the table was checked on


def test_a_renamed_target_fails_the_walk_with_one_line(monkeypatch) -> None:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    release = _release()
    original = _ParamAndGradBucketGroup.start_param_sync
    monkeypatch.delattr(_ParamAndGradBucketGroup, "start_param_sync")
    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_param_sync_renamed", original,
                        raising=False)
    assert walk(release) == [
        "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup"
        ".start_param_sync is missing"]


def test_a_changed_signature_fails_the_walk_with_one_line(monkeypatch) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    release = _release()
    monkeypatch.setattr(mcore_random, "_set_cuda_rng_state",
                        lambda new_state, device=-1, graph_safe=False, stream=None: None)
    assert walk(release) == [
        "megatron.core.tensor_parallel.random._set_cuda_rng_state changed: its signature is "
        "(new_state, device, graph_safe, stream), checked as (new_state, device, graph_safe) "
        f"on megatron-core {release}"]
