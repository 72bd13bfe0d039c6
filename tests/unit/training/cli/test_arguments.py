"""The command line: Megatron-LM names, SDP4Bit flags from the config, one-line errors."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.training.cli.arguments import (
    NO_OP_FLAGS,
    ArgumentsError,
    build_parser,
    parse_args,
    sdp4bit_config_from_args,
)

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data").split()


def parse(extra: str = "", world_size: int = 4):
    return parse_args(BASE + extra.split(), world_size=world_size)


def test_defaults_and_derived_values():
    args = parse("--global-batch-size 16")
    assert args.max_position_embeddings == 32
    assert args.ffn_hidden_size == 256
    assert args.data_parallel_size == 4
    assert args.num_microbatches == 2  # 16 / (2 x 4)
    assert args.lr_decay_iters == 10
    assert args.tokenizer_type == "NullTokenizer"
    assert args.params_dtype == "fp32"
    assert sdp4bit_config_from_args(args) == SDP4BitConfig()


def test_global_batch_defaults_to_one_microbatch_per_rank():
    args = parse(world_size=2)
    assert (args.global_batch_size, args.num_microbatches) == (4, 1)


def test_paper_accuracy_script_flags_parse():
    line = (
        "--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 256 "
        "--lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-decay-iters 70000 "
        "--lr-warmup-fraction 0.01 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 "
        "--weight-decay 0.1 --clip-grad 1.0 --loss-scale 0 --loss-scale-window 1000 "
        "--hysteresis 2 --min-loss-scale 1 --bf16 --use-distributed-optimizer "
        "--overlap-grad-reduce --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
        "--train-iters 80000 --mock-data --vocab-file v.json --merge-file m.txt "
        "--log-interval 1 --timing-log-level 2 --save-interval 5002 --eval-interval 100 "
        "--eval-iters 10 --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard "
        "--log-throughput --tensorboard-dir tb --tensorboard-log-interval 1 "
        "--wandb-project p --wandb-save-dir w --wandb-exp-name e "
        "--no-async-tensor-model-parallel-allreduce --recompute-activations "
        "--recompute-granularity selective --distributed-backend nccl --exit-interval 200 "
        "--quantized-weights --weight-quantization-bits 4 --wq-group-size 2048 "
        "--quantized-gradients --gradient-quantization-bits-intra 8 --gq-group-size-intra 128 "
        "--gradient-quantization-bits-inter 4 --gq-group-size-inter 128 --hadamard-transform "
        "--gradient-alltoall-pipeline 8 --gradients-quantization-start-iteration 0"
    )
    args = parse_args(line.split(), world_size=32)
    assert args.num_microbatches == 1
    assert args.loss_scale is None  # 0 = dynamic
    assert args.recompute_granularity == "selective"
    assert args.tokenizer_type == "GPT2BPETokenizer"
    cfg = sdp4bit_config_from_args(args)
    assert cfg.quantized_weights and cfg.quantized_gradients and cfg.hadamard_transform
    assert (cfg.gq_group_size_intra, cfg.gq_group_size_inter, cfg.gradient_alltoall_pipeline) == (
        128, 128, 8)


def test_every_config_field_has_a_flag_with_its_docstring_as_help():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(SDP4BitConfig):
        assert f.name in actions, f.name
        if f.name != "seed":
            assert actions[f.name].help, f.name
            assert actions[f.name].default == f.default
    assert actions["weight_quantization_mode"].choices == ["diff", "direct"]
    assert actions["weight_difference_target"].choices == ["main", "rounded-main"]
    assert actions["kernel_backend"].choices == ["auto", "torch", "triton", "cpu"]


def test_sdp4bit_flags_reach_the_config():
    args = parse("--use-distributed-optimizer --quantized-gradients --hadamard-transform "
                 "--hadamard-block-size 16 --gq-group-size-intra 64 --gq-group-size-inter 32 "
                 "--quantization-rounding nearest --dp-ranks-per-node 2 --kernel-backend torch "
                 "--weight-quantization-mode direct --seed 7")
    cfg = sdp4bit_config_from_args(args)
    assert cfg == SDP4BitConfig(quantized_gradients=True, hadamard_transform=True,
                                hadamard_block_size=16, gq_group_size_intra=64,
                                gq_group_size_inter=32, quantization_rounding="nearest",
                                dp_ranks_per_node=2, kernel_backend="torch",
                                weight_quantization_mode="direct", seed=7)
    assert sdp4bit_config_from_args(parse(
        "--use-distributed-optimizer --bf16 --quantized-weights --weight-difference-target "
        "rounded-main")).weight_difference_target == "rounded-main"
    assert sdp4bit_config_from_args(parse("--use-distributed-optimizer --seed 7 "
                                          "--rounding-seed 8")).seed == 8


def test_no_op_flags_are_documented_in_help():
    help_text = build_parser().format_help()
    for flag in NO_OP_FLAGS:
        assert flag in help_text


ERRORS = {
    "quant-without-distopt": ("--quantized-weights",
                              "--quantized-weights requires --use-distributed-optimizer"),
    "grad-quant-without-distopt": ("--quantized-gradients",
                                   "--quantized-gradients requires --use-distributed-optimizer"),
    "batch-not-divisible": ("--global-batch-size 12",
                            "--global-batch-size=12 is not divisible by --micro-batch-size x "
                            "data-parallel size = 2 x 4 = 8"),
    "fp16-and-bf16": ("--fp16 --bf16", "--fp16 and --bf16 are mutually exclusive: pass one"),
    "unknown-flag": ("--no-such-flag", "unrecognized arguments: --no-such-flag"),
    "bad-bits": ("--use-distributed-optimizer --weight-quantization-bits 3",
                 "--weight-quantization-bits=3 is not supported: use one of (4, 8)"),
    "two-bit-weights": ("--use-distributed-optimizer --weight-quantization-bits 2",
                        "--weight-quantization-bits=2 is not supported: use one of (4, 8)"),
    "two-bit-intra": ("--use-distributed-optimizer --gradient-quantization-bits-intra 2",
                      "--gradient-quantization-bits-intra=2 is not supported: use one of (4, 8)"),
    "bad-inter-bits": ("--use-distributed-optimizer --gradient-quantization-bits-inter 3",
                       "--gradient-quantization-bits-inter=3 is not supported: use one of "
                       "(2, 4, 8)"),
    "ef-without-tlq": ("--use-distributed-optimizer --gradient-error-feedback",
                       "--gradient-error-feedback=True needs --quantized-gradients=True: it "
                       "compensates the quantized inter-node hop"),
    "ef-knob-alone": ("--use-distributed-optimizer --quantized-gradients "
                      "--gradient-error-feedback-decay 0.5",
                      "--gradient-error-feedback-decay=0.5 needs --gradient-error-feedback=True"),
    "ef-rounding-alone": ("--use-distributed-optimizer --quantized-gradients "
                          "--gradient-error-feedback-rounding nearest",
                          "--gradient-error-feedback-rounding=nearest needs "
                          "--gradient-error-feedback=True"),
    "ef-decay": ("--use-distributed-optimizer --quantized-gradients --gradient-error-feedback "
                 "--gradient-error-feedback-decay 1",
                 "--gradient-error-feedback-decay=1.0 must be in [0, 1)"),
    "two-bit-group": ("--use-distributed-optimizer --gradient-quantization-bits-inter 2 "
                      "--gq-group-size-inter 130",
                      "--gq-group-size-inter=130 must be a multiple of 4 at 2 bits (four codes "
                      "per byte)"),
    "hadamard-group": ("--use-distributed-optimizer --quantized-gradients --hadamard-transform "
                       "--gq-group-size-inter 48",
                       "--gq-group-size-inter=48 is not a multiple of --hadamard-block-size=32"),
    "group-nesting": ("--use-distributed-optimizer --quantized-gradients --gq-group-size-intra 96 "
                      "--gq-group-size-inter 64",
                      "--gq-group-size-intra=96 and --gq-group-size-inter=64 must divide one "
                      "another (e.g. 128 and 128, or 512 and 128)"),
    "qwd-fp32": ("--use-distributed-optimizer --quantized-weights",
                 "--quantized-weights requires 16-bit parameters: add --bf16 (or --fp16)"),
    "target-without-qwd": ("--use-distributed-optimizer --bf16 --weight-difference-target "
                           "rounded-main", "--weight-difference-target rounded-main needs "
                           "--quantized-weights: it changes what qWD sends"),
    "target-with-qw": ("--use-distributed-optimizer --bf16 --quantized-weights "
                       "--weight-quantization-mode direct --weight-difference-target rounded-main",
                       "--weight-difference-target rounded-main applies to qWD only, not to "
                       "--weight-quantization-mode direct (qW sends the weights)"),
    "bad-choice": ("--weight-quantization-mode half", "argument --weight-quantization-mode: "
                   "invalid choice: 'half' (choose from diff, direct)"),
    "warmup-both": ("--lr-warmup-fraction 0.1 --lr-warmup-iters 3",
                    "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive: pass one"),
    "overlap-param": ("--overlap-param-gather --overlap-grad-reduce",
                      "--overlap-param-gather requires --use-distributed-optimizer"),
    "heads": ("--num-attention-heads 5", "--hidden-size=64 is not divisible by "
              "--num-attention-heads=5"),
    "dp-per-node": ("--dp-ranks-per-node 3", "--dp-ranks-per-node=3 does not divide the "
                    "data-parallel size 4"),
    "gpt2-no-vocab": ("--tokenizer-type GPT2BPETokenizer",
                      "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    "tp-world": ("--tensor-model-parallel-size 3", "world size 4 is not divisible by "
                 "--tensor-model-parallel-size x --pipeline-model-parallel-size = 3"),
    "loss-scale-subnormal": ("--fp16 --loss-scale 1e-39", "--loss-scale=1e-39 is not a "
                             "positive normal fp32 number (1.18e-38 to 3.4e+38): the gradients "
                             "would be unscaled by Inf or 0"),
    # 4 ranks x 100000 slices x 512-element groups = 204.8M-element buckets for a model of
    # 1024 x 64 + 32 x 64 + 2 x (4 x 64^2 + 2 x 64 x 256) = 165,888 parameters.
    "pipeline-too-long": ("--use-distributed-optimizer --quantized-gradients "
                          "--gradient-alltoall-pipeline 100000",
                          "these SDP4Bit settings pad every bucket to a multiple of "
                          "204,800,000 elements, more than the ~165,888 parameters a rank "
                          "holds (the padding would outweigh the model): use "
                          "--gradient-alltoall-pipeline 81 or less"),
    "scheduler-both": ("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler",
                       "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler "
                       "contradict each other: pass one"),
    "timers-to-tb": ("--log-timers-to-tensorboard", "--log-timers-to-tensorboard needs "
                     "--tensorboard-dir and --timing-log-level 1 or 2 (there are no timers at "
                     "level 0)"),
    "heartbeat-short": ("--heartbeat-timeout-seconds 1", "--heartbeat-timeout-seconds=1 is too "
                        "short to tell a busy rank from a stopped one: use >= 2 (or 0 = off)"),
    "replicas-negative": ("--check-replicas-interval -1",
                          "--check-replicas-interval=-1 must be >= 0 (0 = off)"),
    # megatron-core's scheduler would assert: 5 x 8 samples of warm-up, 3 x 8 of decay
    "warmup-longer-than-decay": ("--train-iters 3 --lr-warmup-iters 5",
                                 "the learning-rate warm-up (40 samples) is not shorter than "
                                 "the decay (24 samples, --lr-decay-iters or --train-iters x "
                                 "global batch): lower --lr-warmup-iters/--lr-warmup-samples/"
                                 "--lr-warmup-fraction"),
    "swiglu-openai-gelu": ("--swiglu --openai-gelu", "--openai-gelu and --swiglu contradict "
                           "each other: --swiglu's activation is SiLU; pass one"),
    "kv-channels-0": ("--kv-channels 0", "--kv-channels=0 must be >= 1"),
    "ffn-negative": ("--ffn-hidden-size -5", "--ffn-hidden-size=-5 must be >= 1"),
    "gqa-groups": ("--group-query-attention --num-query-groups 3",
                   "--num-query-groups=3 does not divide --num-attention-heads=4: every group "
                   "needs the same number of heads"),
    "gqa-tp": ("--group-query-attention --num-query-groups 1 --tensor-model-parallel-size 2",
               "--num-query-groups=1 is not divisible by --tensor-model-parallel-size=2"),
    "heads-tp": ("--hidden-size 66 --num-attention-heads 3 --tensor-model-parallel-size 2",
                 "--num-attention-heads=3 is not divisible by --tensor-model-parallel-size=2"),
    "seed-negative": ("--seed -1", "--seed=-1 must be in 0 .. 2**32 - 1 (NumPy's seed range)"),
    "eval-seed-big": ("--eval-data-seed 4294967296", "--eval-data-seed=4294967296 must be in "
                      "0 .. 2**32 - 1 (NumPy's seed range)"),
    "train-seed-negative": ("--train-data-seed -3", "--train-data-seed=-3 must be in 0 .. "
                            "2**32 - 1 (NumPy's seed range)"),
    "heartbeat-nan": ("--heartbeat-timeout-seconds nan", "--heartbeat-timeout-seconds=nan is "
                      "not a number of seconds: give one >= 2, or 0 = off"),
    "heartbeat-inf": ("--heartbeat-timeout-seconds inf", "--heartbeat-timeout-seconds=inf is "
                      "not a number of seconds: give one >= 2, or 0 = off"),
    "heartbeat-huge": ("--heartbeat-timeout-seconds 1e12", "--heartbeat-timeout-seconds=1e+12 "
                       "is longer than a week: a stopped rank would hold the job that long; "
                       "use a shorter timeout"),
    "distributed-timeout-huge": ("--distributed-timeout-minutes 100000000000",
                                 "--distributed-timeout-minutes=1e+11 is longer than a week: a "
                                 "stopped rank would hold the job that long; use a shorter "
                                 "timeout"),
    "async-timeout-zero": ("--save CK --async-save --async-save-timeout-seconds 0",
                           "--async-save-timeout-seconds=0 must be a number of seconds above 0 "
                           "and at most a week"),
    "async-timeout-nan": ("--save CK --async-save --async-save-timeout-seconds nan",
                          "--async-save-timeout-seconds=nan must be a number of seconds above 0 "
                          "and at most a week"),
    "async-timeout-alone": ("--save CK --async-save-timeout-seconds 60",
                            "--async-save-timeout-seconds bounds --async-save's writer: pass "
                            "--async-save too, or drop it"),
    "split-zero": ("--split 0,0,0", "--split '0,0,0' must be up to three non-negative numbers "
                   "with a positive sum, e.g. 969,30,1 (train, valid, test)"),
    "split-words": ("--split abc", "--split 'abc' must be up to three non-negative numbers "
                    "with a positive sum, e.g. 969,30,1 (train, valid, test)"),
    "split-exponent": ("--split 1e2,1,1", "--split '1e2,1,1' must be up to three "
                       "non-negative numbers with a positive sum, e.g. 969,30,1 (train, valid, "
                       "test)"),
    "split-negative": ("--split 90,-10,20", "--split '90,-10,20' must be up to three "
                       "non-negative numbers with a positive sum, e.g. 969,30,1 (train, valid, "
                       "test)"),
}


def test_the_largest_pipeline_that_fits_is_accepted():
    parse("--use-distributed-optimizer --quantized-gradients --gradient-alltoall-pipeline 81")


@pytest.mark.parametrize("case", sorted(ERRORS), ids=str)
def test_errors_are_one_clear_line(case):
    extra, message = ERRORS[case]
    with pytest.raises(ArgumentsError) as info:
        parse(extra)
    text = str(info.value)
    assert "\n" not in text
    # argparse words choices with quotes on some Python versions; compare without them.
    assert text.replace("'", "") == message.replace("'", "")


def test_missing_required_and_data_errors():
    with pytest.raises(ArgumentsError, match=re.escape("missing required flag(s): --lr")):
        parse_args([a for a in BASE if a not in ("--lr", "1e-3")], world_size=1)
    no_data = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ArgumentsError, match="pass --data-path PREFIX"):
        parse_args(no_data, world_size=1)
    with pytest.raises(ArgumentsError, match="weighted --data-path needs pairs"):
        parse_args(no_data + "--data-path 0.5 a 0.5 --vocab-file v --merge-file m".split(),
                   world_size=1)


def test_per_split_data_paths():
    no_data = [a for a in BASE if a != "--mock-data"] + "--vocab-file v --merge-file m".split()
    args = parse_args(no_data + "--train-data-path 0.3 a 0.7 b --valid-data-path c".split(),
                      world_size=1)
    assert (args.train_data_path, args.valid_data_path, args.test_data_path) == (
        ["0.3", "a", "0.7", "b"], ["c"], None)
    assert args.split is None and args.data_path is None
    assert parse_args(no_data + ["--data-path", "a"], world_size=1).split == "969, 30, 1"
    cases = {
        "--data-path a --valid-data-path c":
            "--data-path and --valid-data-path both name the data: pass --data-path (divided "
            "by --split) or --train-data-path/--valid-data-path/--test-data-path (one set of "
            "files per split)",
        "--train-data-path a --split 90,5,5":
            "--split divides --data-path; with --train-data-path each split has its own "
            "files: drop --split",
        "--valid-data-path c --test-data-path d":
            "--valid-data-path, --test-data-path without --train-data-path: pass the training "
            "data with --train-data-path",
        "--train-data-path a --test-data-path 1 d 2":
            "weighted --test-data-path needs pairs 'WEIGHT PREFIX ...'; got an odd count",
        "--train-data-path x a y b":
            "--train-data-path: 'x' is not a weight; use 'WEIGHT PREFIX' pairs or a single PREFIX",
    }
    for extra, message in cases.items():
        with pytest.raises(ArgumentsError) as err:
            parse_args(no_data + extra.split(), world_size=1)
        assert str(err.value) == message, extra
    with pytest.raises(ArgumentsError) as err:
        parse("--train-data-path a")
    assert str(err.value) == "--mock-data makes up its data: drop it or drop --train-data-path"


def test_blend_weights_must_be_positive():
    no_data = [a for a in BASE if a != "--mock-data"] + "--vocab-file v --merge-file m".split()
    for weight in ("0", "-1", "nan", "inf"):
        with pytest.raises(ArgumentsError) as info:
            parse_args(no_data + ["--data-path", weight, "a", "1", "b"], world_size=1)
        assert str(info.value) == (f"--data-path: weight {weight} must be a positive number "
                                   "(drop a prefix instead of weighting it 0)")


def test_a_model_that_cannot_fit_in_memory_is_refused():
    with pytest.raises(ArgumentsError) as info:
        parse("--hidden-size 1000000000 --num-attention-heads 1")
    assert re.fullmatch(r"the model's weights alone need [\d,]+ GiB per rank \(--hidden-size "
                        r"1000000000, --num-layers 2, --ffn-hidden-size 4000000000\), more "
                        r"than this machine's [\d,]+ GiB: choose a smaller model or more "
                        r"model parallelism", str(info.value)), str(info.value)


def test_a_bad_fault_spec_is_a_parse_error(monkeypatch):
    monkeypatch.setenv("SDP4BIT_FAULT", "bogus")
    with pytest.raises(ArgumentsError) as info:
        parse()
    assert str(info.value) == ("SDP4BIT_FAULT='bogus': use KIND@ITERATION:RANK, KIND one of "
                               "nan-grad, die-saving, nan-weight, flip-replica, fill-disk-saving, "
                               "slow-writer")


def test_split_spellings_agree():
    spaced = parse_args(BASE + ["--split", "98, 2, 0"], world_size=4)
    assert parse("--split 98,2,0").split_vector == spaced.split_vector == [0.98, 0.02, 0.0]


def test_abbreviations_are_refused():
    with pytest.raises(ArgumentsError, match="unrecognized arguments: --num-lay"):
        parse("--num-lay 3")


def test_ckpt_step_needs_load_and_a_non_negative_iteration():
    assert parse("--load x --ckpt-step 20").ckpt_step == 20
    with pytest.raises(ArgumentsError, match=re.escape(
            "--ckpt-step 20 needs --load (the folder holding iter_0000020)")):
        parse("--ckpt-step 20")
    with pytest.raises(ArgumentsError, match=re.escape("--ckpt-step=-1 must be an iteration "
                                                       "number >= 0")):
        parse("--load x --ckpt-step -1")


def test_async_save_needs_torch_dist_and_save():
    assert parse("--save x --async-save").async_save
    with pytest.raises(ArgumentsError, match=re.escape(
            "--async-save needs --ckpt-format torch_dist (the torch format is saved "
            "synchronously, as in Megatron-LM)")):
        parse("--save x --async-save --ckpt-format torch")
    with pytest.raises(ArgumentsError, match=re.escape(
            "--async-save needs --save (the folder its checkpoints are written to)")):
        parse("--async-save")
