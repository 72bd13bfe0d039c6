"""Import a Hugging Face ``transformers`` model as a checkpoint this trainer starts from.

    python tools/checkpoint/import_hf.py --hf HF_DIR --save CKPT_DIR [--overwrite]
        [--make-vocab-size-divisible-by 128] [--tensor-model-parallel-size 1]

Reads a local folder (``config.json`` and ``model.safetensors``, ``pytorch_model.bin`` or their
sharded ``*.index.json`` forms; nothing is downloaded) of a ``GPT2LMHeadModel`` or a
``LlamaForCausalLM`` (grouped-query attention, tied or untied embeddings, RoPE base from
the config; GPT-2's tanh GeLU ``gelu_new``, transformers' default, becomes
``--openai-gelu``) and writes ``CKPT_DIR/iter_0000000`` as a torch_dist checkpoint of the
model's weights (fp32) with this trainer's manifest, which records the model settings: a run
whose model flags differ is refused naming them. Start training from it with ``--finetune --load
CKPT_DIR`` or ``--pretrained-checkpoint CKPT_DIR``. The last line printed is the
``pretrain_gpt.py`` model flags of the checkpoint. The folder's tokenizer (its tokenizer
files, read offline by transformers) is recorded in the manifest as the
``--tokenizer-type HuggingFaceTokenizer --tokenizer-model HF_DIR`` it is, with its files'
SHA-256, and those two flags end the printed line; a folder without one is noted in one
line.

The tensors go through the export's mapping backwards (the architecture's entry in
megatron/sdp4bit/training/checkpoint/hf/registry.py). The vocabulary is padded as
Megatron-LM pads it, with zero rows up to a multiple of ``--make-vocab-size-divisible-by``
x ``--tensor-model-parallel-size``; the export cuts them off again. Any other architecture, or a setting that does not map (a GPT-2
activation other than GeLU or its tanh approximation, RoPE scaling, biases in a Llama, ...),
is refused in one line naming it. The checkpoint is written into a temporary folder beside
``CKPT_DIR`` and renamed at the end; a non-empty ``CKPT_DIR`` is refused unless
``--overwrite``. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile

from megatron.sdp4bit.training.checkpoint.hf import (
    REGISTRY, Architecture, MappingError, from_hf, pad_vocab, trainer_flags)


def _read_tensors(hf: str) -> dict:
    """Every tensor of the folder's weight files (fp32 or the dtype stored)."""
    import torch
    from safetensors.torch import load_file

    names = os.listdir(hf)
    for index, single, loader in (
            ("model.safetensors.index.json", "model.safetensors", load_file),
            ("pytorch_model.bin.index.json", "pytorch_model.bin",
             lambda p: torch.load(p, map_location="cpu", weights_only=True))):
        if index in names:
            with open(os.path.join(hf, index), encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        elif single in names:
            shards = [single]
        else:
            continue
        tensors: dict = {}
        for shard in shards:
            try:
                tensors.update(loader(os.path.join(hf, shard)))
            except Exception as err:  # noqa: BLE001 - safetensors/torch raise many types
                raise MappingError(f"cannot read {os.path.join(hf, shard)} ({type(err).__name__}: "
                                   f"{str(err).splitlines()[0][:160]})") from None
        return tensors
    raise MappingError(f"--hf {hf} holds no model.safetensors or pytorch_model.bin (nor their "
                       "sharded .index.json forms)")


def _normalized(arch: Architecture, tensors: dict, tied: bool) -> dict:
    """The weight names as ``save_pretrained`` of the architecture writes them (its own
    rules, then: no RoPE frequency buffers, and no output layer when it is the tied
    embedding)."""
    out = arch.normalize(tensors)
    out = {k: v for k, v in out.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied and "lm_head.weight" in out:
        if arch.embedding in out and not bool((out["lm_head.weight"] == out[arch.embedding]).all()):
            raise MappingError("config.json ties the output layer to the embedding, but "
                               "lm_head.weight differs from it")
        del out["lm_head.weight"]
    return out


def _source_tokenizer(hf: str, vocab: int) -> tuple[dict | None, str | None]:
    """(the manifest's record of the folder's tokenizer, as ``--tokenizer-type
    HuggingFaceTokenizer --tokenizer-model HF`` builds it; or None and why)."""
    import argparse

    from megatron.sdp4bit.training.tokenizers import registry
    from megatron.sdp4bit.training.tokenizers.huggingface import tokenizer_files

    if not tokenizer_files(hf):
        return None, (f"--hf {hf} holds no tokenizer files: none recorded (the export will "
                      "ship none)")
    args = argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf)
    try:
        tok = registry.build_tokenizer(args)
    except ValueError as err:
        return None, f"the tokenizer is not recorded: {err}"
    if tok.vocab_size > vocab:
        return None, (f"the tokenizer is not recorded: it has {tok.vocab_size} tokens, more "
                      f"than config.json's vocab_size {vocab}")
    return registry.record(args, tok), None


def _parse_trainer_flags(flags: list[str]):
    """The trainer's own parser and validation over the model flags (so the manifest records
    exactly what a run with these flags records)."""
    from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

    filler = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4", "--mock-data"]
    try:
        return parse_args(flags + filler, world_size=1)
    except ArgumentsError as err:
        raise MappingError(f"the trainer refuses the model's flags: {err}") from None


def _fill(model, tensors: dict) -> None:
    """Load ``tensors`` (named as the checkpoint names them, one per layer) into the model.
    The checkpoint's keys are the model's sharded state dict's, which differ from its module
    names (the local spec's ``input_layernorm`` is ``self_attention.linear_qkv.layer_norm_*``):
    each parameter is matched to its sharded key by its storage, and the layer index is
    taken from its module name."""
    import re

    import torch
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_storage = {}
    for sh in nested_values(model.sharded_state_dict()):
        if isinstance(getattr(sh, "data", None), torch.Tensor) and hasattr(sh, "key"):
            by_storage[sh.data.data_ptr()] = sh.key
    names = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        key = by_storage[param.data_ptr()]
        layer = re.match(r"decoder\.layers\.(\d+)\.", name)
        if layer:
            key = f"decoder.layers.{layer.group(1)}.{key[len('decoder.layers.'):]}"
        names[name] = key
    wrong = [f"{k} {list(tensors[k].shape)} (the model's is {list(p.shape)})"
             for n, p in model.state_dict().items() if (k := names.get(n)) in tensors
             and tuple(tensors[k].shape) != tuple(p.shape)]
    if wrong:
        raise MappingError("the weights do not have the shapes config.json gives: "
                           + ", ".join(wrong[:4]))
    missing = sorted(k for k in names.values() if k not in tensors)
    extra = sorted(set(tensors) - set(names.values()))
    if missing or extra:  # the mapping and megatron-core disagree: a bug of this tool
        raise MappingError(f"internal: the mapping misses {missing[:3]} and leaves {extra[:3]}")
    with torch.no_grad():
        model.load_state_dict({n: tensors[k] for n, k in names.items()}, strict=False)


def _write(args, tensors: dict, vocab: int, padded: int, partial: str, source: str,
           tokenizer: dict | None) -> None:
    """Build the trainer's GPTModel (fp32, one process), load the tensors, save them."""
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.training import build
    from megatron.sdp4bit.training.checkpoint import weights_only
    from megatron.sdp4bit.training.checkpoint.settings import run_settings
    from megatron.sdp4bit.training.model import build_model, transformer_config_from_args

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    build.init_distributed(args)
    try:
        model = build_model(args, transformer_config_from_args(args), padded)
        _fill(model, tensors)
        settings = run_settings(args, SDP4BitConfig(), padded, vocab)
        settings = {"model": settings["model"], "layout": settings["layout"],
                    "vocab_size": vocab, "source": source, "tokenizer": tokenizer}
        weights_only.save_weights(partial, [model], settings)
    finally:
        build.teardown()


def import_hf(hf: str, save: str, overwrite: bool = False, divisible_by: int = 128,
              tp: int = 1) -> list[str]:
    """Write the checkpoint; returns the ``pretrain_gpt.py`` model flags that match it."""
    from megatron.sdp4bit.training.tokenizers import padded_vocab_size

    if not os.path.isfile(os.path.join(hf, "config.json")):
        raise MappingError(f"--hf {hf} has no config.json: give a local Hugging Face model "
                           "folder (save_pretrained's output)")
    if os.path.exists(save) and not os.path.isdir(save):
        raise MappingError(f"--save {save} is a file: give a folder")
    if os.path.isdir(save) and os.listdir(save) and not overwrite:
        raise MappingError(f"--save {save} is not empty: pass --overwrite to replace what it "
                           "holds, or choose another folder")
    if divisible_by < 1 or tp < 1:
        raise MappingError("--make-vocab-size-divisible-by and --tensor-model-parallel-size "
                           "must be >= 1")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(hf, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types for bad configs
        raise MappingError(f"cannot read {os.path.join(hf, 'config.json')} as a transformers "
                           f"config ({type(err).__name__}: {str(err).splitlines()[0][:200]})"
                           ) from None
    name, flags, vocab = trainer_flags(config)
    tokenizer, note = _source_tokenizer(hf, vocab)
    padded = padded_vocab_size(vocab, divisible_by, tp)
    args = _parse_trainer_flags(flags)
    model = {k: getattr(args, k) for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
        "group_query_attention", "num_query_groups", "untie_embeddings_and_output_weights")}
    arch = REGISTRY[name]
    embedding = arch.embedding
    tensors = _normalized(arch, _read_tensors(hf), not model["untie_embeddings_and_output_weights"])
    rows = tensors[embedding].shape[0] if embedding in tensors else vocab
    if rows != vocab:
        raise MappingError(f"{embedding} has {rows} rows, config.json's vocab_size is {vocab}")
    tensors = pad_vocab(from_hf(name, tensors, model), padded)
    parent = os.path.dirname(os.path.abspath(save))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(save))}.import-",
                           dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is private; a checkpoint is not
    try:
        _write(args, tensors, vocab, padded, tmp, f"import_hf.py from {os.path.abspath(hf)} "
               f"({name})", tokenizer)
        from megatron.sdp4bit.atomic_files import replace_folder

        replace_folder(tmp, save)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if divisible_by != 128:
        flags += ["--make-vocab-size-divisible-by", str(divisible_by)]
    if tp != 1:
        flags += ["--tensor-model-parallel-size", str(tp)]
    if tokenizer is not None:
        flags += ["--tokenizer-type", tokenizer["type"], "--tokenizer-model",
                  tokenizer["args"]["tokenizer_model"]]
    if note:
        print(f"note: {note}", file=sys.stderr)
    return flags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="import_hf.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="local Hugging Face model folder")
    p.add_argument("--save", required=True, help="checkpoint folder to write (the run's "
                   "--load or --pretrained-checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --save")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary as the run will (default 128, the trainer's)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="the run's TP: the vocabulary is padded to a multiple of the divisor "
                   "x TP")
    args = p.parse_args(argv)
    from megatron.sdp4bit.training.observe.noise import quiet_megatron_core

    quiet_megatron_core(rank=0)
    from megatron.sdp4bit.training.checkpoint.files import CheckpointError

    try:
        flags = import_hf(args.hf, args.save, args.overwrite, args.make_vocab_size_divisible_by,
                          args.tensor_model_parallel_size)
    except (MappingError, CheckpointError, OSError) as err:
        p.exit(2, f"import_hf.py: error: {err}\n")
    print(f"wrote {args.save} (iteration 0, model weights only): start from it with "
          f"pretrain_gpt.py --finetune --load {args.save} and these model flags:")
    print(" ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
