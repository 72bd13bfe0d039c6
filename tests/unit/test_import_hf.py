"""tools/checkpoint/import_hf.py before it writes anything: the flags a config.json maps to,
the refusals (one line each, nothing written), and the mapping read backwards; plus the
trainer's --finetune / --pretrained-checkpoint flag checks. The import itself, its logits
and its training run are in tests/e2e/test_pretrained_start.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron.sdp4bit.training.checkpoint import hf as hf_arch
from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

from tests.helpers.scripts import load_tool

import_hf = load_tool("tools/checkpoint/import_hf.py")

GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 300,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 32,
        "activation_function": "gelu", "layer_norm_epsilon": 1e-5}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "tie_word_embeddings": False, "hidden_act": "silu"}


def _config(tmp_path, fields: dict) -> str:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(fields))
    return str(d)


def _flags(tmp_path, fields: dict) -> tuple[str, list[str], int]:
    from transformers import AutoConfig

    return hf_arch.trainer_flags(AutoConfig.from_pretrained(_config(tmp_path, fields)))


def test_config_json_maps_to_the_trainers_model_flags(tmp_path):
    assert _flags(tmp_path, GPT2) == ("GPT2LMHeadModel", (
        "--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4 "
        "--seq-length 32 --max-position-embeddings 32 --position-embedding-type "
        "learned_absolute --normalization LayerNorm --norm-epsilon 1e-05").split(), 300)
    assert _flags(tmp_path, LLAMA) == ("LlamaForCausalLM", (
        "--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 "
        "--kv-channels 32 --group-query-attention --num-query-groups 2 --seq-length 128 "
        "--max-position-embeddings 128 --position-embedding-type rope --rotary-base 500000 "
        "--normalization RMSNorm --norm-epsilon 1e-06 --swiglu --disable-bias-linear "
        "--untie-embeddings-and-output-weights").split(), 32000)
    # transformers 4's spelling of the RoPE base; tied, one key/value head per query head
    old = {k: v for k, v in LLAMA.items() if k not in ("rope_parameters", "head_dim")}
    name, flags, _ = _flags(tmp_path, {**old, "rope_theta": 10000.0, "num_key_value_heads": 4,
                                       "tie_word_embeddings": True})
    assert "--rotary-base 10000" in " ".join(flags)
    assert not {"--group-query-attention", "--kv-channels",
                "--untie-embeddings-and-output-weights"} & set(flags)
    # the printed flags are accepted by the trainer as they are
    parse_args(flags + "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data".split(),
               world_size=1)


def test_gpt2s_tanh_gelu_maps_to_openai_gelu(tmp_path):
    """transformers' GPT-2 default (gelu_new, what OpenAI's checkpoints use) and its other
    names for the tanh formula -> --openai-gelu; 'gelu' -> the exact GeLU (no flag)."""
    default = {k: v for k, v in GPT2.items() if k != "activation_function"}
    _, flags, _ = _flags(tmp_path, default)
    assert flags[-1] == "--openai-gelu" and flags.count("--openai-gelu") == 1
    for name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate"):
        assert _flags(tmp_path, {**GPT2, "activation_function": name})[1] == flags
    assert "--openai-gelu" not in _flags(tmp_path, GPT2)[1]
    args = parse_args(flags + "--micro-batch-size 1 --train-iters 1 --lr 1e-4 --mock-data"
                      .split(), world_size=1)
    assert args.openai_gelu
    # each accepted name is transformers' tanh formula (within float32 rounding)
    from transformers.activations import ACT2FN

    x = torch.linspace(-8, 8, 4001)
    tanh = torch.nn.functional.gelu(x, approximate="tanh")
    for name in hf_arch.TANH_GELUS:
        assert (ACT2FN[name](x) - tanh).abs().max() <= 8 * 2.0 ** -24 * x.abs().max(), name
    assert (ACT2FN["gelu"](x) - tanh).abs().max() > 1e-4  # the exact GeLU is another function


def _refused(tmp_path, capsys, fields: dict | None, save=None, extra=()) -> str:
    hf = _config(tmp_path, fields) if fields is not None else str(tmp_path / "nothing")
    save = save or str(tmp_path / "ckpt")
    with pytest.raises(SystemExit) as exit_:
        import_hf.main(["--hf", hf, "--save", save, *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("import_hf.py: error: "), err
    return err[0][len("import_hf.py: error: "):]


def test_what_does_not_map_is_refused_in_one_line(tmp_path, capsys):
    mistral = {**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert _refused(tmp_path, capsys, mistral) == (
        "architecture ['MistralForCausalLM'] is not imported: only GPT2LMHeadModel and "
        "LlamaForCausalLM")
    assert _refused(tmp_path, capsys, {**GPT2, "activation_function": "quick_gelu"}) == (
        "the GPT2LMHeadModel in config.json does not map to this trainer's model: "
        "activation_function 'quick_gelu' (needs 'gelu', the exact GeLU, or the tanh "
        "approximation 'gelu_new', 'gelu_pytorch_tanh', 'gelu_fast', 'gelu_accurate', "
        "--openai-gelu)")
    scaled = {**LLAMA, "attention_bias": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    assert _refused(tmp_path, capsys, scaled) == (
        "the LlamaForCausalLM in config.json does not map to this trainer's model: rope type "
        "'llama3' (needs 'default': megatron-core's RoPE here has no scaling), attention_bias "
        "True (needs False)")
    assert _refused(tmp_path, capsys, None) == (
        f"--hf {tmp_path / 'nothing'} has no config.json: give a local Hugging Face model "
        "folder (save_pretrained's output)")
    assert _refused(tmp_path, capsys, GPT2) == (
        f"--hf {tmp_path / 'hf'} holds no model.safetensors or pytorch_model.bin (nor their "
        "sharded .index.json forms)")
    assert not (tmp_path / "ckpt").exists()


def test_a_non_empty_save_is_refused_without_overwrite(tmp_path, capsys):
    save = tmp_path / "ckpt"
    save.mkdir()
    (save / "keep.txt").write_text("mine")
    _config(tmp_path, GPT2)
    before = sorted(os.listdir(tmp_path))
    assert _refused(tmp_path, capsys, GPT2, save=str(save)) == (
        f"--save {save} is not empty: pass --overwrite to replace what it holds, or choose "
        "another folder")
    assert (save / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == before  # no temporary folder either


def test_the_mapping_read_backwards_inverts_the_export():
    model = {"num_layers": 2, "hidden_size": 8, "ffn_hidden_size": 12,
             "num_attention_heads": 4, "kv_channels": 4, "group_query_attention": True,
             "num_query_groups": 2, "untie_embeddings_and_output_weights": True}
    gen = torch.Generator().manual_seed(0)
    hf = {"model.embed_tokens.weight": torch.randn(10, 8, generator=gen),
          "model.norm.weight": torch.randn(8, generator=gen),
          "lm_head.weight": torch.randn(10, 8, generator=gen)}
    for i in range(2):
        p = f"model.layers.{i}."
        for name, shape in (
                ("self_attn.q_proj.weight", (16, 8)), ("self_attn.k_proj.weight", (8, 8)),
                ("self_attn.v_proj.weight", (8, 8)), ("self_attn.o_proj.weight", (8, 16)),
                ("input_layernorm.weight", (8,)), ("post_attention_layernorm.weight", (8,)),
                ("mlp.gate_proj.weight", (12, 8)), ("mlp.up_proj.weight", (12, 8)),
                ("mlp.down_proj.weight", (8, 12))):
            hf[p + name] = torch.randn(*shape, generator=gen)
    megatron = hf_arch.from_hf("LlamaForCausalLM", hf, model)
    assert megatron["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (32, 8)
    back = hf_arch.to_hf("LlamaForCausalLM", megatron, model)
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # the vocabulary: zero rows up to the padded size, cut off again by the same rule
    padded = hf_arch.pad_vocab(megatron, 16)
    assert padded["embedding.word_embeddings.weight"].shape == (16, 8)
    assert not padded["output_layer.weight"][10:].any()
    assert all(torch.equal(v, megatron[k])
               for k, v in hf_arch.trim_vocab(padded, 10).items())
    del hf["model.layers.0.mlp.up_proj.weight"]
    hf["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(hf_arch.MappingError) as err:
        hf_arch.from_hf("LlamaForCausalLM", hf, model)
    assert str(err.value) == (
        "the LlamaForCausalLM weights do not match its config.json: missing "
        "model.layers.0.mlp.up_proj.weight; not part of the model model.layers.0.mlp.extra.weight")


FILLER = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 " \
         "--micro-batch-size 1 --train-iters 10 --lr 1e-4 --mock-data "


@pytest.mark.parametrize("extra, message", [
    ("--finetune", "--finetune needs --load (the checkpoint whose weights to start from) or "
                   "--pretrained-checkpoint"),
    ("--pretrained-checkpoint p --use-checkpoint-opt_param-scheduler",
     "--use-checkpoint-opt_param-scheduler contradicts --finetune / --pretrained-checkpoint, "
     "which start a fresh learning-rate schedule: drop it"),
])
def test_finetune_flags_are_checked(extra, message):
    with pytest.raises(ArgumentsError) as err:
        parse_args((FILLER + extra).split(), world_size=1)
    assert str(err.value) == message
    args = parse_args((FILLER + "--finetune --load x --pretrained-checkpoint y").split(),
                      world_size=1)
    assert (args.finetune, args.load, args.pretrained_checkpoint) == (True, "x", "y")


def test_older_gpt2_files_and_tied_output_layers_are_read_as_save_pretrained_writes_them():
    w = torch.ones(3, 2)
    old = {"wte.weight": w, "h.0.attn.bias": torch.zeros(1), "h.0.attn.masked_bias": w,
           "lm_head.weight": w.clone()}
    gpt2, llama = (hf_arch.REGISTRY[n] for n in ("GPT2LMHeadModel", "LlamaForCausalLM"))
    assert (gpt2.embedding, llama.embedding) == ("transformer.wte.weight",
                                                 "model.embed_tokens.weight")
    assert import_hf._normalized(gpt2, old, True) == {"transformer.wte.weight": w}
    rope = {"model.embed_tokens.weight": w, "model.layers.0.self_attn.rotary_emb.inv_freq": w}
    assert list(import_hf._normalized(llama, rope, False)) == ["model.embed_tokens.weight"]
    with pytest.raises(hf_arch.MappingError) as err:
        import_hf._normalized(llama, {"model.embed_tokens.weight": w, "lm_head.weight": 2 * w},
                              True)
    assert str(err.value) == ("config.json ties the output layer to the embedding, but "
                              "lm_head.weight differs from it")


def test_the_folders_tokenizer_is_recorded_as_a_huggingface_tokenizer(tmp_path):
    from tests.helpers.corpora import write_hf_tokenizer

    hf = _config(tmp_path, GPT2)
    assert import_hf._source_tokenizer(hf, 300) == (None, (
        f"--hf {hf} holds no tokenizer files: none recorded (the export will ship none)"))
    write_hf_tokenizer(tmp_path / "hf")
    saved, note = import_hf._source_tokenizer(hf, 300)
    assert note is None
    assert (saved["type"], saved["args"], saved["vocab_size"], saved["eod"], saved["bos"],
            saved["pad"]) == ("HuggingFaceTokenizer", {"tokenizer_model": hf}, 300, 2, 1, 0)
    assert sorted(saved["sha256"]) == [f"{hf}/tokenizer.json", f"{hf}/tokenizer_config.json"]
    assert import_hf._source_tokenizer(hf, 299) == (None, (
        "the tokenizer is not recorded: it has 300 tokens, more than config.json's "
        "vocab_size 299"))
