"""An iteration is opened by ``handle.set_iteration`` and closed by the optimizer step; a
gradient reduce-scatter or a step in an iteration that was never opened raises one line
(integration/install.py, [Note: an iteration without set_iteration]). The wiring into
megatron-core's calls is run by tests/e2e/test_own_loop_example.py."""

from __future__ import annotations

import pytest

from megatron.sdp4bit.comm import GradientQuantConfig, WeightQuantConfig
from megatron.sdp4bit.config import SDP4BitConfig
from megatron.sdp4bit.integration.install import _step_check
from megatron.sdp4bit.integration.state import RunState

FIX = ("call handle.set_iteration(iteration) at the start of every iteration (it seeds the "
       "rounding noise, which would otherwise repeat the last iteration's, and starts "
       "handle.step_stats())")


def _state() -> RunState:
    config = SDP4BitConfig(quantized_weights=True, quantized_gradients=True)
    return RunState(config=config, grad_config=GradientQuantConfig.from_sdp4bit(config),
                    weight_config=WeightQuantConfig.from_sdp4bit(config))


def _open(state: RunState, iteration: int) -> None:  # what handle.set_iteration does
    state.iteration = iteration
    state.iteration_open = state.iteration_ever_set = True


@pytest.mark.parametrize("gradients", [True, False], ids=["TLq", "qWD-only"])
def test_set_iteration_opens_and_the_step_closes(gradients):
    state = _state()
    step = _step_check(state, gradients=gradients)
    with pytest.raises(RuntimeError) as err:
        state.require_iteration("a gradient reduce-scatter")
    assert str(err.value) == ("SDP4Bit: a gradient reduce-scatter came before the first "
                              f"handle.set_iteration(...): {FIX}")
    for iteration in (1, 2, 3):
        _open(state, iteration)
        state.require_iteration("a gradient reduce-scatter")  # any number per iteration
        state.require_iteration("a gradient reduce-scatter")
        state.grad_syncs_since_step += 1
        step()
    with pytest.raises(RuntimeError) as err:
        step()  # a second step in iteration 3
    assert str(err.value) == ("SDP4Bit: an optimizer step came after iteration 3's optimizer "
                              f"step without a new handle.set_iteration(...): {FIX}")


def test_a_chain_of_optimizers_steps_once_per_iteration():
    """A chained optimizer's step copies once per distributed optimizer: the first copy
    checks, the last closes the iteration."""
    state = _state()
    step = _step_check(state, gradients=True, optimizers=2)
    for iteration in (1, 2):
        _open(state, iteration)
        state.grad_syncs_since_step += 1
        step()
        assert state.iteration_open  # the second optimizer of the same step still to copy
        step()
        assert not state.iteration_open and state.grad_syncs_since_step == 0
    with pytest.raises(RuntimeError, match="an optimizer step came after iteration 2's"):
        step()
    _open(state, 3)  # an iteration whose gradients were never reduced
    with pytest.raises(RuntimeError, match="found no gradient reduce-scatter"):
        step()
