"""training/noise.py: megatron-core's noise dropped, other warnings kept, rank 0 speaks."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron.sdp4bit.training.observe import noise

ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def clean_logging():
    """Undo the logger filters and levels quiet_megatron_core installs."""
    names = ["megatron", *noise.NOISE_LOGS]
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).filters)) for n in names}
    yield
    for n, (level, filters) in saved.items():
        logger = logging.getLogger(n)
        logger.setLevel(level)
        logger.filters[:] = filters


def _package_source(name: str) -> str:
    root = Path(importlib.util.find_spec(name).submodule_search_locations[0])
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))


def test_every_dropped_message_is_one_the_installed_packages_print():
    """Each pattern matches text in megatron-core (or torch.distributed) as installed: when an
    upstream release rewords a message, this fails instead of the filter going stale."""
    mcore = _package_source("megatron.core")
    torch_dist = _package_source("torch.distributed")
    # the source spreads some messages over adjacent string literals: join them
    joined = [re.sub(r"\"\s*\n\s*[f]?\"|'\s*\n\s*[f]?'", "", s) for s in (mcore, torch_dist)]
    from megatron.sdp4bit.integration.version import megatron_core_version

    installed = megatron_core_version()  # a release-specific pattern is checked on its own
    # release (the end-to-end run checks the console of each release for the noise)
    for message, module, _ in noise.NOISE_WARNINGS:
        if noise.RELEASE_SPECIFIC.get(message, installed) != installed:
            continue
        haystack = joined[1] if module.startswith("torch") else joined[0]
        assert re.search(message, haystack), message
    for patterns in noise.NOISE_LOGS.values():
        for pattern in patterns:  # plain text; megatron-core formats the class name in
            if noise.RELEASE_SPECIFIC.get(pattern, installed) != installed:
                continue
            assert pattern.replace("MockGPTDataset", "{type(self).__name__}") in joined[0], \
                pattern


def test_rank0_drops_the_noise_and_keeps_other_warnings(clean_logging, caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        noise.quiet_megatron_core(rank=0, cuda=False)
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "backends.py", 21, module="megatron.core.models.backends")
        warnings.warn_explicit("full scope is deprecated. Use empty cuda_graph_scope to capture "
                               "the whole layer.", UserWarning, "transformer_config.py", 1705,
                               module="megatron.core.transformer.transformer_config")
        # the same words from another package are not megatron-core's noise: kept
        warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning,
                               "mine.py", 1, module="mypackage")
        registry: dict = {}  # the calling module's, which "once per place" consults
        for _ in range(3):  # a user-facing warning: shown, once per place
            warnings.warn_explicit("your learning rate is huge", UserWarning, "user.py", 7,
                                   module="megatron.core.optimizer", registry=registry)
    assert [str(w.message) for w in caught] == [
        "Apex is not installed. Falling back to Torch Norm", "your learning rate is huge"]
    assert caught[0].filename == "mine.py"
    with caplog.at_level(logging.INFO):
        logging.getLogger("megatron.core.rerun_state_machine").warning(
            "Implicit initialization of Rerun State Machine!")
        logging.getLogger("megatron.core.rerun_state_machine").warning(
            "RerunStateMachine initialized in mode RerunMode.DISABLED")
        logging.getLogger("megatron.core.datasets.gpt_dataset").warning(
            "Unable to save MockGPTDataset indexes because path_to_cache is None")
        logging.getLogger("megatron.core.datasets.gpt_dataset").warning(
            "Unable to save GPTDataset indexes because path_to_cache is None")
        logging.getLogger("megatron.core.rerun_state_machine").warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == [
        "Unable to save GPTDataset indexes because path_to_cache is None", "a real problem"]


def test_other_ranks_speak_only_on_errors(clean_logging, caplog, monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        noise.quiet_megatron_core(rank=3, cuda=False)
        warnings.warn("a warning every rank would repeat", UserWarning)
        with caplog.at_level(logging.INFO):
            log = logging.getLogger("megatron.core.distributed")
            log.warning("every rank says this")
            log.error("this rank failed")
    assert caught == []
    assert [r.getMessage() for r in caplog.records] == ["this rank failed"]


def test_other_ranks_say_when_the_cpu_kernels_fall_back(clean_logging, monkeypatch):
    """Each rank that runs the slow torch references instead of the CPU kernels says so,
    once per process and naming its rank, though other warnings stay off on that rank."""
    import torch

    from megatron.sdp4bit.quantization import cpu_kernels
    from megatron.sdp4bit.quantization.backend import KernelBackend, resolve_backend

    monkeypatch.setattr(sys, "warnoptions", [])
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(cpu_kernels, "unavailable_reason", lambda: "no C compiler found")
    cpu_kernels._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        noise.quiet_megatron_core(rank=3, cuda=False)
        for _ in range(3):
            assert resolve_backend("auto", torch.empty(1)) is KernelBackend.TORCH
        warnings.warn("a warning every rank would repeat", UserWarning)
    cpu_kernels._warn_once.cache_clear()
    assert [str(w.message) for w in caught] == [
        "SDP4Bit CPU kernels unavailable on rank 3 (no C compiler found); the slower torch "
        "references run instead"]


def test_a_users_warning_options_win_on_other_ranks(clean_logging, monkeypatch):
    monkeypatch.setattr(sys, "warnoptions", ["always"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        noise.quiet_megatron_core(rank=1, cuda=False)
        warnings.warn("asked for with -W always", UserWarning)
    assert [str(w.message) for w in caught] == ["asked for with -W always"]


def _start(code: str, rank: str) -> subprocess.Popen:
    env = dict(os.environ, RANK=rank, PYTHONPATH=str(ROOT))
    env.pop("PYTHONWARNINGS", None)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


IMPORT_AND_BUILD = """
from megatron.sdp4bit.training.observe.noise import quiet_megatron_core
quiet_megatron_core(cuda=False)
import warnings
import megatron.core.optimizer
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.rerun_state_machine import get_rerun_state_machine
get_gpt_layer_local_spec()
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
get_rerun_state_machine()
for _ in range(2):
    warnings.warn("a warning of the user's own")
"""


def test_megatron_core_imports_and_builds_quietly_in_a_fresh_process():
    """What pretrain_gpt.py does first, in a new interpreter: megatron-core's real import-time
    and config-time noise is gone; a warning of the user's own still shows, once."""
    procs = [_start(IMPORT_AND_BUILD, rank) for rank in ("0", "1")]  # side by side
    (_, err0), (_, err1) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], err0 + err1
    shown = [line for line in err0.splitlines() if "Warning" in line or "Rerun" in line]
    assert len(shown) == 1 and "UserWarning: a warning of the user's own" in shown[0], err0
    assert err1 == ""


def test_announce_speaks_on_rank_zero_only(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    noise.announce("building the model")
    monkeypatch.setenv("RANK", "2")
    noise.announce("building the model")
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and re.fullmatch(r"\[\s*\d+\.\d s\] building the model", out[0])


def test_with_cuda_one_line_says_what_is_missing(clean_logging, capsys, monkeypatch):
    """On a GPU machine a missing apex is worth knowing (speed): one line, rank 0. A missing
    Transformer Engine is not said here: the argument check says it where it matters."""
    missing = {"transformer_engine", "apex"}  # the rest counts as installed
    monkeypatch.setattr(noise.importlib.util, "find_spec",
                        lambda name: None if name in missing else object())
    with warnings.catch_warnings():
        noise.quiet_megatron_core(rank=0, cuda=True)
        noise.quiet_megatron_core(rank=5, cuda=True)
    assert capsys.readouterr().err == (
        "note: apex not installed: megatron-core uses torch's optimizers, norms and kernels "
        "instead (correct, slower on GPU)\n")
    missing.discard("apex")
    with warnings.catch_warnings():
        noise.quiet_megatron_core(rank=0, cuda=True)
    assert capsys.readouterr().err == ""
    missing.add("apex")
    with warnings.catch_warnings():
        noise.quiet_megatron_core(rank=0, cuda=False)
    assert capsys.readouterr().err == ""