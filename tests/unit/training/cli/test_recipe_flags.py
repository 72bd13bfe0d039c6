"""Three flags of Megatron-LM's Llama recipes, honoured: --apply-layernorm-1p reaches
TransformerConfig and every norm of the local spec (zero-centred, training/layer_spec.py),
--empty-unused-memory-level empties the CUDA cache at Megatron-LM's points (training/step.py),
--decoupled-lr / --decoupled-min-lr reach megatron-core's OptimizerConfig (the parameter
group they give the embedding is checked on a built optimizer in
tests/distributed/test_integration_loss_fusion.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --train-iters 10").split()


def parse(extra: str, world_size: int = 4):
    return parse_args(BASE + extra.split(), world_size=world_size)


def error(extra: str) -> str:
    with pytest.raises(ArgumentsError) as info:
        parse(extra)
    return str(info.value)


def _built_spec(monkeypatch, extra: str):
    from megatron.sdp4bit.training import layer_spec
    from megatron.sdp4bit.training import model as trainer_model

    built = {}
    monkeypatch.setattr(trainer_model, "GPTModel", lambda **kw: built.update(kw))
    monkeypatch.setattr(layer_spec, "get_num_layers_to_build",  # one stage: every layer
                        lambda config, vp_stage=None: config.num_layers)
    monkeypatch.setattr(trainer_model.parallel_state, "is_pipeline_first_stage", lambda **kw: True)
    monkeypatch.setattr(trainer_model.parallel_state, "is_pipeline_last_stage", lambda **kw: True)
    args = parse(extra)
    config = trainer_model.transformer_config_from_args(args)
    trainer_model.build_model(args, config, 128)
    return config, built["transformer_layer_spec"]


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_zero_centres_every_local_norm(monkeypatch, norm):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from megatron.sdp4bit.training.layer_spec import LocalNorm, ZeroCenteredNorm

    config, spec = _built_spec(monkeypatch, f"--normalization {norm} --qk-layernorm")
    assert not config.layernorm_zero_centered_gamma
    layer = spec.submodules  # megatron-core's own spec, untouched without the flag
    assert layer.input_layernorm is WrappedTorchNorm
    config, spec = _built_spec(monkeypatch, f"--normalization {norm} --qk-layernorm "
                                            "--apply-layernorm-1p")
    assert config.layernorm_zero_centered_gamma
    assert spec.layer_norm is LocalNorm and len(spec.layer_specs) == 2
    layer = spec.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    assert layer.input_layernorm is LocalNorm and attention.q_layernorm is LocalNorm
    assert attention.k_layernorm is LocalNorm

    built = LocalNorm(config, 16, eps=1e-5)
    assert isinstance(built, ZeroCenteredNorm)
    assert not built.weight.any() and (built.bias is None) == (norm == "RMSNorm")
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    plain = torch.nn.LayerNorm(16) if norm == "LayerNorm" else torch.nn.RMSNorm(16, eps=1e-5)
    # at its start the norm is the plain one (scale 1)
    assert torch.equal(built(x.float()), plain(x.float()))
    with torch.no_grad():
        built.weight.copy_(torch.linspace(-0.5, 0.5, 16))
    scale = built.weight.float() + 1
    want = (F.rms_norm(x.float(), (16,), scale, 1e-5) if norm == "RMSNorm" else
            F.layer_norm(x.float(), (16,), scale, built.bias.float(), 1e-5))
    got = built(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_empty_unused_memory_level_empties_the_cache_where_megatron_lm_does(monkeypatch):
    """Level 1: after each forward-backward pass and each evaluation step; level 2: also
    after each optimizer step (Megatron-LM's training.py); 0 never."""
    from megatron.sdp4bit.training import step

    for level, expected in ((0, []), (1, ["forward-backward", "evaluation"]),
                            (2, ["forward-backward", "evaluation", "optimizer"])):
        args = parse(f"--empty-unused-memory-level {level}")
        emptied = []
        for point in ("forward-backward", "evaluation", "optimizer"):
            monkeypatch.setattr(torch.cuda, "empty_cache",
                                lambda point=point: emptied.append(point))
            step.release_unused_memory(args, point)
        assert emptied == expected, level
    assert "invalid choice: 3" in error("--empty-unused-memory-level 3")


def test_decoupled_lr_reaches_megatron_cores_optimizer_config(monkeypatch):
    from megatron.sdp4bit.training import model as trainer_model

    made = {}
    monkeypatch.setattr(trainer_model, "get_megatron_optimizer",
                        lambda config, chunks, config_overrides=None: made.update(
                            config=config, overrides=config_overrides))
    for extra, want in (("", (None, None)), ("--decoupled-lr 2e-3", (2e-3, None)),
                        ("--decoupled-lr 2e-3 --decoupled-min-lr 1e-4", (2e-3, 1e-4))):
        trainer_model.build_optimizer(parse(extra), [])
        assert (made["config"].decoupled_lr, made["config"].decoupled_min_lr) == want, extra
        if want[0] is None:  # megatron-core's own overrides
            assert made["overrides"] is None
            continue
        # its standard overrides, the decoupled group marked ([Note: the decoupled group on
        # load] in training/model.py)
        decoupled = [v for k, v in made["overrides"].items()
                     if k.attr == "is_embedding_or_output_parameter"]
        rates = {"max_lr": want[0], **({"min_lr": want[1]} if want[1] else {})}
        assert decoupled == [{**rates, "is_decoupled_lr": True}], extra
        assert any(v == {"wd_mult": 0.0} for v in made["overrides"].values())
    assert error("--decoupled-min-lr 1e-4") == (
        "--decoupled-min-lr needs --decoupled-lr (without it the embedding and output layer "
        "follow --lr and --min-lr)")
    assert error("--decoupled-lr 1e-4 --decoupled-min-lr 1e-3") == (
        "--decoupled-min-lr=0.001 must be in 0 .. --decoupled-lr=0.0001")
    assert error("--decoupled-lr 1e-5 --min-lr 1e-4") == (
        "--decoupled-lr=1e-05 is below --min-lr=0.0001, which the embedding and output layer "
        "keep as their floor: pass --decoupled-min-lr too")
    assert error("--decoupled-lr -1") == "--decoupled-lr=-1.0 must be >= 0"
