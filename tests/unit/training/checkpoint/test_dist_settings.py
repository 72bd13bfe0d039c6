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


def _moe_run(flags: str = "", world: int = 4) -> dict:
    """What a run with these flags records (the trainer's parser and settings contract)."""
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.training.checkpoint.settings import run_settings
    from megatron.sdp4bit.training.cli.arguments import parse_args

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data").split()
    settings = run_settings(parse_args(base + flags.split(), world_size=world),
                            SDP4BitConfig(), 384)
    return {k: settings[k] for k in ("layout", "model", "sdp4bit")}


EP2 = "--num-experts 4 --expert-model-parallel-size 2"


def _saved_moe(sharding: str, flags: str = EP2) -> dict:
    return {**_moe_run(flags), "ckpt_format": "torch_dist", "optim_sharding": sharding}


def test_the_manifest_records_expert_parallelism_and_the_moe_settings():
    recorded = _moe_run(EP2 + " --moe-layer-freq 2 --moe-router-topk 1")
    assert (recorded["layout"]["ep"], recorded["layout"]["etp"]) == (2, 1)
    model = recorded["model"]
    assert (model["num_experts"], model["moe_router_topk"], model["moe_ffn_hidden_size"],
            model["moe_layer_freq"], model["moe_grouped_gemm"]) == (4, 1, 256, [1, 0], False)
    # megatron-core's reading of an integer: the same pattern as the list
    assert _moe_run(EP2 + " --moe-layer-freq [1,0]")["model"] == model | {"moe_router_topk": 2}
    dense = _moe_run()
    assert "ep" not in dense["layout"]
    assert all(dense["model"][k] is None for k in model if k.startswith(("moe_", "num_exp")))


def test_a_dense_run_and_a_moe_checkpoint_are_refused_naming_num_experts():
    # before, neither was recorded: megatron-core failed on every rank reading the tensors
    assert settings_problem(_saved_moe("dp_reshardable"), _moe_run(), "D", False) == (
        "checkpoint D was saved with model num_experts 4; this run has num_experts None: resume "
        "with the same model flags (--num-experts and the other MoE flags)")
    dense = {**_moe_run(), "ckpt_format": "torch_dist", "optim_sharding": "fully_reshardable"}
    assert settings_problem(dense, _moe_run(EP2), "D", False) == (
        "checkpoint D was saved with model num_experts None; this run has num_experts 4: resume "
        "with the same model flags (--num-experts and the other MoE flags)")
    assert settings_problem(_saved_moe("dp_reshardable"),
                            _moe_run(EP2 + " --moe-router-topk 1"), "D", False) == (
        "checkpoint D was saved with model moe_router_topk 2; this run has moe_router_topk 1: "
        "resume with the same model flags")


def test_expert_parallel_size_changes_only_fully_reshardable_and_not_to_one():
    for ep in (1, 4):
        now = _moe_run(f"--num-experts 4 --expert-model-parallel-size {ep}")
        assert settings_problem(_saved_moe("dp_reshardable"), now, "D", False) == (
            f"checkpoint D was saved with layout ep 2; this run has ep {ep}: resume with the "
            "same layout (or start a new run); an expert-parallel size change (between sizes "
            "above 1) needs a checkpoint saved with --dist-ckpt-optim-fully-reshardable")
    fully = _saved_moe("fully_reshardable")
    assert settings_problem(fully, _moe_run("--num-experts 4 --expert-model-parallel-size 4"),
                            "D", False) is None  # resumed in tests/e2e/test_moe_trainer.py
    assert settings_problem(fully, _moe_run("--num-experts 4"), "D", False) == (
        "checkpoint D was saved with layout ep 2; this run has ep 1: megatron-core's optimizer "
        "state changes the expert-parallel size only between sizes above 1 (at 1 the experts "
        "share the dense optimizer); resume with --expert-model-parallel-size 2 or another "
        "size above 1")


def test_a_moe_checkpoint_of_an_older_trainer_is_compared_as_before():
    """Its manifest records neither the expert layout nor the MoE settings: nothing to compare
    them with (as for the settings of the Llama export), and its RNG and error state are this
    layout's."""
    from megatron.sdp4bit.training.checkpoint.settings import MOE_KEYS, same_layout

    now = _moe_run(EP2)
    old = _saved_moe("dp_reshardable")
    old["layout"] = {k: v for k, v in old["layout"].items() if k not in ("ep", "etp")}
    old["model"] = {k: v for k, v in old["model"].items() if k not in MOE_KEYS}
    assert settings_problem(old, now, "D", False) is None
    assert same_layout(old, now) and not same_layout(_saved_moe("dp_reshardable"),
                                                     _moe_run("--num-experts 4"))


def test_an_interleaved_pipeline_change_names_the_fully_reshardable_format():
    vpp = saved("dp_reshardable", pp=2, dp=2, vpp=2)
    assert settings_problem(vpp, run(pp=2, dp=2), "D", False) == (
        "checkpoint D was saved with layout vpp 2; this run has vpp None: resume with the same "
        "layout (or start a new run); a change of the interleaved pipeline's chunks needs a "
        "checkpoint saved with --dist-ckpt-optim-fully-reshardable")
    vpp["optim_sharding"] = "fully_reshardable"
    assert settings_problem(vpp, run(pp=2, dp=2), "D", False) is None
