"""dev/mutate.py stays runnable: every mutation still applies to the source as written,
every target exists, and the tool restores what it mutates (CI does not run the mutations
themselves: the whole list takes about 7 minutes on 2 cores)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "dev" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutate"] = module
    spec.loader.exec_module(module)
    return module


mutate = _load()


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name)
def test_mutation_applies_to_the_current_source(mutation) -> None:
    for edit in mutation.edits:
        assert (ROOT / edit.path).read_text().count(edit.old) == edit.count, (
            f"{mutation.name}: {edit.path} no longer holds {edit.old!r} {edit.count} time(s)")
        assert edit.old != edit.new
    for target in mutation.targets:
        path, _, test = target.partition("::")
        assert (ROOT / path).is_file(), target
        if test:  # a function of the file (a parametrized case: its id among the ids)
            name, _, case = test.partition("[")
            text = (ROOT / path).read_text()
            assert f"def {name}(" in text, target
            assert not case or f'"{case.rstrip("]")}"' in text, target


def test_names_are_unique() -> None:
    names = [m.name for m in mutate.MUTATIONS]
    assert len(names) == len(set(names))


def test_apply_and_restore_round_trip(tmp_path, monkeypatch) -> None:
    target = tmp_path / "x.py"
    target.write_text("a = 1\nb = 1\n")
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    originals = mutate._apply((mutate.Edit("x.py", "= 1", "= 2", count=2),))
    assert target.read_text() == "a = 2\nb = 2\n"
    mutate._restore(originals)
    assert target.read_text() == "a = 1\nb = 1\n"
    with pytest.raises(SystemExit, match="expected 1 occurrence"):
        mutate._apply((mutate.Edit("x.py", "= 1", "= 2"),))
    assert target.read_text() == "a = 1\nb = 1\n"  # nothing written when an edit fails
