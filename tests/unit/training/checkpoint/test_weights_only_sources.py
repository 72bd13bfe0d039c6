"""Which checkpoint a run starts from, and how (training/checkpoint/formats.py), without
processes: rank 0's probe is replaced by the folders' verdicts and the loaders by
recorders, so only the rules are exercised: --pretrained-checkpoint when --load holds no
checkpoint, --finetune's weights-only load, and the refusals of a checkpoint a full resume
cannot use. The loads themselves run in tests/e2e/test_pretrained_start.py."""

from __future__ import annotations

import argparse

import pytest

from megatron.sdp4bit.training.checkpoint import files, formats, weights_only
from megatron.sdp4bit.training.checkpoint.files import CheckpointError

OURS = {"settings": {"model": {}}, "files": {}}
IMPORTED = {"settings": {"model": {}, "contents": weights_only.MODEL_ONLY,
                         "source": "import_hf.py from /hf (LlamaForCausalLM)"}, "files": {}}


def _args(**kw) -> argparse.Namespace:
    base = dict(load=None, pretrained_checkpoint=None, finetune=False, ckpt_format="torch_dist",
                auto_detect_ckpt_format=False, no_load_optim=False, no_load_rng=False,
                load_without_manifest=False, allow_changed_sdp4bit_settings=False,
                allow_changed_data=False, ckpt_fully_parallel_load=False, global_batch_size=16,
                ckpt_step=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture
def world(monkeypatch):
    """folders: root -> (format, manifest) or None (no tracker); calls: what was loaded."""
    folders: dict = {}
    calls: list = []
    monkeypatch.setattr(formats, "_verdict",
                        lambda root, step=None: folders.get(root) or (None, None))
    monkeypatch.setattr(formats, "_iteration", lambda root, step: 5)

    def weights(directory, manifest, *_, finetune, **__):
        calls.append(("weights", directory, finetune))
        return (0, 0) if finetune else (5, 80)

    def full(directory, *_, **__):
        calls.append(("full", directory))
        return 5, 80

    monkeypatch.setattr(weights_only, "load_weights", weights)
    monkeypatch.setattr(formats.torch_dist_format, "load_checkpoint", full)
    return folders, calls


def _load(args):
    return formats.load(args, [], None, None, {})


def test_pretrained_checkpoint_is_used_only_while_load_holds_none(world, capsys):
    folders, calls = world
    folders["pre"] = ("torch_dist", OURS)
    loaded = _load(_args(load="run", pretrained_checkpoint="pre"))
    assert loaded == (0, 0, "pre/iter_0000005", True)
    assert calls == [("weights", "pre/iter_0000005", True)]
    assert capsys.readouterr().out == ""
    folders["run"] = ("torch_dist", OURS)  # the fine-tuning run saved: a restart resumes it
    assert _load(_args(load="run", pretrained_checkpoint="pre")) == (
        5, 80, "run/iter_0000005", False)
    assert calls[-1] == ("full", "run/iter_0000005")
    assert capsys.readouterr().out == (  # said, not silently ignored
        "note: --pretrained-checkpoint pre is not read: --load run holds a checkpoint, which "
        "this run resumes (Megatron-LM's rule: the pretrained weights start a run only while "
        "--load holds none)\n")
    with pytest.raises(CheckpointError) as err:
        _load(_args(load="new", pretrained_checkpoint="none"))
    assert str(err.value) == ("--pretrained-checkpoint none holds no checkpoint (no "
                              "latest_checkpointed_iteration.txt naming an existing iteration "
                              "folder), nor does --load new")
    assert _load(_args(load="new", finetune=True)) == (0, 0, None, True)  # a fresh start


def test_finetune_loads_the_weights_of_either_kind_of_checkpoint(world):
    folders, calls = world
    folders["ours"], folders["mlm"] = ("torch_dist", OURS), ("torch_dist", None)
    folders["imp"] = ("torch_dist", IMPORTED)
    for root in ("ours", "mlm", "imp"):
        assert _load(_args(load=root, finetune=True)) == (0, 0, f"{root}/iter_0000005", True)
    assert [c[0] for c in calls] == ["weights"] * 3
    # without a manifest, a resume at the checkpoint's iteration needs a fresh optimizer
    assert _load(_args(load="mlm", load_without_manifest=True, no_load_optim=True,
                       no_load_rng=True)) == (5, 80, "mlm/iter_0000005", False)


def test_what_a_full_resume_cannot_use_is_refused_in_one_line(world):
    folders, _ = world
    folders["mlm"], folders["imp"] = ("torch_dist", None), ("torch_dist", IMPORTED)
    for extra in ({}, {"load_without_manifest": True}):
        with pytest.raises(CheckpointError) as err:
            _load(_args(load="mlm", **extra))
        assert str(err.value) == (
            "mlm/iter_0000005 holds a distributed checkpoint without manifest.json (not written "
            "by this trainer, e.g. Megatron-LM's, or its save did not finish): start from its "
            "weights with --finetune (iteration 0), or pass --load-without-manifest "
            "--no-load-optim --no-load-rng to continue at its iteration with a fresh optimizer")
    with pytest.raises(CheckpointError) as err:
        _load(_args(load="imp"))
    assert str(err.value) == (
        "checkpoint imp/iter_0000005 holds model weights only (import_hf.py from /hf "
        "(LlamaForCausalLM)): start from it with --finetune, or --pretrained-checkpoint imp")


def test_finetune_reads_a_per_rank_checkpoint_without_its_optimizer_schedule_or_rng(
        world, monkeypatch):
    folders, _ = world
    folders["old"] = ("torch", OURS)
    seen = {}

    def per_rank(root, model_chunks, optimizer, scheduler, settings, **options):
        seen.update(root=root, scheduler=scheduler, **options)
        return 5, 80

    monkeypatch.setattr(formats.torch_format, "load_checkpoint", per_rank)
    # another --ckpt-format is no obstacle: only the weights are read
    assert _load(_args(load="old", finetune=True)) == (0, 0, "old/iter_0000005", True)
    assert seen == {"root": "old", "scheduler": None, "load_optim": False, "load_rng": False,
                    "allow_sdp4bit_change": True, "allow_data_change": True,
                    "allow_no_manifest": False}
