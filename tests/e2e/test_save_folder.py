"""A refused run leaves no ``--save`` folder it made (pretrain_gpt.py), and keeps one the user
made: the refusal here comes after the lock is taken (a ``--pretrained-checkpoint`` holding
no checkpoint), the last moment a run can be refused before it trains."""

from __future__ import annotations

import os

import pytest

from tests.helpers.trainer import TINY, launch, one_error_line

pytestmark = pytest.mark.distributed


@pytest.mark.release_independent  # pretrain_gpt.py's own refusal and clean-up
def test_a_refused_run_removes_the_save_folder_it_made(tmp_path):
    empty = tmp_path / "pretrained"
    empty.mkdir()
    for made_by_user in (False, True):
        save = tmp_path / f"save_{made_by_user}"
        if made_by_user:
            save.mkdir()
        message = one_error_line(launch(TINY + ["--mock-data", "--save", str(save),
                                                "--pretrained-checkpoint", str(empty)],
                                        nproc=1))
        assert message.startswith(f"--pretrained-checkpoint {empty} holds no checkpoint")
        assert save.exists() == made_by_user
        if made_by_user:
            assert os.listdir(save) in ([], [".lock"])
