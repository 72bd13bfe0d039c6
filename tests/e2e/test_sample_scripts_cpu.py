"""A sample script run for real on CPU: ``LAUNCHER=torchrun NNODES=1`` with a tiny model
through ``EXTRA_ARGS``, 2 processes, 2 iterations.

The accuracy scripts train with ``--recompute-activations --recompute-granularity selective``
(``tests/unit/test_sample_scripts.py`` checks their command lines): megatron-core then runs
the attention's core again inside the backward pass, where a torch function mode is off
unless entered again, and builds the causal mask with ``device="cuda"`` there. This run
fails on a CUDA-less machine unless CPU mode keeps that mask on the CPU
(``integration/cpu_mode.py``: item 6 replaces the mask, item 7 enters the device rewrite
again inside backward; either is enough, both broken fail).
The script's launch itself depends on no megatron-core release, and megatron-core's
recompute path runs in both test passes in ``test_pretrain_gpt.py``'s run on Megatron-LM's
per-split files, so this test is ``release_independent`` (it runs once).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from tests.helpers.job import run_job  # noqa: E402
from tests.helpers.trainer import free_port, python, train_lines, trainer_env  # noqa: E402
from tests.helpers.corpora import TEXT, write_gpt2_vocab  # noqa: E402

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 "
        "--log-interval 1 --eval-iters 1")


@pytest.mark.slow
@pytest.mark.distributed
# megatron-core's selective recompute on CPU: test_pretrain_gpt.py's baseline-preprocessed run
@pytest.mark.release_independent
def test_accuracy_script_trains_on_cpu_with_selective_recompute(tmp_path):
    vocab, merges = write_gpt2_vocab(tmp_path / "gpt2")
    corpus = tmp_path / "corpus.jsonl"
    # 1000 one-sentence documents: the scripts' --split 969,30,1 leaves the test split one
    # (megatron-core loops for ever building a split without a document)
    corpus.write_text("".join(json.dumps({"text": TEXT[i % len(TEXT)]}) + "\n"
                              for i in range(1000)), encoding="utf-8")
    res = python(str(ROOT / "tools" / "preprocess_data.py"),
                 ["--input", str(corpus), "--output-prefix", str(tmp_path / "corpus"),
                  "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                  "--merge-file", merges, "--append-eod"])
    assert res.returncode == 0, res.stderr

    env = {k: v for k, v in trainer_env().items() if not k.startswith("SLURM_")}
    for name in ("CLUSTER", "MASTER_ADDR", "SDP4BIT_HOME", "MICRO_BATCH_SIZE", "WANDB_PROJECT"):
        env.pop(name, None)
    runs = tmp_path / "runs"
    # the script runs torchrun from PATH, as a job does: this interpreter's environment
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    env.update(LAUNCHER="torchrun", NNODES="1", GPUS_PER_NODE="2", MASTER_PORT=str(free_port()),
               TRAIN_ITERS="2", RUN_ROOT=str(runs),
               DATA_PATH=str(tmp_path / "corpus_text_document"), VOCAB_FILE=vocab,
               MERGE_FILE=merges, EXTRA_ARGS=TINY)
    script = ROOT / "sample_scripts" / "accuracy" / "125M" / "quantWeightDiff_Grad" / "train.sh"
    res = run_job(["bash", str(script)], env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "Torch not compiled with CUDA" not in res.stderr

    lines = train_lines(res.stdout)
    assert [m["iteration"] for m in lines] == [1, 2]
    assert all(math.isfinite(m["lm_loss"]) and m["skipped_iterations"] == 0 for m in lines)
    # SDP4Bit ran: both collectives sent 4-bit/8-bit data, not the unquantized sizes
    assert 0 < lines[-1]["comm_bytes_params"] < lines[-1]["baseline_comm_bytes_params"]
    assert 0 < lines[-1]["comm_bytes_grads_intra"] < lines[-1]["baseline_comm_bytes_grads_intra"]
    run_dir = runs / "accuracy" / "125M" / "quantWeightDiff_Grad"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "lm_loss" in r] == [1, 2]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2\n"
