"""Datasets as the trainer builds them (megatron-core's builder, in-process): each split
reads the files it was given."""

from __future__ import annotations

import numpy
import pytest
import torch

from megatron.sdp4bit.training.cli.arguments import parse_args
from megatron.sdp4bit.training.data import build_datasets, describe_data
from megatron.sdp4bit.training.tokenizers import build_tokenizer

MODEL = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
         "--micro-batch-size 1 --train-iters 4 --lr 1e-3 --eval-interval 2 --eval-iters 2 "
         "--tokenizer-type NullTokenizer --vocab-size 64").split()


def _corpus(path, low: int, high: int, docs: int = 12) -> str:
    """``docs`` documents of 10 tokens drawn from [low, high): a split's tokens tell which
    file they came from."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(low)
    builder = IndexedDatasetBuilder(str(path) + ".bin", dtype=numpy.uint16)
    for _ in range(docs):
        builder.add_document(torch.from_numpy(rng.integers(low, high, 10).astype(numpy.int64)),
                             [10])
    builder.finalize(str(path) + ".idx")
    return str(path)


def _tokens(dataset) -> set[int]:
    return {int(t) for i in range(len(dataset)) for t in dataset[i]["tokens"]}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("splits")
    return {name: _corpus(d / name, low, low + 10)
            for name, low in {"a": 1, "b": 20, "c": 40}.items()}


def test_each_split_reads_its_own_files(corpora):
    args = parse_args(MODEL + ["--train-data-path", corpora["a"], "--valid-data-path",
                               corpora["b"], "--test-data-path", corpora["c"]], world_size=1)
    train, valid, test = build_datasets(args, build_tokenizer(args))
    eod = build_tokenizer(args).eod
    assert _tokens(train) - {eod} <= set(range(1, 11))
    assert _tokens(valid) - {eod} <= set(range(20, 30))
    assert _tokens(test) - {eod} <= set(range(40, 50))
    # At least Megatron-LM's sizes (whole epochs: 12 documents of 10 tokens are 14 samples of
    # 8): train_iters x batch, (train_iters // eval_interval + 1) x eval_iters x batch,
    # eval_iters x batch.
    assert len(train) >= 4 and len(valid) >= 6 and len(test) >= 2
    assert describe_data(args) == f"train {corpora['a']}; valid {corpora['b']}; test {corpora['c']}"


def test_a_split_without_files_has_no_dataset(corpora):
    args = parse_args(MODEL + ["--train-data-path", "1", corpora["a"], "3", corpora["c"]],
                      world_size=1)
    train, valid, test = build_datasets(args, build_tokenizer(args))
    assert valid is None and test is None
    seen = _tokens(train)
    assert seen & set(range(1, 11)) and seen & set(range(40, 50))  # both weighted files


def test_data_path_is_divided_by_split(corpora):
    args = parse_args(MODEL + ["--data-path", corpora["b"]], world_size=1)
    assert describe_data(args) == f"--data-path {corpora['b']} (split 969, 30, 1)"
    # 12 documents: 969,30,1 would leave the test split none (the preflight refuses that
    # before megatron-core's sample loop spins); 10,1,1 gives 10, 1 and 1.
    args = parse_args(MODEL + ["--data-path", corpora["b"], "--split", "10,1,1"], world_size=1)
    datasets = build_datasets(args, build_tokenizer(args))
    for dataset in datasets:
        assert _tokens(dataset) - {build_tokenizer(args).eod} <= set(range(20, 30))


def _samples(dataset) -> list[list[int]]:
    return [dataset[i]["tokens"].tolist() for i in range(len(dataset))]


def test_eval_data_seed_keeps_the_held_out_samples_across_seeds(corpora, tmp_path):
    """--seed shuffles every split; with --eval-data-seed the validation and test samples
    no longer depend on it (the study compares runs of other --seed on them), while the
    training samples still do."""
    def build(*extra: str) -> list:
        args = parse_args(MODEL + ["--data-path", corpora["b"], "--split", "6,3,3",
                                   "--data-cache-path", str(tmp_path), *extra], world_size=1)
        return [_samples(d) for d in build_datasets(args, build_tokenizer(args))]

    plain = [build("--seed", str(s)) for s in (1, 2)]
    fixed = [build("--seed", str(s), "--eval-data-seed", "9") for s in (1, 2)]
    assert plain[0][1] != plain[1][1]  # the validation samples follow --seed without it
    assert fixed[0][1] == fixed[1][1] and fixed[0][2] == fixed[1][2]
    assert fixed[0][0] != fixed[1][0]  # the training order is still --seed's
    assert fixed[0][0] == plain[0][0] and fixed[1][0] == plain[1][0]
    assert fixed[0][1] == build("--seed", "9")[1]  # the same as a run at --seed 9


def test_train_data_seed_moves_the_training_order_alone(corpora, tmp_path):
    """--train-data-seed shuffles the training split instead of --seed: runs that differ in
    --seed alone then read the same training samples in the same order (they differ in
    initialization only), runs that differ in it alone read another order, and the held-out
    samples stay --eval-data-seed's (or --seed's without it) in every case."""
    def build(*extra: str) -> list:
        args = parse_args(MODEL + ["--data-path", corpora["b"], "--split", "6,3,3",
                                   "--data-cache-path", str(tmp_path), *extra], world_size=1)
        return [_samples(d) for d in build_datasets(args, build_tokenizer(args))]

    plain = {s: build("--seed", str(s)) for s in (1, 2)}
    # another initialization, the same order: --seed 2 reads --seed 1's training samples
    init = build("--seed", "2", "--train-data-seed", "1")
    assert init[0] == plain[1][0] and init[1:] == plain[2][1:]  # held out: --seed's
    # the same initialization, another order: --seed 1 reads --seed 2's training samples
    order = build("--seed", "1", "--train-data-seed", "2")
    assert order[0] == plain[2][0] != plain[1][0] and order[1:] == plain[1][1:]
    held = build("--seed", "1", "--train-data-seed", "2", "--eval-data-seed", "9")
    assert held[0] == plain[2][0] and held[1:] == build("--seed", "9")[1:]
