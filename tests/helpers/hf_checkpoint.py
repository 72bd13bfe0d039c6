"""A torch_dist checkpoint of a GPT-2-shaped model as the trainer lays it out (the model's
tensors in PyTorch Distributed Checkpoint files, metadata.json, the manifest, the tracker),
written without the trainer: what tools/checkpoint/export_hf.py reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def gpt2_tensors(model: dict) -> dict[str, torch.Tensor]:
    """Random tensors of the settings' shapes, the layers stacked as torch_dist stores them."""
    hidden, ffn, layers = model["hidden_size"], model["ffn_hidden_size"], model["num_layers"]
    t = {"embedding.word_embeddings.weight": (model["padded_vocab_size"], hidden),
         "embedding.position_embeddings.weight": (model["max_position_embeddings"], hidden),
         "decoder.final_layernorm.weight": (hidden,), "decoder.final_layernorm.bias": (hidden,)}
    for name, shape in (("self_attention.linear_qkv.weight", (3 * hidden, hidden)),
                        ("self_attention.linear_qkv.bias", (3 * hidden,)),
                        ("self_attention.linear_proj.weight", (hidden, hidden)),
                        ("self_attention.linear_proj.bias", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_weight", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.weight", (ffn, hidden)), ("mlp.linear_fc1.bias", (ffn,)),
                        ("mlp.linear_fc2.weight", (hidden, ffn)),
                        ("mlp.linear_fc2.bias", (hidden,))):
        t["decoder.layers." + name] = (layers, *shape)
    return {k: torch.randn(shape) for k, shape in t.items()}


def write_gpt2_checkpoint(root: Path, model: dict, iteration: int = 2,
                          settings: dict | None = None) -> str:
    """Write the checkpoint under ``root``; the manifest's settings are ``model`` and the
    padded vocabulary as the tokenizer's size, updated with ``settings``. Returns ``root``."""
    import torch.distributed.checkpoint as dcp

    from megatron.sdp4bit.training.checkpoint import files, integrity

    directory = files.iteration_dir(str(root), iteration)
    dcp.save(gpt2_tensors(model), storage_writer=dcp.FileSystemWriter(directory),
             no_dist=True)
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1}, f)
    entries = {n: integrity.file_hash(os.path.join(directory, n))
               for n in sorted(os.listdir(directory))}
    files.write_manifest(directory, iteration, entries, {
        "model": model, "vocab_size": model["padded_vocab_size"], **(settings or {})})
    files.write_tracker(str(root), iteration)
    return str(root)
