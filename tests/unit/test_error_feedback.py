"""The error-feedback step between the hops, in one process, on every kernel backend.

``ErrorFeedback.requantize`` takes one slice's N received intra messages and writes the M
inter messages. Checked: with a zero error it writes the bytes of the fused ``tlq_middle``;
the torch references, the CPU kernels and the Triton kernels (interpreted) agree bit for bit
over several calls; and with decay 0 and fp32 storage the calls telescope (what was sent over
T calls is the sum of the inputs minus the last error, [Note: error feedback on the
inter-node hop]).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron.sdp4bit.comm import ErrorFeedback, ErrorFeedbackConfig, GradientQuantConfig
from megatron.sdp4bit.quantization import ops
from megatron.sdp4bit.quantization.backend import triton_available
from megatron.sdp4bit.quantization.format import message_nbytes, split_messages

N, M, SHARD = 2, 2, 128  # one slice: M * SHARD values
CFG = GradientQuantConfig(intra_bits=8, intra_group_size=64, inter_bits=2, inter_group_size=32,
                          kernel_backend="torch")
BACKENDS = ["torch", "cpu"] + (["triton"] if triton_available() else [])


def _recv(seed: int) -> torch.Tensor:
    """N intra messages of M * SHARD values (what the rank received on the intra hop)."""
    x = torch.randn(N * M * SHARD, generator=torch.Generator().manual_seed(seed))
    wire = torch.empty(N * message_nbytes(M * SHARD, 8, 64), dtype=torch.uint8)
    ops.tlq_sender(x, wire, num_dests=N, blocks_per_dest=1, slices=1, bits=8, group_size=64,
                   hadamard_block=0, stochastic=True, seed=seed, backend="torch")
    return wire


def _step(ef: ErrorFeedback, cfg: GradientQuantConfig, seed: int) -> torch.Tensor:
    send = torch.empty(M * message_nbytes(SHARD, cfg.inter_bits, cfg.inter_group_size),
                       dtype=torch.uint8)
    ef.start_call()
    ef.requantize(_recv(seed), send, 0, grad_config=cfg, ranks_per_node=N, nodes=M,
                  seed=seed + 100)
    return send


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_zero_error_gives_the_fused_bytes(backend: str, stochastic: bool) -> None:
    cfg = dataclasses.replace(CFG, kernel_backend=backend, stochastic=stochastic)
    ef = ErrorFeedback(N * M * SHARD, N, M, cfg, ErrorFeedbackConfig())
    fused = torch.empty(M * message_nbytes(SHARD, 2, 32), dtype=torch.uint8)
    ops.tlq_middle(_recv(1), fused, n_in=N, numel=M * SHARD, bits_in=8, group_size_in=64,
                   n_out=M, bits_out=2, group_size_out=32, stochastic=stochastic, seed=101,
                   backend=backend)
    assert torch.equal(_step(ef, cfg, 1), fused)


@pytest.mark.parametrize("storage,decay", [("int8", 0.0), ("fp32", 0.5)])
def test_backends_agree_over_several_calls(storage: str, decay: float) -> None:
    results = []
    for backend in BACKENDS:
        cfg = dataclasses.replace(CFG, kernel_backend=backend)
        ef = ErrorFeedback(N * M * SHARD, N, M, cfg, ErrorFeedbackConfig(decay=decay,
                                                                         storage=storage))
        sends = [_step(ef, cfg, seed) for seed in (1, 2, 3)]
        results.append((sends, ef.state.clone()))
    for sends, state in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(sends, results[0][0]))
        assert torch.equal(state, results[0][1])


def test_calls_telescope_with_decay_zero() -> None:
    ef = ErrorFeedback(N * M * SHARD, N, M, CFG, ErrorFeedbackConfig(storage="fp32"))
    sent_total = torch.zeros(M * SHARD, dtype=torch.float64)
    input_total = torch.zeros(M * SHARD, dtype=torch.float64)
    plain_total = torch.zeros(M * SHARD, dtype=torch.float64)
    for seed in range(1, 11):
        fused = torch.empty(M * message_nbytes(SHARD, 2, 32), dtype=torch.uint8)
        ops.tlq_middle(_recv(seed), fused, n_in=N, numel=M * SHARD, bits_in=8,
                       group_size_in=64, n_out=M, bits_out=2, group_size_out=32,
                       stochastic=True, seed=seed + 100)
        plain = torch.empty(M * SHARD)
        ops.qwd_receiver(fused, plain, world=M, bits=2, group_size=32, accumulate=False)
        plain_total += plain.double()
        send = _step(ef, CFG, seed)
        sent = torch.empty(M * SHARD)
        ops.qwd_receiver(send, sent, world=M, bits=2, group_size=32, accumulate=False)
        total = torch.empty(M * SHARD)
        ops.tlq_receiver(_recv(seed), total, n_in=N, bits=8, group_size=64, hadamard_block=0)
        sent_total += sent.double()
        input_total += total.double()
    residual = input_total - ef.state.double()
    assert torch.allclose(sent_total, residual, rtol=0, atol=1e-5 * input_total.abs().max())
    # Without feedback the ten calls' errors add up (norm ~ sqrt(10) x one call's); with it
    # only the last call's error is left: each element within one step of that call's scale
    # (a stochastic rounding moves a value by less than one step), whatever the calls before.
    scales, _ = split_messages(send, M, SHARD, 2, 32)
    step = scales.reshape(-1).repeat_interleave(32).double()
    error = (sent_total - input_total).abs()
    assert (error <= step * (1 + 1e-6) + 1e-5 * input_total.abs().max()).all()
    assert (plain_total - input_total).norm() > 0  # the plain calls do round


def _handle(numels: dict[int, int], ef_config: ErrorFeedbackConfig = ErrorFeedbackConfig()):
    """An SDP4Bit handle holding only error-feedback states (``numels``: bucket id -> size)."""
    from megatron.sdp4bit.comm import WeightQuantConfig
    from megatron.sdp4bit.config import SDP4BitConfig
    from megatron.sdp4bit.integration.install import SDP4BitHandle
    from megatron.sdp4bit.integration.state import RunState

    config = SDP4BitConfig(quantized_gradients=True, gradient_error_feedback=True,
                           gradient_error_feedback_storage=ef_config.storage)
    state = RunState(config=config, grad_config=CFG,
                     weight_config=WeightQuantConfig.from_sdp4bit(config))
    for bucket_id, numel in numels.items():
        state.error_feedback[bucket_id] = ErrorFeedback(numel, N, M, CFG, ef_config)
    return SDP4BitHandle(state=state, _applied=None, buckets=())


def test_handle_state_round_trips_through_the_restricted_loader(tmp_path) -> None:
    """What a checkpoint holds of the state (SDP4BitHandle.error_feedback_state) is read back
    by ``torch.load(weights_only=True)`` (the checkpoints' restricted loader), restores every
    bucket bit for bit with its call count, and a state that does not fit is not loaded: the
    reason comes back and the error stays as it was."""
    handle = _handle
    numel = N * M * SHARD
    saver = handle({0: numel, 1: numel})
    for bucket_id, ef in saver.state.error_feedback.items():
        for call in range(2):
            _step(ef, CFG, 10 * bucket_id + call)
    torch.save(saver.error_feedback_state(), tmp_path / "ef.pt")
    saved = torch.load(tmp_path / "ef.pt", weights_only=True)

    assert not torch.equal(saver.state.error_feedback[0].state,
                           saver.state.error_feedback[1].state)
    loader = handle({0: numel, 1: numel})
    assert loader.load_error_feedback_state(saved) is None
    for bucket_id, ef in saver.state.error_feedback.items():
        assert torch.equal(loader.state.error_feedback[bucket_id].state, ef.state)
        assert loader.state.error_feedback[bucket_id].calls == ef.calls == 2

    other = handle({0: numel, 1: 2 * numel})
    before = {i: ef.state.clone() for i, ef in other.state.error_feedback.items()}
    assert other.load_error_feedback_state(saved) == (
        "the checkpoint's error-feedback state of bucket 1 does not fit this run's (another "
        "bucket size or --gradient-error-feedback-storage)")
    assert all(torch.equal(other.state.error_feedback[i].state, b) for i, b in before.items())
    assert handle({0: numel}).load_error_feedback_state(saved) == (
        "the checkpoint's error-feedback state is for other buckets")
    assert loader.load_error_feedback_state(None) == (
        "the checkpoint holds no error-feedback state")


@pytest.mark.parametrize("storage", ["fp32", "int8"])
def test_a_saved_state_holding_nan_or_inf_is_not_loaded(storage) -> None:
    """A checkpoint's error state that decodes to NaN or Inf (fp32: a value; int8: a group's
    scale) is never added back: the reason names the rank and the bucket, and the error stays
    zero (loaded, every later inter-hop message would be non-finite and every step skipped).
    Loaded as it was, a finite state comes back bit for bit."""
    numel = N * M * SHARD
    ef_config = ErrorFeedbackConfig(storage=storage)
    saver = _handle({0: numel, 1: numel}, ef_config)
    for bucket_id, ef in saver.state.error_feedback.items():
        _step(ef, CFG, 3 + bucket_id)
    for bad in (float("nan"), float("inf")):
        saved = saver.error_feedback_state()
        state = saved["buckets"][1]["state"]  # a copy (error_feedback_state clones)
        if storage == "fp32":
            state[7] = bad
        else:  # the first group scale of the first slice's message (fp32 scales come first)
            state[:4].view(torch.float32)[0] = bad
        loader = _handle({0: numel, 1: numel}, ef_config)
        zero = {i: ef.state.clone() for i, ef in loader.state.error_feedback.items()}
        assert loader.load_error_feedback_state(saved) == (
            "rank 0's saved error state of bucket 1 holds NaN or Inf (a run never saves one: "
            "the checkpoint was changed after it was written)")
        for i, ef in loader.state.error_feedback.items():
            assert torch.equal(ef.state, zero[i]) and ef.calls == 0, i
    loader = _handle({0: numel, 1: numel}, ef_config)
    assert loader.load_error_feedback_state(saver.error_feedback_state()) is None
    assert all(torch.equal(loader.state.error_feedback[i].state, ef.state)
               for i, ef in saver.state.error_feedback.items())


def test_nearest_rounding_of_the_compensated_hop() -> None:
    """``rounding="nearest"`` rounds the compensated values to nearest while the hop's own
    rounding stays stochastic: with a zero error the bytes are the fused nearest
    requantization's, whatever the seed; over ten calls the sums still telescope, and the
    error left is smaller than stochastic feedback's (no rounding noise fed back)."""
    nearest = ErrorFeedbackConfig(rounding="nearest", storage="fp32")
    for seed in (1, 2):
        ef = ErrorFeedback(N * M * SHARD, N, M, CFG, nearest)
        fused = torch.empty(M * message_nbytes(SHARD, 2, 32), dtype=torch.uint8)
        ops.tlq_middle(_recv(1), fused, n_in=N, numel=M * SHARD, bits_in=8, group_size_in=64,
                       n_out=M, bits_out=2, group_size_out=32, stochastic=False, seed=0)
        send = torch.empty_like(fused)
        ef.start_call()
        ef.requantize(_recv(1), send, 0, grad_config=CFG, ranks_per_node=N, nodes=M,
                      seed=seed)
        assert torch.equal(send, fused)
    errors = {}
    for rounding in ("stochastic", "nearest"):
        ef = ErrorFeedback(N * M * SHARD, N, M, CFG,
                           ErrorFeedbackConfig(rounding=rounding, storage="fp32"))
        sent_total = torch.zeros(M * SHARD, dtype=torch.float64)
        input_total = torch.zeros(M * SHARD, dtype=torch.float64)
        for seed in range(1, 11):
            send = _step(ef, CFG, seed)
            sent = torch.empty(M * SHARD)
            ops.qwd_receiver(send, sent, world=M, bits=2, group_size=32, accumulate=False)
            total = torch.empty(M * SHARD)
            ops.tlq_receiver(_recv(seed), total, n_in=N, bits=8, group_size=64,
                             hadamard_block=0)
            sent_total += sent.double()
            input_total += total.double()
        assert torch.allclose(sent_total, input_total - ef.state.double(), rtol=0,
                              atol=1e-5 * input_total.abs().max())
        errors[rounding] = (sent_total - input_total).norm()
    # measured here: 18.0 / 43.8 = 0.41x (docs/comm.md's table, T = 10)
    assert errors["nearest"] < 0.75 * errors["stochastic"], errors


def test_rounding_knob_is_checked() -> None:
    with pytest.raises(ValueError, match=r"^rounding='up': use 'stochastic' or 'nearest'$"):
        ErrorFeedbackConfig(rounding="up")
