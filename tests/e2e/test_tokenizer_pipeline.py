"""A Hugging Face tokenizer folder through the whole pipeline, as a Megatron-LM recipe uses
it: ``tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer``, 3 iterations of
SDP4Bit on 2 ranks of a Llama-style model with the same tokenizer flags, and the export,
which ships that tokenizer with its ids."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import launch as _launch
from tests.helpers.trainer import (METHODS, ROOT, build_hf_corpus, torchrun, train_lines,
                                   trainer_env)

# The tokenizer families are the trainer's own; megatron-core's IndexedDatasetBuilder and
# GPTDataset: test_pretrain_gpt.py's preprocessed runs, the Llama-style model and the export:
# test_dist_checkpoint.py's, all in both passes
pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.release_independent]

LLAMA = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 "
         "--train-iters 3 --lr 3e-3 --bf16 --use-distributed-optimizer --log-interval 1 "
         "--eval-interval 10 --eval-iters 1 --split 90,10,0 --seed 7 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu "
         "--disable-bias-linear").split()


def test_a_huggingface_tokenizer_is_preprocessed_trained_with_and_exported(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from transformers import AutoTokenizer

    folder, docs, prefix = build_hf_corpus(tmp_path)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder]
    data = IndexedDataset(prefix)
    assert len(data) == len(docs)
    assert data[5].tolist() == tok(docs[5]).input_ids + [tok.eos_token_id]

    save = tmp_path / "ckpt"
    res = torchrun(LLAMA + METHODS["SDP4Bit"] + flags + [
        "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
        "--save", str(save), "--save-interval", "3"], nproc=2)
    assert [m["iteration"] for m in train_lines(res.stdout)] == [1, 2, 3]
    manifest = json.loads((save / "iter_0000003" / "manifest.json").read_text())
    # Megatron-LM's padding of the tokenizer's vocabulary: a multiple of 128 rows
    assert (manifest["settings"]["vocab_size"], manifest["settings"]["model"][
        "padded_vocab_size"]) == (len(tok), -(-len(tok) // 128) * 128)
    saved = manifest["settings"]["tokenizer"]
    assert (saved["type"], saved["args"], saved["vocab_size"], saved["eod"], saved["bos"],
            saved["pad"]) == ("HuggingFaceTokenizer", {"tokenizer_model": folder}, len(tok),
                              tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)

    out = tmp_path / "hf"
    res = _launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                         ["--load", str(save), "--output", str(out)], env=trainer_env(),
                         cwd=ROOT, timeout=300)
    assert (res.returncode, res.stderr) == (0, ""), res.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"], config["eos_token_id"],
            config["bos_token_id"], config["pad_token_id"]) == (
        ["LlamaForCausalLM"], len(tok), tok.eos_token_id, tok.bos_token_id, tok.pad_token_id)
    shipped = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert [shipped(d).input_ids for d in docs[:4]] == [tok(d).input_ids for d in docs[:4]]
