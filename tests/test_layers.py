"""The package's layers import only downwards.

The layers, in the README's order (section "Architecture: one plan, layers that import downwards"), from the ground up:
the flags' number types (``flag_types.py``), schedule/ and planning/ (pure), runtime/ (torch), the flags
(``config.py``), integration/ (Megatron), the package's ``__init__`` (``install()``), cli/ (the subcommands),
training/ (the entry point); each imports only the layers before it. bench/ (measurements), study/ (the paper-scale
study) and data/ (the demo corpus and its tokenizer) are wings built on them, which no layer imports and which do not
import each other (bench/ may prepare its data with data/). On top, the command's table (``command.py``) gathers the
subcommands of cli/ and of the wings. Every module is parsed with ``ast``; its imports at any depth (module level and
inside functions), relative ones resolved, are checked against the rules below.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = "megatron_pipemesh"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
FLAG_TYPES, FLAGS, ROOT_MODULE, COMMAND_LINE, TABLE = "flag_types", "config", "", "cli", "command"
"""The layers of the loose top-level modules (:func:`layer`); the package's ``__init__`` is its own ("")."""
LAYERS = (FLAG_TYPES, "schedule", "planning", "runtime", FLAGS, "integration", ROOT_MODULE, COMMAND_LINE, "training")
"""The layers from the ground up, each above the ones before it (the README's order)."""
WINGS = ("bench", "study", "data")
WING_USES = {"bench": ("data",)}
"""The one wing another wing may import: bench/ prepares its data with data/."""

FORBIDDEN: Dict[str, Tuple[str, ...]] = {
    **{name: LAYERS[i + 1:] + WINGS + (TABLE,) for i, name in enumerate(LAYERS)},
    **{wing: tuple(w for w in WINGS if w != wing and w not in WING_USES.get(wing, ())) + (TABLE,) for wing in WINGS},
    TABLE: (),
}
"""Layer -> the layers its modules must not import: a layer none above it in :data:`LAYERS`, nor a wing, nor the
command's table; a wing neither another wing (but :data:`WING_USES`) nor the table."""


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
    """The top-level subpackage or loose module of a module of the package (``cli``, ``config``, ``command``,
    ...); '' for the package itself."""
    parts = module.split(".")
    return ROOT_MODULE if len(parts) == 1 else parts[1]


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
    # The command's table: function-level imports of the wings' subcommands.
    table = set(imports(ROOT / "command.py"))
    assert {"megatron_pipemesh.bench.cli", "megatron_pipemesh.study.study", "megatron_pipemesh.study.headroom"} <= table
    assert layer("megatron_pipemesh.cli") == layer("megatron_pipemesh.cli.plan") == COMMAND_LINE
    assert layer("megatron_pipemesh.config") == FLAGS and layer("megatron_pipemesh.command") == TABLE
    assert layer("megatron_pipemesh.study") == layer("megatron_pipemesh.study.rows") == "study"
    assert layer("megatron_pipemesh") == ROOT_MODULE


def test_layers_import_only_downwards():
    """Each layer imports only the layers before it in :data:`LAYERS` (schedule/ neither planning/ nor runtime/, the
    flags not cli/, cli/ not training/, ...), none imports a wing or the command's table, and the wings do not import
    each other (:data:`FORBIDDEN`)."""
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
    """Planted upward imports (schedule -> planning, planning -> runtime, runtime -> the flags, the flags -> cli/, cli/
    -> bench/) are reported, and downward ones (planning -> schedule, bench/ -> cli/) are not (so an empty answer
    means something)."""
    package = tmp_path / PACKAGE
    for sub in ("", "schedule", "planning", "runtime", "cli", "bench"):
        (package / sub).mkdir(exist_ok=True)
        (package / sub / "__init__.py").write_text("")
    (package / "config.py").write_text("from .cli.common import positive_int\n")
    (package / "cli" / "common.py").write_text("")
    (package / "cli" / "parser.py").write_text("def f():\n    from ..bench.cli import add_bench_parser\n")
    (package / "bench" / "cli.py").write_text("from ..cli.common import positive_int\n")
    (package / "schedule" / "order.py").write_text("def f():\n    from ..planning.costs import price\n")
    (package / "planning" / "costs.py").write_text("from ..runtime.executor import run\nfrom ..schedule import order\n")
    (package / "runtime" / "executor.py").write_text("from megatron_pipemesh.config import X\n")
    monkeypatch.setitem(globals(), "ROOT", package)
    assert violations() == {(f"{PACKAGE}.schedule.order", f"{PACKAGE}.planning.costs"),
                            (f"{PACKAGE}.planning.costs", f"{PACKAGE}.runtime.executor"),
                            (f"{PACKAGE}.runtime.executor", f"{PACKAGE}.config"),
                            (f"{PACKAGE}.config", f"{PACKAGE}.cli.common"),
                            (f"{PACKAGE}.cli.parser", f"{PACKAGE}.bench.cli")}


def test_planning_holds_no_study_code():
    """The study's drivers live in study/, not in the product's planning layer."""
    assert not (ROOT / "planning" / "study.py").exists() and not (ROOT / "planning" / "headroom.py").exists()


MAX_MODULE_LINES = 600
"""The most lines a module of the package may have (the README's house rules)."""


def modules_over(limit: int, root: Path = ROOT) -> List[Tuple[str, int]]:
    """Every module under ``root`` with more than ``limit`` lines, with its count."""
    counts = ((str(path.relative_to(root.parent)), len(path.read_text().splitlines())) for path in root.rglob("*.py"))
    return sorted((name, lines) for name, lines in counts if lines > limit)


def test_every_module_stays_under_the_line_limit(tmp_path):
    """No module of the package over :data:`MAX_MODULE_LINES` lines; a module one line over is found."""
    assert not modules_over(MAX_MODULE_LINES), modules_over(MAX_MODULE_LINES)
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (package / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    assert modules_over(MAX_MODULE_LINES, package) == [(f"{PACKAGE}/long.py", MAX_MODULE_LINES + 1)]
