"""What this machine lacks for the command line: refused in one line before any process
group (training/cli/installed.py), warned about once where the run goes on at a cost. The
machine is simulated (CUDA present or not, packages importable or not), so every case runs
on a CPU-only machine."""

from __future__ import annotations

import argparse

import pytest

from megatron.sdp4bit.training.cli import devices, installed
from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data").split()


def machine(monkeypatch, *, cuda: bool, have: set[str], devices: int = 1) -> None:
    """CUDA with ``devices`` GPUs or none, these packages importable; one local rank unless
    the test sets torchrun's LOCAL_WORLD_SIZE."""
    monkeypatch.setattr(installed, "_cuda", lambda: cuda)
    monkeypatch.setattr(installed, "_device_count", lambda: devices if cuda else 0)
    monkeypatch.setattr(installed, "_importable", lambda name: name in have)
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def check(extra: str, quantized: bool = False) -> argparse.Namespace:
    args = parse_args(BASE + extra.split(), world_size=2)
    installed.check_installed(args, quantized)
    return args


def refusal(extra: str, quantized: bool = False) -> str:
    with pytest.raises(ArgumentsError) as info:
        check(extra, quantized)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_transformer_engine_is_refused_where_it_cannot_run(monkeypatch):
    machine(monkeypatch, cuda=True, have={"tensorboard"})
    assert refusal("--transformer-impl transformer_engine") == (
        "--transformer-impl transformer_engine needs Transformer Engine, which is not "
        'installed: pip install -e ".[te]", or --transformer-impl local')
    assert refusal("--use-flash-attn") == (
        "--attention-backend flash (or --use-flash-attn) needs Transformer Engine, which is not "
        'installed: pip install -e ".[te]", or drop the flag')
    machine(monkeypatch, cuda=False, have={"transformer_engine"})
    assert refusal("--transformer-impl transformer_engine") == (
        "--transformer-impl transformer_engine runs Transformer Engine's CUDA kernels and there "
        "is no CUDA device here: --transformer-impl local")
    assert refusal("--attention-backend fused").startswith(
        "--attention-backend fused (or --use-flash-attn) runs Transformer Engine's CUDA kernels")
    machine(monkeypatch, cuda=True, have={"transformer_engine"})
    check("--transformer-impl transformer_engine --use-flash-attn")  # what a GPU cluster runs
    assert installed.uses_transformer_engine("transformer_engine")
    assert installed.uses_transformer_engine("auto")
    assert not installed.uses_transformer_engine("local")


def test_auto_on_cuda_without_transformer_engine_warns_once_on_rank_zero(monkeypatch, capsys):
    machine(monkeypatch, cuda=True, have=set())
    monkeypatch.setenv("RANK", "0")
    check("")
    check("--transformer-impl local")  # asked for the local layers: nothing to say
    monkeypatch.setenv("RANK", "3")
    check("")
    assert capsys.readouterr().err == (
        "warning: --transformer-impl auto: Transformer Engine is not installed, so this run "
        "uses megatron-core's local layers (correct, slower on GPU); for Transformer Engine's: "
        'pip install -e ".[te]"\n')
    assert not installed.uses_transformer_engine("auto")
    machine(monkeypatch, cuda=False, have=set())  # a CPU run never uses it: no warning
    monkeypatch.setenv("RANK", "0")
    check("")
    assert capsys.readouterr().err == ""


def test_logging_packages_are_refused_with_their_extra(monkeypatch):
    machine(monkeypatch, cuda=False, have={"tensorboard"})
    assert refusal("--wandb-project p") == (
        '--wandb-project needs the wandb package, which is not installed: pip install -e '
        '".[wandb]" (or pip install wandb)')
    check("--tensorboard-dir tb")
    machine(monkeypatch, cuda=False, have={"wandb"})
    assert refusal("--tensorboard-dir tb") == (
        '--tensorboard-dir needs the tensorboard package, which is not installed: pip install '
        '-e ".[logging]" (or pip install tensorboard)')
    check("--wandb-project p")


def test_an_untested_megatron_core_is_refused_or_said_loudly(monkeypatch, capsys):
    import megatron.sdp4bit.integration as integration

    machine(monkeypatch, cuda=False, have=set())
    monkeypatch.setenv("RANK", "0")
    moved = ("SDP4Bit was tested with megatron-core 0.16.1 and 0.19.2 but megatron-core 0.17.0 "
             "is installed, and X.y is missing: install megatron-core==0.19.2 (Python >= 3.12) "
             "or megatron-core==0.16.1 (Python < 3.12), or pass --allow-untested-megatron-core "
             "to try this one")
    asked, walked = [], []

    def version_check(*, scopes, allow_untested_version=False, how_to_allow=""):
        asked.append((allow_untested_version, how_to_allow))
        walked.append(tuple(scopes))
        if not allow_untested_version:
            raise RuntimeError(moved)
        return "0.17.0"

    monkeypatch.setattr(integration, "check_megatron_core_version", version_check)
    check("")  # no quantization: megatron-core's own collectives, nothing of it replaced
    assert asked == []
    assert refusal("", quantized=True) == moved
    assert asked == [(False, "pass --allow-untested-megatron-core")]
    # the scopes the trainer applies: on this CUDA-less machine CPU mode's too
    assert walked == [("seam", "padding", "checkpoint", "cpu_mode")]
    check("--allow-untested-megatron-core", quantized=True)
    assert asked[-1] == (True, "pass --allow-untested-megatron-core")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: !!!")
    assert "megatron-core 0.17.0 is NOT a tested release (SDP4Bit was tested with 0.16.1 " \
           "and 0.19.2)" in err
    machine(monkeypatch, cuda=True, have=set())
    check("--allow-untested-megatron-core --transformer-impl local", quantized=True)
    assert walked[-1] == ("seam", "padding", "checkpoint")  # with CUDA, no CPU mode
    machine(monkeypatch, cuda=False, have=set())
    capsys.readouterr()
    # An untested release whose replaced attributes are unchanged passes the check (the
    # integration says so itself): no banner without the flag.
    monkeypatch.setattr(integration, "check_megatron_core_version",
                        lambda scopes, allow_untested_version=False, how_to_allow="": "0.17.0")
    check("", quantized=True)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(integration, "check_megatron_core_version",
                        lambda scopes, allow_untested_version=False, how_to_allow="": "0.19.2")
    check("--allow-untested-megatron-core", quantized=True)  # a tested release: nothing said
    assert capsys.readouterr().err == ""


def test_the_flag_reaches_the_integrations_version_check(monkeypatch):
    """pretrain_gpt.py passes --allow-untested-megatron-core to install_sdp4bit, whose own
    version check would otherwise stop the run after the model was built."""
    import types

    from megatron.sdp4bit.comm import CommStats
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.integration import install, lifecycle
    from megatron.sdp4bit.integration.topologies import ModelTopologies
    from megatron.sdp4bit.training import sdp4bit_setup
    from megatron.sdp4bit.training.loop import TrainState

    given = []

    def install_sdp4bit(model, optimizer, config, *, allow_untested_version=False):
        given.append(allow_untested_version)
        return types.SimpleNamespace(stats=CommStats(), topologies=ModelTopologies(dense=None))

    monkeypatch.setattr(install, "install_sdp4bit", install_sdp4bit)
    monkeypatch.setattr(lifecycle, "_rank", lambda: 1)  # the start-up lines are rank 0's
    state = TrainState(model=[], optimizer=None, scheduler=None, datasets=[], vocab_size=0)
    config = SDP4BitConfig(quantized_gradients=True)
    sdp4bit_setup.install(config, state, allow_untested_version=True)
    sdp4bit_setup.install(config, state)
    assert given == [True, False]


def test_sequence_parallel_runs_without_transformer_engine_or_apex(monkeypatch):
    """The local spec's norms support sequence parallelism (training/layer_spec.py)."""
    machine(monkeypatch, cuda=False, have=set())
    check("--tensor-model-parallel-size 2 --sequence-parallel")
    check("--tensor-model-parallel-size 2 --sequence-parallel --transformer-impl local")


def test_context_parallel_is_refused_naming_why(monkeypatch):
    """Context parallelism needs Transformer Engine's attention; where that runs, the
    trainer still does not split its batches over the context-parallel ranks."""
    cp2 = "--context-parallel-size 2"
    machine(monkeypatch, cuda=False, have={"transformer_engine"})
    assert refusal(cp2) == (
        "--context-parallel-size=2 needs Transformer Engine's attention, and there is no CUDA "
        "device here: drop --context-parallel-size (accepted: 1)")
    machine(monkeypatch, cuda=True, have=set())
    assert refusal(cp2) == (
        "--context-parallel-size=2 needs Transformer Engine's attention, and Transformer "
        f"Engine is not installed ({installed.TE_INSTALL}): drop --context-parallel-size "
        "(accepted: 1)")
    machine(monkeypatch, cuda=True, have={"transformer_engine"})
    assert refusal(cp2 + " --transformer-impl local").startswith(
        "--context-parallel-size=2 needs Transformer Engine's attention, and --transformer-impl "
        "local does not use it")
    assert refusal(cp2).startswith(
        "--context-parallel-size=2 is not supported by this trainer yet: it does not split its "
        "batches over context-parallel ranks")
    check("--context-parallel-size 1")


def test_distributed_backend_follows_the_devices(monkeypatch):
    """NCCL with CUDA and gloo without by default; nccl needs one CUDA device per local rank;
    gloo on CUDA lets more local ranks than devices share them, local rank r on cuda:(r mod
    devices) (training/cli/devices.py)."""
    machine(monkeypatch, cuda=False, have=set())
    assert check("").distributed_backend == "gloo"
    assert check("--distributed-backend gloo").distributed_backend == "gloo"
    assert refusal("--distributed-backend nccl") == (
        "--distributed-backend nccl needs CUDA devices and there is none here: drop the flag "
        "(without CUDA the ranks use gloo)")
    machine(monkeypatch, cuda=True, have=set(), devices=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert check("").distributed_backend == "nccl"  # one device per rank: as Megatron-LM
    assert check("--distributed-backend gloo").distributed_backend == "gloo"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert devices.local_device(8) == 3 and devices.sharing_note(8) is None
    machine(monkeypatch, cuda=True, have=set(), devices=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    expected = ("4 ranks on this node and 1 CUDA device(s): NCCL cannot put two ranks on one "
                "device (ncclInvalidUsage): start at most one rank per device (torchrun "
                "--nproc-per-node 1), or pass --distributed-backend gloo to let ranks share the "
                "devices (collectives through host memory: for tests, not speed)")
    assert refusal("") == expected and refusal("--distributed-backend nccl") == expected
    assert check("--distributed-backend gloo").distributed_backend == "gloo"
    for rank, on_one, on_two in ((0, 0, 0), (1, 0, 1), (2, 0, 0), (3, 0, 1)):
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert (devices.local_device(1), devices.local_device(2)) == (on_one, on_two)
    assert devices.sharing_note(1) == (
        "4 ranks share 1 CUDA device(s) (--distributed-backend gloo): local rank r runs on "
        "cuda:(r mod 1), every collective goes through gloo")
    assert devices.sharing_note(4) is None
