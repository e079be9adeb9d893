"""The package's layers import only downwards.

The product's layers, in the README's order (section "Architecture: one plan, layers that import downwards"), are
schedule/ and planning/ (pure), runtime/ (torch), integration/ (Megatron) and training/ (the entry point); each
imports only the layers before it. bench/ (measurements) and study/ (the paper-scale study) are wings built on them,
with data/ (the demo corpus and its tokenizer), which no product layer imports and which do not import each other.
The package's loose top-level modules are the command line (``cli*.py``, or a ``cli/`` package: it may import
everything) and the flags (``config.py``, read by integration/ and training/, never by the pure layers or the
runtime). Every module is parsed with ``ast``; its imports at any depth (module level and inside functions),
relative ones resolved, are checked against the rules below.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = "megatron_pipemesh"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
PRODUCT = ("schedule", "planning", "runtime", "integration", "training")
"""The product's layers, each above the next."""
WINGS = ("bench", "study", "data")
COMMAND_LINE, FLAGS, ROOT_MODULE = "cli", "config", ""
"""The layers of the loose top-level modules (:func:`layer`); the package's ``__init__`` is its own ("")."""

FORBIDDEN: Dict[str, Tuple[str, ...]] = {
    **{name: PRODUCT[i + 1:] + WINGS + (COMMAND_LINE, FLAGS, ROOT_MODULE)
       for i, name in enumerate(PRODUCT[:3])},
    "integration": ("training",) + WINGS + (COMMAND_LINE,),
    "training": WINGS + (COMMAND_LINE,),
    FLAGS: ("runtime", "integration", "training") + WINGS,
    "bench": ("study",),
    "study": ("bench", "data"),
}
"""Layer -> the layers its modules must not import: a product layer none below it, no wing and not the command
line; the pure layers and the runtime not the flags nor the package root (whose ``__init__`` imports integration/);
the flags only the pure layers; the wings not each other (bench/ prepares its data with data/)."""


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
    """The top-level subpackage of a module of the package; for its loose top-level modules, :data:`COMMAND_LINE`
    (``cli``, ``cli_*``) or :data:`FLAGS` (``config``); '' for the package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return ROOT_MODULE
    if parts[1] == "cli" or parts[1].startswith("cli_"):
        return COMMAND_LINE
    return parts[1]


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
    # The pipemesh command, a module or a package of subcommands: function-level imports of the subcommands.
    files = [ROOT / "cli.py"] if (ROOT / "cli.py").is_file() else sorted((ROOT / "cli").rglob("*.py"))
    cli = set().union(*(imports(path) for path in files))
    assert {"megatron_pipemesh.bench.cli", "megatron_pipemesh.study.study", "megatron_pipemesh.study.headroom"} <= cli
    assert layer("megatron_pipemesh.cli") == layer("megatron_pipemesh.cli.plan") == layer("megatron_pipemesh.cli_advice")
    assert layer("megatron_pipemesh.cli") == COMMAND_LINE and layer("megatron_pipemesh.config") == FLAGS
    assert layer("megatron_pipemesh.study") == layer("megatron_pipemesh.study.rows") == "study"
    assert layer("megatron_pipemesh") == ROOT_MODULE


def test_layers_import_only_downwards():
    """Each product layer imports only the layers before it (schedule/ neither planning/ nor runtime/, planning/ not
    runtime/, ...), none imports a wing or the command line, and the wings do not import each other
    (:data:`FORBIDDEN`)."""
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


def test_the_rules_find_an_upward_import(tmp_path, monkeypatch):
    """Planted upward imports (schedule -> planning, planning -> runtime, runtime -> the flags) are reported, and a
    downward one is not (so an empty answer means something)."""
    package = tmp_path / PACKAGE
    for sub in ("", "schedule", "planning", "runtime"):
        (package / sub).mkdir(exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "config.py").write_text("")
    (package / "schedule" / "order.py").write_text("def f():\n    from ..planning.costs import price\n")
    (package / "planning" / "costs.py").write_text("from ..runtime.executor import run\nfrom ..schedule import order\n")
    (package / "runtime" / "executor.py").write_text("from megatron_pipemesh.config import X\n")
    monkeypatch.setitem(globals(), "ROOT", package)
    assert violations() == {(f"{PACKAGE}.schedule.order", f"{PACKAGE}.planning.costs"),
                            (f"{PACKAGE}.planning.costs", f"{PACKAGE}.runtime.executor"),
                            (f"{PACKAGE}.runtime.executor", f"{PACKAGE}.config")}


def test_planning_holds_no_study_code():
    """The study's drivers live in study/, not in the product's planning layer."""
    assert not (ROOT / "planning" / "study.py").exists() and not (ROOT / "planning" / "headroom.py").exists()
