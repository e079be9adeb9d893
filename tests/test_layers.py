"""The package's layers import only downwards.

The product's layers are schedule/ and planning/ (pure), runtime/ (torch), integration/ (Megatron) and
training/ (the entry point); bench/ (measurements) and study/ (the paper-scale study) are wings built on them.
Every module is parsed with ``ast``; its imports at any depth (module level and inside functions), relative
ones resolved, are checked against the rules below.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = "megatron_pipemesh"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
PRODUCT = ("schedule", "planning", "runtime", "integration", "training")

FORBIDDEN: Dict[str, Tuple[str, ...]] = {
    "schedule": ("integration", "training", "bench", "study"),
    "planning": ("integration", "training", "bench", "study"),
    "runtime": ("integration", "training", "bench", "study"),
    "integration": ("study",),
    "training": ("bench", "study"),
}
"""Layer -> the layers its modules must not import."""

def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of this repository's package."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> Iterator[str]:
    """The package's modules that ``path`` imports, at any depth, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from X import y`` imports X, and X.y when y is a module
            targets = [module] + [f"{module}.{a.name}" for a in node.names if is_module(f"{module}.{a.name}")]
        else:
            continue
        yield from (t for t in targets if t == PACKAGE or t.startswith(PACKAGE + "."))


def layer(module: str) -> str:
    """The top-level subpackage of a module of the package ('' for the package's own top-level modules)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else ""


def violations() -> Set[Tuple[str, str]]:
    found = set()
    for path in sorted(ROOT.rglob("*.py")):
        importer = module_name(path)
        banned = FORBIDDEN.get(layer(importer), ())
        for imported in imports(path):
            if layer(imported) in banned:
                found.add((importer, imported))
    return found


def test_import_resolution():
    """Relative imports at any depth resolve to the package's modules (the walker sees what Python sees)."""
    executor = set(imports(ROOT / "runtime" / "executor.py"))
    assert "megatron_pipemesh.runtime.memory" in executor and "megatron_pipemesh.schedule.ops" in executor
    cli = set(imports(ROOT / "cli.py"))  # function-level imports of the subcommands
    assert {"megatron_pipemesh.bench.cli", "megatron_pipemesh.study.study", "megatron_pipemesh.study.headroom"} <= cli
    assert layer("megatron_pipemesh.cli") == "" and layer("megatron_pipemesh.study") == "study"


def test_layers_import_only_downwards():
    """No product layer imports the study wing; schedule/, planning/ and runtime/ import neither integration/,
    training/ nor the wings; training/ imports neither wing."""
    found = sorted(violations())
    assert not found, "layer violations (importer -> imported):\n" + "\n".join(f"{a} -> {b}" for a, b in found)


def import_cycles() -> List[List[str]]:
    """Every set of the package's modules that import each other in a circle (strongly connected components of
    more than one module, or a module importing itself), by Tarjan's algorithm."""
    graph = {module_name(path): set(imports(path)) for path in sorted(ROOT.rglob("*.py"))}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    cycles: List[List[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycle():
    """No module of the package imports, directly or through others, a module that imports it back (imports at any
    depth count: a function-level import closes a cycle as much as a module-level one)."""
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles(tmp_path, monkeypatch):
    """A planted two-module cycle is reported (so an empty answer means something)."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "c.py").write_text("from .a import b\n")
    monkeypatch.setitem(globals(), "ROOT", package)  # the walker reads the module's ROOT
    assert import_cycles() == [[f"{PACKAGE}.a", f"{PACKAGE}.b"]]


def test_planning_holds_no_study_code():
    """The study's drivers live in study/, not in the product's planning layer."""
    assert not (ROOT / "planning" / "study.py").exists() and not (ROOT / "planning" / "headroom.py").exists()
