"""The replacement engine (integration/patches.py), and that nothing else replaces attributes
of megatron-core or torch objects.

The engine's targets here are a throwaway module and class made by the test, so these checks
need no megatron-core; the release walk over the real table is
tests/distributed/test_integration_replacements.py.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

from megatron.sdp4bit.integration import patches
from megatron.sdp4bit.integration.patches import CLASS, INSTANCE, MODULE, Replacement

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron" / "sdp4bit"
ENGINE = PACKAGE / "integration" / "patches.py"


class _Target:
    def method(self, a, b=1):
        return ("original", a, b)


def _make_module(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("sdp4bit_test_target")
    module.function = lambda x, *, y=0: ("original", x, y)
    module.Target = _Target
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _entry(name: str, owner: str, attribute: str, kind: str, replacement, checked: str,
           **kw) -> Replacement:
    # Not declared: the test's entries stay out of the package's table.
    return Replacement(name, owner, attribute, kind, replacement, "[Note: test]",
                       {patches.megatron_core_version(): checked}, (patches.SEAM,), **kw)


def test_apply_and_revert_restore_exactly(monkeypatch) -> None:
    module = _make_module(monkeypatch)
    original_function = module.function
    obj, other = _Target(), _Target()
    on_module = _entry("t.function", module.__name__, "function", MODULE,
                       lambda x, *, y=0: ("new", x, y), "(x, *, y)")
    on_instance = _entry("t.method", f"{module.__name__}:Target", "method", INSTANCE,
                         lambda target, tag: lambda self, a, b=1: (tag, a, b), "(self, a, b)")
    wrapping = _entry("t.class_method", f"{module.__name__}:Target", "method", CLASS,
                      lambda original: lambda self, a, b=1: ("wrapped",) + original(self, a, b),
                      "(self, a, b)", wraps=True)
    with patches.applied([on_module, on_instance.on(obj, tag="bound")]) as done:
        assert module.function(2) == ("new", 2, 0)
        assert obj.method(3) == ("bound", 3, 1)
        assert other.method(3) == ("original", 3, 1)  # the class is untouched
        assert done.objects() == [module, obj]
    assert module.function is original_function
    assert "method" not in obj.__dict__ and obj.method(3) == ("original", 3, 1)
    before = vars(_Target)["method"]
    applied = patches.apply([wrapping])
    assert other.method(4) == ("wrapped", "original", 4, 1)
    applied.revert()
    assert vars(_Target)["method"] is before and other.method(4) == ("original", 4, 1)


def test_a_missing_or_changed_target_is_refused_before_anything_changes(monkeypatch) -> None:
    module = _make_module(monkeypatch)
    original_function = module.function
    fine = _entry("t.function", module.__name__, "function", MODULE, lambda x: x, "(x, *, y)")
    missing = _entry("t.gone", module.__name__, "renamed", MODULE, lambda: None, "()")
    changed = _entry("t.changed", module.__name__, "function", MODULE, lambda x: x, "(x, y)")
    with pytest.raises(patches.ReplacementError) as err:
        patches.apply([fine, missing])
    assert str(err.value) == "SDP4Bit cannot replace sdp4bit_test_target.renamed is missing"
    assert module.function is original_function  # the first entry was not applied either
    release = patches.megatron_core_version()
    with pytest.raises(patches.ReplacementError) as err:
        patches.apply([changed])
    assert str(err.value) == (
        "SDP4Bit cannot replace sdp4bit_test_target.function changed: its signature is "
        f"(x, *, y), checked as (x, y) on megatron-core {release}")
    assert "\n" not in str(err.value)
    def failing_maker(target):
        raise RuntimeError("maker failed")

    failing = _entry("t.failing", f"{module.__name__}:Target", "method", INSTANCE,
                     failing_maker, "(self, a, b)")
    obj = _Target()
    with pytest.raises(RuntimeError, match="maker failed"):
        patches.apply([fine, failing.on(obj)])
    assert module.function is original_function  # the first one was put back
    wrong_object = _entry("t.method", f"{module.__name__}:Target", "method", INSTANCE,
                          lambda target: lambda self, a, b=1: None, "(self, a, b)")
    with pytest.raises(patches.ReplacementError, match="on a object: it is not a Target"):
        patches.apply([wrong_object.on(object())])


def test_fingerprint_names_parameters_and_kinds() -> None:
    def f(a, /, b, *args, c, d=1, **kw):
        return None

    assert patches.fingerprint(f) == "(a, /, b, *args, c, d, **kw)"
    assert patches.fingerprint(lambda *, x: x) == "(*, x)"
    assert patches.fingerprint(_Target) == "()"  # a class: its constructor's parameters
    assert patches.fingerprint(None) == "<NoneType>"
    assert patches.fingerprint(types) == "<module types>"


# --- nothing outside the engine replaces a megatron-core or torch attribute ------------------

_FOREIGN = ("torch", "megatron.core")


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names bound to something imported from torch or megatron-core (or an alias of one)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" or alias.name.startswith("megatron.core"):
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "torch" or node.module.startswith("megatron.core")):
            names.update(alias.asname or alias.name for alias in node.names)
    changed = True
    while changed:  # x = torch.cuda: x is foreign too
        changed = False
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id not in names
                    and isinstance(node.value, ast.Attribute)
                    and _root(node.value) in names):
                names.add(node.targets[0].id)
                changed = True
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def replacements_outside_the_engine(source: str, where: str) -> list[str]:
    """Every attribute replacement in ``source`` that is not the engine's: a ``setattr`` or
    ``delattr`` on anything but ``self``, an assignment to an attribute of an imported torch
    or megatron-core name, a function (a lambda, a ``def`` of the file, a ``make_*``
    factory's result, ``MethodType``) assigned to an attribute of anything but
    ``self``, a write through ``__dict__``."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    functions = {n.name for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("setattr", "delattr") and node.args
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")):
            found.append((node.lineno, f"{line}: {node.func.id}({ast.unparse(node.args[0])}, ...)"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Attribute)
                and node.func.value.attr == "__dict__"):
            found.append((node.lineno, f"{line}: {ast.unparse(node.func)}(...)"))
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            is_function = (isinstance(value, ast.Lambda)
                           or (isinstance(value, ast.Name) and value.id in functions)
                           or (isinstance(value, ast.Call) and (
                               "MethodType" in ast.unparse(value.func)
                               or isinstance(value.func, ast.Name)
                               and value.func.id.startswith("make_"))))
            flat = [e for t in targets
                    for e in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])]
            for t in flat:
                if not isinstance(t, (ast.Attribute, ast.Subscript)):
                    continue
                text = ast.unparse(t)
                if "__dict__" in text or isinstance(t, ast.Attribute) and (
                        _root(t) in foreign or is_function and _root(t) not in ("self", "cls")):
                    found.append((node.lineno, f"{line}: {text} = ..."))
                    continue
    return [text for _, text in sorted(found, key=lambda f: f[0])]


def test_the_scan_finds_planted_replacements() -> None:
    planted = '''
import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import random as mcore_random
import types

cuda = torch.cuda


def stub():
    return 0


def install(opt, bucket_group):
    torch.cuda.current_device = stub
    cuda.is_available = lambda: True
    mcore_random._set_cuda_rng_state = None
    opt.step = types.MethodType(stub, opt)
    bucket_group.start_grad_sync = stub
    bucket_group.start_param_sync = make_start_param_sync(bucket_group)
    setattr(dist, "all_reduce", stub)
    opt.__dict__.pop("step", None)
    opt.config.grad_sync_func = bucket_group.start_grad_sync  # an option, not a replacement
    self_like = object()
'''
    found = replacements_outside_the_engine(planted, "planted.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "torch.cuda.current_device = ...",
        "cuda.is_available = ...",
        "mcore_random._set_cuda_rng_state = ...",
        "opt.step = ...",
        "bucket_group.start_grad_sync = ...",
        "bucket_group.start_param_sync = ...",
        "setattr(dist, ...)",
        "opt.__dict__.pop(...)",
    ]


def test_no_replacement_outside_the_engine() -> None:
    files = sorted(PACKAGE.rglob("*.py")) + [ROOT / "pretrain_gpt.py"]
    found = []
    for path in files:
        if path == ENGINE:
            continue
        found += replacements_outside_the_engine(path.read_text(encoding="utf-8"),
                                                 str(path.relative_to(ROOT)))
    assert len(files) > 50
    assert not found, "\n".join(found)


DRY_RUN = "megatron.sdp4bit.testing.cuda_dryrun"


def test_every_declaring_module_is_listed() -> None:
    """The walk and the untested-release check import patches.DECLARED_IN to see the
    library's table: a module that declares entries and is not listed there would be
    skipped. The dry run declares its own, outside the library's import graph: every module
    listed is in integration/."""
    declaring = set()
    for path in PACKAGE.rglob("*.py"):
        if path == ENGINE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "declare"
               for n in ast.walk(tree)):
            declaring.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert "megatron.sdp4bit.integration.install" in declaring
    assert declaring == set(patches.DECLARED_IN) | {DRY_RUN}
    assert all(m.startswith("megatron.sdp4bit.integration.") for m in patches.DECLARED_IN)


def _registered() -> list[Replacement]:
    """The library's entries and the dry run's (registered by importing its tool)."""
    from dev import cuda_dryrun  # noqa: F401

    return patches.all_replacements()


def test_every_entry_names_a_note_that_exists() -> None:
    """An entry's ``note`` is ``[Note: title] (file under megatron/sdp4bit/)``, and the file
    holds that Note; it was checked on tested releases of its library, and has scopes."""
    import re

    from megatron.sdp4bit.integration.releases import TESTED_TORCH_VERSIONS

    entries = _registered()
    assert len(entries) > 100
    for entry in entries:
        match = re.fullmatch(r"(\[Note: [^\]]+\]) \(([\w/.]+\.py)\)", entry.note)
        assert match, (entry.name, entry.note)
        title, path = match.groups()
        assert title in (PACKAGE / path).read_text(encoding="utf-8"), (entry.name, entry.note)
        tested = (set(TESTED_TORCH_VERSIONS) if patches.library(entry) == "torch"
                  else {"0.16.1", "0.19.2"})
        assert set(entry.checked) <= tested and entry.checked, entry.name
        assert entry.scopes and set(entry.scopes) <= set(patches.SCOPES), entry.name


def test_the_scopes_say_who_applies_each_entry() -> None:
    """Each applier's entries carry its scope: install_sdp4bit's the seam, sdp4bit_padding's
    the padding, the torch_dist writer's the checkpoint, CPU mode's (with the shared CUDA
    stubs) cpu_mode, the dry run's (with the same stubs) dryrun."""
    from megatron.sdp4bit.integration import cpu_mode, dist_checkpointing, install, padding

    _registered()
    dry = sys.modules[DRY_RUN]  # the dry run's module, imported by its tool
    by_scope = {scope: {e.name for e in _registered() if scope in e.scopes}
                for scope in patches.SCOPES}
    assert by_scope["seam"] == {e.name for e in (install.START_GRAD_SYNC, install.START_PARAM_SYNC,
                                                 install.COPY_MAIN_PARAMS,
                                                 install.COPY_MODEL_GRADS)}
    assert by_scope["padding"] == {e.name for e in padding.PADDING}
    assert by_scope["checkpoint"] == {e.name for e in (
        dist_checkpointing.SAVE_CALLBACKS, dist_checkpointing.RESULTS_QUEUE,
        dist_checkpointing.BUCKET_SPACE, dist_checkpointing.MISSING_STEP)}
    assert by_scope["cpu_mode"] == {e.name for e in cpu_mode.CPU_MODE_STUBS}
    assert by_scope["dryrun"] == {e.name for e in dry.DRY_RUN}
    # torch's attributes are checked per torch release, megatron-core's per its release
    assert {patches.library(e) for e in dry.DRY_RUN} == {"torch", "megatron-core"}
    assert all(patches.library(e) == "megatron-core" for e in install.__dict__.values()
               if isinstance(e, Replacement))
    with pytest.raises(ValueError, match=r"scope 'everything' is not one of \('seam', "):
        patches.declare("t.bad", "torch", "load", MODULE, None, note="[Note: test]",
                        checked={}, scope="everything")


def test_the_listing_groups_the_entries_by_scope() -> None:
    """``python -m megatron.sdp4bit.integration.patches``: one header per scope with its
    count, each entry under every scope it has."""
    _registered()
    text = patches.listing()
    headers = [line for line in text.splitlines() if line.startswith("== ")]
    counts = {scope: sum(scope in e.scopes for e in patches.all_replacements())
              for scope in patches.SCOPES}
    assert headers == [f"== {s}: {counts[s]} entries" for s in patches.SCOPES]
    seam = text.split("== seam:")[1].split("== padding:")[0]
    assert "install.start_grad_sync" in seam and "checkpoint.save_callbacks" not in seam
    cpu = text.split("== cpu_mode:")[1].split("== dryrun:")[0]
    assert "cuda.current_device" in cpu and "(also dryrun)" in cpu
    assert "dryrun.torch.load" in text.split("== dryrun:")[1]
