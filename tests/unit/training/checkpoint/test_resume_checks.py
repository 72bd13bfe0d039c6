"""What a resume must agree with (rank 0's checks of torch_format.py, without processes):
the data blend, split and seed, and a manifest to check at all."""

from __future__ import annotations

import argparse
import os

import pytest

from megatron.sdp4bit.training.checkpoint import settings, torch_format
from megatron.sdp4bit.training.checkpoint import files as cf


def _data(path="data/a_text_document", split="98,2,0", seed=1234, mock=False,
          **seeds: int) -> dict:
    from megatron.sdp4bit.training.checkpoint.settings import data_settings
    from megatron.sdp4bit.training.cli.validate import parse_split

    args = argparse.Namespace(mock_data=mock, data_path=path.split(), split=split, seed=seed,
                              split_vector=parse_split(split), **seeds)
    return data_settings(args)


def _settings(**data) -> dict:
    return {"layout": {"dp": 4}, "model": {"hidden_size": 64}, "data": _data(**data),
            "sdp4bit": {"quantized_weights": True}}


def test_the_data_blend_is_recorded_in_a_comparable_form(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _data() == {"data_path": f"{tmp_path}/data/a_text_document", "split": "0.98,0.02,0",
                       "seed": 1234}
    assert _data(split="98, 2, 0") == _data(split="49,1,0") == _data()
    assert _data(path="0.3 a 0.7 b")["data_path"] == f"0.3 {tmp_path}/a 0.7 {tmp_path}/b"
    assert _data(mock=True)["data_path"] == "mock"


@pytest.mark.parametrize("change,said", [
    ({"path": "data/default_text_document"}, "data_path {cwd}/data/a_text_document; this run "
     "has data_path {cwd}/data/default_text_document"),
    ({"seed": 7}, "seed 1234; this run has seed 7"),
    ({"split": "90,10,0"}, "split 0.98,0.02,0; this run has split 0.9,0.1,0"),
    ({"train_data_seed": 7}, "train_data_seed unrecorded; this run has train_data_seed 7"),
])
def test_a_resume_on_other_data_is_refused_unless_asked(change, said):
    saved, now = _settings(), _settings(**change)
    problem = settings.settings_problem(saved, now, "D", False)
    assert problem == (f"checkpoint D was trained with {said.format(cwd=os.getcwd())}: resume "
                       "with the checkpoint's --data-path, --split and --seed (and "
                       "--train-data-seed / --eval-data-seed), or pass "
                       "--allow-changed-data to continue on other data")
    assert settings.settings_problem(saved, now, "D", False, allow_data_change=True) is None
    assert settings.settings_problem(saved, _settings(), "D", False) is None


def test_a_checkpoint_without_manifest_is_refused_unless_asked(tmp_path):
    root = str(tmp_path)
    os.makedirs(cf.iteration_dir(root, 8))
    cf.write_tracker(root, 8)
    iteration, manifest, problem = torch_format._inspect(root, _settings(), False)
    assert (iteration, manifest) == (None, None)
    assert problem == (f"checkpoint {root}/iter_0000008 has no manifest.json: nothing in it "
                       "can be verified (checksums, layout, settings); restore the manifest, "
                       "load an earlier checkpoint, or pass --load-without-manifest to load it "
                       "unchecked")
    assert torch_format._inspect(root, _settings(), False, allow_no_manifest=True) == (
        8, None, None)


def test_ckpt_step_loads_an_earlier_iteration_and_damage_names_it(tmp_path, monkeypatch):
    """Megatron-LM's --ckpt-step N loads iter_N instead of the tracker's iteration; a damaged
    checkpoint's message names the newest complete one and the flag."""
    from megatron.sdp4bit.training.checkpoint import formats

    monkeypatch.setattr(torch_format.dist, "get_world_size", lambda: 1)
    root = str(tmp_path)
    for iteration in (2, 4, 6):
        directory = cf.iteration_dir(root, iteration)
        os.makedirs(directory)
        entries = {name: cf.save_file({"iteration": iteration}, os.path.join(directory, name))
                   for name in ("common.pt", "rank_00000.pt")}
        cf.write_manifest(directory, iteration, entries, _settings())
    cf.write_tracker(root, 6)
    os.remove(os.path.join(cf.iteration_dir(root, 4), "rank_00000.pt"))  # 4: incomplete
    rank_file = os.path.join(cf.iteration_dir(root, 6), "rank_00000.pt")
    with open(rank_file, "r+b") as f:
        f.truncate(10)  # 6, the tracker's: damaged
    iteration, _, problem = torch_format._inspect(root, _settings(), False)
    assert iteration == 6 and problem.endswith("it is truncated")
    assert formats.with_earlier(problem, root, 6) == (
        f"checkpoint file {rank_file} is 10 bytes, the manifest says "
        f"{os.path.getsize(os.path.join(cf.iteration_dir(root, 2), 'rank_00000.pt'))}: it is "
        f"truncated (the newest complete checkpoint in {root} is iteration 2: pass "
        "--ckpt-step 2 to load it)")
    assert torch_format._inspect(root, _settings(), False, iteration=2)[::2] == (2, None)
    assert formats._iteration(root, 2) == 2 and formats._iteration(root, None) == 6
    with pytest.raises(cf.CheckpointError) as err:
        formats._iteration(root, 8)
    assert str(err.value) == (f"--ckpt-step 8: {root}/iter_0000008 does not exist ({root} "
                              "holds iterations 2, 4, 6)")
    mismatch = settings.settings_problem(_settings(), _settings(seed=1), root, False)
    assert formats.with_earlier(mismatch, root, 6) == mismatch  # not damage: no hint


def test_the_qwd_target_is_recorded_and_a_change_is_named():
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.training.checkpoint.settings import method_settings

    qwd = SDP4BitConfig(quantized_weights=True)
    rounded = qwd.replace(weight_difference_target="rounded-main")
    assert method_settings(qwd)["weight_difference_target"] == "main"
    assert "weight_difference_target" not in method_settings(
        qwd.replace(weight_quantization_mode="direct"))  # qW sends no difference
    saved, now = _settings(), _settings()
    saved["sdp4bit"], now["sdp4bit"] = method_settings(qwd), method_settings(rounded)
    assert settings.settings_problem(saved, now, "D", False) == (
        "checkpoint D was trained with SDP4Bit weight_difference_target main; this run has "
        "weight_difference_target rounded-main: use the same SDP4Bit flags, or pass "
        "--allow-changed-sdp4bit-settings to change the method on resume")
    assert settings.settings_problem(saved, now, "D", True) is None
    # A manifest written before the target was recorded: those runs sent main - replica.
    older = {**saved, "sdp4bit": {k: v for k, v in saved["sdp4bit"].items()
                                  if k != "weight_difference_target"}}
    assert settings.settings_problem(older, saved, "D", False) is None
    assert "weight_difference_target main; this run has weight_difference_target " \
        "rounded-main" in settings.settings_problem(older, now, "D", False)


def test_error_feedback_is_part_of_the_method():
    """Switching --gradient-error-feedback on or off, or changing its storage, rounding, decay
    or reset, on resume is a method change like any other (before, a resume without the flag
    dropped the saved error and one with another rounding or decay loaded it, silently):
    refused in one line unless --allow-changed-sdp4bit-settings. An older trainer's manifest
    records none of it: not compared."""
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.training.checkpoint.settings import method_settings

    tlq = SDP4BitConfig(quantized_gradients=True)
    ef = tlq.replace(gradient_error_feedback=True, gradient_error_feedback_storage="fp32")

    def problem(before: SDP4BitConfig, after: SDP4BitConfig, allow: bool = False):
        saved, now = _settings(), _settings()
        saved["sdp4bit"], now["sdp4bit"] = method_settings(before), method_settings(after)
        return settings.settings_problem(saved, now, "D", allow)

    fix = ("use the same SDP4Bit flags, or pass --allow-changed-sdp4bit-settings to change the "
           "method on resume")
    assert problem(ef, tlq) == ("checkpoint D was trained with SDP4Bit gradient_error_feedback "
                                "True; this run has gradient_error_feedback False: " + fix)
    assert problem(tlq, ef) == ("checkpoint D was trained with SDP4Bit gradient_error_feedback "
                                "False; this run has gradient_error_feedback True: " + fix)
    for knob, value in (("storage", "int8"), ("rounding", "nearest"), ("decay", 0.5),
                        ("reset_interval", 4)):
        key = f"gradient_error_feedback_{knob}"
        assert problem(ef, ef.replace(**{key: value})) == (
            f"checkpoint D was trained with SDP4Bit {key} {getattr(ef, key)}; this run has "
            f"{key} {value}: " + fix)
        assert problem(ef, ef.replace(**{key: value}), allow=True) is None
    assert problem(ef, ef) is None and problem(tlq, tlq) is None
    older = _settings()
    older["sdp4bit"] = {k: v for k, v in method_settings(ef).items()
                        if not k.startswith("gradient_error_feedback")}
    for now in (tlq, ef, ef.replace(gradient_error_feedback_storage="int8")):
        current = _settings()
        current["sdp4bit"] = method_settings(now)
        assert settings.settings_problem(older, current, "D", False) is None


def test_an_older_manifest_without_openai_gelu_is_a_plain_gelu_model():
    from megatron.sdp4bit.training.checkpoint.weights_only import model_settings_problem

    older = _settings()  # its model settings lack openai_gelu: the flag was refused then
    plain, tanh = _settings(), _settings()
    plain["model"] = {**plain["model"], "openai_gelu": False}
    tanh["model"] = {**tanh["model"], "openai_gelu": True}
    assert settings.settings_problem(older, plain, "D", False) is None
    assert model_settings_problem(older, plain, "D") is None
    said = "checkpoint D was saved with model openai_gelu False; this run has openai_gelu True"
    assert settings.settings_problem(older, tanh, "D", False) == (
        said + ": resume with the same model flags")
    assert model_settings_problem(older, tanh, "D") == said + ": pass the checkpoint's model flags"


def test_finetune_names_the_divisor_and_a_vocabulary_of_the_same_padded_size():
    from megatron.sdp4bit.training.checkpoint.weights_only import model_settings_problem

    saved = {"layout": {"tp": 1}, "model": {"hidden_size": 64, "padded_vocab_size": 640},
             "vocab_size": 513}
    tp2 = {"layout": {"tp": 2}, "model": {"hidden_size": 64, "padded_vocab_size": 768},
           "vocab_size": 513}
    said = ("checkpoint D was saved with model padded_vocab_size 640; this run has "
            "padded_vocab_size 768: the vocabulary is padded to a multiple of "
            "--make-vocab-size-divisible-by x TP; ")
    assert model_settings_problem(saved, tp2, "D") == (
        said + "at TP 2, --make-vocab-size-divisible-by 320 gives the checkpoint's 640")
    tp3 = {**tp2, "layout": {"tp": 3}}
    assert model_settings_problem(saved, tp3, "D") == (
        said + "choose a TP and --make-vocab-size-divisible-by whose product divides 640")
    other = {**saved, "vocab_size": 600}  # another tokenizer, padded to the same 640 rows
    assert model_settings_problem(saved, other, "D") == (
        "checkpoint D was trained with a 513-token vocabulary, this run's tokenizer has 600 "
        "tokens (both padded to 640): its embedding rows would mean other tokens; use the "
        "tokenizer files the checkpoint was trained with")
    assert model_settings_problem(saved, {**saved, "vocab_size": None}, "D") is None
    assert model_settings_problem(saved, saved, "D") is None


def test_a_manifest_less_checkpoint_at_another_tp_names_the_divisor():
    from megatron.sdp4bit.training.checkpoint.weights_only import padding_fix

    rows = {"embedding.word_embeddings.weight": ((640, 64), (768, 64)),
            "output_layer.weight": ((640, 64), (768, 64))}
    assert padding_fix(rows, 2) == (
        "the vocabulary is padded to a multiple of --make-vocab-size-divisible-by x TP; at TP 2, "
        "--make-vocab-size-divisible-by 320 gives the checkpoint's 640")
    # another width, or another tensor, is a model of other flags
    assert padding_fix({"embedding.word_embeddings.weight": ((640, 64), (640, 32))}, 2) is None
    assert padding_fix({**rows, "decoder.final_layernorm.weight": ((64,), (32,))}, 2) is None


def test_a_changed_tokenizer_is_named_unless_the_data_may_change():
    """The record of SentencePieceTokenizer (Megatron-LM's: <EOD> appended) against the
    GPTSentencePieceTokenizer of the same model file: another vocabulary and end of
    document. Where the files are is not compared; an older manifest records none."""
    def record(kind, vocab, eod, path="/data/sp.model"):
        return {"type": kind, "args": {"tokenizer_model": path}, "sha256": {path: "ab"},
                "vocab_size": vocab, "eod": eod, "bos": 1, "pad": None}

    saved, now = _settings(), _settings()
    saved["tokenizer"] = record("GPTSentencePieceTokenizer", 300, 2)
    now["tokenizer"] = record("SentencePieceTokenizer", 305, 302)
    assert settings.settings_problem(saved, now, "D", False) == (
        "checkpoint D was trained with tokenizer type GPTSentencePieceTokenizer, vocab_size "
        "300, eod 2; this run has type SentencePieceTokenizer, vocab_size 305, eod 302: pass "
        "the checkpoint's --tokenizer-type and tokenizer files, or --allow-changed-data to "
        "continue with another tokenizer")
    assert settings.settings_problem(saved, now, "D", False, allow_data_change=True) is None
    now["tokenizer"] = record("GPTSentencePieceTokenizer", 300, 2, path="/moved/sp.model")
    assert settings.settings_problem(saved, now, "D", False) is None
    assert settings.settings_problem(_settings(), now, "D", False) is None
