"""The one table of replaced megatron-core and torch attributes, and the engine that applies it.

Every attribute of megatron-core or torch that SDP4Bit replaces (a method bound on an
instance, a module global, a function of a torch module) is a :class:`Replacement`
declared with :func:`declare`, next to the code that owns it. The library's entries are in
the modules of :data:`DECLARED_IN` (all in ``integration/``); the CUDA dry run
(``megatron/sdp4bit/testing/cuda_dryrun.py``) declares its own when it is imported, outside
the library's import graph. :func:`all_replacements` lists what is registered (``python -m
megatron.sdp4bit.integration.patches`` prints it by scope; docs/integration.md explains it).
Nothing else in the package assigns an attribute of a megatron-core or torch object
(tests/unit/test_replacement_seams.py greps for it).

An entry names its target (``owner``: a module, or ``module:Class``; ``attribute``), how
the replacement goes in (:data:`INSTANCE`: bound on one object with
:func:`types.MethodType`, the class untouched; :data:`MODULE` / :data:`CLASS`: set on the
module or class), the replacement itself, the ``[Note: ...]`` that explains it, who applies
it (its ``scopes``, [Note: scopes]), and the releases it was checked on with the
:func:`fingerprint` of the original there: megatron-core releases for a megatron-core
target, torch releases for a torch one (:func:`library`).

[Note: scopes]
Each entry says who applies it, one or more of :data:`SCOPES`:

* :data:`SEAM`: ``install_sdp4bit`` (the quantized collectives on bucket groups and
  distributed optimizers);
* :data:`PADDING`: ``sdp4bit_padding`` (around DDP construction);
* :data:`CHECKPOINT`: the trainer's ``torch_dist`` checkpoints
  (``integration/dist_checkpointing.py``);
* :data:`CPU_MODE`: ``enable_cpu_mode`` (megatron-core on CPU);
* :data:`DRYRUN`: the CUDA dry run (``enable_cuda_dryrun``, a development tool);
* :data:`MEGATRON_LM`: the plug-in for Megatron-LM's own trainer
  (``integration/megatron_lm.py``: ``megatron_lm.enable()``).

The untested-release check walks only the scopes its caller applies (:func:`in_scopes`): a
library user's ``install_sdp4bit`` (seam and padding) is never refused because a target of
the checkpoint writer or of the dry run moved. The CUDA runtime stubs that CPU mode and the
dry run share are in both scopes.

[Note: what the engine checks]
Before it replaces anything, :func:`apply` resolves every target and compares the
fingerprint of what is there now (the parameter list of a function or class, the type of
anything else) with the one recorded for the installed release of the target's library
(megatron-core or torch), or, on a release no entry was checked on, with any recorded one.
A missing target or a changed fingerprint is refused with one line naming the target,
before any attribute changes: a replacement re-states or wraps code it was written against,
and a silently different original is the bug this guards against. The untested-release
decision (:func:`megatron.sdp4bit.integration.version.check_megatron_core_version`) walks
the entries of the caller's scopes with the same check (:func:`first_problem`); a user who
accepts the moved targets (``allow_untested_version=True``) makes :func:`accept_changed`
lift the fingerprint check for those (a missing target still cannot be replaced).

Reverting restores exactly what was there: a module or class attribute gets its previous
value back, an instance attribute is deleted (or its own previous value restored), in the
reverse order of application.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from megatron.sdp4bit.integration.releases import (
    TESTED_MEGATRON_CORE_VERSIONS,
    TESTED_TORCH_VERSIONS,
    megatron_core_version,
    torch_version,
)

INSTANCE = "instance"
MODULE = "module"
CLASS = "class"
KINDS = (INSTANCE, MODULE, CLASS)

# Who applies an entry ([Note: scopes]).
SEAM = "seam"
PADDING = "padding"
CHECKPOINT = "checkpoint"
CPU_MODE = "cpu_mode"
DRYRUN = "dryrun"
MEGATRON_LM = "megatron_lm"
SCOPES = (SEAM, PADDING, CHECKPOINT, CPU_MODE, DRYRUN, MEGATRON_LM)

# The library's modules that declare entries; its table is complete once they are imported.
# The dry run's entries are not among them: it registers them itself ([Note: scopes]).
DECLARED_IN = (
    "megatron.sdp4bit.integration.padding",
    "megatron.sdp4bit.integration.install",
    "megatron.sdp4bit.integration.cuda_stubs",
    "megatron.sdp4bit.integration.cpu_mode",
    "megatron.sdp4bit.integration.dist_checkpointing",
    "megatron.sdp4bit.integration.megatron_lm",
    "megatron.sdp4bit.integration.megatron_lm_bridges",
)

_MISSING = object()


class ReplacementError(RuntimeError):
    """A target that is missing or changed (one line naming it)."""


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One replaced attribute (see the module docstring)."""

    name: str
    """Unique, short: what the table and the errors call it."""
    owner: str
    """The module (``torch.cuda``) or class (``megatron.core.x.y:Class``) that holds it."""
    attribute: str
    kind: str
    """:data:`INSTANCE`, :data:`MODULE` or :data:`CLASS`."""
    replacement: Any
    """:data:`MODULE` / :data:`CLASS`: the new value, or with ``wraps`` a function of the
    original (and the application's context) returning it. :data:`INSTANCE`: a function of
    the object (and the context) returning the function to bind on it."""
    note: str
    """The ``[Note: ...]`` (and the file that holds it) that explains the replacement."""
    checked: Mapping[str, str]
    """Release of the target's :func:`library` -> :func:`fingerprint` of the original it was
    checked with."""
    scopes: tuple[str, ...]
    """Who applies it: some of :data:`SCOPES` ([Note: scopes])."""
    wraps: bool = False
    witness: str | None = None
    """Another attribute of ``owner`` (dotted) whose fingerprint stands for this one's, for a
    target that is a plain value (a module global): the function that uses it."""
    applies: Callable[[], bool] | None = None
    """For an entry of some releases only: whether it applies to the installed one (a
    feature test). None: it always applies."""
    adds: bool = False
    """:data:`MODULE` only: a name that a newer Python has and this one may lack. Where the
    owner lacks it, it is added (revert deletes it); where the owner has it, it is left
    alone. Its ``checked`` fingerprint is ``<absent>``."""

    @property
    def target(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.attribute}"

    def on(self, obj: Any = None, **context: Any) -> "Patch":
        """This replacement applied to ``obj`` (:data:`INSTANCE` only), with ``context`` for
        its maker."""
        return Patch(self, obj, context)


@dataclasses.dataclass(frozen=True)
class Patch:
    """One application of a :class:`Replacement` (what :func:`apply` takes)."""

    entry: Replacement
    obj: Any = None
    context: Mapping[str, Any] = dataclasses.field(default_factory=dict)


_REGISTRY: dict[str, Replacement] = {}
_ACCEPTED_CHANGES: set[str] = set()


def declare(name: str, owner: str, attribute: str, kind: str, replacement: Any, *, note: str,
            checked: Mapping[str, str], scope: str | tuple[str, ...], wraps: bool = False,
            witness: str | None = None,
            applies: Callable[[], bool] | None = None, adds: bool = False) -> Replacement:
    """Add an entry to the table (at import of a module of :data:`DECLARED_IN`, or of the
    dry run's). ``scope``: who applies it, one of :data:`SCOPES` or a tuple of them."""
    if kind not in KINDS:
        raise ValueError(f"replacement {name}: kind {kind!r} is not one of {KINDS}")
    if name in _REGISTRY:
        raise ValueError(f"replacement {name} is declared twice")
    if kind == INSTANCE and ":" not in owner:
        raise ValueError(f"replacement {name}: an instance replacement names its class")
    scopes = (scope,) if isinstance(scope, str) else tuple(scope)
    if not scopes or any(s not in SCOPES for s in scopes):
        raise ValueError(f"replacement {name}: scope {scope!r} is not one of {SCOPES}")
    if adds and (kind != MODULE or wraps):
        raise ValueError(f"replacement {name}: only a plain module attribute can be added")
    entry = Replacement(name, owner, attribute, kind, replacement, note, dict(checked), scopes,
                        wraps, witness, applies, adds)
    _REGISTRY[name] = entry
    return entry


def both(fingerprint_: str) -> dict[str, str]:
    """``checked`` for a megatron-core target with the same fingerprint on both tested
    releases."""
    return {release: fingerprint_ for release in TESTED_MEGATRON_CORE_VERSIONS}


def on_torch(fingerprint_: str) -> dict[str, str]:
    """``checked`` for a torch target: its fingerprint on the tested torch release(s)."""
    return {release: fingerprint_ for release in TESTED_TORCH_VERSIONS}


def all_replacements() -> list[Replacement]:
    """Every registered entry, in declaration order (imports :data:`DECLARED_IN`; the dry
    run's are there once it has been imported)."""
    for module in DECLARED_IN:
        importlib.import_module(module)
    return list(_REGISTRY.values())


def checked_scopes(scopes: Iterable[str]) -> tuple[str, ...]:
    """``scopes`` as a tuple; ``ValueError`` naming any that is not one of :data:`SCOPES`."""
    scopes = tuple(scopes)
    unknown = sorted(set(scopes) - set(SCOPES))
    if unknown:
        raise ValueError(f"unknown scope(s) {unknown}: the scopes are {SCOPES}")
    return scopes


def in_scopes(scopes: Iterable[str]) -> list[Replacement]:
    """The registered entries that one of ``scopes`` applies and that apply to the installed
    megatron-core (their feature test), in declaration order."""
    wanted = set(checked_scopes(scopes))
    return [e for e in all_replacements() if wanted & set(e.scopes) and applies(e)]


# --- fingerprints and the check -----------------------------------------------------------

def fingerprint(obj: Any) -> str:
    """What a replacement was checked against: ``(a, b, *, c, **d)`` (parameter names and
    kinds, no defaults or annotations, which change without changing a call) for a function
    or class, ``<module NAME>`` for a module, ``<TYPE>`` for anything else."""
    if isinstance(obj, types.ModuleType):
        return f"<module {obj.__name__}>"
    if not callable(obj):
        return f"<{type(obj).__name__}>"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "<builtin>"
    parts, star = [], False
    for p in signature.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            star = True
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name)
        if p.kind is p.POSITIONAL_ONLY and (
                len(parts) == len(signature.parameters)
                or list(signature.parameters.values())[len(parts)].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return f"({', '.join(parts)})"


def resolve_owner(entry: Replacement) -> Any:
    """The module or class that holds ``entry``'s attribute; :class:`ReplacementError` if
    it is not there."""
    module_name, _, qualname = entry.owner.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as err:
        raise ReplacementError(f"{entry.target} is missing: {module_name} cannot be imported "
                               f"({str(err).splitlines()[0] if str(err) else err!r})") from None
    for part in qualname.split(".") if qualname else ():
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            raise ReplacementError(f"{entry.target} is missing: {entry.owner} has no {part}")
    return owner


def _lookup(owner: Any, dotted: str) -> Any:
    value = owner
    for part in dotted.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def applies(entry: Replacement) -> bool:
    """Whether ``entry`` applies to the installed megatron-core (its feature test)."""
    return entry.applies is None or bool(entry.applies())


def library(entry: Replacement) -> str:
    """``"torch"`` for a target of torch, else ``"megatron-core"``: whose releases
    ``entry.checked`` names."""
    return "torch" if entry.owner.split(":")[0].split(".")[0] == "torch" else "megatron-core"


def installed_release(entry: Replacement) -> str:
    """The installed release of ``entry``'s :func:`library`."""
    return torch_version() if library(entry) == "torch" else megatron_core_version()


def problem(entry: Replacement, release: str | None = None) -> str | None:
    """One line if ``entry``'s target is missing or its fingerprint is not the one checked
    on ``release`` of its :func:`library` (default: the installed one; any checked one when
    ``release`` is untested); else None."""
    try:
        owner = resolve_owner(entry)
    except ReplacementError as err:
        return str(err)
    if entry.adds:  # absent: added; present (a newer Python): left alone
        return None  # (before the release: an interpreter's start-up applies one, light)
    release = installed_release(entry) if release is None else release
    if _lookup(owner, entry.attribute) is _MISSING:
        return f"{entry.target} is missing"
    watched = entry.witness or entry.attribute
    value = _lookup(owner, watched)
    if value is _MISSING:
        return f"{entry.target} changed: {entry.owner.replace(':', '.')}.{watched} is missing"
    got = fingerprint(value)
    if release in entry.checked:
        if got == entry.checked[release]:
            return None
        want, where = entry.checked[release], f"{library(entry)} {release}"
    else:
        if got in entry.checked.values():
            return None
        want = " or ".join(sorted(set(entry.checked.values())))
        where = f"{library(entry)} " + " and ".join(sorted(entry.checked))
    what = f" (through {watched})" if entry.witness else ""
    return f"{entry.target} changed{what}: its signature is {got}, checked as {want} on {where}"


def first_problem(entries: Iterable[Replacement]) -> str | None:
    """The first :func:`problem` (on the installed releases) among the entries that apply,
    or None."""
    for entry in entries:
        if applies(entry):
            found = problem(entry)
            if found is not None:
                return found
    return None


def accept_changed(entries: Iterable[Replacement]) -> None:
    """Lift the fingerprint check for ``entries`` in this process (a user accepted an
    untested megatron-core: ``allow_untested_version=True``). Missing targets stay refused."""
    _ACCEPTED_CHANGES.update(entry.name for entry in entries)


def _check(entry: Replacement) -> None:
    found = problem(entry)
    if found is None:
        return
    if entry.name in _ACCEPTED_CHANGES and " is missing" not in found.split(":")[0]:
        return
    raise ReplacementError(f"SDP4Bit cannot replace {found}")


# --- the engine -----------------------------------------------------------------------------

@dataclasses.dataclass
class _Done:
    entry: Replacement
    obj: Any
    previous: Any  # _MISSING: the instance (or class) had no attribute of its own


class Applied:
    """Replacements in place; :meth:`revert` puts everything back (also a context manager)."""

    def __init__(self, done: list[_Done]) -> None:
        self._done = done

    @property
    def active(self) -> bool:
        return bool(self._done)

    def objects(self) -> list[Any]:
        """The objects that carry a replacement (instances, modules, classes)."""
        return [d.obj for d in self._done]

    def revert(self) -> None:
        done, self._done = self._done, []
        for d in reversed(done):
            if d.previous is _MISSING:
                delattr(d.obj, d.entry.attribute)
            else:
                setattr(d.obj, d.entry.attribute, d.previous)

    def __enter__(self) -> "Applied":
        return self

    def __exit__(self, *exc: object) -> None:
        self.revert()


def _new_value(patch: Patch, obj: Any, original: Any) -> Any:
    entry = patch.entry
    if entry.kind == INSTANCE:
        return types.MethodType(entry.replacement(obj, **patch.context), obj)
    if entry.wraps:
        return entry.replacement(original, **patch.context)
    if patch.context:
        raise ValueError(f"replacement {entry.name} takes no context")
    return entry.replacement


def apply(patches: Iterable[Patch | Replacement]) -> Applied:
    """Check every target, then replace them all, in order (see [Note: what the engine
    checks]). :class:`ReplacementError` names the first bad target; nothing is changed then."""
    planned = []
    for patch in patches:
        patch = patch if isinstance(patch, Patch) else Patch(patch)
        entry = patch.entry
        _check(entry)
        owner = resolve_owner(entry)
        if entry.kind == INSTANCE:
            if not isinstance(patch.obj, owner):
                raise ReplacementError(
                    f"SDP4Bit cannot replace {entry.target} on a {type(patch.obj).__name__}: "
                    f"it is not a {entry.owner.split(':')[1]}")
            obj = patch.obj
            previous = obj.__dict__.get(entry.attribute, _MISSING)
            original = getattr(type(obj), entry.attribute)
        else:
            if patch.obj is not None:
                raise ValueError(f"replacement {entry.name} is set on {entry.owner}, not on "
                                 "an object")
            if entry.adds:
                if hasattr(owner, entry.attribute):
                    continue  # the owner has it: nothing to add
                planned.append((patch, owner, _MISSING, _MISSING))
                continue
            obj = owner
            original = getattr(owner, entry.attribute)
            # A class's own entry as stored (a staticmethod stays one); an inherited one is
            # deleted again on revert.
            previous = (vars(owner).get(entry.attribute, _MISSING) if entry.kind == CLASS
                        else original)
        planned.append((patch, obj, previous, original))
    done: list[_Done] = []
    try:
        for patch, obj, previous, original in planned:
            setattr(obj, patch.entry.attribute, _new_value(patch, obj, original))
            done.append(_Done(patch.entry, obj, previous))
    except BaseException:
        Applied(done).revert()  # a maker failed: all or nothing
        raise
    return Applied(done)


@contextlib.contextmanager
def applied(patches: Iterable[Patch | Replacement]) -> Iterator[Applied]:
    """:func:`apply` for the duration of a ``with`` block."""
    with apply(patches) as done:
        yield done


def table() -> list[dict[str, str]]:
    """The registered entries as rows of text (the ``python -m`` listing and the docs)."""
    return [{"name": e.name, "target": e.target, "kind": e.kind + (" (adds)" if e.adds else ""), "scopes": ", ".join(e.scopes),
             "releases": f"{library(e)} " + ", ".join(sorted(e.checked)), "checked": " / ".join(
                 f"{library(e)} {r}: {f}" for r, f in sorted(e.checked.items())),
             "note": e.note}
            for e in all_replacements()]


def listing() -> str:
    """The table grouped by scope (an entry of two scopes is under each), as ``python -m
    megatron.sdp4bit.integration.patches`` prints it."""
    rows = table()
    out = []
    for scope in SCOPES:
        mine = [r for r in rows if scope in r["scopes"].split(", ")]
        out.append(f"== {scope}: {len(mine)} entries")
        if scope == DRYRUN and all(len(r["scopes"].split(", ")) > 1 for r in mine):
            out.append("   (the CUDA runtime stubs CPU mode shares with it; the dry run "
                       "registers its own entries when it is used: "
                       "megatron/sdp4bit/testing/cuda_dryrun.py)")
        for row in mine:
            also = [s for s in row["scopes"].split(", ") if s != scope]
            out.append(f"{row['name']:<40} {row['kind']:<8} {row['target']}"
                       + (f"  (also {', '.join(also)})" if also else ""))
            out.append(f"{'':<40} {row['checked']}")
            out.append(f"{'':<40} {row['note']}")
    return "\n".join(out)


if __name__ == "__main__":
    # The entries register in the imported module, not in this __main__ copy of it.
    from megatron.sdp4bit.integration import patches as _table

    print(_table.listing())
