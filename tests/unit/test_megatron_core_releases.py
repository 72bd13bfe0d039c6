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


def test_untested_version_is_refused_naming_both(monkeypatch) -> None:
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", "0.17.0")
    message = ("SDP4Bit was tested with megatron-core 0.16.1 and 0.19.2 but megatron-core 0.17.0 "
               "is installed: install megatron-core==0.19.2 (Python >= 3.12) or "
               "megatron-core==0.16.1 (Python < 3.12), or pass allow_untested_version=True to "
               "try this one (then run tests/distributed/test_integration_sdp4bit.py against it "
               "first)")
    with pytest.raises(RuntimeError) as err:
        check_megatron_core_version()
    assert str(err.value) == message
    assert check_megatron_core_version(allow_untested_version=True) == "0.17.0"


@pytest.mark.parametrize("installed,release", [("0.19.2+0d43811", "0.19.2"), ("0.16.1", "0.16.1")])
def test_local_version_label_is_not_part_of_the_release(monkeypatch, installed, release) -> None:
    """0.19.2 appends the commit of the git repository its files sit in (a virtual environment
    inside a clone): that names no megatron-core change and must not be refused."""
    from megatron.core import package_info

    monkeypatch.setattr(package_info, "__version__", installed)
    assert check_megatron_core_version() == release
    monkeypatch.setattr(package_info, "__version__", "0.19.3+0d43811")
    with pytest.raises(RuntimeError, match=r"but megatron-core 0\.19\.3 is installed"):
        check_megatron_core_version()
