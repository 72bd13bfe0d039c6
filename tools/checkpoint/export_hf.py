"""Export a torch_dist checkpoint of this trainer to a Hugging Face ``transformers`` model.

    python tools/checkpoint/export_hf.py --load CKPT_DIR --output HF_DIR [--iteration N]
        [--vocab-file vocab.json --merge-file merges.txt]

Reads only the model's tensors of the checkpoint the tracker names (in one process, no
torch.distributed), checks them against the manifest's SHA-256, and writes ``HF_DIR`` with
``model.safetensors`` and ``config.json`` (fp32) and, given GPT-2 BPE files, the tokenizer.
The default architecture (learned absolute positions, LayerNorm, GeLU, biases, tied
embeddings) maps to ``GPT2LMHeadModel``; any other combination is refused with one line
naming what does not map. The vocabulary keeps the trainer's padded size (the padding rows
are never produced by the tokenizer). See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ExportError(ValueError):
    """What stops the export; one line with the reason."""


def _checkpoint_dir(load: str, iteration: int | None) -> str:
    from megatron.sdp4bit.training.checkpoint import dist as dist_ckpt, files

    if iteration is None:
        iteration = files.latest_iteration(load)
        if iteration is None:
            raise ExportError(f"--load {load} holds no checkpoint (no {files.TRACKER})")
    directory = files.iteration_dir(load, iteration)
    if not os.path.isdir(directory):
        raise ExportError(f"{directory} does not exist")
    if not dist_ckpt.is_dist_checkpoint(directory):
        raise ExportError(f"{directory} is a per-rank (--ckpt-format torch) checkpoint: resume "
                          "it once with --auto-detect-ckpt-format (saves in torch_dist), then "
                          "export that")
    return directory


# What GPT2LMHeadModel computes, as the trainer's settings spell it.
GPT2_NEEDS = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
              "swiglu": False, "add_bias_linear": True,
              "untie_embeddings_and_output_weights": False, "group_query_attention": False}


def gpt2_config(model: dict) -> dict:
    """``GPT2Config`` fields for the trainer's model settings (refuses what does not map)."""
    wrong = [f"{k} {model.get(k)!r} (GPT-2 needs {v!r})" for k, v in GPT2_NEEDS.items()
             if model.get(k) != v]
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    if model.get("kv_channels") not in (None, hidden // heads):
        wrong.append(f"kv_channels {model['kv_channels']} (GPT-2 needs hidden/heads)")
    if wrong:
        raise ExportError("the model does not map to a Hugging Face architecture this tool "
                          "writes (GPT2LMHeadModel): " + "; ".join(wrong))
    eod = 50256 if model["padded_vocab_size"] > 50256 else None
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": model["padded_vocab_size"], "n_positions":
            model["max_position_embeddings"], "n_embd": hidden, "n_layer": model["num_layers"],
            "n_head": heads, "n_inner": model["ffn_hidden_size"],
            "activation_function": "gelu",  # megatron-core's GeLU is the exact (erf) one
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0, "tie_word_embeddings": True, "torch_dtype": "float32",
            # GPT-2's <|endoftext|>, when the vocabulary is GPT-2's
            "bos_token_id": eod, "eos_token_id": eod}


def read_model_tensors(directory: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a torch_dist checkpoint, full size, fp32 (no optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith(("optimizer", "rng"))}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return {k: v.float() for k, v in state.items()}


def gpt2_state(t: dict[str, torch.Tensor], model: dict) -> dict[str, torch.Tensor]:
    """megatron-core GPT tensors (layers stacked on dim 0) -> GPT2LMHeadModel's names."""
    heads, hidden = model["num_attention_heads"], model["hidden_size"]
    head_dim = hidden // heads
    out = {"transformer.wte.weight": t["embedding.word_embeddings.weight"],
           "transformer.wpe.weight": t["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": t["decoder.final_layernorm.weight"],
           "transformer.ln_f.bias": t["decoder.final_layernorm.bias"]}
    L = "decoder.layers."
    for i in range(model["num_layers"]):
        h = f"transformer.h.{i}."
        # megatron's fused QKV rows are [q, k, v] per head; GPT-2's columns are all q, all k,
        # all v. Conv1D stores weights as (in, out): transposed.
        qkv_w = t[L + "self_attention.linear_qkv.weight"][i].view(heads, 3, head_dim, hidden)
        qkv_b = t[L + "self_attention.linear_qkv.bias"][i].view(heads, 3, head_dim)
        out[h + "attn.c_attn.weight"] = qkv_w.transpose(0, 1).reshape(3 * hidden, hidden).t()
        out[h + "attn.c_attn.bias"] = qkv_b.transpose(0, 1).reshape(3 * hidden)
        out[h + "attn.c_proj.weight"] = t[L + "self_attention.linear_proj.weight"][i].t()
        out[h + "attn.c_proj.bias"] = t[L + "self_attention.linear_proj.bias"][i]
        out[h + "ln_1.weight"] = t[L + "self_attention.linear_qkv.layer_norm_weight"][i]
        out[h + "ln_1.bias"] = t[L + "self_attention.linear_qkv.layer_norm_bias"][i]
        out[h + "ln_2.weight"] = t[L + "mlp.linear_fc1.layer_norm_weight"][i]
        out[h + "ln_2.bias"] = t[L + "mlp.linear_fc1.layer_norm_bias"][i]
        out[h + "mlp.c_fc.weight"] = t[L + "mlp.linear_fc1.weight"][i].t()
        out[h + "mlp.c_fc.bias"] = t[L + "mlp.linear_fc1.bias"][i]
        out[h + "mlp.c_proj.weight"] = t[L + "mlp.linear_fc2.weight"][i].t()
        out[h + "mlp.c_proj.bias"] = t[L + "mlp.linear_fc2.bias"][i]
    return {k: v.contiguous() for k, v in out.items()}


def _verify(directory: str) -> None:
    from megatron.sdp4bit.training.checkpoint import dist as dist_ckpt, files

    manifest = files.read_manifest(directory)
    if manifest is None:
        raise ExportError(f"{directory} has no {files.MANIFEST}: not saved by this trainer")
    for name, entry in sorted(manifest["files"].items()):
        if dist_ckpt._hash(os.path.join(directory, name)) != entry:
            raise ExportError(f"checkpoint file {os.path.join(directory, name)} does not match "
                              "its manifest: it is damaged; export an earlier checkpoint")


def export(load: str, output: str, iteration: int | None = None, vocab_file: str | None = None,
           merge_file: str | None = None) -> str:
    """Write the Hugging Face model; returns ``output``."""
    from safetensors.torch import save_file

    from megatron.sdp4bit.training.checkpoint import files

    directory = _checkpoint_dir(load, iteration)
    _verify(directory)
    model = files.read_manifest(directory)["settings"]["model"]
    config = gpt2_config(model)
    state = gpt2_state(read_model_tensors(directory), model)
    os.makedirs(output, exist_ok=True)
    save_file(state, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(output, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    if vocab_file and merge_file:
        shutil.copyfile(vocab_file, os.path.join(output, "vocab.json"))
        shutil.copyfile(merge_file, os.path.join(output, "merges.txt"))
        with open(os.path.join(output, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({"tokenizer_class": "GPT2Tokenizer", "model_max_length":
                       model["max_position_embeddings"], "bos_token": "<|endoftext|>",
                       "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}, f, indent=1)
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the trainer's --save folder")
    p.add_argument("--output", required=True, help="folder for the Hugging Face model")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--vocab-file", help="GPT-2 BPE vocab.json to ship as the tokenizer")
    p.add_argument("--merge-file", help="GPT-2 BPE merges.txt to ship as the tokenizer")
    args = p.parse_args(argv)
    from megatron.sdp4bit.training.checkpoint.files import CheckpointError

    try:
        out = export(args.load, args.output, args.iteration, args.vocab_file, args.merge_file)
    except (ExportError, CheckpointError) as err:
        p.exit(2, f"export_hf.py: error: {err}\n")
    print(f"wrote {out} (GPT2LMHeadModel): transformers.AutoModelForCausalLM."
          f"from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
