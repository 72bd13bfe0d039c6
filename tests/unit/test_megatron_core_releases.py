"""The two tested megatron-core releases: install pins by interpreter, and the version check."""

from __future__ import annotations

import ast
import pathlib

import pytest
from packaging.requirements import Requirement

from megatron.sdp4bit.integration import TESTED_MEGATRON_CORE_VERSIONS, check_megatron_core_version

REPO = pathlib.Path(__file__).resolve().parents[2]


def _requirements_txt() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [line for line in (x.split("#")[0].strip() for x in lines) if line]


def _setup_py_install_requires() -> list[str]:
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no install_requires")


def _megatron_core_pick(requirements: list[str], python: str) -> list[str]:
    """The megatron-core versions pip would install for ``python`` (from the markers)."""
    env = {"python_version": python, "python_full_version": f"{python}.0",
           "platform_system": "Linux", "sys_platform": "linux"}
    picks = []
    for text in requirements:
        req = Requirement(text)
        if req.name == "megatron-core" and (req.marker is None or req.marker.evaluate(env)):
            assert len(req.specifier) == 1, text
            spec = next(iter(req.specifier))
            assert spec.operator == "==", text
            picks.append(spec.version)
    return picks


@pytest.mark.parametrize("source", ["requirements.txt", "setup.py"])
def test_install_picks_the_tested_release_by_python(source) -> None:
    reqs = _requirements_txt() if source == "requirements.txt" else _setup_py_install_requires()
    old, new = TESTED_MEGATRON_CORE_VERSIONS
    assert (old, new) == ("0.16.1", "0.19.2")
    for python in ("3.10", "3.11"):
        assert _megatron_core_pick(reqs, python) == [old], (source, python)
    for python in ("3.12", "3.13"):
        assert _megatron_core_pick(reqs, python) == [new], (source, python)


@pytest.fixture
def untested(monkeypatch, caplog):
    """megatron-core reports 0.17.0 (its files are the tested release's); the check's
    once-per-release warning and the engine's accepted changes start empty."""
    from megatron.core import package_info

    from megatron.sdp4bit.integration import patches, version

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    monkeypatch.setattr(version, "_warned", set())
    monkeypatch.setattr(patches, "_ACCEPTED_CHANGES", set())
    caplog.set_level("WARNING", logger="megatron.sdp4bit")
    return caplog


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megatron.sdp4bit"]


def test_untested_release_with_every_target_in_place_runs_with_one_warning(untested) -> None:
    assert check_megatron_core_version() == "0.17.0"
    assert check_megatron_core_version() == "0.17.0"  # warned once per process
    assert _warnings(untested) == [
        "SDP4Bit: warning: megatron-core 0.17.0 was never tested (tested: 0.16.1, 0.19.2); "
        "every attribute SDP4Bit replaces here (seam, padding) is present with the signature "
        "it was checked with, so it runs"]


def test_untested_release_with_a_moved_target_is_refused_naming_it(untested,
                                                                   monkeypatch) -> None:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron.sdp4bit.integration import patches
    from megatron.sdp4bit.integration.install import START_GRAD_SYNC

    renamed = "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup"
    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_grad_sync",
                        lambda self, force_all_reduce=False, new_option=None: None)
    message = ("SDP4Bit was tested with megatron-core 0.16.1 and 0.19.2 but megatron-core 0.17.0 "
               f"is installed, and {renamed}.start_grad_sync changed: its signature is (self, "
               "force_all_reduce, new_option), checked as (self, force_all_reduce) on "
               "megatron-core 0.16.1 and 0.19.2: install megatron-core==0.19.2 (Python >= 3.12) "
               "or megatron-core==0.16.1 (Python < 3.12), or pass allow_untested_version=True "
               "to try this one (then run tests/distributed/test_integration_sdp4bit.py "
               "against it first)")
    with pytest.raises(RuntimeError) as err:
        check_megatron_core_version()
    assert str(err.value) == message
    with pytest.raises(RuntimeError, match=r"or add --allow-untested-megatron-core to try"):
        check_megatron_core_version(how_to_allow="add --allow-untested-megatron-core")
    assert _warnings(untested) == []
    # The engine refuses the changed target until the user accepts the release.
    with pytest.raises(patches.ReplacementError, match=r"start_grad_sync changed"):
        patches.apply([START_GRAD_SYNC.on(object.__new__(_ParamAndGradBucketGroup))])
    assert check_megatron_core_version(allow_untested_version=True) == "0.17.0"
    assert _warnings(untested) == [
        f"SDP4Bit: warning: megatron-core 0.17.0 was never tested (tested: 0.16.1, 0.19.2) and "
        f"{renamed}.start_grad_sync changed: its signature is (self, force_all_reduce, "
        "new_option), checked as (self, force_all_reduce) on megatron-core 0.16.1 and 0.19.2; "
        "running anyway as asked"]
    group = object.__new__(_ParamAndGradBucketGroup)
    with patches.applied([START_GRAD_SYNC.on(group, bucket_ids=[], topology=None, group_id=0,
                                             state=None)]):
        assert "start_grad_sync" in vars(group)
    assert "start_grad_sync" not in vars(group)


def test_a_scoped_target_decides_only_for_the_callers_of_its_scope(untested,
                                                                   monkeypatch) -> None:
    """A target only the Megatron-LM plug-in replaces (scope ``megatron_lm``) that moved
    refuses the plug-in on an untested release, never a run that does not use it."""
    from megatron.sdp4bit.integration import patches

    moved = patches.Replacement(
        "t.scoped", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
        patches.MODULE, None, "[Note: test]", {"0.19.2": "(somewhere, else)"},
        (patches.MEGATRON_LM,))
    monkeypatch.setitem(patches._REGISTRY, moved.name, moved)
    assert check_megatron_core_version() == "0.17.0"
    # As enable() does: the Python 3.11 bridge first, for the plug-in's own entries (in the
    # table once integration/megatron_lm.py was imported) where megatron.training exists.
    from megatron.sdp4bit.integration.megatron_lm import PYTHON_312

    with patches.applied([PYTHON_312]), pytest.raises(
            RuntimeError, match=r"_set_cuda_rng_state changed: its signature is "
            r"\(new_state, device, graph_safe\), checked as \(somewhere, else\)"):
        check_megatron_core_version(
            scopes=(patches.SEAM, patches.PADDING, patches.MEGATRON_LM))


def test_untested_release_with_a_missing_target_stays_refused_even_when_allowed(
        untested, monkeypatch) -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    monkeypatch.delattr(mcore_random, "_set_cuda_rng_state")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 is installed, and "
                       r"megatron\.core\.tensor_parallel\.random\._set_cuda_rng_state is "
                       r"missing: install"):
        check_megatron_core_version(scopes=["cpu_mode"])
    # The override cannot make a missing target replaceable: one line, before anything is
    # built (not a ReplacementError at the first application, on every rank).
    with pytest.raises(RuntimeError) as err:
        check_megatron_core_version(scopes=["cpu_mode"], allow_untested_version=True)
    assert str(err.value) == (
        "SDP4Bit cannot run on megatron-core 0.17.0: megatron.core.tensor_parallel.random."
        "_set_cuda_rng_state is missing, and SDP4Bit replaces it (the override accepts a "
        "changed signature, not a missing target): install megatron-core==0.19.2 (Python >= "
        "3.12) or megatron-core==0.16.1 (Python < 3.12)")
    # a scope the caller does not apply cannot refuse it
    assert check_megatron_core_version(scopes=["seam"], allow_untested_version=True) == "0.17.0"
    from megatron.sdp4bit.integration import patches
    from megatron.sdp4bit.integration.cuda_stubs import SHARED_STUBS

    with pytest.raises(patches.ReplacementError, match=r"_set_cuda_rng_state is missing"):
        patches.apply(SHARED_STUBS)


def test_a_moved_target_refuses_only_the_callers_that_apply_its_scope(untested,
                                                                       monkeypatch) -> None:
    """A checkpoint-writer target that moved does not refuse a library user's
    install_sdp4bit (seam and padding), and does refuse the trainer, which writes
    checkpoints; a seam target that moved refuses both."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    from megatron.sdp4bit.integration import install_sdp4bit

    monkeypatch.setattr(TorchDistSaveShardedStrategy, "_get_save_and_finalize_callbacks",
                        lambda self, writer, save_state_dict_ret, strategy, extra=None: None)
    moved = ("megatron.core.dist_checkpointing.strategies.torch.TorchDistSaveShardedStrategy."
             "_get_save_and_finalize_callbacks changed: its signature is (self, writer, "
             "save_state_dict_ret, strategy, extra), checked as (self, writer, "
             "save_state_dict_ret) or (self, writer, save_state_dict_ret, async_strategy) on "
             "megatron-core 0.16.1 and 0.19.2")
    # install_sdp4bit's own check passes: it goes on to refuse the argument it was given
    with pytest.raises(ValueError, match="config must be an SDP4BitConfig, got NoneType"):
        install_sdp4bit([], None, None)
    assert check_megatron_core_version() == "0.17.0"
    trainer = ["seam", "padding", "checkpoint"]
    with pytest.raises(RuntimeError) as err:
        check_megatron_core_version(scopes=trainer, how_to_allow="pass --allow")
    assert f"megatron-core 0.17.0 is installed, and {moved}: install" in str(err.value)
    monkeypatch.setattr(_ParamAndGradBucketGroup, "start_param_sync",
                        lambda self, force_sync=False, extra=None: None)
    for scopes in (["seam", "padding"], trainer):
        with pytest.raises(RuntimeError, match=r"start_param_sync changed"):
            check_megatron_core_version(scopes=scopes)
    with pytest.raises(RuntimeError, match=r"start_param_sync changed"):
        install_sdp4bit([], None, None)
    with pytest.raises(ValueError, match=r"unknown scope\(s\) \['checkpoints'\]"):
        check_megatron_core_version(scopes=["checkpoints"])


def test_a_torch_target_is_checked_against_torchs_release(untested, monkeypatch) -> None:
    """The dry run registers its entries itself; its torch targets are checked against the
    installed torch release, and only a caller that applies the dry run walks them."""
    import torch.distributed as dist

    from dev import cuda_dryrun  # noqa: F401 - registers the dry run's entries
    from megatron.sdp4bit.integration import patches
    from megatron.sdp4bit.integration.releases import TESTED_TORCH_VERSIONS, torch_version

    entry = next(e for e in patches.all_replacements() if e.name == "dryrun.dist.all_reduce")
    assert patches.library(entry) == "torch" and entry.scopes == ("dryrun",)
    assert set(entry.checked) == set(TESTED_TORCH_VERSIONS) == {torch_version()}
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=None, group=None: None)
    assert check_megatron_core_version() == "0.17.0"  # install_sdp4bit does not apply it
    with pytest.raises(RuntimeError) as err:
        check_megatron_core_version(scopes=["dryrun"])
    assert (f"and torch.distributed.all_reduce changed: its signature is (tensor, op, group), "
            f"checked as (tensor, op, group, async_op) on torch {torch_version()}: install"
            in str(err.value))


@pytest.mark.parametrize("installed,release", [("0.19.2+0d43811", "0.19.2"), ("0.16.1", "0.16.1")])
def test_local_version_label_is_not_part_of_the_release(monkeypatch, installed, release) -> None:
    """0.19.2 appends the commit of the git repository its files sit in (a virtual environment
    inside a clone): that names no megatron-core change and must not be refused."""
    from megatron.core import package_info

    from megatron.sdp4bit.integration import version

    monkeypatch.setattr(version, "_warned", set())
    monkeypatch.setattr(package_info, "__version__", installed)
    assert check_megatron_core_version() == release
    monkeypatch.setattr(package_info, "__version__", "0.19.3+0d43811")
    assert check_megatron_core_version() == "0.19.3"  # untested: the table decides
