"""Megatron-LM flag parity: honoured flags reach what they control, refused flags say so in
one line, no-op flags change nothing and are documented, the paper's scripts parse."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

from megatron.sdp4bit.training.cli import megatron_flags as mf
from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

FLAGS_PAGE = Path(__file__).resolve().parents[4] / "docs" / "flags.md"
BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data").split()


def parse(extra: str, world_size: int = 4, iters: bool = True):
    argv = BASE + (["--train-iters", "10"] if iters else []) + extra.split()
    return parse_args(argv, world_size=world_size)


def error(extra: str, iters: bool = True) -> str:
    with pytest.raises(ArgumentsError) as info:
        parse(extra, iters=iters)
    text = str(info.value)
    assert "\n" not in text
    return text


# Every flag the paper's released accuracy and speed scripts pass, with their values (the
# speed scripts pass --data-path with an empty $DATA_PATH next to --mock-data).
PAPER_SCRIPTS = (
    "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 "
    "--max-position-embeddings 2048 --lr 0.0006 --lr-decay-iters 70000 --lr-decay-style cosine "
    "--min-lr 0.00006 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-08 --weight-decay .1 "
    "--lr-warmup-fraction 0.01 --clip-grad 1.0 --loss-scale 0 --loss-scale-window 1000 "
    "--hysteresis 2 --min-loss-scale 1 --bf16 --use-distributed-optimizer "
    "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --micro-batch-size 8 "
    "--global-batch-size 256 --train-iters 80000 --data-path --vocab-file v.json "
    "--merge-file m.txt --mock-data --log-interval 100 --timing-log-level 2 "
    "--save-interval 5002 --eval-interval 100 --eval-iters 10 --log-timers-to-tensorboard "
    "--log-validation-ppl-to-tensorboard --log-throughput --tensorboard-dir tb "
    "--tensorboard-log-interval 1 --wandb-project NeurIPS --wandb-save-dir w "
    "--wandb-exp-name 125M-quant --no-async-tensor-model-parallel-allreduce "
    "--recompute-activations --recompute-granularity selective --quantized-gradients "
    "--gq-group-size-inter 128 --gradient-quantization-bits-inter 4 --gq-group-size-intra 128 "
    "--gradient-quantization-bits-intra 8 --hadamard-transform --quantized-weights "
    "--weight-quantization-bits 4 --wq-group-size 2048 --gradient-alltoall-pipeline 8 "
    "--overlap-grad-reduce --distributed-backend nccl --save ck --load ck "
    "--exit-duration-in-mins 1530 --exit-interval 200"
)


def test_every_flag_of_the_papers_released_scripts_parses():
    args = parse_args(PAPER_SCRIPTS.split(), world_size=32)
    assert args.exit_duration_in_mins == 1530.0 and args.exit_interval == 200
    assert (args.train_iters, args.num_microbatches) == (80000, 1)
    assert args.recompute_granularity == "selective"


def test_train_samples_sets_the_iterations_and_a_sample_schedule():
    args = parse("--train-samples 170 --global-batch-size 16 --lr-decay-samples 120 "
                 "--lr-warmup-samples 24", iters=False)
    assert args.train_iters == 10  # 170 // 16: Megatron-LM drops the partial batch
    assert mf.scheduler_steps(args) == (24, 120, 170)
    # without --global-batch-size: one micro-batch per data-parallel rank, 2 x 4 = 8
    args = parse("--train-samples 100", iters=False)
    assert (args.global_batch_size, args.train_iters) == (8, 12)
    assert mf.scheduler_steps(args) == (0, 100, 100)
    args = parse("--train-samples 100 --lr-warmup-fraction 0.25", iters=False)
    assert mf.scheduler_steps(args) == (25, 100, 100)


def test_iteration_schedule_counts_samples_too():
    args = parse("--global-batch-size 16 --lr-decay-iters 8 --lr-warmup-iters 2")
    assert mf.scheduler_steps(args) == (32, 128, 160)
    args = parse("--global-batch-size 16 --lr-warmup-fraction 0.5")
    assert mf.scheduler_steps(args) == (80, 160, 160)


class _Opt:
    """What megatron-core's scheduler needs of an optimizer."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def test_the_built_schedule_follows_samples(monkeypatch):
    """build._scheduler with --train-samples: linear warm-up over 24 samples, cosine decay to
    --min-lr at 120 samples, stepped by the global batch (16) as the loop steps it."""
    from megatron.sdp4bit.training import build

    args = parse("--train-samples 170 --global-batch-size 16 --lr-decay-samples 120 "
                 "--lr-warmup-samples 24 --lr-decay-style cosine --min-lr 1e-4", iters=False)
    opt = _Opt()
    sched = build._scheduler(args, opt)
    lrs = []
    for _ in range(args.train_iters):
        sched.step(increment=args.global_batch_size)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(1e-3 * 16 / 24)
    # sample 48: (48 - 24) / (120 - 24) of the way through the cosine
    ratio = (48 - 24) / (120 - 24)
    assert lrs[2] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * ratio)))
    assert lrs[-1] == pytest.approx(1e-4)  # 160 samples > 120: the floor


def test_override_opt_param_scheduler_reaches_the_scheduler():
    from megatron.sdp4bit.training import build

    for flag, expected in (("", (False, False)),
                           ("--override-opt_param-scheduler", (True, False)),
                           ("--use-checkpoint-opt_param-scheduler", (False, True))):
        sched = build._scheduler(parse(flag), _Opt())
        assert (sched.override_opt_param_scheduler,
                sched.use_checkpoint_opt_param_scheduler) == expected


SAMPLE_ERRORS = {
    "--train-samples 100": "--train-iters and --train-samples are mutually exclusive: pass one",
    "--lr-decay-samples 50": "--lr-decay-samples needs --train-samples (sample-based training); "
                             "with --train-iters use --lr-decay-iters",
    "--lr-warmup-samples 5": "--lr-warmup-samples needs --train-samples (sample-based "
                             "training); with --train-iters use --lr-warmup-iters",
}
SAMPLE_ERRORS_NO_ITERS = {
    "--train-samples 100 --lr-decay-iters 5": "--lr-decay-iters counts iterations; with "
                                              "--train-samples use --lr-decay-samples",
    "--train-samples 100 --lr-warmup-iters 5": "--lr-warmup-iters counts iterations; with "
                                               "--train-samples use --lr-warmup-samples",
    "--train-samples 100 --lr-warmup-fraction .1 --lr-warmup-samples 5":
        "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive: pass one",
    "--train-samples 7": "--train-samples=7 is less than one global batch (8)",
    "--train-samples 0": "--train-samples=0 must be >= 1",
}


@pytest.mark.parametrize("extra", sorted(SAMPLE_ERRORS))
def test_sample_based_errors_with_iterations(extra):
    assert error(extra) == SAMPLE_ERRORS[extra]


@pytest.mark.parametrize("extra", sorted(SAMPLE_ERRORS_NO_ITERS))
def test_sample_based_errors(extra):
    assert error(extra, iters=False) == SAMPLE_ERRORS_NO_ITERS[extra]


def test_train_samples_without_micro_batch_names_it():
    cut = BASE.index("--micro-batch-size")
    argv = BASE[:cut] + BASE[cut + 2:] + ["--train-samples", "64"]
    with pytest.raises(ArgumentsError, match=r"^missing required flag\(s\): --micro-batch-size$"):
        parse_args(argv, world_size=1)


@pytest.mark.parametrize("flag", sorted(mf.REFUSED_FLAGS))
def test_refused_flags_say_so_in_one_line(flag):
    nargs, why = mf.REFUSED_FLAGS[flag]
    values = {0: "", 1: " 3", 3: " 1 2 3", "+": " 0 1", "*": " a b"}[nargs]
    assert error(flag + values) == f"{flag} is not supported by this trainer: {why}"


@pytest.mark.parametrize("flag", sorted(mf.ONLY_VALUE))
def test_only_value_flags_take_their_value_and_refuse_others(flag):
    kind, value, why = mf.ONLY_VALUE[flag]
    parse(f"{flag} {value}")  # what the trainer does: accepted
    other = 2 if kind is int else "cyclic"
    assert error(f"{flag} {other}") == (f"{flag}={other} is not supported by this trainer: "
                                        f"only {value} ({why})")


def test_several_refusals_are_named_in_one_message():
    """One launch names every flag to drop: a refused flag of this parser, a refused value,
    a Megatron-LM flag this parser lacks (with its group's reason) and a misspelt flag."""
    from megatron.sdp4bit.training.cli import megatron_lm_flags as mlm

    fsdp, rl = "--use-torch-fsdp2", "--grpo-group-size"
    assert mlm.MEGATRON_LM_FLAGS[rl] == "rl"
    got = error(f"--no-save-optim {rl} 4 --rerun-mode validate_results {fsdp} --no-such-flag 3")
    assert got == (
        "5 problems with this command line; drop or replace each: "
        f"(1) {rl}: {mlm.GROUP_REASONS['rl']}; (2) {fsdp}: {mlm.FLAG_REASONS[fsdp]}; "
        f"(3) --no-save-optim: {mf.REFUSED_FLAGS['--no-save-optim'][1]}; "
        f"(4) --rerun-mode=validate_results: only disabled ({mf.ONLY_VALUE['--rerun-mode'][2]}); "
        "(5) unrecognized arguments: --no-such-flag 3")


def test_no_op_flags_change_nothing_else():
    reference = vars(parse(""))
    for flag, kwargs in [(f, mf._NO_OP_VALUES.get(f)) for f in mf.NO_OP_FLAGS]:
        value = "" if kwargs is None else (" nccl" if "choices" in kwargs else " 3")
        got = vars(parse(flag + value))
        changed = {k for k in got if got[k] != reference[k]} - {"start_time"}
        assert changed == {mf._dest(flag)}, (flag, changed)


def test_no_op_flags_are_not_read_by_the_trainer():
    """A no-op's dest must not be used anywhere our trainer's code can reach (else it is not a
    no-op). The plug-in's modules (``megatron_lm.py``, ``integration/megatron_lm*.py``) read
    Megatron-LM's own arguments, where the same flag names have Megatron-LM's meaning; our
    trainer never imports them (held below)."""
    package = Path(mf.__file__).resolve().parents[2]  # megatron/sdp4bit
    plugin = {package / "megatron_lm.py", *(package / "integration").glob("megatron_lm*.py")}
    ours = [p for p in package.rglob("*.py") if p.name != "megatron_flags.py" and p not in plugin]
    source = "\n".join(p.read_text() for p in ours)
    trainer = "\n".join(p.read_text() for p in (package / "training").rglob("*.py"))
    assert not re.search(r"^\s*(from|import) megatron\.sdp4bit\.(integration\.)?megatron_lm",
                         trainer, flags=re.M)
    for flag in mf.NO_OP_FLAGS:
        assert not re.search(rf"\bargs\.{mf._dest(flag)}\b", source), flag


def test_the_flags_page_lists_exactly_the_no_op_flags():
    text = FLAGS_PAGE.read_text(encoding="utf-8")
    section = text.split("\n## Accepted flags that do nothing here\n", 1)[1].split("\n#", 1)[0]
    listed = re.findall(r"^\| `(--[a-zA-Z0-9_-]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(mf.NO_OP_FLAGS)


def test_switches():
    args = parse("--use-rotary-position-embeddings --no-position-embedding")
    assert args.position_embedding_type == "rope"
    assert parse("--no-position-embedding").position_embedding_type == "none"
    assert parse("").position_embedding_type == "learned_absolute"
    assert parse("--recompute-activations --recompute-modules core_attn mlp").recompute_modules \
        == ["core_attn", "mlp"]


SWITCH_ERRORS = {
    "--use-flash-attn --attention-backend fused":
        "--use-flash-attn and --attention-backend fused contradict each other: pass one",
    "--attention-backend flash --transformer-impl local":
        "--attention-backend flash (or --use-flash-attn) chooses Transformer Engine's attention "
        "kernel, and --transformer-impl local does not use it: drop the flag",
    "--distribute-saved-activations --recompute-activations":
        "--distribute-saved-activations needs --recompute-granularity full and no "
        "--sequence-parallel",
    "--recompute-modules mlp": "--recompute-modules needs --recompute-granularity selective "
                               "(or --recompute-activations)",
    "--log-world-size-to-tensorboard": "--log-world-size-to-tensorboard needs --tensorboard-dir",
    "--distributed-timeout-minutes 0": "--distributed-timeout-minutes=0 must be >= 1",
    "--exit-duration-in-mins 0": "--exit-duration-in-mins=0.0 must be > 0",
    "--exit-signal-handler --exit-signal SIGKILL": "--exit-signal SIGKILL is not supported: use "
                                                  "SIGTERM (the default), SIGINT, SIGUSR1 or SIGUSR2",
    "--exit-signal-handler --exit-signal TERM": "--exit-signal TERM is not supported: use SIGTERM "
                                               "(the default), SIGINT, SIGUSR1 or SIGUSR2",
    "--exit-signal SIGUSR1": "--exit-signal SIGUSR1 needs --exit-signal-handler (without it no "
                             "signal is caught)",
}


@pytest.mark.parametrize("extra", sorted(SWITCH_ERRORS))
def test_switch_errors(extra):
    assert error(extra) == SWITCH_ERRORS[extra]


def test_exit_signal_is_megatron_lms_default_and_only_with_the_handler():
    assert parse("").exit_signal is None  # no handler: the signal keeps its default action
    assert parse("--exit-signal-handler").exit_signal == "SIGTERM"
    for name in ("SIGINT", "SIGUSR1", "SIGUSR2"):
        assert parse(f"--exit-signal-handler --exit-signal {name}").exit_signal == name


def test_transformer_switches_reach_the_config():
    from megatron.core.transformer.enums import AttnBackend

    from megatron.sdp4bit.training.model import transformer_config_from_args

    assert mf.transformer_config_overrides(parse("")) == {}
    args = parse("--use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion "
                 "--no-bias-dropout-fusion --apply-query-key-layer-scaling --fp16 "
                 "--fp32-residual-connection --no-clone-scatter-output-in-embedding "
                 "--recompute-granularity full --recompute-method uniform "
                 "--recompute-num-layers 1 --tensor-model-parallel-size 2 "
                 "--distribute-saved-activations")
    config = transformer_config_from_args(args)
    assert config.use_cpu_initialization and config.apply_query_key_layer_scaling
    assert config.fp32_residual_connection and config.distribute_saved_activations
    assert not (config.masked_softmax_fusion or config.bias_activation_fusion
                or config.bias_dropout_fusion or config.clone_scatter_output_in_embedding)
    # the SwiGLU switch governs SwiGLU's fusion, the GeLU switch GeLU's
    assert "bias_activation_fusion" not in mf.transformer_config_overrides(
        parse("--swiglu --no-bias-gelu-fusion"))
    assert mf.transformer_config_overrides(parse("--swiglu --no-bias-swiglu-fusion")) == {
        "bias_activation_fusion": False}
    config = transformer_config_from_args(parse("--recompute-activations --recompute-modules "
                                                "core_attn mlp"))
    assert config.recompute_modules == ["core_attn", "mlp"]
    assert mf.transformer_config_overrides(parse("--attention-backend local")) == {
        "attention_backend": AttnBackend.local}


def test_qk_layernorm_and_rope_scaling_reach_the_model(monkeypatch):
    """--qk-layernorm: the config's switch and the layer spec's per-head q/k norms;
    --use-rope-scaling: GPTModel's rope_scaling and its factor."""
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron.sdp4bit.training import model as trainer_model

    built = {}
    monkeypatch.setattr(trainer_model, "GPTModel", lambda **kw: built.update(kw))
    monkeypatch.setattr(trainer_model.parallel_state, "is_pipeline_first_stage", lambda **kw: True)
    monkeypatch.setattr(trainer_model.parallel_state, "is_pipeline_last_stage", lambda **kw: True)

    def attention_norms(extra: str):
        args = parse(extra)
        config = trainer_model.transformer_config_from_args(args)
        trainer_model.build_model(args, config, 128)
        sub = built["transformer_layer_spec"].submodules.self_attention.submodules
        return config.qk_layernorm, sub.q_layernorm, sub.k_layernorm

    assert attention_norms("") == (False, IdentityOp, IdentityOp)
    on, q_norm, k_norm = attention_norms("--qk-layernorm --normalization RMSNorm")
    # (the norm class builds the config's --normalization kind)
    assert on and q_norm is k_norm and q_norm is not IdentityOp
    assert (built["rope_scaling"], built["rope_scaling_factor"]) == (False, 8.0)
    attention_norms("--position-embedding-type rope --use-rope-scaling --rope-scaling-factor 32")
    assert (built["rope_scaling"], built["rope_scaling_factor"]) == (True, 32.0)
    assert error("--use-rope-scaling") == (
        "--use-rope-scaling scales RoPE's frequencies: it needs --position-embedding-type rope "
        "(or --use-rotary-position-embeddings)")
    assert error("--use-rotary-position-embeddings --rope-scaling-factor 8") == (
        "--rope-scaling-factor needs --use-rope-scaling (without it RoPE is not scaled)")
    assert error("--use-rotary-position-embeddings --use-rope-scaling --rope-scaling-factor "
                 "0.5") == ("--rope-scaling-factor=0.5 must be >= 1 (Llama 3.x stretches the "
                            "low frequencies by it)")


def test_cheaper_gradient_collectives_reach_megatron_cores_ddp(monkeypatch):
    """--grad-reduce-in-bf16 (with --bf16, also with SDP4Bit's quantized gradients, whose
    integration test runs bf16 buffers) and --ddp-reduce-scatter-with-fp32-accumulation
    (baseline only) become DistributedDataParallelConfig's fields; misuse is one line."""
    import torch

    from megatron.sdp4bit.training import model as trainer_model

    made = {}

    class FakeDDP:
        def __init__(self, config, ddp_config, module, **kwargs):
            made["ddp"] = ddp_config

        def broadcast_params(self):
            pass

    monkeypatch.setattr(trainer_model, "DistributedDataParallel", FakeDDP)

    def ddp_config(extra: str):
        args = parse(extra)
        trainer_model.wrap_ddp(args, None, torch.nn.Linear(2, 2))
        return made["ddp"].grad_reduce_in_fp32, made["ddp"].reduce_scatter_with_fp32_accumulation

    monkeypatch.setattr(trainer_model, "Float16Module", lambda config, module: module)
    dist_opt = "--bf16 --use-distributed-optimizer"
    assert ddp_config(dist_opt) == (True, False)
    assert ddp_config(dist_opt + " --grad-reduce-in-bf16") == (False, False)
    assert ddp_config(dist_opt + " --grad-reduce-in-bf16 --quantized-gradients") == (False, False)
    assert ddp_config(dist_opt + " --grad-reduce-in-bf16 "
                      "--ddp-reduce-scatter-with-fp32-accumulation") == (False, True)
    assert error("--grad-reduce-in-bf16 --fp16") == (
        "--grad-reduce-in-bf16 needs --bf16: it keeps the gradients in the bf16 parameters' "
        "dtype (with --fp16 or fp32 parameters they are reduced in fp32)")
    rs = "--ddp-reduce-scatter-with-fp32-accumulation"
    assert error(rs) == (f"{rs} replaces the distributed optimizer's reduce-scatter: it needs "
                         "--use-distributed-optimizer")
    assert error(f"{rs} {dist_opt} --overlap-grad-reduce") == (
        f"{rs} with --overlap-grad-reduce runs in megatron-core on a single gradient bucket "
        "only: drop --overlap-grad-reduce")
    assert error(f"{rs} {dist_opt} --quantized-gradients") == (
        f"{rs} replaces the reduce-scatter that SDP4Bit replaces (whose quantized gradients are "
        "already summed in fp32): drop it")


def test_openai_gelu_is_the_tanh_approximation_in_the_config(monkeypatch):
    import math

    import torch
    import torch.nn.functional as F

    from megatron.sdp4bit.training.model import transformer_config_from_args

    # As on a GPU, where the fused bias + activation kernel is used: it computes the exact
    # GeLU only (TransformerConfig refuses it with another function), so it stays off here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plain = transformer_config_from_args(parse(""))
    assert plain.activation_func is F.gelu and plain.bias_activation_fusion
    config = transformer_config_from_args(parse("--openai-gelu"))
    assert not config.bias_activation_fusion and not config.gated_linear_unit
    x = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    assert torch.equal(config.activation_func(x), F.gelu(x, approximate="tanh"))
    assert (config.activation_func(x) - tanh).abs().max() <= 1e-15
    # and not the exact one: they differ by ~1e-4 around |x| = 2
    assert (config.activation_func(x) - F.gelu(x)).abs().max() > 1e-4


def test_exit_duration_counts_from_the_parse():
    args = parse("--exit-duration-in-mins 2")
    assert args.exit_duration_in_mins == 2.0
    assert abs(args.start_time - time.time()) < 60
    assert parse("").exit_duration_in_mins is None  # off by default


def test_virtual_pipeline_flags():
    """Megatron-LM's meanings: chunks per pipeline rank from layers per virtual stage or
    given directly (two spellings), a size of 1 is none; without the interleaved schedule
    no p2p overlap or aligned gather; batched p2p ([Note: batched p2p at PP 2]) follows."""
    from megatron.sdp4bit.training.model import transformer_config_from_args

    pp2 = "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8"
    args = parse(pp2 + " --num-layers-per-virtual-pipeline-stage 2")
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.overlap_p2p_comm and args.align_param_gather
    for flag in ("--num-virtual-stages-per-pipeline-rank",
                 "--virtual-pipeline-model-parallel-size"):
        assert parse(f"{pp2} {flag} 4").virtual_pipeline_model_parallel_size == 4
    assert parse(f"{pp2} --num-layers-per-virtual-pipeline-stage 4"
                 ).virtual_pipeline_model_parallel_size is None  # one chunk: plain pipeline
    plain = parse(pp2)
    assert plain.virtual_pipeline_model_parallel_size is None
    assert not plain.overlap_p2p_comm and not plain.align_param_gather
    assert not parse(pp2 + " --num-layers-per-virtual-pipeline-stage 2 --no-align-param-gather"
                     ).align_param_gather
    config = transformer_config_from_args(args)
    assert (config.virtual_pipeline_model_parallel_size, config.overlap_p2p_comm,
            config.batch_p2p_comm) == (2, True, False)
    config = transformer_config_from_args(parse(
        "--num-layers 8 --pipeline-model-parallel-size 4 --global-batch-size 8 "
        "--num-layers-per-virtual-pipeline-stage 1 --no-overlap-p2p-communication",
        world_size=4))
    assert (config.overlap_p2p_comm, config.batch_p2p_comm) == (False, True)


VIRTUAL_PIPELINE_ERRORS = {
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8 "
    "--num-layers-per-virtual-pipeline-stage 3":
        "--num-layers-per-virtual-pipeline-stage=3 does not divide the 4 layers of each "
        "pipeline stage (--num-layers 8 / --pipeline-model-parallel-size 2)",
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8 "
    "--num-virtual-stages-per-pipeline-rank 3":
        "--num-layers=8 is not divisible by --pipeline-model-parallel-size x "
        "--num-virtual-stages-per-pipeline-rank = 2 x 3: every model chunk needs the same "
        "number of layers",
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8 "
    "--num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 4":
        "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
        "(--virtual-pipeline-model-parallel-size) both set the interleaved pipeline's chunks: "
        "pass one",
    "--num-layers 8 --num-layers-per-virtual-pipeline-stage 2":
        "the interleaved pipeline (--num-layers-per-virtual-pipeline-stage / "
        "--num-virtual-stages-per-pipeline-rank) needs --pipeline-model-parallel-size > 1",
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8 "
    "--num-layers-per-virtual-pipeline-stage 2 --no-overlap-p2p-communication":
        "--no-overlap-p2p-communication with the interleaved pipeline needs "
        "--pipeline-model-parallel-size > 2: at 2 the batched sends and receives go both ways "
        "between the same two ranks and are matched in the wrong order (Megatron-LM refuses "
        "it too); drop --no-overlap-p2p-communication",
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 12 "
    "--num-layers-per-virtual-pipeline-stage 2":
        "the interleaved pipeline needs the number of micro-batches per step (3 = "
        "--global-batch-size / (--micro-batch-size x data-parallel size)) to be a multiple "
        "of --pipeline-model-parallel-size=2",
    "--num-layers 8 --pipeline-model-parallel-size 2 --global-batch-size 8 "
    "--num-virtual-stages-per-pipeline-rank 0":
        "--num-virtual-stages-per-pipeline-rank=0 must be >= 1",
    "--context-parallel-size 0": "--context-parallel-size=0 must be >= 1",
}


@pytest.mark.parametrize("extra", sorted(VIRTUAL_PIPELINE_ERRORS))
def test_virtual_pipeline_errors(extra):
    assert error(extra) == VIRTUAL_PIPELINE_ERRORS[extra]
