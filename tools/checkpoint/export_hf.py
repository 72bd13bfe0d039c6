"""Export a torch_dist checkpoint of this trainer to a Hugging Face ``transformers`` model.

    python tools/checkpoint/export_hf.py --load CKPT_DIR --output HF_DIR [--iteration N]
        [--vocab-file vocab.json --merge-file merges.txt] [--overwrite]

Reads only the model's tensors of the checkpoint the tracker names (in one process, no
torch.distributed), checks them against the manifest's SHA-256, and writes ``HF_DIR`` with
``model.safetensors`` and ``config.json`` (fp32), and the tokenizer the run was trained with,
which the manifest records, with its bos, eos (end-of-document) and pad ids in
``config.json`` (``--vocab-file``/``--merge-file``: where its GPT-2 BPE files are now); where
it cannot (the files changed or are gone, a tokenizer without a
Hugging Face form, an older trainer's manifest without ``--vocab-file``/``--merge-file``) it
ships none and says why in one line (checkpoint/hf/tokenizer.py). Every file it reads keeps
the trainer's trust rule, and the checkpoint's pickles are read through the restricted
unpicklers (safe_load.py), after every entry of its ``.metadata`` is checked against its
files (dcp_entries.py); the tensors written must have the architecture's shapes under the
``config.json`` written. The architecture follows the model flags recorded in the manifest
(checkpoint/hf/):

* the default (learned absolute positions, LayerNorm, GeLU, biases, tied embeddings) is a
  ``GPT2LMHeadModel`` (``activation_function`` ``gelu``, or ``gelu_new`` with
  ``--openai-gelu``);
* ``--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear``
  (with ``--rotary-percent 1.0``; untied or tied embeddings, ``--group-query-attention``,
  any ``--kv-channels``) is a ``LlamaForCausalLM``, ``--rotary-base`` its ``rope_theta`` and
  ``--norm-epsilon`` its ``rms_norm_eps``.
* the same with ``--num-experts`` on every layer (megatron-core's softmax top-k router, no
  shared expert) is a ``MixtralForCausalLM``.

Any other combination is refused with one line naming, for each architecture, the settings
that differ. The vocabulary is cut back to the tokenizer's size the manifest records (the
rows megatron padded it with go; import_hf.py adds them the same way). See
docs/checkpoints.md.

The model is written into a fresh temporary folder beside ``HF_DIR`` and renamed to it when
complete, so ``HF_DIR`` never mixes files of two exports: an existing non-empty ``HF_DIR``
is refused unless ``--overwrite``, which replaces the whole folder. Every error (a damaged
checkpoint, a full disk) is one line, and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import warnings

import torch

from megatron.sdp4bit.training.checkpoint.hf import (
    READS, ExportError, hf_config, to_hf, trim_vocab, unstack, with_defaults)
from megatron.sdp4bit.training.checkpoint.hf import tokenizer as hf_tokenizer


def _checkpoint_dir(load: str, iteration: int | None) -> str:
    from megatron.sdp4bit.training.checkpoint import files, torch_dist_format

    if iteration is None:
        iteration = files.latest_iteration(load)
        if iteration is None:
            raise ExportError(f"--load {load} holds no checkpoint (no {files.TRACKER})")
    directory = files.iteration_dir(load, iteration)
    if not os.path.isdir(directory):
        raise ExportError(f"{directory} does not exist")
    try:
        files.check_trusted(load, directory)
    except files.CheckpointError as err:
        raise ExportError(str(err)) from None
    if not torch_dist_format.is_dist_checkpoint(directory):
        raise ExportError(f"{directory} is a per-rank (--ckpt-format torch) checkpoint: resume "
                          "it once with --auto-detect-ckpt-format (saves in torch_dist), then "
                          "export that")
    return directory


def read_model_tensors(directory: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a torch_dist checkpoint, full size, fp32 (no optimizer state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron.sdp4bit.training.checkpoint import safe_load

    reader = safe_load.safe_reader(directory)
    metadata = reader.read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and not k.startswith(("optimizer", "rng"))}
    with warnings.catch_warnings():  # one process by design: not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k: v.float() for k, v in state.items()}


def _verify(directory: str) -> dict:
    """The manifest of ``directory``, every file it lists checked against it."""
    from megatron.sdp4bit.training.checkpoint import files, integrity

    manifest = files.read_manifest(directory)
    if manifest is None:
        raise ExportError(f"{directory} has no {files.MANIFEST}: not saved by this trainer")
    for name, entry in sorted(manifest["files"].items()):
        if not os.path.isfile(os.path.join(directory, name)):
            raise ExportError(f"checkpoint file {os.path.join(directory, name)} is missing: the "
                              "checkpoint is incomplete; export an earlier checkpoint")
        if integrity.file_hash(os.path.join(directory, name)) != entry:
            raise ExportError(f"checkpoint file {os.path.join(directory, name)} does not match "
                              "its manifest: it is damaged; export an earlier checkpoint")
    return manifest


def _hf_state(directory: str, name: str, model: dict, vocab: int | None,
              config: dict) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors of the checkpoint, each of the shape the architecture gives
    it under ``config``; else ``ExportError`` naming them. The ``.metadata``'s shapes were
    checked against the files (nothing larger than they hold is read); whether they are the
    model's the manifest records is checked here, as the trainer's resume checks them
    against its model."""
    fix = (f"checkpoint {directory}'s tensors do not have the shapes its manifest's model "
           "settings give")
    try:
        tensors = unstack(read_model_tensors(directory), model)
        if vocab is not None:  # the padding rows go: the import's rule backwards (hf/tensors.py)
            tensors = trim_vocab(tensors, vocab)
        state = to_hf(name, tensors, model)
    except (RuntimeError, IndexError, AssertionError) as err:  # a reshape of the wrong size
        raise ExportError(f"{fix} ({type(err).__name__}: {str(err).splitlines()[0][:200]}): "
                          "the checkpoint is damaged or was crafted; export an earlier one"
                          ) from None
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: nothing allocated
        expected = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).state_dict()
    # A name the module does not have is one transformers converts when it loads the file
    # (transformers 5 fuses Mixtral's per-expert weights): the mapping's own tests cover those.
    wrong = [f"{k} is {list(v.shape)}, not {list(expected[k].shape)}"
             for k, v in sorted(state.items()) if k in expected and v.shape != expected[k].shape]
    if wrong:
        raise ExportError(f"{fix} ({'; '.join(wrong[:3])}"
                          + (f"; {len(wrong) - 3} more" if len(wrong) > 3 else "")
                          + "): the checkpoint is damaged or was crafted; export an earlier one")
    return state


def _check_output(output: str, overwrite: bool) -> None:
    if os.path.exists(output) and not os.path.isdir(output):
        raise ExportError(f"--output {output} is a file: give a folder")
    held = sorted(os.listdir(output)) if os.path.isdir(output) else []
    if held and not overwrite:
        raise ExportError(f"--output {output} is not empty (it holds {', '.join(held[:3])}"
                          f"{', ...' if len(held) > 3 else ''}): pass --overwrite to replace "
                          "the whole folder, or choose another --output")


def _write(folder: str, state: dict, config: dict) -> None:
    from safetensors.torch import save_file

    path = os.path.join(folder, "model.safetensors")
    try:
        save_file(state, path, metadata={"format": "pt"})
    except Exception as err:  # noqa: BLE001 - safetensors reports a failed write as its own type
        code = re.search(r"(?:code:|os error) (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)


def export(load: str, output: str, iteration: int | None = None, vocab_file: str | None = None,
           merge_file: str | None = None, overwrite: bool = False) -> str:
    """Write the Hugging Face model into ``output``; returns its architecture's name."""
    from megatron.sdp4bit import trusted_paths
    from megatron.sdp4bit.atomic_files import replace_folder
    from megatron.sdp4bit.training.checkpoint import files, safe_load

    output = os.path.abspath(output)
    _check_output(output, overwrite)
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if path and not os.path.isfile(path):
            raise ExportError(f"{flag} {path}: no such file")
        try:  # the trainer's trust rule, as for every file the tools read
            if path:
                trusted_paths.check(path, flag, "copy it to a folder of yours that only you "
                                    "can write")
        except trusted_paths.UntrustedPathError as err:
            raise ExportError(str(err)) from None
    directory = _checkpoint_dir(load, iteration)
    manifest = _verify(directory)
    # before anything unpickles its files or allocates a tensor of the shapes it gives
    safe_load.check_dist_checkpoint(directory, manifest["files"])
    settings = manifest["settings"]
    if (note := files.unsealed_note(directory, manifest)) is not None:
        print(f"note: {note}", file=sys.stderr)
    model, assumed = with_defaults(settings["model"])
    vocab = settings.get("vocab_size")
    tokenizer, special_ids, no_tokenizer = hf_tokenizer.choose(settings, vocab_file, merge_file)
    config = hf_config(model, vocab, special_ids)
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
    state = _hf_state(directory, name, model, vocab, config)
    parent = os.path.dirname(output)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(output)}.tmp-")
        os.chmod(tmp, 0o755)
        _write(tmp, state, config)
        if tokenizer is not None:
            no_tokenizer = hf_tokenizer.write(tmp, tokenizer, model["max_position_embeddings"],
                                              hf_tokenizer.digests(settings, vocab_file,
                                                                   merge_file))
        replace_folder(tmp, output)
    except OSError as err:
        raise ExportError(f"cannot write {output} ({err.strerror or err}): free space or fix "
                          "the folder; nothing was written") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if no_tokenizer:
        print(f"note: {no_tokenizer}", file=sys.stderr)
    return name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="export_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="the trainer's --save folder")
    p.add_argument("--output", required=True, help="folder for the Hugging Face model")
    p.add_argument("--iteration", type=int, default=None, help="default: the tracker's")
    p.add_argument("--vocab-file", help="the run's GPT-2 BPE vocab.json: where the recorded "
                   "one is now, or for a checkpoint of an older trainer (its manifest records "
                   "no tokenizer) the file to ship")
    p.add_argument("--merge-file", help="the same run's GPT-2 BPE merges.txt")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --output folder (the whole folder)")
    args = p.parse_args(argv)
    from megatron.sdp4bit.training.observe.noise import quiet_megatron_core

    quiet_megatron_core()  # before megatron-core's first import: an error is one line
    from megatron.sdp4bit.training.checkpoint.files import CheckpointError
    from megatron.sdp4bit.training.checkpoint.safe_load import UnsafePickle

    try:
        name = export(args.load, args.output, args.iteration, args.vocab_file, args.merge_file,
                      args.overwrite)
    except (ExportError, CheckpointError, UnsafePickle) as err:
        p.exit(2, f"export_hf.py: error: {err}\n")
    except OSError as err:  # an unreadable checkpoint file (permissions, a lost mount)
        p.exit(2, f"export_hf.py: error: cannot read {err.filename or args.load} "
                  f"({err.strerror or err}): fix its permissions or export another checkpoint\n")
    out = args.output
    print(f"wrote {out} ({name}): transformers.AutoModelForCausalLM.from_pretrained({out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
