"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.helpers.trainer import build_corpus


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> list[str]:
    """The tests' GPT-2 BPE corpus through tools/preprocess_data.py, built once per session;
    returns the flags that use it. Tests must not change its files (copy them to break them)."""
    return build_corpus(tmp_path_factory.mktemp("data"))
