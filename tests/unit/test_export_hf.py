"""tools/checkpoint/export_hf.py without a checkpoint: the architecture mapping and the
GPT-2 tensor layout (the logits test is in tests/e2e/test_dist_checkpoint.py)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location(
    "export_hf", os.path.join(ROOT, "tools", "checkpoint", "export_hf.py"))
export_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_hf)

DEFAULT = {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 32, "num_attention_heads": 2,
           "kv_channels": None, "group_query_attention": False, "num_query_groups": None,
           "max_position_embeddings": 16, "position_embedding_type": "learned_absolute",
           "untie_embeddings_and_output_weights": False, "swiglu": False,
           "normalization": "LayerNorm", "add_bias_linear": True, "params_dtype": "bf16",
           "padded_vocab_size": 128}


def test_default_architecture_maps_to_gpt2():
    config = export_hf.gpt2_config(DEFAULT)
    assert config["architectures"] == ["GPT2LMHeadModel"]
    assert (config["n_embd"], config["n_layer"], config["n_head"], config["n_inner"],
            config["vocab_size"], config["n_positions"]) == (8, 2, 2, 32, 128, 16)


def test_other_architectures_are_refused_naming_what_does_not_map():
    llama = {**DEFAULT, "position_embedding_type": "rope", "normalization": "RMSNorm",
             "swiglu": True, "add_bias_linear": False}
    with pytest.raises(export_hf.ExportError) as err:
        export_hf.gpt2_config(llama)
    assert str(err.value) == (
        "the model does not map to a Hugging Face architecture this tool writes "
        "(GPT2LMHeadModel): position_embedding_type 'rope' (GPT-2 needs 'learned_absolute'); "
        "normalization 'RMSNorm' (GPT-2 needs 'LayerNorm'); swiglu True (GPT-2 needs False); "
        "add_bias_linear False (GPT-2 needs True)")


def test_fused_qkv_rows_become_gpt2_q_k_v_columns():
    heads, hidden, head_dim = 2, 8, 4
    t = {"embedding.word_embeddings.weight": torch.zeros(128, hidden),
         "embedding.position_embeddings.weight": torch.zeros(16, hidden),
         "decoder.final_layernorm.weight": torch.ones(hidden),
         "decoder.final_layernorm.bias": torch.zeros(hidden)}
    L = "decoder.layers."
    # Row r of megatron's fused weight belongs to head r // 12, part (r // 4) % 3 (q, k, v).
    rows = torch.arange(3 * hidden, dtype=torch.float32)
    t[L + "self_attention.linear_qkv.weight"] = rows.view(1, -1, 1).expand(2, -1, hidden)
    t[L + "self_attention.linear_qkv.bias"] = rows.view(1, -1).expand(2, -1)
    for name, shape in (("self_attention.linear_proj.weight", (hidden, hidden)),
                        ("self_attention.linear_proj.bias", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_weight", (hidden,)),
                        ("self_attention.linear_qkv.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_weight", (hidden,)),
                        ("mlp.linear_fc1.layer_norm_bias", (hidden,)),
                        ("mlp.linear_fc1.weight", (32, hidden)), ("mlp.linear_fc1.bias", (32,)),
                        ("mlp.linear_fc2.weight", (hidden, 32)), ("mlp.linear_fc2.bias", (hidden,))):
        t[L + name] = torch.zeros(2, *shape)
    out = export_hf.gpt2_state(t, DEFAULT)
    bias = out["transformer.h.0.attn.c_attn.bias"]
    # GPT-2 column c: part c // 8, head (c % 8) // 4, element c % 4.
    expect = [h * 3 * head_dim + part * head_dim + e
              for part in range(3) for h in range(heads) for e in range(head_dim)]
    assert bias.tolist() == expect
    assert out["transformer.h.0.attn.c_attn.weight"].shape == (hidden, 3 * hidden)
    assert out["transformer.h.0.attn.c_attn.weight"][0].tolist() == expect
    assert out["transformer.h.0.mlp.c_fc.weight"].shape == (hidden, 32)
