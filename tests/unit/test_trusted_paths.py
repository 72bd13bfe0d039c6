"""The trust rule (megatron/sdp4bit/trusted_paths.py) where the trainer applies it.

Every planted file, folder and link is made by another user ("nobody", through ``setpriv``),
as an attacker on a shared machine would make it; the run (root here) must refuse each with
one line naming the path, and accept its own files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy
import pytest

from megatron.sdp4bit import trusted_paths
from megatron.sdp4bit.training.checkpoint import files, formats
from megatron.sdp4bit.training.checkpoint.files import CheckpointError
from megatron.sdp4bit.training.guards import preflight as pf
from megatron.sdp4bit.training.tokenizers import build_tokenizer
from tests.helpers.corpora import write_gpt2_vocab, write_indexed_dataset

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="planting as another user needs root and setpriv")
WHY = "refused, another user could change what the run reads"


def as_nobody(*command: str) -> None:
    subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                    *command], check=True, timeout=60)


@pytest.fixture
def shared():
    """A folder everyone may write and reach, like /tmp (sticky): where another user plants."""
    folder = Path(tempfile.mkdtemp(prefix="sdp4bit-shared-"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder)


def plant(shared: Path, name: str, source: str | None = None) -> Path:
    """A file ``shared/name`` of another user's (a copy of ``source``, else empty)."""
    if source is None:
        as_nobody("touch", str(shared / name))
    else:
        shutil.copyfile(source, shared / "source")
        as_nobody("cp", str(shared / "source"), str(shared / name))
        os.remove(shared / "source")
    return shared / name


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(save=None, tensorboard_dir=None, data_cache_path=None, wandb_save_dir="",
                metrics_jsonl=None, mock_data=False, data_path=None,
                tokenizer_type="NullTokenizer", vocab_size=64, vocab_file=None,
                merge_file=None, tokenizer_model=None)
    base.update(kw)
    return argparse.Namespace(**base)


def _refusal(args) -> str:
    with pytest.raises(pf.InputError) as err:
        pf.check_inputs(args, build_tokenizer)
    return str(err.value)


def test_a_data_cache_others_can_write_is_refused(tmp_path, shared):
    """The probe: a 1777 --data-cache-path holding index files another user planted was used
    silently and the run trained on one sample."""
    prefix = write_indexed_dataset(tmp_path)
    cache = shared / "cache"
    as_nobody("mkdir", "-m", "1777", str(cache))
    name = "0" * 32 + "-GPTDataset-train-document_index.npy"
    numpy.save(tmp_path / "planted.npy", numpy.zeros(1, numpy.int32))
    os.replace(plant(shared, "p.npy", str(tmp_path / "planted.npy")), cache / name)
    args = _args(tmp_path, data_path=[prefix], data_cache_path=str(cache))
    assert _refusal(args) == (
        f"--data-cache-path {cache} belongs to uid {NOBODY}, not to this user (uid 0): "
        f"{WHY}; give --data-cache-path a folder of yours that only you can write")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o1777)
    mine.chmod(0o1777)
    args.data_cache_path = str(mine)
    assert _refusal(args) == (
        f"--data-cache-path {mine} is writable by group or others (mode 1777): {WHY}; give "
        "--data-cache-path a folder of yours that only you can write")
    mine.chmod(0o755)
    pf.check_inputs(args, build_tokenizer)  # this user's folder: used
    os.rename(cache / name, mine / name)  # another user's file in this user's folder
    assert _refusal(args) == (
        f"dataset index cache {mine / name} belongs to uid {NOBODY}, not to this user (uid "
        f"0): {WHY}; delete it (it is rebuilt), or give --data-cache-path a folder of yours "
        "that only you can write")


def test_the_cache_beside_the_data_and_a_link_another_user_made(tmp_path, shared):
    prefix = write_indexed_dataset(tmp_path)
    folder = os.path.join(prefix, "cache", "GPTDataset_indices")
    os.makedirs(folder)
    os.chmod(folder, 0o777)
    args = _args(tmp_path, data_path=[prefix])
    assert _refusal(args) == (
        f"the dataset index cache folder {folder} is writable by group or others (mode "
        f"0777): {WHY}; pass --data-cache-path a folder of yours that only you can write")
    os.chmod(folder, 0o755)
    pf.check_inputs(args, build_tokenizer)
    own = tmp_path / "own-cache"
    own.mkdir()
    as_nobody("ln", "-s", str(own), str(shared / "cache"))  # points at a folder of mine
    args = _args(tmp_path, data_path=[prefix], data_cache_path=str(shared / "cache"))
    assert _refusal(args) == (
        f"--data-cache-path {shared / 'cache'} is a symbolic link made by uid {NOBODY}, not by "
        f"this user (uid 0): {WHY}; give --data-cache-path a folder of yours that only you "
        "can write")
    (tmp_path / "my-link").symlink_to(own)  # this user's own link: followed and checked
    args.data_cache_path = str(tmp_path / "my-link")
    pf.check_inputs(args, build_tokenizer)


def test_tokenizer_files_of_another_user_are_refused(tmp_path, shared):
    vocab, merges = write_gpt2_vocab(tmp_path)
    plant(shared, "vocab.json", vocab)
    args = _args(tmp_path, mock_data=True, tokenizer_type="GPT2BPETokenizer",
                 vocab_file=str(shared / "vocab.json"), merge_file=merges)
    assert _refusal(args) == (
        f"--vocab-file {shared / 'vocab.json'} belongs to uid {NOBODY}, not to this user (uid "
        f"0): {WHY}; copy it to a folder of yours that only you can write")
    os.chmod(merges, 0o666)
    args.vocab_file = vocab
    assert _refusal(args).startswith(f"--merge-file {merges} is writable by group or others "
                                     "(mode 0666): ")
    os.chmod(merges, 0o644)
    pf.check_inputs(args, build_tokenizer)


def _checkpoint(root, iteration: int = 2) -> str:
    directory = files.iteration_dir(str(root), iteration)
    os.makedirs(directory)
    entry = files.save_file({"x": 1}, os.path.join(directory, "common.pt"))
    files.write_manifest(directory, iteration, {"common.pt": entry}, {})
    files.write_tracker(str(root), iteration)
    return directory


def test_a_checkpoint_another_user_could_change_is_not_read(tmp_path, shared):
    root = tmp_path / "ckpt"
    directory = _checkpoint(root)
    assert formats._probe(str(root))[2] is None
    os.rename(plant(shared, "extra"), os.path.join(directory, "extra"))
    assert formats._probe(str(root))[2] == (
        f"a file of checkpoint {directory}/extra belongs to uid {NOBODY}, not to this user "
        f"(uid 0): {WHY}; copy the checkpoint into a folder of yours that only you can write")
    os.remove(os.path.join(directory, "extra"))
    os.chmod(root, 0o777)
    assert formats._probe(str(root))[2].startswith(
        f"--load {root} is writable by group or others (mode 0777): {WHY}")
    os.chmod(root, 0o755)
    tracker = root / files.TRACKER
    (tmp_path / "two").write_text("2\n")
    os.replace(plant(shared, "tracker", str(tmp_path / "two")), tracker)
    assert formats._probe(str(root))[2].startswith(
        f"the tracker {tracker} belongs to uid {NOBODY}")


def test_the_rule_accepts_root_and_a_private_group(tmp_path):
    """Root's files (a system install) and this user's private group (the umask 002 of
    Debian and Ubuntu users) are this user's; another group's write is not."""
    path = tmp_path / "f"
    path.write_text("x")
    path.chmod(0o664)
    private = trusted_paths._private_group(os.getgid(), os.geteuid())
    assert (trusted_paths.problem(str(path), "f") is None) == private
    os.chown(path, -1, NOBODY)  # nogroup: never root's private group
    assert trusted_paths.problem(str(path), "f") == (
        f"f {path} is writable by group or others (mode 0664)")
    assert not trusted_paths._private_group(NOBODY, 0)


def test_the_tools_apply_the_rule_to_the_files_they_read(tmp_path, shared, capsys):
    from tests.helpers.scripts import load_tool

    vocab, merges = write_gpt2_vocab(tmp_path)
    planted = plant(shared, "vocab.json", vocab)
    refused = (f"--vocab-file {planted} belongs to uid {NOBODY}, not to this user (uid 0): "
               f"{WHY}; copy it to a folder of yours that only you can write")
    (tmp_path / "in.jsonl").write_text('{"text": "a b"}\n')
    preprocess = load_tool("tools/preprocess_data.py")
    assert preprocess.main(["--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                            str(tmp_path / "out"), "--tokenizer-type", "GPT2BPETokenizer",
                            "--vocab-file", str(planted), "--merge-file", merges]) == 1
    assert capsys.readouterr().err == f"preprocess_data.py: error: {refused}\n"
    assert not list(tmp_path.glob("out*"))

    export_hf = load_tool("tools/checkpoint/export_hf.py")
    with pytest.raises(SystemExit):
        export_hf.main(["--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf"),
                        "--vocab-file", str(planted), "--merge-file", merges])
    assert capsys.readouterr().err == f"export_hf.py: error: {refused}\n"

    import_hf = load_tool("tools/checkpoint/import_hf.py")
    hf = tmp_path / "hf_model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    os.rename(plant(shared, "model.safetensors"), hf / "model.safetensors")
    with pytest.raises(SystemExit):
        import_hf.main(["--hf", str(hf), "--save", str(tmp_path / "imported")])
    assert capsys.readouterr().err == (
        f"import_hf.py: error: a file of --hf {hf / 'model.safetensors'} belongs to uid "
        f"{NOBODY}, not to this user (uid 0): {WHY}; copy it to a folder of yours that only "
        "you can write\n")
    assert not (tmp_path / "imported").exists() and not (tmp_path / "hf").exists()
