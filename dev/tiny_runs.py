"""The tiny trainer runs that the tests and the benchmarks share: the tiny GPT's flags, the
small corpus it trains on, ``torchrun ... pretrain_gpt.py`` and the log lines it prints.

One home for what a test and a benchmark must run identically (``benchmarks/noise_spread.py``
measures the rounding noise of the very runs ``tests/e2e/test_dist_checkpoint.py`` resumes):
the tests re-export these names from ``tests/helpers/trainer.py`` and ``tests/helpers/corpora.py``,
and a benchmark, which never imports ``tests`` (docs/design.md, section 7), imports them here.

* :data:`TINY`: a 2-layer GPT of hidden size 64 on 32-token sequences, 20 iterations.
* :func:`build_corpus`: a GPT-2 vocabulary trained on :data:`TEXT` (:func:`write_gpt2_vocab`)
  and 60 documents of it preprocessed with ``tools/preprocess_data.py``; returns the flags.
* :func:`torchrun`: the real ``torchrun`` of ``pretrain_gpt.py`` (the tests' own launcher,
  ``tests/helpers/launch.py``, forks ready ranks instead; a benchmark pays the start-up).
* :func:`train_lines`: the training log lines of a run's output, parsed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron.sdp4bit.training.observe.logging import parse_log_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharded data parallelism moves gradients and weights between ranks.",
    "Quantization to four bits shrinks every message on the wire.",
    "Hello world! Unicode: caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c.",
] * 4
"""The lines every tokenizer of the tests is trained on, and the documents are made of."""
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 20 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
        "--lr-warmup-iters 2 --bf16 --use-distributed-optimizer --log-interval 5 "
        "--eval-interval 10 --eval-iters 2 --split 90,10,0 --seed 7").split()


def write_gpt2_vocab(directory: Path, vocab_size: int = 300) -> tuple[str, str]:
    """Write GPT-2's ``vocab.json`` and ``merges.txt`` under ``directory``, a byte-level BPE
    that Hugging Face ``tokenizers`` trains on :data:`TEXT` (all 256 byte symbols are in the
    vocabulary, so any text round-trips); return their paths."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(TEXT, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = tok.save_model(str(directory))
    return vocab, merges


def trainer_env() -> dict[str, str]:
    """The environment of a trainer or tool run: one thread per rank, this repository on
    ``PYTHONPATH``, no Triton interpreter (the trainer uses the torch references on CPU)."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    environ.pop("TRITON_INTERPRET", None)
    return environ


def documents(n: int) -> list[str]:
    """``n`` documents: three consecutive lines of :data:`TEXT` each."""
    return [" ".join(TEXT[(i + k) % len(TEXT)] for k in range(3)) for i in range(n)]


def python(script: str, args: list[str]) -> subprocess.CompletedProcess:
    """``python script args`` in a fresh interpreter with :func:`trainer_env`, from the
    repository's root (the output captured as text)."""
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          timeout=300, env=trainer_env(), cwd=ROOT)


def preprocess(d: Path, docs: list[str], tokenizer: list[str], run=python) -> str:
    """``docs`` written to ``d/corpus.jsonl`` and preprocessed with ``tools/preprocess_data.py``
    (``--append-eod``, the ``tokenizer`` flags) through ``run`` (as :func:`python`: the
    tests pass one that forks the process ready); returns the data prefix."""
    with open(d / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    res = run(os.path.join(ROOT, "tools", "preprocess_data.py"),
              ["--input", str(d / "corpus.jsonl"), "--output-prefix", str(d / "corpus"),
               *tokenizer, "--append-eod"])
    if res.returncode != 0:
        raise RuntimeError(f"tools/preprocess_data.py failed: {res.stderr[-2000:]}")
    return str(d / "corpus_text_document")


def build_corpus(d: Path, run=python) -> list[str]:
    """The small corpus in folder ``d`` (preprocessed through ``run``, as in
    :func:`preprocess`); returns the flags that use it."""
    vocab, merges = write_gpt2_vocab(d)
    prefix = preprocess(d, documents(60), ["--tokenizer-type", "GPT2BPETokenizer",
                                           "--vocab-file", vocab, "--merge-file", merges], run)
    return ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges,
            "--data-cache-path", str(d / "cache")]


def torchrun(args: list[str], nproc: int, timeout: int = 300, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc --standalone pretrain_gpt.py args`` from the
    repository's root, with :func:`trainer_env` (and ``env`` over it); the exit code is the
    caller's to check."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", os.path.join(ROOT, "pretrain_gpt.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**trainer_env(), **(env or {})}, cwd=ROOT)


def train_lines(stdout: str) -> list[dict]:
    """The training log lines of ``stdout``, parsed (``observe.logging.parse_log_line``)."""
    return [m for m in map(parse_log_line, stdout.splitlines()) if m is not None]
