"""Export a torch_dist checkpoint of this trainer to a Hugging Face ``transformers`` model.

    python tools/checkpoint/export_hf.py --load CKPT_DIR --output HF_DIR [--iteration N]
        [--vocab-file vocab.json --merge-file merges.txt]

Reads only the model's tensors of the checkpoint the tracker names (in one process, no
torch.distributed), checks them against the manifest's SHA-256, and writes ``HF_DIR`` with
``model.safetensors`` and ``config.json`` (fp32) and, given GPT-2 BPE files, the tokenizer.
The architecture follows the model flags recorded in the manifest (hf_mappings.py):

* the default (learned absolute positions, LayerNorm, GeLU, biases, tied embeddings) is a
  ``GPT2LMHeadModel`` (``activation_function`` ``gelu``, or ``gelu_new`` with
  ``--openai-gelu``);
* ``--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear``
  (with ``--rotary-percent 1.0``; untied or tied embeddings, ``--group-query-attention``,
  any ``--kv-channels``) is a ``LlamaForCausalLM``, ``--rotary-base`` its ``rope_theta`` and
  ``--norm-epsilon`` its ``rms_norm_eps``.

Any other combination is refused with one line naming, for each architecture, the settings
that differ. The vocabulary is cut back to the tokenizer's size the manifest records (the
rows megatron padded it with go; import_hf.py adds them the same way). See
docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

from megatron.sdp4bit.training.checkpoint.hf_mappings import (
    READS, ExportError, hf_config, to_hf, trim_vocab, unstack, with_defaults)


def _checkpoint_dir(load: str, iteration: int | None) -> str:
    from megatron.sdp4bit.training.checkpoint import files, torch_dist_format

    if iteration is None:
        iteration = files.latest_iteration(load)
        if iteration is None:
            raise ExportError(f"--load {load} holds no checkpoint (no {files.TRACKER})")
    directory = files.iteration_dir(load, iteration)
    if not os.path.isdir(directory):
        raise ExportError(f"{directory} does not exist")
    if not torch_dist_format.is_dist_checkpoint(directory):
        raise ExportError(f"{directory} is a per-rank (--ckpt-format torch) checkpoint: resume "
                          "it once with --auto-detect-ckpt-format (saves in torch_dist), then "
                          "export that")
    return directory


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


def _verify(directory: str) -> None:
    from megatron.sdp4bit.training.checkpoint import files, torch_dist_format

    manifest = files.read_manifest(directory)
    if manifest is None:
        raise ExportError(f"{directory} has no {files.MANIFEST}: not saved by this trainer")
    for name, entry in sorted(manifest["files"].items()):
        if torch_dist_format.file_hash(os.path.join(directory, name)) != entry:
            raise ExportError(f"checkpoint file {os.path.join(directory, name)} does not match "
                              "its manifest: it is damaged; export an earlier checkpoint")


def export(load: str, output: str, iteration: int | None = None, vocab_file: str | None = None,
           merge_file: str | None = None) -> str:
    """Write the Hugging Face model into ``output``; returns its architecture's name."""
    from safetensors.torch import save_file

    from megatron.sdp4bit.training.checkpoint import files

    directory = _checkpoint_dir(load, iteration)
    _verify(directory)
    settings = files.read_manifest(directory)["settings"]
    model, assumed = with_defaults(settings["model"])
    vocab = settings.get("vocab_size")
    config = hf_config(model, vocab)
    name = config["architectures"][0]
    assumed = [k for k in assumed if k in READS[name]]
    if assumed:
        print(f"note: {directory}'s manifest (an older trainer's) does not record "
              + ", ".join(f"{k} (assumed the trainer's default {model[k]})" for k in assumed),
              file=sys.stderr)
    if vocab is None:
        print(f"note: {directory}'s manifest (an older trainer's) does not record the "
              "tokenizer's vocabulary size: the model keeps the padded "
              f"{model['padded_vocab_size']} rows", file=sys.stderr)
    tensors = unstack(read_model_tensors(directory), model)
    if vocab is not None:  # the padding rows go: the import's rule backwards (hf_mappings)
        tensors = trim_vocab(tensors, vocab)
    state = to_hf(name, tensors, model)
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
    return name


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
        name = export(args.load, args.output, args.iteration, args.vocab_file, args.merge_file)
    except (ExportError, CheckpointError) as err:
        p.exit(2, f"export_hf.py: error: {err}\n")
    out = args.output
    print(f"wrote {out} ({name}): transformers.AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
