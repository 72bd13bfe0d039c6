"""Train/valid/test datasets (megatron-core's GPTDataset or MockGPTDataset) and iterators.

Sizes follow Megatron-LM: train = ``train_iters x global batch`` samples, valid =
``(train_iters // eval_interval + 1) x eval_iters x global batch``, test =
``eval_iters x global batch`` (with ``--rampup-batch-size`` the training size is more than
the run reads: its first batches are smaller). The splits come from ``--data-path`` divided
by ``--split``, or each from its own files (``--train-data-path``, ``--valid-data-path``,
``--test-data-path``: megatron-core's ``blend_per_split``); a split without files has no
dataset (no validation without ``--valid-data-path``). The sampler hands every DP rank its
slice of each global batch in order, starting at ``consumed_samples``, so a resumed run
reads exactly the samples the uninterrupted run would have read.

Every split is shuffled with ``--seed`` (Megatron-LM's behaviour), so runs that differ in
``--seed`` train on another sample order and evaluate on different samples.
``--train-data-seed`` shuffles the training split with a seed of its own (the first build
uses it), so runs can differ in initialization alone (``--seed``) or in sample order alone.
``--eval-data-seed`` shuffles the validation and test splits with a seed of their own: when
it differs from the first build's seed they are built a second time with it (the training
split of that second build is asked for no samples, which keeps its index one epoch long),
and the training split is the one of the first build. Without ``--eval-data-seed`` the
held-out splits follow ``--seed``, whatever ``--train-data-seed``.

The split is by documents (megatron-core's builder: contiguous document ranges of
``--split``), and each split's samples are cut from its own documents only, so no token of
the held-out documents is trained on; the cached index files are named by a hash of the
seed, the split, the sizes, the path and the tokenizer files' names (not their contents).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list


def _per_split(args: argparse.Namespace) -> list | None:
    """megatron-core's ``blend_per_split`` of ``--{train,valid,test}-data-path``, or None."""
    paths = [args.train_data_path, args.valid_data_path, args.test_data_path]
    if not any(paths):
        return None
    return [get_blend_from_list(p) if p else None for p in paths]


def describe_data(args: argparse.Namespace) -> str:
    """The data this run reads, for the log: mock data, --data-path with its split, or the
    per-split paths."""
    if args.mock_data:
        return "mock data (--mock-data)"
    if args.data_path:
        return f"--data-path {' '.join(args.data_path)} (split {args.split})"
    return "; ".join(f"{split} {' '.join(paths)}" for split, paths in
                     (("train", args.train_data_path), ("valid", args.valid_data_path),
                      ("test", args.test_data_path)) if paths)


def dataset_config(args: argparse.Namespace, tokenizer) -> GPTDatasetConfig:
    per_split = None if args.mock_data else _per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None if args.mock_data or per_split else get_blend_from_list(args.data_path),
        blend_per_split=per_split,
        split=None if per_split else args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # Causal masking happens inside attention; no dense mask tensor per sample.
        create_attention_mask=False,
    )


def dataset_sizes(args: argparse.Namespace) -> list[int]:
    gbs = args.global_batch_size
    evals = args.train_iters // args.eval_interval + 1
    return [args.train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs]


def build_datasets(args: argparse.Namespace, tokenizer) -> list:
    """[train, valid, test]; rank 0 builds (and caches index files) before the others."""
    cls = MockGPTDataset if args.mock_data else GPTDataset
    sizes = dataset_sizes(args)
    train_seed = getattr(args, "train_data_seed", None)
    train_seed = args.seed if train_seed is None else train_seed
    eval_seed = getattr(args, "eval_data_seed", None)
    eval_seed = args.seed if eval_seed is None else eval_seed
    config = dataclasses.replace(dataset_config(args, tokenizer), random_seed=train_seed)

    def build() -> list:
        datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
        if eval_seed != train_seed:
            held_out = dataclasses.replace(config, random_seed=eval_seed)
            datasets[1:] = BlendedMegatronDatasetBuilder(
                cls, [0, *sizes[1:]], lambda: True, held_out).build()[1:]
        return datasets

    rank = dist.get_rank() if dist.is_initialized() else 0
    datasets = build() if rank == 0 else None
    if dist.is_initialized():
        dist.barrier()
    if datasets is None:
        datasets = build()
    return datasets


def sample_indices(consumed: int, total: int, micro_batch_size: int, dp_rank: int,
                   dp_size: int) -> Iterator[list[int]]:
    """This rank's micro-batches of dataset indices, in order, from ``consumed`` on.

    Samples are dealt out in steps of ``micro_batch_size x dp_size``: DP rank r takes
    the r-th block of ``micro_batch_size`` consecutive indices of every step.
    """
    step = micro_batch_size * dp_size
    if consumed % step:
        raise ValueError(f"consumed samples {consumed} is not a multiple of micro batch x "
                         f"data-parallel size = {step}: the checkpoint came from another layout")
    for start in range(consumed, total - step + 1, step):
        lo = start + dp_rank * micro_batch_size
        yield list(range(lo, lo + micro_batch_size))


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]
            if samples[0][k] is not None}


def batch_iterator(dataset, consumed: int, args: argparse.Namespace,
                   cycle: bool = False) -> Iterator[dict[str, torch.Tensor]] | None:
    """Micro-batches for this DP rank from ``consumed`` on; ``cycle`` restarts at 0 when the
    dataset runs out (for validation, which Megatron-LM also cycles)."""
    if dataset is None or len(dataset) == 0:
        return None
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()

    def gen() -> Iterator[dict[str, torch.Tensor]]:
        start = consumed
        while True:
            for idx in sample_indices(start, len(dataset), args.micro_batch_size, dp_rank, dp_size):
                yield _collate([dataset[i] for i in idx])
            if not cycle:
                return
            start = 0

    return gen()


def chunk_iterators(dataset, consumed: int, args: argparse.Namespace, cycle: bool = False):
    """What megatron-core's schedule takes as ``data_iterator``: :func:`batch_iterator`, or
    with the interleaved pipeline one per model chunk, as Megatron-LM gives it. The
    schedule runs every micro-batch through every chunk in order and each chunk draws its
    own next micro-batch, so identical iterators keep the chunks on the same samples (the
    first chunk uses the tokens, the last the labels). None without data."""
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if vpp is None:
        return batch_iterator(dataset, consumed, args, cycle=cycle)
    iterators = [batch_iterator(dataset, consumed, args, cycle=cycle) for _ in range(vpp)]
    return None if iterators[0] is None else iterators
