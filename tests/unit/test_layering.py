"""The package's import graph: no cycle, and every arrow points down.

Read from the source with ``ast`` (every ``import``, at module level or inside a function,
and every import by name: ``importlib.import_module("...")`` / ``__import__("...")``, and the
module names a file that imports by name holds as strings, such as a list it walks), so a
lazy import that closes a cycle or climbs a layer is seen too.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron" / "sdp4bit"
# Layers, top to bottom: a module may import its own layer and the ones below it.
LAYERS = ["training", "integration", "comm", "quantization"]
# training/'s packages that must not reach the run files at training/'s top.
LEAF_PACKAGES = ("cli", "guards", "observe", "tokenizers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


_BY_NAME = ("import_module", "__import__")


def _by_name(tree: ast.AST, modules: set[str] | None = None) -> set[str]:
    """What ``tree`` imports by name: the string given to ``importlib.import_module`` or
    ``__import__``, and, in a file that imports by name at all, every string constant that
    is one of ``modules`` (``for m in DECLARED_IN: import_module(m)``)."""
    found, calls = set(), False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (
                isinstance(node.func, ast.Name) and node.func.id in _BY_NAME
                or isinstance(node.func, ast.Attribute) and node.func.attr in _BY_NAME):
            calls = True
            if node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                found.add(node.args[0].value)
    if calls and modules:
        found |= {n.value for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in modules}
    return found


def _imports(path: Path, name: str, modules: set[str], by_name: bool = True) -> set[str]:
    """The megatron.sdp4bit modules (or packages) ``path`` imports: ``from pkg import sub``
    is an arrow to ``pkg.sub`` when that is a module, else to ``pkg`` (a name defined there);
    imports by name (:func:`_by_name`) too, unless ``by_name`` is False."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = _by_name(tree, modules) if by_name else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph(by_name: bool = True) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(modules), by_name) for name, path in modules.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in LAYERS else None


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


def test_layers_only_import_downward():
    bad = []
    for module, targets in _graph().items():
        here = _layer(module)
        for target in targets:
            there = _layer(target)
            if here and there and LAYERS.index(there) < LAYERS.index(here):
                bad.append(f"{module} -> {target}")
    assert not bad, bad


def test_training_packages_do_not_import_the_run_files():
    training = "megatron.sdp4bit.training."
    bad = []
    for module, targets in _graph().items():
        if not module.startswith(training):
            continue
        room = module[len(training):].split(".")[0]
        if room not in LEAF_PACKAGES:
            continue
        for target in targets:
            rest = target[len(training):] if target.startswith(training) else ""
            if rest and "." not in rest and rest not in LEAF_PACKAGES + ("checkpoint",):
                bad.append(f"{module} -> {target}")  # a run file at training/'s top
    assert not bad, bad


def test_nothing_imports_the_entry_point():
    users = [p for p in list(PACKAGE.rglob("*.py")) + list((ROOT / "tools").rglob("*.py"))
             if "pretrain_gpt" in _imports_any(p)]
    assert not users, users


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.AST:
    """A file's syntax tree, parsed once for all the tests of this module."""
    return ast.parse(path.read_text(encoding="utf-8"))


def _imports_any(path: Path) -> set[str]:
    names = _by_name(_tree(path))
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# docs/design.md, "The repository, folder by folder": what each top-level folder may import
# from the others (the package itself is open to all of them).
MAY_IMPORT = {
    "megatron": set(),
    "tools": set(),
    "examples": set(),
    "dev": {"dev"},
    "benchmarks": {"benchmarks", "tests.helpers"},
    "tests": {"tests.helpers", "dev", "benchmarks"},
}
REPO_PACKAGES = ("tests", "dev", "benchmarks", "tools", "examples")


def _repo_imports(path: Path) -> set[str]:
    """The absolute imports of ``path`` that name a package of the repository other than
    ``megatron``, as written (``tests.helpers.trainer``, ``dev``...)."""
    return {m for m in _imports_any(path)
            if m.split(".")[0] in REPO_PACKAGES}


def test_folders_import_only_what_the_map_allows():
    bad = []
    for folder, allowed in MAY_IMPORT.items():
        for path in (ROOT / folder).rglob("*.py"):
            for module in _repo_imports(path):
                if not any(module == a or module.startswith(a + ".") for a in allowed):
                    bad.append(f"{path.relative_to(ROOT)} -> {module}")
    assert not bad, bad


def test_the_cuda_dry_run_is_imported_only_by_its_tool():
    users = sorted(str(p.relative_to(ROOT))
                   for folder in ("megatron", "tools", "dev", "benchmarks", "tests")
                   for p in (ROOT / folder).rglob("*.py") if _imports_testing(p))
    assert users == ["dev/cuda_dryrun.py"], users


def _imports_testing(path: Path) -> bool:
    """Whether ``path`` imports ``megatron.sdp4bit.testing`` (or a module of it), in any
    spelling (``import megatron.sdp4bit.testing...``, ``from megatron.sdp4bit import testing``,
    ``importlib.import_module("megatron.sdp4bit.testing...")``)."""
    by_name = _by_name(_tree(path))
    if any(n == "megatron.sdp4bit.testing" or n.startswith("megatron.sdp4bit.testing.")
           for n in by_name):
        return True
    for node in ast.walk(_tree(path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == "megatron.sdp4bit.testing" or n.startswith("megatron.sdp4bit.testing.")
               for n in names):
            return True
    return False


def test_imports_by_name_are_arrows_too(tmp_path):
    """A planted module that imports upward only by name (a string it walks, a literal
    argument, ``__import__``) is seen, by the layer check and by the dry run's."""
    planted = tmp_path / "megatron" / "sdp4bit" / "comm" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text(
        "import importlib\n"
        "DECLARED = ('megatron.sdp4bit.training.loop', 'not a module')\n"
        "def load():\n"
        "    for m in DECLARED:\n"
        "        importlib.import_module(m)\n"
        "    importlib.import_module('megatron.sdp4bit.integration.install')\n"
        "    __import__('megatron.sdp4bit.testing.cuda_dryrun')\n", encoding="utf-8")
    modules = {"megatron.sdp4bit.training.loop", "megatron.sdp4bit.integration.install",
               "megatron.sdp4bit.testing.cuda_dryrun", "megatron.sdp4bit.comm.planted"}
    found = _imports(planted, "megatron.sdp4bit.comm.planted", modules)
    assert found == modules - {"megatron.sdp4bit.comm.planted"}
    assert _imports_testing(planted)
    # the library's own by-name imports: the replacement table's modules, all in integration/
    graph = _graph()
    assert "megatron.sdp4bit.integration.dist_checkpointing" in \
        graph["megatron.sdp4bit.integration.patches"]
