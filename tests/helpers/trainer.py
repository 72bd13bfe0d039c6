"""The tests' trainer runs: the tiny GPT's flags, ``torchrun ... pretrain_gpt.py``, its log lines.

``torchrun(args)`` starts ``pretrain_gpt.py`` on ``nproc`` ranks through :mod:`launch`
(torchrun's worker contract, ranks forked ready from the session's fork server), or the real
``torchrun`` with ``real=True``; ``launch`` is the same without the exit-code check, and
``one_error_line`` asserts the trainer's one-line failure. ``build_hf_corpus`` writes the
tests' documents with a Hugging Face tokenizer. The tiny GPT's flags (``TINY``), the small
corpus (``build_corpus``, ``preprocess``) and the log lines (``train_lines``) are
``dev/tiny_runs.py``'s, which the benchmarks share; here ``tools/preprocess_data.py`` runs
forked from the fork server (``python``: 3 s of CPU less than a fresh interpreter).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import socket
import subprocess
import tempfile

from dev import tiny_runs
from dev.tiny_runs import ROOT, TINY, documents, trainer_env, train_lines
from megatron.sdp4bit.training.cli.methods import METHOD_FLAGS

from tests.helpers import launch as _launch
from tests.helpers.corpora import write_hf_tokenizer

__all__ = ["METHODS", "ROOT", "TINY", "build_corpus", "build_hf_corpus", "documents",
           "free_port", "launch", "one_error_line", "preprocess", "python", "torchrun",
           "train_lines", "trainer_env"]
METHODS = METHOD_FLAGS  # the paper's methods as flags: one table, the tools' own


def python(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python script args`` with :func:`trainer_env` from the repository's root, forked from
    the session's fork server (:func:`launch.python`)."""
    return _launch.python(script, args, env=trainer_env(), cwd=ROOT, timeout=300)


def preprocess(d, docs: list[str], tokenizer: list[str]) -> str:
    """``dev/tiny_runs.py``'s :func:`~dev.tiny_runs.preprocess`, the tool forked ready."""
    return tiny_runs.preprocess(d, docs, tokenizer, run=python)


def build_corpus(d) -> list[str]:
    """``dev/tiny_runs.py``'s :func:`~dev.tiny_runs.build_corpus`, the tool forked ready."""
    return tiny_runs.build_corpus(d, run=python)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _mock_cache() -> str:
    """This pytest process's folder for megatron-core's mock-data indexes (created once,
    removed at exit; each test pass has its own)."""
    folder, owner = tempfile.mkdtemp(prefix="sdp4bit-mock-cache-"), os.getpid()
    # (a forked child that exits normally runs its parent's atexit hooks: not this one)
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, True))
    return folder


def torchrun(args: list[str], nproc: int = 4, timeout: int = 300, env: dict | None = None,
             check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc pretrain_gpt.py args``: by default through
    tests/helpers/launch.py (the ranks forked ready, torchrun's contract kept); ``real=True``
    starts the real ``torchrun``. ``check`` asserts a zero exit.

    A forked launch with ``--mock-data`` and no ``--data-cache-path`` gets the session's
    (:func:`_mock_cache`): megatron-core then builds each mock dataset's shuffled index once
    per configuration (seed, lengths, sample counts: its cache key) and loads it in every
    later launch, as a user's repeated runs with Megatron-LM's ``--data-cache-path`` do,
    instead of shuffling 6.4 million samples in every rank (0.3 s of CPU each). Without the
    flag (the real ``torchrun``'s runs, Megatron-LM's trainer) the index is built every time."""
    if real:
        res = tiny_runs.torchrun(args, nproc=nproc, timeout=timeout, env=env)
    else:
        if "--mock-data" in args and "--data-cache-path" not in args:
            args = [*args, "--data-cache-path", _mock_cache()]
        res = _launch.torchrun(os.path.join(ROOT, "pretrain_gpt.py"), args, nproc=nproc,
                               env={**trainer_env(), **(env or {})}, cwd=ROOT, timeout=timeout)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def build_hf_corpus(d) -> tuple[str, list[str], str]:
    """A Hugging Face tokenizer made offline in ``d/tokenizer`` and 40 of the tests' documents
    preprocessed with it; returns (tokenizer folder, documents, data prefix)."""
    folder = write_hf_tokenizer(d / "tokenizer")
    docs = documents(40)
    prefix = preprocess(d, docs, ["--tokenizer-type", "HuggingFaceTokenizer",
                                  "--tokenizer-model", folder])
    return folder, docs, prefix


def launch(args: list[str], env: dict | None = None, nproc: int = 4, timeout: int = 300,
           real: bool = False) -> subprocess.CompletedProcess:
    """:func:`torchrun` without the exit-code check."""
    return torchrun(args, nproc=nproc, timeout=timeout, env=env, check=False, real=real)


def one_error_line(res: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one error line of the trainer's and no traceback."""
    assert res.returncode != 0, res.stdout[-2000:]
    lines = [x for x in (res.stdout + res.stderr).splitlines()
             if x.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1, res.stdout[-2000:] + res.stderr[-4000:]
    # No worker prints a traceback; torchrun's own failure report (a ChildFailedError
    # traceback of the launcher, after the workers are gone) is the launcher's business.
    for after in (res.stdout + res.stderr).split("Traceback (most recent call last)")[1:]:
        assert "ChildFailedError" in after.split("Traceback")[0], res.stderr[-4000:]
    return lines[0][len("pretrain_gpt.py: error: "):]
