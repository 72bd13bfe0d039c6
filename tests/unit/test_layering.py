"""The house's import rules, read from the source: docs/design.md, section 7, held over every
folder of the repository.

Every ``import`` is read with ``ast``, at module level or inside a function (each arrow knows
which: the import-time rule of the command line needs it), and every import by name
(``importlib.import_module("...")`` / ``__import__("...")``, and the module names a file that
imports by name holds as strings, such as a list it walks), so a lazy import that closes a
cycle or climbs a layer is seen too. A broken rule fails with ``file:line``, what is imported
and the rule. The rules, as the design page states them:

* the package's layers import downward only, with no cycle, and each part of the package
  imports only what the "may import" column of the package table allows (the test reads
  that column from docs/design.md and holds its own table to it);
* ``training/cli`` loads neither ``integration`` nor megatron-core when it is imported
  (only inside the functions that need them);
* each top-level folder imports only the repository packages its row allows: nothing imports
  ``tests`` but the tests, nothing imports ``pretrain_gpt.py``, ``examples/`` uses the
  package's public API only;
* outside ``tests/`` and ``dev/``, no module reads a private name (a leading underscore) of
  another module of the repository, and only ``integration/`` (and ``testing/``, the CUDA dry
  run) reads megatron-core's.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron" / "sdp4bit"
DESIGN = ROOT / "docs" / "design.md"
# Layers, top to bottom: a module may import its own layer and the ones below it.
LAYERS = ["training", "integration", "comm", "quantization"]
# training/'s packages that must not reach the run files at training/'s top.
LEAF_PACKAGES = ("cli", "guards", "observe", "tokenizers")
REPO_PACKAGES = ("tests", "dev", "benchmarks", "tools", "examples")
MEGATRON_CORE = ("megatron.core", "megatron.training")

RULE_LAYERS = ("layers import downward only, training -> integration -> comm -> quantization "
               "(docs/design.md, section 2)")
RULE_LEAVES = ("training's packages (cli, guards, observe, tokenizers) never import the run "
               "files at training/'s top (docs/design.md, section 7)")
RULE_PARTS = "the package table's \"may import\" column (docs/design.md, section 7)"
RULE_CLI = ("training/cli imports integration and megatron-core only inside the functions "
            "that need them: importing the command line, --help and a refused flag load "
            "neither (docs/design.md, section 7)")
RULE_FOLDERS = "the folder table's \"may import\" column (docs/design.md, section 7)"
RULE_PRIVATE = ("outside tests/ and dev/, no module reads another module's private names "
                "(docs/design.md, section 7)")
RULE_MCORE_PRIVATE = ("only integration/ (and testing/, the CUDA dry run) reads megatron-core's "
                      "private names; outside tests/ and dev/ the rest uses its public API "
                      "(docs/design.md, section 7)")

# Violations that work in progress elsewhere removes, each (file, what it imports) with the
# reason. The test fails when an entry no longer occurs: delete it then. Nothing else may be
# added here; a new violation is fixed, not listed.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()


# ------------------------------------------------------------------ reading the imports
@dataclasses.dataclass(frozen=True)
class Arrow:
    """One import of a file."""

    target: str
    """The module imported, absolute: ``from pkg import sub`` is ``pkg.sub`` when that is a
    module of the repository, else ``pkg`` (a name defined there: :attr:`names`)."""
    line: int
    at_import: bool
    """Runs when the file is imported (not inside a function, nor under ``TYPE_CHECKING``)."""
    names: tuple[str, ...] = ()
    """The names ``from target import ...`` takes."""
    by_name: bool = False
    """An import by name (``import_module``), not an import statement."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _python_files(root: Path) -> list[Path]:
    files = [root / "pretrain_gpt.py"] if (root / "pretrain_gpt.py").exists() else []
    for folder in ("megatron",) + REPO_PACKAGES:
        files += sorted(p for p in (root / folder).rglob("*.py") if ".venv" not in p.parts)
    return files


@functools.lru_cache(maxsize=None)
def _modules(root: Path) -> frozenset[str]:
    return frozenset(_module_name(p, root) for p in _python_files(root))


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    """A file's syntax tree, parsed once for all the tests of this module."""
    return ast.parse(path.read_text(encoding="utf-8"))


_BY_NAME = ("import_module", "__import__")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Reader(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, modules: frozenset[str]) -> None:
        self.name, self.is_package, self.modules = name, is_package, modules
        self.depth = 0  # functions around the node
        self.arrows: list[Arrow] = []
        self.by_name_at_import: bool | None = None  # None: no import by name

    def _function(self, node: ast.AST) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # never runs: only type checkers read it
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.arrows.append(Arrow(alias.name, node.lineno, self.depth == 0))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.name.split(".")
            anchor = parts[: len(parts) - node.level + self.is_package]
            base = ".".join(anchor + ([base] if base else []))
        rest = []
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in self.modules:
                self.arrows.append(Arrow(sub, node.lineno, self.depth == 0))
            else:
                rest.append(alias.name)
        if rest:
            self.arrows.append(Arrow(base, node.lineno, self.depth == 0, tuple(rest)))

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Name) and func.id in _BY_NAME
                or isinstance(func, ast.Attribute) and func.attr in _BY_NAME):
            self.by_name_at_import = bool(self.by_name_at_import) or self.depth == 0
            if node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                self.arrows.append(Arrow(node.args[0].value, node.lineno, self.depth == 0,
                                         by_name=True))
        self.generic_visit(node)


def _arrows(path: Path, root: Path = ROOT) -> list[Arrow]:
    """Every import of ``path``; in a file that imports by name at all, also every string
    constant that names a module of the repository (``for m in DECLARED_IN: import_module(m)``),
    at import time when a by-name import runs at module level."""
    modules = _modules(root)
    reader = _Reader(_module_name(path, root), path.name == "__init__.py", modules)
    reader.visit(_tree(path))
    arrows = reader.arrows
    if reader.by_name_at_import is not None:
        arrows += [Arrow(n.value, n.lineno, reader.by_name_at_import, by_name=True)
                   for n in ast.walk(_tree(path))
                   if isinstance(n, ast.Constant) and n.value in modules]
    return arrows


def _rel(path: Path, root: Path = ROOT) -> str:
    return path.relative_to(root).as_posix()


def _known(path: Path, target: str, root: Path) -> bool:
    return root == ROOT and (_rel(path, root), target) in KNOWN_VIOLATIONS


def _package_files(root: Path) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted((root / "megatron" / "sdp4bit").rglob("*.py"))}


def _graph(root: Path = ROOT, by_name: bool = True) -> dict[str, dict[str, int]]:
    """module -> {megatron.sdp4bit module it imports: the line of the first such import}."""
    files = _package_files(root)
    graph = {}
    for name, path in files.items():
        out: dict[str, int] = {}
        for arrow in _arrows(path, root):
            if arrow.target in files and arrow.target != name and (by_name or not arrow.by_name):
                out.setdefault(arrow.target, arrow.line)
        graph[name] = out
    return graph


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in LAYERS else None


# ------------------------------------------------------------------ the package's layers
def test_graph_is_read_from_the_source():
    graph = _graph()
    # A few arrows that must be there, so an empty graph cannot pass the checks below.
    assert "megatron.sdp4bit.training.cli.errors" in graph["megatron.sdp4bit.training.cli.validate"]
    assert "megatron.sdp4bit.training.guards.hooks" in graph["megatron.sdp4bit.training.step"]
    assert "megatron.sdp4bit.comm" in graph["megatron.sdp4bit.integration.install"]
    assert sum(len(v) for v in graph.values()) > 80


def test_no_import_cycle():
    # Imports by name are left out here (not from the layer check below): the one the package
    # has is a registry's, the replacement table's engine (integration/patches.py) importing
    # the modules that declare its entries when it is asked for all of them, at call time,
    # and those import the engine to declare: a cycle by design, that no import order can
    # break.
    graph = _graph(by_name=False)
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt] if nxt in stack else [node, nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _layer_violations(root: Path) -> list[str]:
    files, bad = _package_files(root), []
    for module, targets in _graph(root).items():
        here = _layer(module)
        for target, line in targets.items():
            there = _layer(target)
            if here and there and LAYERS.index(there) < LAYERS.index(here):
                bad.append(f"{_rel(files[module], root)}:{line}: imports {target}: {RULE_LAYERS}")
    return bad


def test_layers_only_import_downward():
    bad = _layer_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_training_packages_do_not_import_the_run_files():
    training = "megatron.sdp4bit.training."
    files, bad = _package_files(ROOT), []
    for module, targets in _graph().items():
        if not module.startswith(training):
            continue
        room = module[len(training):].split(".")[0]
        if room not in LEAF_PACKAGES:
            continue
        for target, line in targets.items():
            rest = target[len(training):] if target.startswith(training) else ""
            if rest and "." not in rest and rest not in LEAF_PACKAGES + ("checkpoint",):
                bad.append(f"{_rel(files[module])}:{line}: imports {target}: {RULE_LEAVES}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the package's parts
# docs/design.md, section 7, the package table: what each part may import besides itself and
# the three modules every part may use (OPEN). "megatron-core" stands for megatron.core and
# megatron.training.
OPEN = {"config", "trusted_paths", "atomic_files"}
TRAINING_PACKAGES = ("tokenizers", "cli", "checkpoint", "guards", "observe")
PART_MAY_IMPORT = {
    "config": set(),
    "config_flags": set(),
    "megatron_lm": {"integration"},
    "trusted_paths": set(),
    "atomic_files": set(),
    "helper_processes": set(),
    "quantization": set(),
    "comm": {"quantization"},
    "integration": {"comm", "quantization", "config_flags", "helper_processes", "megatron-core"},
    "testing": {"integration", "quantization", "megatron-core"},
    "training": {"integration", "comm", "quantization", "config_flags", *TRAINING_PACKAGES,
                 "megatron-core"},
    "tokenizers": {"megatron-core"},
    "cli": {"config_flags", "comm", "guards", "tokenizers", "integration", "megatron-core"},
    "checkpoint": {"guards", "tokenizers", "integration", "megatron-core"},
    "guards": {"integration", "megatron-core"},
    "observe": {"comm", "cli", "megatron-core"},
}


def _part(module: str) -> str | None:
    """The part of the package table that ``module`` belongs to (None: not the package)."""
    parts = module.split(".")
    if parts[:2] != ["megatron", "sdp4bit"]:
        return "megatron-core" if module.startswith(MEGATRON_CORE) else None
    if len(parts) == 2:
        return ""  # the package's own __init__.py: its docstring and version
    if parts[2] == "training" and len(parts) > 3 and parts[3] in TRAINING_PACKAGES:
        return parts[3]
    return parts[2]


def _part_violations(root: Path) -> list[str]:
    bad = []
    for module, path in _package_files(root).items():
        here = _part(module)
        if here == "":
            continue
        if here not in PART_MAY_IMPORT:
            bad.append(f"{_rel(path, root)}: {module} is in no row of the package table: "
                       f"{RULE_PARTS}")
            continue
        allowed = PART_MAY_IMPORT[here] | OPEN | {here}
        for arrow in _arrows(path, root):
            there = _part(arrow.target)
            if there is None or there == "" or there in allowed or _known(path, arrow.target, root):
                continue
            bad.append(f"{_rel(path, root)}:{arrow.line}: {here} imports {arrow.target} "
                       f"({there}): {RULE_PARTS}")
    return bad


def test_package_parts_import_only_what_the_table_allows():
    bad = _part_violations(ROOT)
    assert not bad, "\n".join(bad)


def _table(heading_text: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after the line containing ``heading_text``
    in docs/design.md, header and rule lines left out."""
    lines = DESIGN.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if heading_text in line)
    rows, inside = [], False
    for line in lines[start:]:
        if line.startswith("|"):
            inside = True
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif inside:
            break
    return [r for r in rows[2:]]


def _allowed_in_cell(cell: str) -> tuple[set[str], bool]:
    """The backticked names of a "may import" cell before its first "never", and whether
    megatron-core is among them."""
    allowed = cell.split("never")[0]
    return set(re.findall(r"`([^`]+)`", allowed)), "megatron-core" in allowed


def _short(name: str) -> str:
    """``training/cli/`` -> ``cli``, ``config.py`` -> ``config``, ``training/`` -> ``training``."""
    name = name.rstrip("/").removesuffix(".py")
    return name.split("/")[-1] if name.startswith("training/") else name


def test_the_package_table_states_these_rules():
    """docs/design.md's package table, row by row, allows what :data:`PART_MAY_IMPORT` does."""
    rows = _table("Inside `megatron/sdp4bit/`")
    seen, bad = set(), []
    for cells in rows:
        part = _short(re.findall(r"`([^`]+)`", cells[0])[0])
        seen.add(part)
        names, mcore = _allowed_in_cell(cells[-1])
        stated = {_short(n) for n in names} & set(PART_MAY_IMPORT) - OPEN - {part}
        stated |= {"megatron-core"} if mcore else set()
        wanted = PART_MAY_IMPORT.get(part, set()) - OPEN
        if stated != wanted:
            bad.append(f"row {part}: the doc allows {sorted(stated)}, the test {sorted(wanted)}")
    assert seen == set(PART_MAY_IMPORT), sorted(seen ^ set(PART_MAY_IMPORT))
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the command line at import
def _import_time_closure(start: str, root: Path) -> dict[str, list[str]]:
    """Every module (of the package, or an outside name as imported) that importing ``start``
    imports, with the chain of ``file:line -> module`` steps that gets there. Importing
    ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first, so they are steps too."""
    files = _package_files(root)
    parts = start.split(".")
    chains: dict[str, list[str]] = {".".join(parts[:i]): [] for i in range(1, len(parts) + 1)}
    todo = list(chains)
    while todo:
        module = todo.pop()
        path = files.get(module)
        if path is None:
            continue
        for arrow in _arrows(path, root):
            if not arrow.at_import:
                continue
            parts = arrow.target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step not in chains:
                    chains[step] = chains[module] + [f"{_rel(path, root)}:{arrow.line} -> {step}"]
                    todo.append(step)
    return chains


def _import_time_violations(root: Path) -> list[str]:
    """One line per import of training/cli/ that loads integration/ or megatron-core at import
    time, directly or through the modules it imports: the last import on the way that is
    still in training/cli/ (the one to move into a function), what it loads, and how."""
    forbidden = MEGATRON_CORE + ("megatron.sdp4bit.integration",)
    cli = "megatron/sdp4bit/training/cli/"
    found: dict[str, tuple[set[str], list[str]]] = {}  # file:line -> (what it loads, how)
    for module in _package_files(root):
        if not module.startswith("megatron.sdp4bit.training.cli"):
            continue
        for reached, chain in _import_time_closure(module, root).items():
            if reached not in forbidden:
                continue
            last = max(i for i, step in enumerate(chain) if step.startswith(cli))
            where, first = chain[last].split(" -> ")
            loads, how = found.setdefault(where, (set(), []))
            loads.add(reached)
            if len(chain) - last > len(how):
                how[:] = [f"-> {first}"] + chain[last + 1:]
    return [f"{where}: loads {', '.join(sorted(loads))} when the command line is imported "
            f"({' ; '.join(how)}): {RULE_CLI}" for where, (loads, how) in sorted(found.items())]


def test_the_command_line_loads_no_megatron_core_when_imported():
    bad = _import_time_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_parsing_and_refusing_load_no_megatron_core():
    """The command line's import, ``--help`` and a refused flag, in a fresh interpreter: neither
    megatron-core nor integration/ is loaded (importing megatron-core takes seconds and prints
    its warnings; the refusals are meant to come at once)."""
    code = (
        "import contextlib, io, sys\n"
        "from megatron.sdp4bit.training.cli.arguments import ArgumentsError, parse_args\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try:\n"
        "        parse_args(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "assert '--quantized-weights' in out.getvalue()\n"
        "try:\n"
        "    parse_args('--num-layers 2 --hidden-size 63 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 "
        "--train-iters 2 --lr 1e-3 --mock-data --vocab-size 64'.split())\n"
        "except ArgumentsError as err:\n"
        "    print('refused:', err)\n"
        "print(sorted(m for m in ('megatron.core', 'megatron.training', "
        "'megatron.sdp4bit.integration') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    refused, loaded = res.stdout.splitlines()[-2:]
    assert refused == "refused: --hidden-size=63 is not divisible by --num-attention-heads=4"
    assert loaded == "[]", loaded


# ------------------------------------------------------------------ the folders
# docs/design.md, section 7, the folder table: the repository packages each top-level folder
# may import besides its own modules (tests/: only tests.helpers, a test module never imports
# another). The package megatron.sdp4bit is open to every folder but where PACKAGE_ENTRY says.
FOLDER_MAY_IMPORT = {
    "megatron/sdp4bit/": set(),
    "pretrain_gpt.py": set(),
    "examples/": set(),
    "tools/": set(),
    "benchmarks/": {"dev"},
    "dev/": set(),
    "tests/": {"tests.helpers", "dev", "benchmarks"},
    "tests/helpers/": {"dev"},
}
# What of the package these may import: module names (and, with "*", their submodules).
PACKAGE_ENTRY = {
    "pretrain_gpt.py": ("megatron.sdp4bit.training*",),
    "examples/": ("megatron.sdp4bit.config", "megatron.sdp4bit.integration"),
}


def _folder(path: Path, root: Path) -> str:
    rel = _rel(path, root)
    return max((f for f in FOLDER_MAY_IMPORT if rel == f or f.endswith("/") and rel.startswith(f)),
               key=len)


def _repo_package(target: str, folder: str) -> str | None:
    """The entry of :data:`FOLDER_MAY_IMPORT` a repository module falls under (None: not a
    repository package, or the folder's own)."""
    top = target.split(".")[0]
    if top not in REPO_PACKAGES:
        return None
    if top == "tests":
        return "tests.helpers" if target.startswith("tests.helpers") else "tests"
    return None if folder.split("/")[0] == top else top


def _folder_violations(root: Path) -> list[str]:
    bad = []
    for path in _python_files(root):
        folder = _folder(path, root)
        entry = PACKAGE_ENTRY.get(folder)
        for arrow in _arrows(path, root):
            if _known(path, arrow.target, root):
                continue
            if arrow.target == "pretrain_gpt" or arrow.target.endswith(".pretrain_gpt"):
                bad.append(f"{_rel(path, root)}:{arrow.line}: imports the entry point "
                           f"pretrain_gpt.py: {RULE_FOLDERS}")
            package = _repo_package(arrow.target, folder)
            if package is not None and package not in FOLDER_MAY_IMPORT[folder] \
                    and not (folder == "tests/helpers/" and package == "tests.helpers"):
                bad.append(f"{_rel(path, root)}:{arrow.line}: {folder} imports {arrow.target}: "
                           f"{RULE_FOLDERS}")
            if entry and arrow.target.startswith("megatron.sdp4bit") and not any(
                    arrow.target == e.rstrip("*")
                    or e.endswith("*") and arrow.target.startswith(e.rstrip("*") + ".")
                    for e in entry):
                bad.append(f"{_rel(path, root)}:{arrow.line}: {folder} imports {arrow.target}, "
                           f"not one of {', '.join(entry)}: {RULE_FOLDERS}")
    return bad


def test_folders_import_only_what_the_map_allows():
    bad = _folder_violations(ROOT)
    assert not bad, "\n".join(bad)


def test_the_folder_table_states_these_rules():
    """docs/design.md's folder table, row by row, allows the repository packages that
    :data:`FOLDER_MAY_IMPORT` does."""
    rows = {re.findall(r"`([^`]+)`", cells[0])[0]: cells[-1]
            for cells in _table("| folder | what it is |") if cells[0].startswith("`")}
    bad = []
    for folder, wanted in FOLDER_MAY_IMPORT.items():
        if folder not in rows:
            bad.append(f"{folder}: no row")
            continue
        names, _ = _allowed_in_cell(rows[folder])
        stated = {n for n in names if n.split(".")[0] in REPO_PACKAGES}
        stated = {"tests.helpers" if n.startswith("tests.helpers") else n.split(".")[0]
                  for n in stated}
        if stated != wanted:
            bad.append(f"{folder}: the doc allows {sorted(stated)}, the test {sorted(wanted)}")
    assert not bad, "\n".join(bad)


def test_the_cuda_dry_run_is_imported_only_by_its_tool():
    users = sorted({_rel(p) for p in _python_files(ROOT)
                    if not _rel(p).startswith("megatron/sdp4bit/testing/")
                    for a in _arrows(p) if a.target == "megatron.sdp4bit.testing"
                    or a.target.startswith("megatron.sdp4bit.testing.")})
    assert users == ["dev/cuda_dryrun.py"], users


# ------------------------------------------------------------------ private names
def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owner_kind(module: str) -> str | None:
    """'repo' for a module of the repository, 'mcore' for megatron-core's, else None."""
    if module.startswith(MEGATRON_CORE):
        return "mcore"
    top = module.split(".")[0]
    if module.startswith("megatron.sdp4bit") or top in REPO_PACKAGES:
        return "repo"
    return None


def _private_violations(root: Path) -> list[str]:
    bad = []
    for path in _python_files(root):
        rel = _rel(path, root)
        if rel.startswith(("tests/", "dev/")):
            continue
        mcore_ok = rel.startswith(("megatron/sdp4bit/integration/", "megatron/sdp4bit/testing/"))
        rules = {"repo": RULE_PRIVATE, "mcore": None if mcore_ok else RULE_MCORE_PRIVATE}
        bound: dict[str, str] = {}  # local name -> the dotted name it stands for
        for arrow in _arrows(path, root):
            kind = _owner_kind(arrow.target)
            if kind is None or arrow.by_name:
                continue
            hidden = [p for p in arrow.target.split(".") if _private(p)] + [
                n for n in arrow.names if _private(n)]
            if hidden and rules[kind]:
                bad.append(f"{rel}:{arrow.line}: imports {arrow.target} "
                           f"{', '.join(hidden)}: {rules[kind]}")
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            dotted = _dotted(node)
            if not dotted or dotted[0] not in bound:
                continue
            full = ".".join([bound[dotted[0]]] + dotted[1:])
            kind = _owner_kind(full)
            if kind and rules[kind]:
                bad.append(f"{rel}:{node.lineno}: reads {full}: {rules[kind]}")
    return sorted(set(bad))


def test_no_private_names_read_across_modules():
    bad = _private_violations(ROOT)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ the allow-list
def test_every_known_violation_still_occurs():
    """An entry of :data:`KNOWN_VIOLATIONS` whose import is gone is deleted, so that the list
    only shrinks."""
    stale = []
    for rel, target in sorted(KNOWN_VIOLATIONS):
        path = ROOT / rel
        if not path.exists() or all(a.target != target for a in _arrows(path)):
            stale.append(f"{rel} -> {target}: fixed; delete its entry of KNOWN_VIOLATIONS")
    assert not stale, "\n".join(stale)


# ------------------------------------------------------------------ the checks can fail
def _plant(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_each_rule_names_the_planted_file_and_line(tmp_path):
    """A tree with one violation of each rule: every check names its file:line and rule, and
    passes what the rule allows (an import at call time in the command line)."""
    _plant(tmp_path, {
        "megatron/sdp4bit/__init__.py": "",
        "megatron/sdp4bit/comm/__init__.py": "",
        "megatron/sdp4bit/comm/planted.py": "import os\n"
                                            "from megatron.sdp4bit.training import loop\n",
        "megatron/sdp4bit/integration/__init__.py": "import megatron.core\n",
        "megatron/sdp4bit/integration/install.py": "def _private(): pass\n",
        "megatron/sdp4bit/training/__init__.py": "",
        "megatron/sdp4bit/training/loop.py": "",
        "megatron/sdp4bit/training/cli/__init__.py": "",
        "megatron/sdp4bit/training/cli/lazy.py": (
            "def walk():\n    from megatron.sdp4bit.integration import install\n"),
        "megatron/sdp4bit/training/cli/eager.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from megatron.sdp4bit.integration import install\n"
            "from megatron.sdp4bit.training.cli import chain\n"),
        "megatron/sdp4bit/training/cli/chain.py": "from megatron.sdp4bit.comm import helper\n",
        "megatron/sdp4bit/comm/helper.py": "from megatron.core import parallel_state\n",
        "megatron/sdp4bit/training/observe/__init__.py": "",
        "megatron/sdp4bit/training/observe/counters.py": (
            "def topology():\n    from megatron.sdp4bit.integration.install import _private\n"),
        "benchmarks/__init__.py": "",
        "benchmarks/bench.py": (
            "from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer\n"
            "from megatron.sdp4bit.integration import install\n"
            "def run():\n"
            "    from tests.helpers.trainer import TINY\n"
            "    DistributedOptimizer._build_gbuf_range_map(None)\n"
            "    return install._private()\n"),
        "examples/own_loop.py": "from megatron.sdp4bit.integration.install import install_sdp4bit\n",
    })
    assert _layer_violations(tmp_path) == [
        f"megatron/sdp4bit/comm/planted.py:2: imports megatron.sdp4bit.training.loop: {RULE_LAYERS}"]
    parts = _part_violations(tmp_path)
    assert ("megatron/sdp4bit/training/observe/counters.py:2: observe imports "
            f"megatron.sdp4bit.integration.install (integration): {RULE_PARTS}") in parts
    assert ("megatron/sdp4bit/comm/helper.py:1: comm imports megatron.core (megatron-core): "
            f"{RULE_PARTS}") in parts
    # eager.py reaches megatron-core at import time through chain.py, whose import is the one
    # to move; lazy.py imports integration at call time, which the rule allows.
    assert _import_time_violations(tmp_path) == [
        "megatron/sdp4bit/training/cli/chain.py:1: loads megatron.core when the command line is "
        "imported (-> megatron.sdp4bit.comm.helper ; megatron/sdp4bit/comm/helper.py:1 -> "
        f"megatron.core): {RULE_CLI}"]
    assert _folder_violations(tmp_path) == [
        f"benchmarks/bench.py:4: benchmarks/ imports tests.helpers.trainer: {RULE_FOLDERS}",
        "examples/own_loop.py:1: examples/ imports megatron.sdp4bit.integration.install, not one "
        f"of megatron.sdp4bit.config, megatron.sdp4bit.integration: {RULE_FOLDERS}"]
    assert _private_violations(tmp_path) == [
        "benchmarks/bench.py:5: reads megatron.core.optimizer.distrib_optimizer."
        f"DistributedOptimizer._build_gbuf_range_map: {RULE_MCORE_PRIVATE}",
        f"benchmarks/bench.py:6: reads megatron.sdp4bit.integration.install._private: {RULE_PRIVATE}",
        "megatron/sdp4bit/training/observe/counters.py:2: imports "
        f"megatron.sdp4bit.integration.install _private: {RULE_PRIVATE}"]


def test_imports_by_name_are_arrows_too(tmp_path):
    """A planted module that imports upward only by name (a string it walks, a literal
    argument, ``__import__``) is seen, by the layer check and by the dry run's."""
    _plant(tmp_path, {"megatron/sdp4bit/comm/planted.py": (
        "import importlib\n"
        "DECLARED = ('megatron.sdp4bit.training.loop', 'not a module')\n"
        "def load():\n"
        "    for m in DECLARED:\n"
        "        importlib.import_module(m)\n"
        "    importlib.import_module('megatron.sdp4bit.integration.install')\n"
        "    __import__('megatron.sdp4bit.testing.cuda_dryrun')\n"),
        "megatron/sdp4bit/training/loop.py": "", "megatron/sdp4bit/integration/install.py": "",
        "megatron/sdp4bit/testing/cuda_dryrun.py": ""})
    arrows = _arrows(tmp_path / "megatron/sdp4bit/comm/planted.py", tmp_path)
    assert {a.target for a in arrows if a.by_name} == {
        "megatron.sdp4bit.training.loop", "megatron.sdp4bit.integration.install",
        "megatron.sdp4bit.testing.cuda_dryrun"}
    assert not any(a.at_import for a in arrows if a.by_name)  # the calls are in a function
    assert len(_layer_violations(tmp_path)) == 2
    # the library's own by-name imports: the replacement table's modules, all in integration/
    graph = _graph()
    assert "megatron.sdp4bit.integration.dist_checkpointing" in \
        graph["megatron.sdp4bit.integration.patches"]
