"""A torch_dist checkpoint of a GPT-2-shaped model as the trainer lays it out (the model's
tensors in PyTorch Distributed Checkpoint files, metadata.json, the manifest, the tracker),
written without the trainer: what tools/checkpoint/export_hf.py reads; and the check of an
export against the trainer's own model (:func:`check_export`)."""

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


def check_export(model, ckpt_dir: str, hf_dir: str, architecture: str) -> None:
    """The trainer's GPTModel ``model`` (fp32) gets the checkpoint's weights; its logits and
    the exported model's (``architecture``, read by transformers from ``hf_dir``) on the same
    tokens must agree, and ``generate()`` must run. The checkpoints' tokenizer has 300
    tokens."""
    import torch
    from megatron.core import dist_checkpointing
    from transformers import AutoModelForCausalLM

    model = model.eval()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, ckpt_dir)
    model.load_state_dict(loaded["model"], strict=False)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (2, model.max_sequence_length), generator=gen)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens, positions, None).float()
        theirs = hf(tokens).logits
    # The export cuts the vocabulary back to the tokenizer's 300 tokens (the padding rows go).
    assert hf.config.vocab_size == 300 and theirs.shape[-1] == 300
    ours = ours[..., :300]
    # Same fp32 weights and function; only the order of the fp32 sums differs. A dot product
    # of length K has a relative error of at most K * 2**-24 of the sum of |terms| (K <= 256
    # here: 1.5e-5); through 2 layers the logits (|logit| <= ~10) stay within 1e-4 * max|logit|.
    # With RoPE both sides rotate by cos/sin of the same fp32 angles (position x inv_freq,
    # inv_freq = base ** (-2i / head_dim) computed alike), and RMSNorm's mean of squares is one
    # more dot product (K = 64): the same bound holds.
    bound = 1e-4 * ours.abs().max().item()
    assert (ours - theirs).abs().max().item() <= bound, ((ours - theirs).abs().max(), bound)
    out = hf.generate(tokens[:1, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def init_one_rank() -> None:
    """A spawned child rank of one (world of 1) for building the trainer's model."""
    from megatron.core import tensor_parallel

    from tests.helpers.tiny_gpt import init_parallel

    init_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)  # the attention's RNG tracker


def export_hf(load, hf, architecture: str) -> None:
    """``tools/checkpoint/export_hf.py --load load --output hf``, which must write
    ``architecture``."""
    from tests.helpers import launch
    from tests.helpers.trainer import ROOT, trainer_env

    res = launch.python(os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"),
                        ["--load", str(load), "--output", str(hf)], env=trainer_env(), cwd=ROOT,
                        timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.startswith(f"wrote {hf} ({architecture}): "), res.stdout
