"""``--ckpt-format torch_dist`` under ``torchrun``: resume on the same and on other layouts.

One SDP4Bit run on 4 ranks (2 "nodes" x 2) saves at iteration 4 and goes on to 8; it is the
uninterrupted reference of every case. Dropout is off, so that a resume's first iteration
sees the same weights and samples as the reference, whatever the layout.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.e2e.test_faults import one_error_line
from tests.e2e.test_pretrain_gpt import (  # noqa: F401 - data_prefix is a fixture
    METHODS, TINY, _env, data_prefix, torchrun, train_lines)
from tests.e2e.test_faults import launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BASE = list(TINY)
for flag, value in (("--train-iters", "8"), ("--log-interval", "1"), ("--eval-interval", "100")):
    BASE[BASE.index(flag) + 1] = value
BASE += ["--hidden-dropout", "0", "--attention-dropout", "0", *METHODS["SDP4Bit"]]
SAVED_AT = 4


@pytest.fixture(scope="module")
def reference(data_prefix, tmp_path_factory):
    """(log lines of the uninterrupted run, folder holding only its iteration-4 checkpoint)."""
    root = tmp_path_factory.mktemp("ckpt")
    full = root / "full"
    res = torchrun(BASE + data_prefix + ["--dp-ranks-per-node", "2", "--save", str(full),
                                         "--save-interval", str(SAVED_AT)])
    at4 = root / "at4"
    at4.mkdir()
    shutil.copytree(full / f"iter_{SAVED_AT:07d}", at4 / f"iter_{SAVED_AT:07d}")
    (at4 / "latest_checkpointed_iteration.txt").write_text(f"{SAVED_AT}\n")
    return train_lines(res.stdout), at4


def _resume(reference, tmp_path, data_prefix, nproc: int, extra: list[str]) -> list[dict]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(reference[1], ckpt)
    res = torchrun(BASE + data_prefix + ["--load", str(ckpt), "--check-replicas-interval", "1",
                                         *extra], nproc=nproc)
    assert f"loaded checkpoint from {ckpt} at iteration {SAVED_AT}" in res.stdout
    return train_lines(res.stdout)


def test_same_layout_resume_is_bit_exact(reference, tmp_path, data_prefix):
    full, _ = reference
    resumed = _resume(reference, tmp_path, data_prefix, 4, ["--dp-ranks-per-node", "2"])
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    for a, b in zip(full[SAVED_AT:], resumed):
        for key in ("lm_loss", "grad_norm", "learning_rate", "consumed_samples",
                    "comm_bytes_params", "comm_bytes_grads_inter"):
            assert a[key] == b[key], (key, a, b)
