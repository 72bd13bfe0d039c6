"""What a torch_dist checkpoint may change on resume (training/checkpoint/torch_dist_format.py)."""

from __future__ import annotations

from megatron.sdp4bit.training.checkpoint.torch_dist_format import (EF_KEY, error_feedback_skipped,
                                                                 settings_problem)

LAYOUT = {"world_size": 4, "tp": 1, "pp": 1, "dp": 4, "ddp_bucket_size": None}
MODEL = {"num_layers": 2, "hidden_size": 64}
METHOD = {"quantized_weights": True, "quantized_gradients": True}


def saved(sharding: str, **layout) -> dict:
    return {"layout": {**LAYOUT, **layout}, "model": MODEL, "sdp4bit": METHOD,
            "ckpt_format": "torch_dist", "optim_sharding": sharding}


def run(**layout) -> dict:
    return {"layout": {**LAYOUT, **layout}, "model": MODEL, "sdp4bit": METHOD}


def test_data_parallel_size_may_change():
    for world in (2, 8):
        assert settings_problem(saved("dp_reshardable"), run(world_size=world, dp=world),
                                "D", False) is None


def test_tp_change_needs_the_fully_reshardable_format():
    now = run(tp=2, dp=2)
    assert settings_problem(saved("dp_reshardable"), now, "D", False) == (
        "checkpoint D was saved with layout tp 1; this run has tp 2: resume with the same "
        "layout (or start a new run); a TP or PP change needs a checkpoint saved with "
        "--dist-ckpt-optim-fully-reshardable")
    assert settings_problem(saved("fully_reshardable"), now, "D", False) is None


def test_bucket_size_and_model_stay_checked():
    assert settings_problem(saved("dp_reshardable"), run(ddp_bucket_size=1000), "D", False) == (
        "checkpoint D was saved with layout ddp_bucket_size None; this run has ddp_bucket_size "
        "1000: resume with the same layout (or start a new run)")
    other = {**run(), "model": {**MODEL, "hidden_size": 128}}
    assert settings_problem(saved("fully_reshardable"), other, "D", False) == (
        "checkpoint D was saved with model hidden_size 64; this run has hidden_size 128: "
        "resume with the same model flags")


def test_model_settings_recorded_later_are_compared_only_when_recorded():
    now = {**run(), "model": {**MODEL, "rotary_base": 500, "norm_epsilon": 1e-6}}
    # Saved before the trainer recorded them: resumes (nothing to compare with).
    assert settings_problem(saved("dp_reshardable"), now, "D", False) is None
    recorded = {**saved("dp_reshardable"), "model": {**MODEL, "rotary_base": 10000,
                                                     "norm_epsilon": 1e-6}}
    assert settings_problem(recorded, now, "D", False) == (
        "checkpoint D was saved with model rotary_base 10000; this run has rotary_base 500: "
        "resume with the same model flags")


def test_vocabulary_padded_otherwise_names_the_divisor_that_keeps_it():
    # Saved at TP 2 with the default divisor 128 (padded to 512); TP 1 pads the same tokenizer
    # to 384 unless --make-vocab-size-divisible-by 256.
    before = {**saved("fully_reshardable", tp=2, dp=2), "model": {**MODEL,
                                                                  "padded_vocab_size": 512}}
    now = {**run(), "model": {**MODEL, "padded_vocab_size": 384}}
    assert settings_problem(before, now, "D", False) == (
        "checkpoint D was saved with model padded_vocab_size 512; this run has "
        "padded_vocab_size 384: resume with the same model flags; the vocabulary is padded to "
        "a multiple of --make-vocab-size-divisible-by x TP: at TP 1, "
        "--make-vocab-size-divisible-by 512 gives the checkpoint's 512")
    same = {**run(), "model": {**MODEL, "padded_vocab_size": 512}}
    assert settings_problem(before, same, "D", False) is None
    # another model change besides: no hint
    other = {**run(), "model": {**MODEL, "hidden_size": 128, "padded_vocab_size": 384}}
    assert "make-vocab" not in settings_problem(before, other, "D", False)


def test_error_feedback_state_is_read_only_where_it_was_written_for_this_layout():
    """A data-parallel change is allowed, but the per-rank error state then starts from zero;
    so does a checkpoint saved without --gradient-error-feedback (no entry to ask for)."""
    with_state = {**saved("dp_reshardable"), EF_KEY: True}
    assert error_feedback_skipped(with_state, same_layout=True) is None
    assert error_feedback_skipped(with_state, same_layout=False) == (
        "the checkpoint was saved with another parallel layout or bucket size")
    assert error_feedback_skipped(saved("dp_reshardable"), same_layout=True) == (
        "the checkpoint was saved without --gradient-error-feedback")
