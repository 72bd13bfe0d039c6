"""Megatron-LM's own trainer with SDP4Bit, launched as the tests launch it: the GPT script in
Megatron-LM's shape (tests/helpers/megatron_lm_gpt.py) under ``python -m
megatron.sdp4bit.megatron_lm``, on 4 ranks, on the CUDA dry run (Megatron-LM's trainer
asserts CUDA: docs/megatron_lm.md, "How it is tested here"), with :data:`MEGATRON_LM_FLAGS`
before the test's own flags."""

from __future__ import annotations

import os
import subprocess

from tests.helpers import launch as _launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron-LM's flags for a tiny GPT on mock data; the local layer spec and no fused kernels
# (no Transformer Engine or Apex here); no dataloader workers (they would see the dry run's
# tagged tensors: docs/cuda_dryrun.md, "Other threads"). Dropout off: the dry run's "CUDA"
# generator is the CPU one, so Megatron-LM's RNG checkpoint restores two states into one
# generator and a resumed run's dropout masks differ (a GPU has two generators).
MEGATRON_LM_FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 "
    "--bf16 --use-distributed-optimizer --log-interval 1 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --seed 7 --train-iters 4 "
    "--eval-interval 1000 --eval-iters 0 --num-workers 0 --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-persist-layer-norm --hidden-dropout 0 "
    "--attention-dropout 0 --lr-decay-style constant").split()


def launch(args: list[str]) -> subprocess.CompletedProcess:
    """The script on 4 ranks with :data:`MEGATRON_LM_FLAGS` and ``args`` (as ``subprocess.run``
    with ``capture_output=True, text=True`` returns it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    env.pop("TRITON_INTERPRET", None)
    script = os.path.join(ROOT, "tests", "helpers", "megatron_lm_gpt.py")
    return _launch.torchrun(
        os.path.join(ROOT, "dev", "cuda_dryrun.py"),
        ["-m", "megatron.sdp4bit.megatron_lm", script, *MEGATRON_LM_FLAGS, *args],
        nproc=4, env=env, cwd=ROOT, timeout=400)
