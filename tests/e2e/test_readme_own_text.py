"""README, "Training on your own text": its commands run as written, on a small corpus.

The block between ``<!-- own-text:start -->`` and ``<!-- own-text:end -->`` goes to ``bash``
verbatim, in a scratch folder that stands in for the repository root: ``tools/`` and
``pretrain_gpt.py`` link to the repository's, ``data/cache/`` holds GPT-2's files under the
names ``tools/prepare_default_data.py`` gives them, and the corpus file the README names
holds 100 small documents. One thing differs: ``torchrun`` on ``PATH`` is a stand-in that
runs the real one with the README's arguments followed by ``--train-iters 1``, no warm-up and
an evaluation at the end (``pretrain_gpt.py`` takes the last occurrence of a flag): one
iteration instead of 200 (GPT-2's 50257-token output layer in bf16 takes seconds per
iteration on CPUs without native bf16). Then the ``.bin``/``.idx`` pair must load in megatron-core's
``IndexedDataset`` and hold every document's GPT-2 tokens, and the run must have logged
its iterations, a validation loss and a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.helpers.corpora import TEXT
from tests.helpers.job import run_job
from tests.helpers.scripts import load_tool
from tests.helpers.trainer import train_lines, trainer_env

ROOT = Path(__file__).resolve().parents[2]
pdd = load_tool("tools/prepare_default_data.py")

START, END = "<!-- own-text:start -->", "<!-- own-text:end -->"
SHORT_RUN = ["--train-iters", "1", "--lr-warmup-iters", "0", "--log-interval", "1",
             "--eval-interval", "1", "--eval-iters", "1"]
GPT2_EOD = 50256  # <|endoftext|>

# The stand-in torchrun: the real one (as a module of this interpreter), the README's
# arguments, then the short-run flags.
FAKE_TORCHRUN = """#!/usr/bin/env bash
exec "$README_TEST_PYTHON" -m torch.distributed.run "$@" $README_TEST_SHORT_RUN
"""


def readme_block() -> str:
    """The bash code between the markers (exactly one fenced ``bash`` block)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, "markers missing or repeated"
    section = text.split(START, 1)[1].split(END, 1)[0]
    m = re.fullmatch(r"\s*```bash\n(.*?)```\s*", section, flags=re.S)
    assert m, f"the marked section must be one ```bash block:\n{section}"
    return m.group(1)


def commands(block: str) -> list[list[str]]:
    """The block's commands as argv lists (continuation lines joined, comments dropped)."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if shlex.split(line, comments=True)]


def option(argv: list[str], name: str) -> str:
    (i,) = [i for i, a in enumerate(argv) if a == name]
    return argv[i + 1]


def corpus() -> list[str]:
    """100 documents of 3 to 6 sentences, Unicode included."""
    return [" ".join(TEXT[(i + k) % len(TEXT)] for k in range(3 + i % 4)) for i in range(100)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.release_independent  # the trainer's megatron-core paths: test_pretrain_gpt.py
@pytest.mark.main_environment  # the README's commands, in the environment the README makes
def test_readme_own_text_commands_run_as_written(tmp_path):
    block = readme_block()
    cmds = commands(block)
    # Exactly the two documented steps; a new command needs this test to say what it checks.
    assert [c[:2] for c in cmds] == [["python", "tools/preprocess_data.py"],
                                     ["torchrun", "--standalone"]], cmds
    prep, train = cmds
    assert "pretrain_gpt.py" in train
    prefix = option(prep, "--output-prefix")
    data_path = option(train, "--data-path")
    assert data_path == f"{prefix}_text_document"  # the file the first command writes
    for argv in (prep, train):  # both use the default dataset's GPT-2 files
        assert option(argv, "--tokenizer-type") == "GPT2BPETokenizer"
        assert option(argv, "--vocab-file") == "data/cache/gpt2-vocab.json"
        assert option(argv, "--merge-file") == "data/cache/gpt2-merges.txt"

    # The scratch repository root.
    root = tmp_path / "repo"
    root.mkdir()
    (root / "tools").symlink_to(ROOT / "tools")
    (root / "pretrain_gpt.py").symlink_to(ROOT / "pretrain_gpt.py")
    vocab_src, merges_src = pdd.gpt2_files()
    cache = pdd.paths(root / "data" / "cache")  # where prepare_default_data.py puts them
    cache["vocab"].parent.mkdir(parents=True)
    cache["vocab"].write_bytes(vocab_src.read_bytes())
    cache["merges"].write_bytes(merges_src.read_bytes())
    docs = corpus()
    (root / option(prep, "--input")).write_text(
        "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text(FAKE_TORCHRUN)
    (fake / "torchrun").chmod(0o755)

    env = trainer_env()
    env.update(PATH=os.pathsep.join([str(fake), os.path.dirname(sys.executable), env["PATH"]]),
               README_TEST_PYTHON=sys.executable, README_TEST_SHORT_RUN=" ".join(SHORT_RUN))
    script = tmp_path / "own_text.sh"
    script.write_text("set -euo pipefail\n" + block)
    res = run_job(["bash", str(script)], cwd=root, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]

    # The preprocessed pair: every document, in order, as GPT-2 tokens ending with EOD.
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(str(cache["vocab"]), str(cache["merges"]))
    ds = IndexedDataset(str(root / data_path))
    assert len(ds) == len(docs)
    for i, doc in enumerate(docs):
        ids = ds[i].tolist()
        assert ids[-1] == GPT2_EOD and GPT2_EOD not in ids[:-1]
        assert ids[:-1] == tok.encode(doc).ids
        assert tok.decode(ids[:-1]) == doc

    # The short run: its log line, one validation, a checkpoint at the end.
    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == [1], res.stdout[-3000:]
    assert all(math.isfinite(m["lm_loss"]) and m["lm_loss"] < 11.5 for m in lines)
    assert lines[0]["global_batch_size"] == int(option(train, "--global-batch-size"))
    # the 4 processes are two "nodes" of two: both gradient hops carry bytes
    assert lines[-1]["comm_bytes_grads_intra"] > 0 and lines[-1]["comm_bytes_grads_inter"] > 0
    records = [json.loads(x) for x in (root / option(train, "--metrics-jsonl")).read_text().splitlines()]
    evals = [r for r in records if "val_lm_loss" in r]
    assert [r["iteration"] for r in evals] == [1] and math.isfinite(evals[0]["val_lm_loss"])
    ckpt = root / option(train, "--save")
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1\n"
