"""SDP4Bit inside Megatron-LM's own trainer (integration/megatron_lm.py, ``python -m
megatron.sdp4bit.megatron_lm``): a GPT script in Megatron-LM's shape
(tests/helpers/megatron_lm_gpt.py) runs unchanged under megatron-core 0.19.2's
``megatron.training.pretrain`` with the SDP4Bit flags added to its command line.

Megatron-LM's trainer assumes CUDA (it asserts ``torch.cuda.is_available()``, asks for
NCCL, allocates on the device), so it runs under the CUDA dry run (``dev/cuda_dryrun.py -m``):
its CUDA branch on the CPU, every collective checked against NCCL's rules. 4 ranks as
2 "nodes" x 2: both hops of the gradient reduce-scatter and the qWD all-gather, with
Megatron-LM's overlapped collectives; two launch pairs save and resume bit for bit, from a
save on an iteration without evaluation (the dense GPT, resumed with an evaluation at every
iteration) and on one with (the MoE GPT with the alltoall dispatcher): with
``--overlap-param-gather`` Megatron-LM forces the parameter all-gather before every
evaluation and every save. A mixture-of-experts GPT with expert parallelism 2, with each
token dispatcher, in launches of its own (the allgather one: one launch that evaluates at
every iteration).

Marked ``megatron_lm``: deselected (tests/conftest.py) where the installed megatron-core has
no ``megatron.training`` (0.16.1, the first test pass).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers.megatron_lm_launch import MEGATRON_LM_FLAGS
from tests.helpers.megatron_lm_launch import launch as _launch

pytestmark = pytest.mark.megatron_lm

# Megatron-LM's overlapped collectives, several buckets per buffer; error feedback on the
# inter-node hop, whose state the resume below must bring back from Megatron-LM's checkpoint.
SDP4BIT_FLAGS = ("--quantized-weights --quantized-gradients --dp-ranks-per-node 2 "
                 "--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 20000 "
                 "--gradient-error-feedback").split()
# A Mixtral-style MoE: 4 experts, top-2, expert parallelism 2 (expert data-parallel groups
# of 2 ranks, one per "node": the expert buckets take the inter-node hop alone).
MOE_FLAGS = ("--quantized-weights --quantized-gradients --dp-ranks-per-node 2 "
             "--overlap-grad-reduce --overlap-param-gather --num-experts 4 --moe-router-topk 2 "
             "--expert-model-parallel-size 2 --train-iters 3 --save-interval 2").split()
# The byte fields Megatron-LM's log line gets, the names of our trainer's TensorBoard too.
BYTES = tuple(f"sdp4bit/{kind}-{hop}bytes{unquantized}" for kind in ("params", "grads")
              for hop in ("", "intra-", "inter-") for unquantized in ("", "-unquantized"))

# Bytes sent per element over what megatron-core's unquantized collectives send (the
# buckets are padded to whole groups, so these are exact; comm/stats.py's accounting).
# qWD: 4-bit values + one fp32 scale per 2048, against bf16.
PARAMS_RATIO = (0.5 + 4 / 2048) / 2
# TLq on 2 x 2: per shard of S elements a rank sends (N-1)*M = 2 S on the 8-bit intra hop
# (group 512) and (M-1) = 1 S on the 4-bit inter hop (group 128), against fp32 gradients
# (twice that against bf16 ones, --grad-reduce-in-bf16).
GRADS_RATIO = (2 * (1 + 4 / 512) + (0.5 + 4 / 128)) / (3 * 4)
# The expert buckets on their group of 1 x 2: the 4-bit inter hop alone, per fp32 element.
EXPERT_GRADS_RATIO = (0.5 + 4 / 128) / 4
GRAD_BYTES = {"fp32": 4, "bf16": 2}  # per element of the gradient buffers


def _iterations(out: str) -> dict[int, dict[str, float]]:
    """Megatron-LM's log line, per iteration: every ``name: value`` field."""
    found = {}
    for line in out.splitlines():
        match = re.search(r"\] iteration\s+(\d+)/\s*\d+ \|(.*)", line)
        if match:
            fields = re.findall(r" ([^|:]+): ([-0-9.E+]+) \|", match.group(2))
            found[int(match.group(1))] = {k: float(v) for k, v in fields
                                          if not k.startswith("elapsed")}
    return found


def _end_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.startswith("SDP4Bit on this rank:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


@pytest.mark.slow  # two 4-rank launches of Megatron-LM's trainer, ~1 min
@pytest.mark.dryrun
@pytest.mark.distributed
def test_megatron_lm_trainer_trains_saves_and_resumes_with_sdp4bit(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    tensorboard = tmp_path / "tb"
    first = _launch([*SDP4BIT_FLAGS, "--save", ckpt, "--save-interval", "2",
                     "--tensorboard-dir", str(tensorboard), "--log-memory-to-tensorboard"])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    out = first.stdout
    assert ("SDP4Bit installed on 5 bucket(s): weights qWD 4-bit, group 2048 | gradients TLq "
            "intra 8-bit group 512, inter 4-bit group 128") in out
    assert ("| bytes counted against megatron-core's bf16 parameter all-gather and fp32 "
            "gradient reduction\n") in out, out[-3000:]
    assert re.search(r"SDP4Bit error feedback on the inter-node hop: [0-9.]+ MiB of error "
                     r"state on this rank \(int8, 1/N of the gradient buckets\)", out), \
        out[-3000:]
    logged = _iterations(out)
    assert sorted(logged) == [1, 2, 3, 4]
    assert logged[4]["lm loss"] < logged[1]["lm loss"] - 0.3, logged  # 4.85 -> 4.25
    # Every iteration's gradients quantized at the format's ratio; the weights too, from the
    # second iteration on (overlapped: an update's all-gather runs in the next forward pass).
    assert logged[1]["sdp4bit/params-bytes-unquantized"] == 0
    for it, fields in logged.items():
        assert set(BYTES) <= set(fields), fields
        assert fields["sdp4bit/grads-bytes"] / fields["sdp4bit/grads-bytes-unquantized"] \
            == pytest.approx(GRADS_RATIO, rel=1e-5), (it, fields)
        for kind in ("params", "grads"):  # the totals a dashboard sums: the two hops
            for end in ("", "-unquantized"):
                assert fields[f"sdp4bit/{kind}-bytes{end}"] == pytest.approx(
                    fields[f"sdp4bit/{kind}-intra-bytes{end}"]
                    + fields[f"sdp4bit/{kind}-inter-bytes{end}"], rel=1e-6), (it, kind, fields)
        if it > 1:
            assert fields["sdp4bit/params-bytes"] / fields["sdp4bit/params-bytes-unquantized"] \
                == pytest.approx(PARAMS_RATIO, rel=1e-5), (it, fields)
    end = _end_line(out)
    # 5 buckets x 4 iterations: one all-gather per step (the save after iteration 4 forces the
    # last; the end of training forces one more, with no step since: it sends nothing).
    assert end.startswith("SDP4Bit on this rank: 20 quantized gradient reduce-scatters, 20 "
                          "quantized parameter all-gathers, 0 unquantized"), end
    assert (f"bytes sent / unquantized: params {PARAMS_RATIO:.4f} against bf16 parameter "
            f"all-gather, grads {GRADS_RATIO:.4f} against fp32 gradient reduction;") in end, end
    assert "model replicas on the 4 data-parallel ranks: bitwise identical" in end
    for it in (2, 4):
        assert f"successfully saved checkpoint from iteration {it:7d} to {ckpt}" in out
    assert re.search(r"cuda dry run: done, \d+ collectives on rank 0 passed", out)
    _check_tensorboard(tensorboard, sorted(logged))
    uninterrupted = re.search(r"checksum ([0-9a-f]{16})", end).group(1)

    # Resume from iteration 2 (Megatron-LM's tracker file names the checkpoint to load).
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    # It evaluates every iteration (the first run never did): with --overlap-param-gather
    # Megatron-LM forces the pending all-gather before each evaluation, and training must not
    # change (integration/param_sync.py, [Note: a parameter sync sends each step once]). It
    # does not save: the first run saved twice, and each run that saves starts a writer
    # process per rank (megatron-core's spawn Manager, which imports the script: about 4 s of
    # CPU each), which the checksum below does not need.
    second = _launch([*SDP4BIT_FLAGS, "--load", ckpt, "--eval-interval", "1",
                      "--eval-iters", "1"])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    out2 = second.stdout
    assert f"loading distributed checkpoint from {ckpt} at iteration 2" in out2
    assert "starts from zero error" not in out2  # the error state came back
    resumed = _iterations(out2)
    assert sorted(resumed) == [3, 4]
    assert {"3", "4"} <= set(re.findall(r"validation loss at iteration (\d+)", out2)), out2[-3000:]
    # The first iteration after the load logs the uninterrupted run's loss, grad norm and
    # learning rate (its bytes differ: the uninterrupted run's line also counts the all-gather
    # its save forced). Later lines differ: Megatron-LM's log line keeps the first iteration
    # of a run in its running sums (training_log's ``is_first_iteration``), so the resumed
    # run's iteration 4 shows the mean of iterations 3 and 4.
    assert {k: v for k, v in resumed[3].items() if k not in BYTES} == \
        {k: v for k, v in logged[3].items() if k not in BYTES}, (resumed[3], logged[3])
    end2 = _end_line(out2)
    assert "model replicas on the 4 data-parallel ranks: bitwise identical" in end2
    # Bit for bit: the replica checksum after iteration 4 is the uninterrupted run's (constant
    # learning rate: iteration 4 updates the weights). Iteration 3's gradients carry the error
    # fed back from iteration 2: a resume that started it from zero would differ here.
    assert f"checksum {uninterrupted}" in end2, (end, end2)


def _check_tensorboard(folder, iterations: list[int]) -> None:
    """Megatron-LM's TensorBoard scalars (the last rank's writer): SDP4Bit's bytes under the
    log line's names, each iteration's own (the log line averages), at the formats' ratios;
    and --log-memory-to-tensorboard's four memory scalars, which read
    ``torch.cuda.memory_stats()`` (the dry run has no device memory: 0)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    memory = ("mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
              "mem-allocated-count")
    assert set(memory) | set(BYTES) <= tags, tags
    for tag in memory:
        assert [(e.step, e.value) for e in events.Scalars(tag)] == [
            (it, 0.0) for it in iterations], tag
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in BYTES}
    for it in iterations:
        assert scalars["sdp4bit/grads-bytes"][it] / scalars["sdp4bit/grads-bytes-unquantized"][
            it] == pytest.approx(GRADS_RATIO, rel=1e-5), it
        sent, unquantized = (scalars[f"sdp4bit/params-bytes{end}"][it]
                             for end in ("", "-unquantized"))
        # overlapped: the first update's all-gather runs in the second forward pass
        assert (sent, unquantized) == (0, 0) if it == 1 else \
            sent / unquantized == pytest.approx(PARAMS_RATIO, rel=1e-5), it


@pytest.mark.slow  # three 4-rank launches of Megatron-LM's trainer, ~40 s
@pytest.mark.dryrun
@pytest.mark.distributed
@pytest.mark.parametrize("dispatcher, flags, resumed, grads", [
    # saved on an iteration with an evaluation (at 2), resumed without evaluations
    ("alltoall", ["--eval-interval", "2", "--eval-iters", "1"], True, "fp32"),
    # gradients reduced in bf16 (the bytes against megatron-core's bf16 reduction), evaluated
    # at every iteration. Not saved: a resume that evaluates runs in the dense test above, and
    # neither the dispatcher nor the gradients' type is checkpoint state, while a save starts
    # a writer process per rank (4 s of CPU each)
    ("allgather", ["--grad-reduce-in-bf16", "--eval-interval", "1", "--eval-iters", "1"],
     False, "bf16"),
], ids=["alltoall", "allgather-bf16-grads"])
def test_a_moe_run_with_expert_parallelism_trains_saves_and_resumes(
        dispatcher, flags, resumed, grads, tmp_path):
    """A mixture-of-experts GPT with expert parallelism 2 (Megatron-LM's own MoE flags), each
    token dispatcher: the expert buckets' traffic is quantized (on the log line, at the
    formats' ratios per hop: one rank per node in the expert group of 2, the inter-node hop
    alone), the expert weights, which differ across the expert-parallel ranks by design, are
    compared on the expert data-parallel group and the end line finds the replicas
    identical, also when every iteration evaluates (allgather: Megatron-LM forces the
    parameter all-gather before each evaluation); a resume from the save at iteration 2, an
    evaluation iteration, repeats the uninterrupted run bit for bit (alltoall)."""
    ckpt = str(tmp_path / "ckpt")
    moe = [*MOE_FLAGS, "--moe-token-dispatcher-type", dispatcher]
    first = _launch([*moe, *flags, *(["--save", ckpt] if resumed else [])])
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    out = first.stdout
    assert ("SDP4Bit installed on 2 bucket(s): weights qWD 4-bit, group 2048 | gradients TLq "
            "intra 8-bit group 512, inter 4-bit group 128, pipeline 1, from iteration 0 | "
            "stochastic rounding, auto kernels | 1 of them expert bucket(s), on the expert "
            "data-parallel group of 2 | bytes counted against megatron-core's bf16 parameter "
            f"all-gather and {grads} gradient reduction\n") in out, out[-3000:]
    logged = _iterations(out)
    assert sorted(logged) == [1, 2, 3]
    assert logged[3]["lm loss"] < logged[1]["lm loss"] - 0.3, logged  # 4.88 -> 4.43
    scale = 4 / GRAD_BYTES[grads]  # ratios against a 2-byte gradient are twice fp32's
    for it, fields in logged.items():
        expert = {hop: fields[f"sdp4bit/expert-grads-{hop}-bytes"] for hop in ("intra", "inter")}
        assert expert["intra"] == fields["sdp4bit/expert-grads-intra-bytes-unquantized"] == 0
        assert expert["inter"] / fields["sdp4bit/expert-grads-inter-bytes-unquantized"] == \
            pytest.approx(EXPERT_GRADS_RATIO * scale, rel=1e-5), (it, fields)
        assert 0 < expert["inter"] < fields["sdp4bit/grads-inter-bytes"], (it, fields)
        # the rest, the dense buckets, on the 2 x 2 data-parallel group
        dense = fields["sdp4bit/grads-bytes"] - expert["inter"]
        dense_unquantized = (fields["sdp4bit/grads-bytes-unquantized"]
                             - fields["sdp4bit/expert-grads-inter-bytes-unquantized"])
        assert dense / dense_unquantized == pytest.approx(GRADS_RATIO * scale, rel=1e-5), fields
        if it > 1:  # the expert weights' qWD all-gather, from the second forward pass on
            assert fields["sdp4bit/expert-params-inter-bytes"] / fields[
                "sdp4bit/expert-params-inter-bytes-unquantized"] == pytest.approx(
                    PARAMS_RATIO, rel=1e-5), (it, fields)
    end = _end_line(out)
    # 2 buckets (a dense one, an expert one) x 3 iterations: one all-gather per step, also
    # where an evaluation forced it
    assert end.startswith("SDP4Bit on this rank: 6 quantized gradient reduce-scatters, 6 "
                          "quantized parameter all-gathers, 0 unquantized"), end
    assert re.search(rf"params {PARAMS_RATIO:.4f} against bf16 parameter all-gather, grads "
                     rf"0\.\d{{4}} against {grads} gradient reduction; model replicas on the 4 "
                     r"data-parallel ranks: bitwise identical, checksum", end), end
    evaluated = re.findall(r"validation loss at iteration (\d+) \|", out)
    assert evaluated == (["2"] if resumed else ["1", "2", "3"]), evaluated
    if not resumed:
        return
    assert f"successfully saved checkpoint from iteration       2 to {ckpt}" in out
    uninterrupted = re.search(r"checksum ([0-9a-f]{16})", end).group(1)

    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    second = _launch([*moe, "--load", ckpt])
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    out2 = second.stdout
    assert f"loading distributed checkpoint from {ckpt} at iteration 2" in out2
    resumed_lines = _iterations(out2)
    assert sorted(resumed_lines) == [3]
    assert {k: v for k, v in resumed_lines[3].items() if not k.startswith("sdp4bit/")} == \
        {k: v for k, v in logged[3].items() if not k.startswith("sdp4bit/")}, \
        (resumed_lines, logged)
    end2 = _end_line(out2)
    assert "model replicas on the 4 data-parallel ranks: bitwise identical" in end2
    assert f"checksum {uninterrupted}" in end2, (end, end2)


def test_every_interpreter_of_the_environment_has_the_python_312_bridge():
    """megatron.training imports ``typing.override`` (Python >= 3.12). Where megatron-core's
    wheel asks for a newer Python than the environment's (0.19.2 on the test environment's
    3.11), every interpreter gets it at start-up, from the ``.pth`` file tools/setup_env.sh
    writes, through the replacement table's entry, without importing torch or megatron-core
    (integration/megatron_lm_bridges.py); a process Megatron-LM spawns is such an
    interpreter. On Python >= 3.12 no file is written."""
    import sysconfig

    pth = os.path.join(sysconfig.get_paths()["purelib"], "sdp4bit_python312_bridge.pth")
    code = ("import sys, typing; print(sorted(m for m in ('torch', 'megatron.core') "
            "if m in sys.modules)); from megatron.sdp4bit.integration.megatron_lm_bridges "
            "import PYTHON_312; print(getattr(typing, 'override', None) is "
            "PYTHON_312.replacement)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd="/")
    assert res.returncode == 0, res.stderr
    bridged = sys.version_info < (3, 12)
    assert res.stdout.split() == ["[]", str(bridged)], res.stdout
    assert os.path.exists(pth) == bridged


@pytest.mark.parametrize("change, line", [
    (["--quantized-weights"], "--quantized-weights requires --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--quantized-gradients", "--gq-group-size-intra", "96"],
     "--gq-group-size-intra=96 and --gq-group-size-inter=128 must divide one another "
     "(e.g. 128 and 128, or 512 and 128)"),
    (["--use-distributed-optimizer", "--quantized-gradients", "--gradient-error-feedback",
      "--save", "/tmp/unused", "--ckpt-format", "torch"],
     "--gradient-error-feedback with --save needs --ckpt-format torch_dist in Megatron-LM's "
     "trainer (got torch): the other formats' checkpoints do not hold the error state, so a "
     "resume would not be bit-exact"),
    (["--use-distributed-optimizer", "--quantized-gradients", "--gradient-error-feedback",
      "--save", "/tmp/unused", "--non-persistent-ckpt-type", "local"],
     "--gradient-error-feedback cannot be combined with --non-persistent-ckpt-type local: "
     "local checkpoints do not hold the error state; use global"),
    (["--use-distributed-optimizer", "--quantized-gradients",
      "--gradient-quantization-bits-intra", "2"],
     "--gradient-quantization-bits-intra=2 is not supported: use one of (4, 8)"),
    (["--use-distributed-optimizer", "--quantized-gradients",
      "--ddp-reduce-scatter-with-fp32-accumulation"],
     "--ddp-reduce-scatter-with-fp32-accumulation replaces the reduce-scatter that SDP4Bit "
     "replaces (whose quantized gradients are already summed in fp32): drop it"),
], ids=["no-distributed-optimizer", "group-sizes", "error-feedback-torch-format",
    "error-feedback-local", "two-bit-intra", "fp32-accumulation"])
def test_bad_flags_and_layouts_are_refused_in_one_line_before_anything_runs(
        change, line, monkeypatch, capsys):
    """Megatron-LM parses and validates before it starts torch.distributed: in this process,
    its parser with the plug-in on, as the launcher leaves it."""
    from megatron.sdp4bit.integration import megatron_lm

    flags = [f for f in MEGATRON_LM_FLAGS if f != "--use-distributed-optimizer"]
    monkeypatch.setattr(sys, "argv", ["megatron_lm_gpt.py", *flags, *change])
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    megatron_lm.enable()
    try:
        from megatron.training.arguments import parse_and_validate_args

        with pytest.raises(SystemExit) as stop:
            parse_and_validate_args()
    finally:
        megatron_lm.disable()
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"megatron_lm_gpt.py: error: {line}"]
    assert "arguments" not in out  # before Megatron-LM's dump of its arguments


def test_an_untested_release_with_a_moved_target_is_refused_in_one_line(monkeypatch, capsys):
    """The plug-in's targets are checked as every entry of the table is: on a release no
    entry was checked on, a moved one is refused before anything is replaced."""
    from megatron.sdp4bit import megatron_lm as launcher
    from megatron.sdp4bit.integration import megatron_lm, patches, version

    with patches.applied([megatron_lm.PYTHON_312]):
        from megatron.training import training

        monkeypatch.setattr(training, "train_step", lambda forward_step_func, step=None: None)
    monkeypatch.setattr(version, "megatron_core_version", lambda: "0.20.0")
    with pytest.raises(SystemExit) as stop:
        launcher.main(["tests/helpers/megatron_lm_gpt.py"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "megatron_lm: error: SDP4Bit was tested with megatron-core 0.16.1 and 0.19.2 but "
        "megatron-core 0.20.0 is installed, and megatron.training.training.train_step changed: "
        "its signature is (forward_step_func, step), checked as (forward_step_func, "
        "data_iterator, model, optimizer, opt_param_scheduler, config, "
        "forward_backward_func, iteration, pg_collection, p2p_communicator) on megatron-core "
        "0.19.2: install megatron-core==0.19.2 (Python >= 3.12) or megatron-core==0.16.1 "
        "(Python < 3.12), or pass allow_untested_version=True to try this one (then run "
        "tests/distributed/test_integration_sdp4bit.py against it first)"]
    assert not megatron_lm.enabled()
    assert training.train_step.__name__ == "<lambda>"  # nothing was replaced
