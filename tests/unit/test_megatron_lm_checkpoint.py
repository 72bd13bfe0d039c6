"""The Megatron-LM plug-in's error-feedback state in Megatron-LM's checkpoints
(integration/megatron_lm_checkpoint.py), with stand-ins for Megatron-LM's two functions and
for the run's lifecycle: what a save adds, when a load asks for the state, what it hands to
the lifecycle and why. The real trainer's bit-exact resume is
tests/e2e/test_megatron_lm_trainer.py's (megatron-core 0.19.2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron.sdp4bit.integration.dist_checkpointing import EF_KEY
from megatron.sdp4bit.integration.megatron_lm_checkpoint import (
    LAYOUT_KEY,
    PendingLoad,
    layout_of_args,
    wrap_generate_state_dict,
    wrap_load_base_checkpoint,
)


class _Lifecycle:
    """Stands in for the run's SDP4BitLifecycle: its error state, and what it was handed."""

    def __init__(self, state=None, on: bool = True) -> None:
        self.config = SimpleNamespace(gradient_error_feedback=on)
        self.state, self.restored = state, []

    def error_feedback_state(self):
        return self.state

    def restore_error_feedback(self, saved, *, skipped=None, where=None):
        self.restored.append((saved, skipped))


def _args(**changes) -> SimpleNamespace:
    values = dict(ckpt_format="torch_dist", world_size=4, tensor_model_parallel_size=1,
                  pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                  context_parallel_size=1, expert_model_parallel_size=1, data_parallel_size=4,
                  ddp_bucket_size=20000, dp_ranks_per_node=2, finetune=False)
    return SimpleNamespace(**{**values, **changes})


def test_a_save_holds_this_ranks_state_and_its_layout(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    state = {"storage": "int8", "buckets": {0: {"state": torch.zeros(8), "calls": 5}}}
    run = _Lifecycle(state)
    generate = wrap_generate_state_dict(lambda args, *a, **k: {"model": 1}, lambda: run,
                                        PendingLoad())
    saved = generate(_args(), [], None, None, None, iteration=7,
                     optim_sd_kwargs={"metadata": {}})
    entry = saved[EF_KEY]
    assert (entry.key, entry.data, entry.global_shape, entry.global_offset) == \
        (EF_KEY, state, (4,), (3,))
    assert saved[LAYOUT_KEY] == layout_of_args(_args())
    # other formats, or a run without the flag: Megatron-LM's dict unchanged
    assert generate(_args(ckpt_format="torch"), [], None, None, None) == {"model": 1}
    for off in (_Lifecycle(state, on=False), None):  # without the flag, before validation
        unchanged = wrap_generate_state_dict(lambda args, *a, **k: {"model": 1}, lambda: off,
                                             PendingLoad())
        assert unchanged(_args(), [], None, None, None) == {"model": 1}


@pytest.mark.parametrize("saved_layout, args, why", [
    (None, _args(), "the checkpoint was saved without --gradient-error-feedback"),
    (layout_of_args(_args()), _args(data_parallel_size=2, world_size=2),
     "the checkpoint was saved with another parallel layout or bucket size"),
    (layout_of_args(_args()), _args(ddp_bucket_size=40000),
     "the checkpoint was saved with another parallel layout or bucket size"),
    (layout_of_args(_args()), _args(finetune=True),
     "--finetune starts from the checkpoint's weights only"),
    (layout_of_args(_args()), _args(), None),
], ids=["without-flag", "other-dp", "other-buckets", "finetune", "same-layout"])
def test_a_load_asks_for_the_state_only_on_the_same_layout(saved_layout, args, why,
                                                          monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    pending, run = PendingLoad(), _Lifecycle()
    common = {"iteration": 2, **({LAYOUT_KEY: saved_layout} if saved_layout else {})}
    full = {"iteration": 2, EF_KEY: {"buckets": {}}}
    load = wrap_load_base_checkpoint(
        lambda load_dir, args, rank0=False, *a, **k: (common if rank0 else full, "d", False, 1),
        lambda: run, pending)
    load("ckpt", args, rank0=True)
    assert pending.ask == (why is None)
    template = wrap_generate_state_dict(lambda args, *a, **k: {}, lambda: run,
                                        pending)(args, [], None, None, None,
                                                 optim_sd_kwargs={"is_loading": True})
    assert (EF_KEY in template) == (why is None)
    load("ckpt", args, rank0=False, sharded_state_dict=template)
    # the lifecycle gets the state, or why there is none, once
    assert run.restored == [({"buckets": {}}, None) if why is None else (None, why)]
    assert EF_KEY not in full or why is not None  # handed over, not left for Megatron-LM


def test_no_checkpoint_to_load_says_nothing() -> None:
    pending, run = PendingLoad(ask=True), _Lifecycle()
    load = wrap_load_base_checkpoint(lambda *a, **k: (None, "", False, None), lambda: run,
                                     pending)
    load(None, _args(), rank0=True)
    assert not pending.ask and run.restored == []
