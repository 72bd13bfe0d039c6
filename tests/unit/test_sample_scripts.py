"""Every script in sample_scripts/ launches a pretrain_gpt.py command line the real parser accepts.

Each script is checked with ``bash -n``, then run with fake ``torchrun``/``srun``/``scontrol``/
``sbatch`` first on ``PATH``: the fake ``torchrun`` records its argv, the fake ``srun`` records
its own and runs the rest of its command line. The recorded ``pretrain_gpt.py`` arguments go
through ``megatron.sdp4bit.training.cli.arguments.parse_args`` (full validation, no process group)
and the result is compared with the paper's model cards and methods (docs/reproducing.md,
docs/cluster.md). The batch scripts' ``#SBATCH`` headers are read as sbatch reads them.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from megatron.sdp4bit.training.cli.arguments import parse_args, sdp4bit_config_from_args

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "sample_scripts"

ACCURACY_MODELS = ("125M", "350M", "1.3B", "6.7B")
METHODS = ("baseline", "quantWeightDiff", "quantGradwithoutHT", "quantGrad", "quantWeightDiff_Grad")
SPEED_MODELS = ("1.3B", "2.7B", "6.7B", "13B", "18B")

# (layers, hidden, heads, lr, micro batch) from the paper's model cards.
CARDS = {
    "125M": (12, 768, 12, 6e-4, 8),
    "350M": (24, 1024, 16, 3e-4, 8),
    "1.3B": (24, 2048, 16, 2e-4, 2),
    "6.7B": (32, 4096, 32, 1.2e-4, 2),
}
SPEED_SHAPES = {
    "1.3B": (24, 2048, 16),
    "2.7B": (32, 2560, 32),
    "6.7B": (32, 4096, 32),
    "13B": (40, 5120, 40),
    "18B": (40, 6144, 48),
}
# (TP, PP) of Table 2 on the A100 (4 GPUs/node) and H800 (8 GPUs/node) clusters.
SPEED_TP_PP = {
    "a100": {"1.3B": (1, 1), "2.7B": (1, 1), "6.7B": (4, 1), "13B": (4, 2), "18B": (4, 2)},
    "h800": {"1.3B": (1, 1), "2.7B": (1, 1), "6.7B": (4, 1), "13B": (8, 1), "18B": (8, 1)},
}

FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$RECORD_DIR/torchrun"
"""
# srun OPTIONS... PROGRAM ARGS...: record, then run PROGRAM as SLURM would on one node.
FAKE_SRUN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$RECORD_DIR/srun"
while [[ "$1" == -* ]]; do
    case "$1" in --*=*) shift ;; --kill-on-bad-exit|--exclusive) shift ;; *) shift 2 ;; esac
done
exec "$@"
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 3
printf 'gpu-node-%s\\n' 07 08 09 10
"""
# one line per submission, arguments separated by tabs
FAKE_SBATCH = """#!/usr/bin/env bash
(IFS=$'\\t'; echo "$*") >> "$RECORD_DIR/sbatch"
"""


def all_scripts() -> list[Path]:
    return sorted(p for p in SCRIPTS.rglob("*") if p.suffix in (".sh", ".sbatch"))


def accuracy_script(model: str, method: str) -> Path:
    return SCRIPTS / "accuracy" / model / method / "train.sh"


def speed_script(model: str, method: str) -> Path:
    return SCRIPTS / "speed" / model / f"{method}.sbatch"


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("fake_bin")
    for name, text in (("torchrun", FAKE_TORCHRUN), ("srun", FAKE_SRUN),
                       ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def run_script(script: Path, fake_bin: Path, tmp_path: Path, **env: str) -> dict[str, str]:
    """Run ``script`` with the fakes; return what each fake that ran recorded."""
    records = tmp_path / "records"
    records.mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("NNODES", "GPUS_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "CLUSTER", "LAUNCHER",
                 "SDP4BIT_HOME", "EXTRA_ARGS", "TRAIN_ITERS", "MICRO_BATCH_SIZE", "DATA_PATH",
                 "WANDB_PROJECT", "MODEL", "STUDY_ROOT", "STUDY_METHODS", "ROUNDING_SEEDS",
                 "BASELINE_SEEDS", "EVAL_DATA_SEED", "TASK"):
        base.pop(name, None)
    base.update(PATH=f"{fake_bin}{os.pathsep}{base['PATH']}", RECORD_DIR=str(records),
                RUN_ROOT=str(tmp_path / "runs"), **env)
    result = subprocess.run(["bash", str(script)], env=base, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{script} failed:\n{result.stderr}"
    return {p.name: p.read_text() for p in records.iterdir()}


def argv(record: str) -> list[str]:
    """The argv a fake recorded as NUL-terminated strings."""
    assert record.endswith("\0")
    return record.split("\0")[:-1]


def pretrain_argv(record: str) -> tuple[list[str], list[str]]:
    """Split a recorded torchrun argv into (torchrun options, pretrain_gpt.py arguments)."""
    torchrun_argv = argv(record)
    (i,) = [i for i, a in enumerate(torchrun_argv) if a.endswith("pretrain_gpt.py")]
    assert Path(torchrun_argv[i]) == REPO / "pretrain_gpt.py"
    return torchrun_argv[:i], torchrun_argv[i + 1:]


def option(args: list[str], name: str) -> str:
    (i,) = [i for i, a in enumerate(args) if a == name]
    return args[i + 1]


def test_every_script_is_valid_bash_and_executable():
    scripts = all_scripts()
    # 20 accuracy + the accuracy study + 10 speed + the sweep + common.sh
    assert len(scripts) == len(ACCURACY_MODELS) * len(METHODS) + 2 * len(SPEED_MODELS) + 3
    for script in scripts:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"
        if script.name != "common.sh":
            assert script.stat().st_mode & stat.S_IXUSR, f"{script} is not executable"
            assert "pretrain_gpt.py" in script.read_text() or script.name == "sweep.sh"


def batch_scripts() -> list[Path]:
    return ([accuracy_script(m, k) for m in ACCURACY_MODELS for k in METHODS]
            + [speed_script(m, k) for m in SPEED_MODELS for k in ("baseline", "sdp4bit")])


def sbatch_header(script: Path) -> list[str]:
    """The lines sbatch reads for options: those before the first line that is neither blank
    nor a comment (sbatch ignores any ``#SBATCH`` after it)."""
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash", script
    header = []
    for line in lines[1:]:
        if line.strip() and not line.startswith("#"):
            break
        header.append(line)
    return header


def sbatch_options(header: list[str]) -> dict[str, str]:
    """``#SBATCH --name=value`` lines as {name: value}; each option once."""
    options = {}
    for line in header:
        if line.startswith("#SBATCH "):
            m = re.fullmatch(r"#SBATCH (--[a-z-]+)(?:=(\S+))?", line)
            assert m, f"malformed directive {line!r}"
            assert m[1] not in options, f"{m[1]} given twice"
            options[m[1]] = m[2] or ""
    return options


def slurm_minutes(value: str) -> float:
    """SLURM's [days-]hours:minutes:seconds (the form the scripts use) in minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d{2}):(\d{2})", value)
    assert m, f"--time={value} is not [days-]HH:MM:SS"
    days, hours, minutes, seconds = (int(x or 0) for x in m.groups())
    assert minutes < 60 and seconds < 60, value
    return days * 1440 + hours * 60 + minutes + seconds / 60


def test_batch_script_headers_give_time_output_partition_account_and_environment():
    scripts = batch_scripts()
    assert len(scripts) == len(ACCURACY_MODELS) * len(METHODS) + 2 * len(SPEED_MODELS)
    for script in scripts:
        header = sbatch_header(script)
        # every directive sits in the header, where sbatch reads it
        directives = [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]
        assert directives == [line for line in header if line.startswith("#SBATCH")], script
        options = sbatch_options(header)
        kind = script.relative_to(SCRIPTS).parts[0]
        model = script.relative_to(SCRIPTS).parts[1]
        method = script.parent.name if kind == "accuracy" else script.stem
        short = "acc" if kind == "accuracy" else "speed"
        assert options["--job-name"] == f"sdp4bit-{short}-{model}-{method}", script
        # accuracy: a day per job (80k iterations resume across jobs); speed: 30 iterations
        assert slurm_minutes(options["--time"]) == (24 * 60 if kind == "accuracy" else 30), script
        assert options["--output"] == "logs/%x-%j.out", script
        # disabled (two '#'), ready to be switched on: sbatch must not read them as given
        assert "--partition" not in options and "--account" not in options, script
        assert "##SBATCH --partition=" in header and "##SBATCH --account=" in header, script
        comments = " ".join(line.lstrip("# ") for line in header if not line.startswith("#SBATCH"))
        assert "Python environment active" in comments, script
        assert "sbatch copies the submitting shell's environment" in comments, script
        if kind == "accuracy":  # how to get past the time limit
            assert "--exit-duration-in-mins 1380" in comments, script
    # --output is relative to the submit directory, the repository root: the folder must be
    # there in every clone (SLURM does not create it), and its contents stay out of git
    assert (REPO / "logs").is_dir()
    assert (REPO / "logs" / ".gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]


def test_launch_without_torchrun_says_to_activate_the_environment(fake_bin, tmp_path):
    """sbatch from a shell without the environment: the job has no torchrun; it must say so
    instead of failing on every node with 'command not found'."""
    system = "/usr/bin:/bin"
    if shutil.which("torchrun", path=system):
        pytest.skip("this machine has a torchrun outside any environment")
    no_torchrun = tmp_path / "bin"
    no_torchrun.mkdir()
    for name in ("srun", "scontrol"):
        shutil.copy(fake_bin / name, no_torchrun / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{no_torchrun}{os.pathsep}{system}", RECORD_DIR=str(tmp_path),
               RUN_ROOT=str(tmp_path / "runs"))
    for extra in ({"NNODES": "2", "GPUS_PER_NODE": "4"},  # torchrun launcher
                  {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4",
                   "SLURM_JOB_NODELIST": "gpu-node-[07-08]"}):  # srun launcher
        result = subprocess.run(["bash", str(accuracy_script("125M", "baseline"))],
                                env={**env, **extra}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "torchrun is not on PATH: activate the Python environment" in result.stderr
        assert not (tmp_path / "srun").exists()  # stopped before launching anything


def check_method(args, method: str) -> None:
    cfg = sdp4bit_config_from_args(args)
    assert args.use_distributed_optimizer
    weights = method in ("quantWeightDiff", "quantWeightDiff_Grad", "sdp4bit")
    grads = method in ("quantGradwithoutHT", "quantGrad", "quantWeightDiff_Grad", "sdp4bit")
    hadamard = method in ("quantGrad", "quantWeightDiff_Grad", "sdp4bit")
    assert (cfg.quantized_weights, cfg.quantized_gradients, cfg.hadamard_transform) == (
        weights, grads, hadamard)
    if weights:
        assert (cfg.weight_quantization_bits, cfg.wq_group_size, cfg.weight_quantization_mode) == (
            4, 2048, "diff")
    if grads:
        assert (cfg.gradient_quantization_bits_intra, cfg.gq_group_size_intra) == (8, 128)
        assert (cfg.gradient_quantization_bits_inter, cfg.gq_group_size_inter) == (4, 128)
        assert cfg.quantization_rounding == "stochastic"
    # the topology is detected from where the ranks run, never forced by a script
    assert cfg.dp_ranks_per_node is None


@pytest.mark.parametrize("model", ACCURACY_MODELS)
def test_accuracy_scripts_parse_with_the_model_card(model, fake_bin, tmp_path):
    layers, hidden, heads, lr, micro = CARDS[model]
    for method in METHODS:
        rec = run_script(accuracy_script(model, method), fake_bin, tmp_path,
                         NNODES="4", GPUS_PER_NODE="4", MASTER_ADDR="node0")
        assert set(rec) == {"torchrun"}  # no SLURM: one torchrun on this node
        launcher, cmd = pretrain_argv(rec["torchrun"])
        assert option(launcher, "--nnodes") == "4"
        assert option(launcher, "--nproc-per-node") == "4"
        assert option(launcher, "--rdzv-endpoint") == "node0:29500"
        args = parse_args(cmd, world_size=16)
        assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (layers, hidden, heads)
        assert (args.seq_length, args.max_position_embeddings) == (2048, 2048)
        assert (args.micro_batch_size, args.global_batch_size, args.train_iters) == (micro, 256, 80000)
        assert args.num_microbatches == 256 // (micro * 16)
        assert args.lr == pytest.approx(lr) and args.min_lr == pytest.approx(lr / 10)
        assert (args.lr_decay_style, args.lr_decay_iters, args.lr_warmup_fraction) == (
            "cosine", 70000, 0.01)
        assert (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.95, 1e-8)
        assert (args.weight_decay, args.clip_grad, args.bf16) == (0.1, 1.0, True)
        assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
        assert args.recompute_granularity == "selective"
        assert args.overlap_grad_reduce == (model in ("1.3B", "6.7B"))
        assert not args.mock_data and args.tokenizer_type == "GPT2BPETokenizer"
        assert args.data_path == [str(REPO / "data/pile/pile_text_document")]
        run_dir = tmp_path / "runs" / "accuracy" / model / method
        assert args.save == args.load == str(run_dir / "checkpoints")
        assert args.metrics_jsonl == str(run_dir / "metrics.jsonl")
        assert args.transformer_impl == "auto"  # Transformer Engine where it is installed
        check_method(args, method)


@pytest.mark.parametrize("cluster", ["a100", "h800"])
def test_speed_scripts_under_slurm_use_the_papers_parallelism(cluster, fake_bin, tmp_path):
    gpus = 4 if cluster == "a100" else 8
    for model in SPEED_MODELS:
        for method in ("baseline", "sdp4bit"):
            # sbatch --nodes 4: SLURM's variables give nodes, GPUs and the rendezvous host
            rec = run_script(speed_script(model, method), fake_bin, tmp_path, CLUSTER=cluster,
                             SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="4",
                             SLURM_GPUS_ON_NODE=str(gpus), SLURM_JOB_NODELIST="gpu-node-[07-10]")
            assert option(argv(rec["srun"]), "--nodes") == "4"
            assert option(argv(rec["srun"]), "--ntasks-per-node") == "1"
            launcher, cmd = pretrain_argv(rec["torchrun"])
            assert option(launcher, "--nproc-per-node") == str(gpus)
            assert option(launcher, "--rdzv-endpoint") == "gpu-node-07:29500"
            assert option(launcher, "--rdzv-id") == "4242"
            args = parse_args(cmd, world_size=4 * gpus)
            tp, pp = SPEED_TP_PP[cluster][model]
            assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
            assert (args.num_layers, args.hidden_size, args.num_attention_heads) == SPEED_SHAPES[model]
            assert args.mock_data and args.micro_batch_size == 1 and args.num_microbatches == 1
            # GPT-2's vocabulary size, without needing its files
            assert (args.tokenizer_type, args.vocab_size) == ("NullTokenizer", 50257)
            assert args.global_batch_size == 4 * gpus // (tp * pp)
            assert args.train_iters == 30 and args.log_interval == 1
            # Transformer Engine's layers, as Megatron-LM's GPU runs use them
            assert args.transformer_impl == "transformer_engine"
            check_method(args, method)
            pipeline = 8 if method == "sdp4bit" and model in ("1.3B", "2.7B", "6.7B") else 1
            assert args.gradient_alltoall_pipeline == pipeline


def test_environment_overrides_reach_the_command_line(fake_bin, tmp_path):
    rec = run_script(accuracy_script("125M", "quantGrad"), fake_bin, tmp_path,
                     NNODES="2", GPUS_PER_NODE="2", TRAIN_ITERS="50", MICRO_BATCH_SIZE="4",
                     DATA_PATH="0.3 /d/pile_a 0.7 /d/pile_b", WANDB_PROJECT="sdp4bit",
                     EXTRA_ARGS="--exit-interval 20 --quantization-rounding nearest")
    _, cmd = pretrain_argv(rec["torchrun"])
    args = parse_args(cmd, world_size=4)
    assert (args.train_iters, args.micro_batch_size, args.exit_interval) == (50, 4, 20)
    assert args.data_path == ["0.3", "/d/pile_a", "0.7", "/d/pile_b"]
    assert args.wandb_project == "sdp4bit" and args.wandb_exp_name == "accuracy-125M-quantGrad"
    assert sdp4bit_config_from_args(args).quantization_rounding == "nearest"


def test_speed_script_refuses_a_world_size_the_model_parallelism_does_not_divide(fake_bin, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{fake_bin}{os.pathsep}{env['PATH']}", RECORD_DIR=str(tmp_path),
               NNODES="1", GPUS_PER_NODE="6", CLUSTER="a100", RUN_ROOT=str(tmp_path))
    result = subprocess.run(["bash", str(speed_script("13B", "sdp4bit"))], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "13B needs TP x PP = 8 to divide 6 GPUs" in result.stderr
    assert not (tmp_path / "torchrun").exists()


def test_sweep_submits_every_speed_script_per_node_count(fake_bin, tmp_path):
    # a copy of sample_scripts/ stands in for the repository, to see the sweep create logs/
    root = tmp_path / "repo"
    shutil.copytree(SCRIPTS, root / "sample_scripts")
    rec = run_script(root / "sample_scripts" / "speed" / "sweep.sh", fake_bin, tmp_path,
                     NODE_COUNTS="4 16", SBATCH_ARGS="--partition gpu")
    assert (root / "logs").is_dir()  # the jobs' --output folder, made before submitting
    jobs = [line.split("\t") for line in rec["sbatch"].splitlines()]
    submitted = sorted((j[1], j[-1]) for j in jobs)
    expected = sorted((n, f"sample_scripts/speed/{m}/{k}.sbatch")
                      for n in ("4", "16") for m in SPEED_MODELS for k in ("baseline", "sdp4bit"))
    assert submitted == expected
    assert all(j[0] == "--nodes" and j[2:4] == ["--partition", "gpu"] for j in jobs)


# The accuracy study's array tasks with the defaults: (method, label, script method) in order.
STUDY = SCRIPTS / "accuracy" / "study.sbatch"
STUDY_TASKS = [("baseline", "ref", "baseline"), ("baseline", "seed1235", "baseline"),
               ("baseline", "seed1236", "baseline")] + [
    (m, f"rs{r}", script) for m, script in (
        ("qW", "quantWeightDiff"), ("qWD", "quantWeightDiff"),
        ("qWD-rounded", "quantWeightDiff"), ("TLq", "quantGradwithoutHT"),
        ("TLq-HS", "quantGrad"), ("SDP4Bit", "quantWeightDiff_Grad")) for r in (1, 2, 3)]


def test_accuracy_study_array_runs_every_method_and_seed(fake_bin, tmp_path):
    """sample_scripts/accuracy/study.sbatch: its header as sbatch reads it (an array of one
    task per run), the task list it prints without SLURM, and each task's command line: the
    accuracy script's flags for the method, its seed, the shared held-out samples, and its
    own run folder <study root>/<method>/<label>/ (benchmarks/accuracy_study.py reads that)."""
    options = sbatch_options(sbatch_header(STUDY))
    assert options["--job-name"] == "sdp4bit-acc-study"
    assert options["--array"] == f"0-{len(STUDY_TASKS) - 1}"
    assert options["--output"] == "logs/%x-%A_%a.out"
    assert slurm_minutes(options["--time"]) == 24 * 60
    assert "--partition" not in options and "--account" not in options
    listing = subprocess.run(["bash", str(STUDY)], capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "TASK"
                                  and not k.startswith("SLURM_")}).stdout.splitlines()
    last = len(STUDY_TASKS) - 1
    assert listing[-1] == f"{len(STUDY_TASKS)} tasks: sbatch --array=0-{last} {STUDY}"
    assert [tuple(line.split()[1:3]) for line in listing[:-1]] == [t[:2] for t in STUDY_TASKS]
    root = tmp_path / "study"
    slurm = dict(SLURM_JOB_ID="99", SLURM_JOB_NUM_NODES="4", SLURM_GPUS_ON_NODE="4",
                 SLURM_JOB_NODELIST="gpu-node-[07-10]", STUDY_ROOT=str(root))
    # The listing above checked every task's method and label; the command lines of the
    # baseline's two kinds of runs and of one rounding seed of every method (bash is slow).
    picked = [0, 2] + [k for k, t in enumerate(STUDY_TASKS) if t[1] == "rs2"]
    for task in picked:
        method, label, script = STUDY_TASKS[task]
        rec = run_script(STUDY, fake_bin, tmp_path, SLURM_ARRAY_TASK_ID=str(task), **slurm)
        _, cmd = pretrain_argv(rec["torchrun"])
        args = parse_args(cmd, world_size=16)
        if method != "qW":  # qW: the qWD script's flags with the direct mode added
            check_method(args, script)
        cfg = sdp4bit_config_from_args(args)
        assert cfg.weight_quantization_mode == ("direct" if method == "qW" else "diff")
        assert cfg.weight_difference_target == ("rounded-main" if method == "qWD-rounded"
                                                else "main")
        assert args.seed == (int(label[4:]) if label.startswith("seed") else 1234)
        assert args.rounding_seed == (int(label[2:]) if label.startswith("rs") else None)
        assert args.eval_data_seed == 4321 and args.train_iters == 80000
        run_dir = root / method / label / "accuracy" / "125M" / script
        assert args.metrics_jsonl == str(run_dir / "metrics.jsonl")
        assert args.save == args.load == str(run_dir / "checkpoints")
    result = subprocess.run(["bash", str(STUDY)], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "TASK": str(len(STUDY_TASKS)),
                                 "PATH": f"{fake_bin}{os.pathsep}{os.environ['PATH']}",
                                 "RECORD_DIR": str(tmp_path)})
    assert result.returncode == 2 and result.stderr.strip() == (
        f"task {len(STUDY_TASKS)}: the study has {len(STUDY_TASKS)} tasks (0-"
        f"{len(STUDY_TASKS) - 1}); submit with --array=0-{len(STUDY_TASKS) - 1}")


def test_scripts_save_on_slurms_early_sigterm_within_torchruns_wait(fake_bin, tmp_path):
    """Every batch script asks SLURM for SIGTERM ahead of --time, sent to the job step (where
    srun runs torchrun), not to the batch shell alone ('B:'); the trainer catches that signal
    (--exit-signal-handler) and torchrun waits for the save longer than its default 30 s, yet
    ends before the time limit."""
    leads = set()
    for script in batch_scripts():
        header = sbatch_header(script)
        signal_option = sbatch_options(header)["--signal"]
        m = re.fullmatch(r"TERM@(\d+)", signal_option)
        assert m, f"{script}: --signal={signal_option}"
        leads.add(int(m[1]))
        comments = " ".join(line.lstrip("# ") for line in header if not line.startswith("#SBATCH"))
        assert f"--signal={signal_option} above" in comments and "--exit-signal-handler" in comments
    (lead,) = leads
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "4",
             "SLURM_JOB_NODELIST": "gpu-node-[07-08]"}
    for script in (accuracy_script("1.3B", "quantWeightDiff_Grad"), speed_script("1.3B", "sdp4bit")):
        rec = run_script(script, fake_bin, tmp_path, **slurm)
        assert "srun" in rec  # the step SLURM signals
        launcher, cmd = pretrain_argv(rec["torchrun"])
        wait = int(option(launcher, "--shutdown-timeout"))
        # SLURM may signal up to 60 s early, never late: torchrun's wait must end before --time
        assert 30 < wait < lead, (wait, lead)
        args = parse_args(cmd, world_size=8)
        assert args.exit_signal_handler and args.exit_signal == "SIGTERM"
        assert (args.save is not None) == (script.name == "train.sh")
    rec = run_script(speed_script("1.3B", "sdp4bit"), fake_bin, tmp_path, SHUTDOWN_TIMEOUT="90")
    assert option(pretrain_argv(rec["torchrun"])[0], "--shutdown-timeout") == "90"
