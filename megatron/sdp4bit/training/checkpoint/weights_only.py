"""A checkpoint's model weights alone: ``--finetune``, ``--pretrained-checkpoint``, torch_dist
checkpoints without this trainer's manifest (Megatron-LM's), and the weights-only
checkpoints that tools/checkpoint/import_hf.py writes.

[Note: what a weights-only start takes from the checkpoint]
Megatron-LM's ``--finetune`` (megatron/training/checkpointing.py, ``load_checkpoint``) loads
the model's tensors and nothing else: the iteration is set to 0, the optimizer and the
learning-rate schedule are not loaded (the command line's schedule starts fresh), nor the
RNG states, and the checkpoint's saved arguments are not compared with the run's
(``check_checkpoint_args`` is skipped), so the consumed samples stay 0 and the data are read
from this run's start. The fp32 main weights are then copied from the loaded 16-bit weights
(``reload_model_params``). This module does the same, with two checks Megatron-LM leaves to
the strict ``load_state_dict``, both one line naming every difference:

* where the checkpoint has our manifest, its model settings (the shape and the function:
  layers, heads, positions, normalization, ...) must equal this run's, all but the
  parameters' dtype (a fp32 import may be trained in bf16); its layout, data and SDP4Bit
  settings are not compared, and its files are checked against their SHA-256 first;
* always, the global shape of every model tensor this run builds must equal the one in the
  checkpoint's sharded metadata (megatron-core's ``load_tensors_metadata``), and no model
  tensor of the checkpoint may be left unused (optimizer entries are not model tensors).

The model's ``ShardedTensor`` s carry their TP/PP placement, so the weights load on any
tensor- and pipeline-parallel layout; the padded vocabulary is part of the shape.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

from megatron.sdp4bit import atomic_files
from megatron.sdp4bit.integration.dist_checkpointing import in_process_writer
from megatron.sdp4bit.training.checkpoint import (common, files, integrity, safe_load,
                                                  stored_shapes, torch_dist_format)
from megatron.sdp4bit.training.checkpoint import settings as settings_contract
from megatron.sdp4bit.training.checkpoint.files import CheckpointError

# settings["contents"] of a checkpoint that holds the model's weights and nothing else.
MODEL_ONLY = "model weights"
# Model settings a weights-only start does not compare (the load converts the dtype).
FREE_MODEL_SETTINGS = ("params_dtype",)
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine")


def _chunk_state(model_chunks) -> dict[str, Any]:
    return torch_dist_format.model_state(model_chunks)


def _shapes(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {t.key: tuple(t.global_shape) for t in stored_shapes.sharded_tensors(state)}


# The tensors whose rows are the padded vocabulary.
VOCABULARY_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def padding_fix(differ: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                tp: int) -> str | None:
    """The flag to name when only the vocabulary's rows differ ({key: (there, here)}): the
    model flags are the checkpoint's, the padding (divisor x TP) is not."""
    if not differ or any(k not in VOCABULARY_TENSORS or there[1:] != here[1:]
                         for k, (there, here) in differ.items()):
        return None
    rows = {there[0] for there, _ in differ.values()}.pop()
    fix = (f"at TP {tp}, --make-vocab-size-divisible-by {rows // tp} gives the checkpoint's "
           f"{rows}" if rows % tp == 0 else
           f"choose a TP and --make-vocab-size-divisible-by whose product divides {rows}")
    return ("the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP; "
            + fix)


def shape_problem(directory: str, state: dict[str, Any]) -> str | None:
    """Collective: what keeps this run's model (``state``: its sharded state dict, this
    rank's stage) from the checkpoint's tensors; None when every shape agrees."""
    mine = _shapes(state)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    wanted = {k: v for part in gathered for k, v in part.items()}
    problem: list = [None]
    if dist.get_rank() == 0:
        try:
            stored = {k: tuple(t.global_shape) for k, t in
                      dist_checkpointing.load_tensors_metadata(directory).items()
                      if not k.startswith(NOT_MODEL)}
        except Exception as err:  # noqa: BLE001 - megatron-core/torch raise many types here
            problem[0] = (f"cannot read the tensor metadata of checkpoint {directory} "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]})")
        else:
            fmt = lambda s: "[" + ", ".join(map(str, s)) + "]"  # noqa: E731
            differ = {k: (stored[k], v) for k, v in sorted(wanted.items())
                      if k in stored and stored[k] != v}
            wrong = [f"{k} is {fmt(there)} there, {fmt(here)} here"
                     for k, (there, here) in differ.items()]
            others = sorted(set(wanted) ^ set(stored))
            wrong += [f"{k} is missing there" for k in sorted(set(wanted) - set(stored))]
            wrong += [f"{k} is not part of this model" for k in sorted(set(stored) - set(wanted))]
            if wrong:
                fix = None if others else padding_fix(
                    differ, parallel_state.get_tensor_model_parallel_world_size())
                problem[0] = (f"checkpoint {directory} does not fit this model: "
                              + "; ".join(wrong) + ": "
                              + (fix or "pass the checkpoint's model flags"))
    dist.broadcast_object_list(problem, src=0)
    return problem[0]


def model_settings_problem(saved: dict[str, Any], current: dict[str, Any],
                           directory: str) -> str | None:
    """The manifest's model settings against this run's, the dtype left out."""
    old = {k: v for k, v in settings_contract.saved_model_settings(saved, current).items()
           if k not in FREE_MODEL_SETTINGS}
    new = {k: v for k, v in current["model"].items() if k not in FREE_MODEL_SETTINGS}
    for k in settings_contract.LATER_MODEL_SETTINGS:  # an older manifest lacks them: not compared
        if k not in old:
            new.pop(k, None)
    diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if not diff:
        return _vocabulary_problem(saved, current, directory)
    problem = (f"checkpoint {directory} was saved with model "
               f"{settings_contract.describe({k: old.get(k) for k in diff})}; this run has "
               f"{settings_contract.describe({k: new.get(k) for k in diff})}")
    padded, tp = old.get("padded_vocab_size"), current.get("layout", {}).get("tp", 1)
    if diff == ["padded_vocab_size"] and isinstance(padded, int):
        # Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP
        return f"{problem}: " + padding_fix(
            {VOCABULARY_TENSORS[0]: ((padded,), (new["padded_vocab_size"],))}, tp)
    return f"{problem}: pass the checkpoint's model flags"


def _vocabulary_problem(saved: dict[str, Any], current: dict[str, Any],
                        directory: str) -> str | None:
    """The tokenizer's vocabulary (before padding), which two tokenizers of one padded size
    can differ in: the rows would then mean other tokens."""
    old, new = saved.get("vocab_size"), current.get("vocab_size")
    if isinstance(old, int) and isinstance(new, int) and old != new:
        return (f"checkpoint {directory} was trained with a {old}-token vocabulary, this run's "
                f"tokenizer has {new} tokens (both padded to "
                f"{current['model'].get('padded_vocab_size')}): its embedding rows would mean "
                "other tokens; use the tokenizer files the checkpoint was trained with")
    return None


def _consumed(saved_common: dict[str, Any], iteration: int, global_batch: int) -> int:
    """Samples a resume of a manifest-less checkpoint continues after: ours record them,
    Megatron-LM's in its saved arguments, else the iteration's worth at this batch size."""
    if isinstance(saved_common.get("consumed_samples"), int):
        return saved_common["consumed_samples"]
    consumed = getattr(saved_common.get("args"), "consumed_train_samples", None)
    return consumed if isinstance(consumed, int) else iteration * global_batch


def load_weights(directory: str, manifest: dict[str, Any] | None, model_chunks, optimizer,
                 settings: dict[str, Any], *, finetune: bool, global_batch: int,
                 fully_parallel: bool = False) -> tuple[int, int]:
    """Collective: load the model's weights of a torch_dist checkpoint folder; the fp32 main
    weights follow them. Returns (0, 0) for ``finetune``, else the checkpoint's (iteration,
    consumed samples) (``--load-without-manifest --no-load-optim --no-load-rng``)."""
    if manifest is not None:
        problem = model_settings_problem(manifest["settings"], settings, directory)
        if problem is None:
            problem = integrity.verify_files(directory, manifest)
        if problem is not None:
            raise CheckpointError(problem)
    problem = safe_load.dist_checkpoint_problem(
        directory, None if manifest is None else manifest["files"])
    state = _chunk_state(model_chunks)
    problem = problem or shape_problem(directory, state)
    if problem is not None:
        raise CheckpointError(problem)
    strategy = TorchDistLoadShardedStrategy()
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    loaded = dist_checkpointing.load(state, directory, sharded_strategy=strategy)
    for key, chunk in zip(state, model_chunks):
        torch_dist_format.unwrap(chunk).load_state_dict(loaded[key], strict=True)
    for opt in common.inner_optimizers(optimizer):
        opt.reload_model_params()  # the fp32 main weights still hold the initialization
    if finetune:
        return 0, 0
    saved_common = dist_checkpointing.load_common_state_dict(directory)
    iteration = saved_common.get("iteration")
    if not isinstance(iteration, int):
        raise CheckpointError(f"checkpoint {directory} records no iteration: start from its "
                              "weights with --finetune instead")
    return iteration, _consumed(saved_common, iteration, global_batch)


def save_weights(root: str, model_chunks, settings: dict[str, Any]) -> str:
    """Collective: write the model's weights alone as iteration 0 under ``root`` (a torch_dist
    checkpoint with the manifest, ``contents`` = :data:`MODEL_ONLY`); returns its folder.
    A trainer run starts from it with ``--finetune`` or ``--pretrained-checkpoint``."""
    final = files.iteration_dir(root, 0)
    partial = final + ".partial"
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    state = _chunk_state(model_chunks)
    state.update(iteration=0, checkpoint_version=3.0)
    with in_process_writer() as strategy:
        dist_checkpointing.save(state, partial, sharded_strategy=strategy,
                                validate_access_integrity=True)
    dist.barrier()
    entries = integrity.hash_shares(partial, integrity.shared_listing(partial))
    if dist.get_rank() == 0:
        files.write_manifest(partial, 0, entries, {**settings, "contents": MODEL_ONLY,
                                                   "ckpt_format": torch_dist_format.FORMAT_NAME})
        os.replace(partial, final)
        atomic_files.fsync_dir(root)
        files.write_tracker(root, 0)
    dist.barrier()
    return final


def is_model_only(manifest: dict[str, Any] | None) -> bool:
    return manifest is not None and manifest["settings"].get("contents") == MODEL_ONLY
