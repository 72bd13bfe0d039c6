"""examples/own_loop.py, the public API in a loop of one's own: it runs on 4 gloo ranks as
2 nodes x 2 GPUs with quantized bytes on both hops and logs the true loss under gradient
accumulation; the same loop that never reduces its gradients, or skips
``handle.set_iteration`` in an iteration, is stopped with one line instead of training silently.

The logged loss at iteration 1 (2 micro-batches, the default) is checked against its value
derived from the initialization: the final layer norm gives hidden states of unit variance
and the tied output embedding has std 0.02 over hidden 64, so the logits are about normal with
sigma = 0.02 * sqrt(64) = 0.16, and the cross entropy of such logits over V = 512 tokens is
ln(V) + sigma^2 / 2 = 6.251 (measured: 6.246 to 6.248 for 1, 2 and 4 micro-batches). The
loss megatron-core leaves in the loss tensor after dividing it in place by the number of
micro-batches would be half that.

Bytes per iteration (``handle.step_stats()``), against the unquantized figures it prints
beside them: the weight all-gather sends 4 bits + one fp32 scale per 2048 (16 / 4.0156 =
3.98x fewer bytes than bf16), the gradient hops 8 bits + a scale per 512 inside a node
(32 / 8.0625 = 3.97x) and 4 bits + a scale per 128 across (32 / 4.25 = 7.53x); bucket
padding can only lower these ratios a little.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tests.helpers import launch as _launch
from tests.helpers.trainer import ROOT, trainer_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLE = Path(ROOT) / "examples" / "own_loop.py"
HOOK = "config.finalize_model_grads_func = finalize_model_grads\n"
SET_ITERATION = "    handle.set_iteration(iteration)  # SDP4Bit:"
INITIAL_LOSS = math.log(512) + (0.02 * math.sqrt(64)) ** 2 / 2  # see the module docstring
LINE = re.compile(r"iteration (\d+) \| loss ([\d.]+) \| .* weights to the node (\d+) \((\d+)\), "
                  r"to other nodes (\d+) \((\d+)\), gradients intra (\d+) \((\d+)\), inter "
                  r"(\d+) \((\d+)\)")


def _run(script: Path, iterations: int):
    return _launch.torchrun(str(script), ["--dp-ranks-per-node", "2", "--iterations",
                                          str(iterations)],
                            nproc=4, env=trainer_env(), cwd=ROOT, timeout=300)


def _variant(tmp_path: Path, hook: str, line: str = HOOK) -> Path:
    """The example with its ``line`` (the finalize hook's) replaced by ``hook``."""
    text = EXAMPLE.read_text(encoding="utf-8")
    assert text.count(line) == 1
    script = tmp_path / "own_loop.py"
    script.write_text(text.replace(line, hook), encoding="utf-8")
    return script


def test_the_example_loop_quantizes_both_hops():
    res = _run(EXAMPLE, 3)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rows = [tuple(map(float, m.groups())) for m in map(LINE.search, res.stdout.splitlines())
            if m]
    assert [int(r[0]) for r in rows] == [1, 2, 3], res.stdout[-2000:]
    assert abs(rows[0][1] - INITIAL_LOSS) < 0.05, rows[0]  # 2 micro-batches: the whole loss
    for _, loss, p_in, p_in_b, p_out, p_out_b, g_in, g_in_b, g_out, g_out_b in rows:
        assert 5.0 < loss < 7.0  # about ln(512) = 6.24 at the start
        # 2 x 2: one node peer, two ranks on the other node; the unquantized two-level
        # schedule sends twice as much inside the node as across
        assert p_out == 2 * p_in and p_out_b == 2 * p_in_b and g_in_b == 2 * g_out_b
        assert 3.7 < p_in_b / p_in <= 16 / (4 + 32 / 2048) + 1e-9
        assert 3.7 < g_in_b / g_in <= 32 / (8 + 32 / 512) + 1e-9
        assert 6.8 < g_out_b / g_out <= 32 / (4 + 32 / 128) + 1e-9
    # CPU mode is quiet through the API: megatron-core's RNG-tracker warning is dropped
    assert "CPU RNG state changed" not in res.stdout + res.stderr


@pytest.mark.release_independent  # SDP4Bit's own check of the model's config
def test_a_loop_without_the_finalize_hook_is_refused_at_install(tmp_path):
    res = _run(_variant(tmp_path, ""), 1)
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if "finalize_model_grads_func" in line]
    assert said and all(line.endswith(
        "ValueError: the model's TransformerConfig has no finalize_model_grads_func, so "
        "megatron-core's schedule never reduces the gradients across data-parallel ranks "
        "(quantized or not): set config.finalize_model_grads_func = "
        "megatron.core.distributed.finalize_model_grads before install_sdp4bit")
        for line in said), res.stderr[-3000:]
    assert "iteration 1 |" not in res.stdout


def test_a_hook_that_does_not_reduce_stops_the_first_step(tmp_path):
    """The hook set to something that reduces nothing: install accepts it, and the first
    optimizer step, finding no gradient reduce-scatter, raises on every rank."""
    res = _run(_variant(tmp_path, "config.finalize_model_grads_func = lambda *a, **k: None\n"),
               1)
    assert res.returncode != 0
    said = [line for line in res.stderr.splitlines() if "found no gradient reduce-scatter" in line]
    assert said and all(line.endswith(
        "RuntimeError: SDP4Bit: an optimizer step at iteration 1 found no gradient "
        "reduce-scatter since the previous step: its gradients were never reduced across "
        "data-parallel ranks. megatron-core's schedule reduces them through "
        "config.finalize_model_grads_func (set it to "
        "megatron.core.distributed.finalize_model_grads); a loop without the schedule calls "
        "ddp.finish_grad_sync() before optimizer.step()") for line in said), res.stderr[-3000:]
    assert "iteration 1 |" not in res.stdout


def test_an_iteration_without_set_iteration_is_refused_at_its_first_collective(tmp_path):
    """set_iteration in iteration 1 only: iteration 1 trains, iteration 2's gradient
    reduce-scatter (its first collective) raises on every rank."""
    script = _variant(tmp_path, "    if iteration == 1:\n        handle.set_iteration(iteration)"
                      "  # SDP4Bit:", line=SET_ITERATION)
    res = _run(script, 2)
    assert res.returncode != 0
    assert "iteration 1 |" in res.stdout and "iteration 2 |" not in res.stdout, res.stdout[-2000:]
    said = [line for line in res.stderr.splitlines() if "set_iteration" in line]
    assert said and all(line.endswith(
        "RuntimeError: SDP4Bit: a gradient reduce-scatter came after iteration 1's optimizer "
        "step without a new handle.set_iteration(...): call handle.set_iteration(iteration) at "
        "the start of every iteration (it seeds the rounding noise, which would otherwise "
        "repeat the last iteration's, and starts handle.step_stats())") for line in said), \
        res.stderr[-3000:]
