"""The tests' trainer runs: the tiny GPT's flags, ``torchrun ... pretrain_gpt.py``, its log lines.

``torchrun(args)`` starts ``pretrain_gpt.py`` on ``nproc`` ranks through :mod:`launch`
(torchrun's worker contract, ranks forked ready from the session's fork server), or the real
``torchrun`` with ``real=True``; ``launch`` is the same without the exit-code check, and
``one_error_line`` asserts the trainer's one-line failure. ``build_corpus`` writes the tests'
small preprocessed corpus (GPT-2's tokenizer format), ``build_hf_corpus`` the same documents
with a Hugging Face tokenizer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from megatron.sdp4bit.training.cli.methods import METHOD_FLAGS
from megatron.sdp4bit.training.observe.logging import parse_log_line

from tests.helpers import launch as _launch
from tests.helpers.corpora import TEXT, write_gpt2_vocab, write_hf_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 20 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
        "--lr-warmup-iters 2 --bf16 --use-distributed-optimizer --log-interval 5 "
        "--eval-interval 10 --eval-iters 2 --split 90,10,0 --seed 7").split()
METHODS = METHOD_FLAGS  # the paper's methods as flags: one table, the tools' own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_env() -> dict[str, str]:
    """The environment of a trainer or tool run: one thread per rank, this repository on
    ``PYTHONPATH``, no Triton interpreter (the trainer uses the torch references on CPU)."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    environ.pop("TRITON_INTERPRET", None)
    return environ


def torchrun(args: list[str], nproc: int = 4, timeout: int = 300, env: dict | None = None,
             check: bool = True, real: bool = False) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc pretrain_gpt.py args``: by default through
    tests/helpers/launch.py (the ranks forked ready, torchrun's contract kept); ``real=True``
    starts the real ``torchrun``. ``check`` asserts a zero exit."""
    script, environ = os.path.join(ROOT, "pretrain_gpt.py"), {**trainer_env(), **(env or {})}
    if real:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--standalone", script, *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                             env=environ, cwd=ROOT)
    else:
        res = _launch.torchrun(script, args, nproc=nproc, env=environ, cwd=ROOT,
                               timeout=timeout)
    if check:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return res


def train_lines(stdout: str) -> list[dict]:
    return [m for m in map(parse_log_line, stdout.splitlines()) if m is not None]


def documents(n: int) -> list[str]:
    """The tests' ``n`` documents: three consecutive lines of :data:`TEXT` each."""
    return [" ".join(TEXT[(i + k) % len(TEXT)] for k in range(3)) for i in range(n)]


def preprocess(d, docs: list[str], tokenizer: list[str]) -> str:
    """``docs`` written to ``d/corpus.jsonl`` and preprocessed with ``tools/preprocess_data.py``
    (``--append-eod``, the ``tokenizer`` flags); returns the data prefix."""
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                          "--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "corpus"),
                          *tokenizer, "--append-eod"],
                         capture_output=True, text=True, timeout=300, env=trainer_env())
    assert res.returncode == 0, res.stderr
    return str(d / "corpus_text_document")


def build_corpus(d) -> list[str]:
    """The tests' corpus in folder ``d`` (a ``pathlib.Path``); returns the flags that use it
    (also used by benchmarks/noise_spread.py, which measures on the tests' runs)."""
    vocab, merges = write_gpt2_vocab(d)
    prefix = preprocess(d, documents(60), ["--tokenizer-type", "GPT2BPETokenizer",
                                           "--vocab-file", vocab, "--merge-file", merges])
    return ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges,
            "--data-cache-path", str(d / "cache")]


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
