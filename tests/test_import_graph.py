"""hpsjax stands in layers, and its modules import one another without circles.

The graph is read from the source (``ast``), not by importing: an edge from
module A to module B for every ``import`` in A that loads B, and to each
package above B that A is not inside (importing ``hpsjax.wire._frames`` runs
``hpsjax/wire/__init__.py`` first). Imports inside functions count too: an import
moved into a function to dodge a circle still makes one, only later. On that
graph: no circle of modules (hpsjax's or the experiments'), every package
imports only its own layer and those below it (:data:`LAYERS`), so packages
make no circle either, and no module imports a private name (one part of its
dotted path starts with ``_``) of a package it is not inside.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hpsjax"


def _modules(package: pathlib.Path = PACKAGE) -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _from(module: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports resolved."""
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
    return base


def _targets(module: str, path: pathlib.Path, node: ast.AST, modules) -> list[str]:
    """The hpsjax modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = _from(module, path, node)
    named = [f"{base}.{alias.name}" for alias in node.names]
    submodules = [name for name in named if name in modules]
    return submodules if len(submodules) == len(node.names) else [base, *submodules]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in (
        "TYPE_CHECKING",
        "typing.TYPE_CHECKING",
    )


def _imports(tree: ast.Module, *, inner: bool) -> list[ast.stmt]:
    """The module's import statements: at its top level (under ``if``/``try``
    too, but not ``if TYPE_CHECKING``), and with ``inner`` those in its
    functions and classes."""
    found = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif _is_type_checking(node):
                continue
            elif isinstance(node, ast.If | ast.Try | ast.With):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif inner and isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            ):
                visit([n for n in ast.walk(node) if n is not node])

    visit(tree.body)
    return found


def import_graph(
    *, inner: bool, package: pathlib.Path = PACKAGE
) -> dict[str, set[str]]:
    modules = _modules(package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text()), inner=inner):
            for target in _targets(module, path, node, modules):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    loaded = ".".join(parts[:i])
                    inside = module == loaded or module.startswith(loaded + ".")
                    if loaded in modules and not inside:
                        graph[module].add(loaded)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


LAYERS: tuple[tuple[str, ...], ...] = (
    ("hpsjax",),  # the package's lazy re-exports
    ("hpsjax.launch",),  # starts the server and the workers
    ("hpsjax.config",),  # one run configuration, and the command lines from it
    ("hpsjax.cli",),  # hpsjax-worker: trains, or profiles itself in place
    ("hpsjax.ps",),  # the server's command line; re-exports the layers below
    ("hpsjax.sim",),  # drives the real cores on a virtual clock
    ("hpsjax.profiling",),  # measurement: the profiling pass, the pilot
    ("hpsjax.worker",),  # WorkerCore and its asyncio runtime
    ("hpsjax.net", "hpsjax.export"),  # asyncio server, clients, shards, auth
    ("hpsjax.decisions",),  # ServerCore and the policies
    ("hpsjax.apply",),  # the aggregator and its deferred and overlapped variants
    ("hpsjax.planning",),  # the plan from fitted costs: pure arithmetic
    ("hpsjax.wire", "hpsjax.storage", "hpsjax.telemetry"),
    (
        "hpsjax.transforms",
        "hpsjax.models",
        "hpsjax.data",
        "hpsjax.tasks",
        "hpsjax.metrics",
        "hpsjax._optimizers",
        "hpsjax._config_flags",
        "hpsjax._devices",
        "hpsjax._compile_cache",
        "hpsjax._logs",
        "hpsjax._progress",
    ),
    (
        "hpsjax._checks",
        "hpsjax._ewma",
        "hpsjax._npz",
        "hpsjax._factory",
        "hpsjax._flags",
        "hpsjax._lru",
        "hpsjax._project",
    ),
)
"""hpsjax's packages (and top-level modules), top to bottom: each imports only
those of its own row and of the rows below it."""

ARROWS_UP: dict[tuple[str, str], str] = {}
"""The imports (module, package) still running up the layers, each with why and
until when. An entry the code no longer needs fails the test: remove it."""


PRIVATE_IMPORTS_LEFT: frozenset[str] = frozenset()
"""The private names still imported across packages (importer -> private module
or name). The list only shrinks: a new one fails the test, and so does an entry
the code no longer needs."""


def unit(module: str) -> str:
    """The package (or top-level module) of hpsjax that ``module`` is part of."""
    return ".".join(module.split(".")[:2])


def arrows_up(graph: dict[str, set[str]], layers=LAYERS) -> list[tuple[str, str]]:
    """The imports ``(module, package)`` from a package up to one above it."""
    rank = {u: i for i, row in enumerate(layers) for u in row}
    unplaced = sorted({unit(m) for m in graph} - set(rank))
    assert not unplaced, f"in no layer of LAYERS: {unplaced} (add each to a row)"
    return sorted(
        {
            (a, unit(b))
            for a, targets in graph.items()
            for b in targets
            if rank[unit(b)] < rank[unit(a)]
        }
    )


def package_graph(graph: dict[str, set[str]], skip=()) -> dict[str, set[str]]:
    """The graph of packages: an edge where a module of one imports another's,
    leaving out the imports ``(module, package)`` in ``skip``."""
    packages: dict[str, set[str]] = {unit(m): set() for m in graph}
    for a, targets in graph.items():
        for b in targets:
            if unit(a) != unit(b) and (a, unit(b)) not in skip:
                packages[unit(a)].add(unit(b))
    return packages


def _owner(dotted: str) -> str | None:
    """The package a private name belongs to (the path up to its first part
    that starts with one underscore), or ``None`` for a public name."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i]) or None
    return None


def private_imports(package: pathlib.Path = PACKAGE) -> list[str]:
    """The imports of a private name by a module outside the package that
    holds it, as ``"importer -> private module (or name)"``."""
    modules = _modules(package)
    found = set()
    for module, path in modules.items():
        for node in _imports(ast.parse(path.read_text()), inner=True):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = _from(module, path, node)
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                owner = _owner(name)
                inside = owner is not None and (
                    module == owner or module.startswith(owner + ".")
                )
                if owner is not None and owner.split(".")[0] == "hpsjax" and not inside:
                    private = name.split(".")[: len(owner.split(".")) + 1]
                    found.add(f"{module} -> {'.'.join(private)}")
    return sorted(found)


def _described(graph, component) -> str:
    return "; ".join(
        f"{m} -> {', '.join(sorted(graph[m] & set(component)))}" for m in component
    )


@pytest.mark.parametrize("inner", [False, True], ids=["top_level", "with_inner"])
def test_hpsjax_modules_import_each_other_without_circles(inner):
    graph = import_graph(inner=inner)
    assert len(graph) > 50 and graph["hpsjax.launch._ray"]  # the graph is read
    found = cycles(graph)
    assert not found, " | ".join(_described(graph, c) for c in found)


def test_the_experiments_import_each_other_without_circles():
    graph = import_graph(inner=True, package=ROOT / "experiments")
    assert graph["experiments.registry"] and graph["experiments.train"]
    found = cycles(graph)
    assert not found, " | ".join(_described(graph, c) for c in found)


def test_every_package_imports_only_its_layer_and_those_below():
    graph = import_graph(inner=True)
    found = arrows_up(graph)
    unexplained = [arrow for arrow in found if arrow not in ARROWS_UP]
    assert not unexplained, f"imports running up the layers: {unexplained}"
    gone = [arrow for arrow in ARROWS_UP if arrow not in found]
    assert not gone, f"ARROWS_UP names imports the code no longer makes: {gone}"
    packages = package_graph(graph, skip=set(ARROWS_UP))
    assert not cycles(packages), cycles(packages)


def test_no_module_imports_a_private_name_of_another_package():
    found = private_imports()
    new = sorted(set(found) - PRIVATE_IMPORTS_LEFT)
    assert not new, "private names imported across packages:\n" + "\n".join(new)
    gone = sorted(PRIVATE_IMPORTS_LEFT - set(found))
    assert not gone, "PRIVATE_IMPORTS_LEFT lists imports now gone:\n" + "\n".join(gone)


def _package(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "hpsjax"


def test_the_checks_find_an_arrow_up_a_circle_of_packages_and_a_private_import(
    tmp_path,
):
    # The wire imports the network above it, from inside a function, and the
    # network imports a private module of the wire.
    package = _package(
        tmp_path,
        {
            "hpsjax/__init__.py": "",
            "hpsjax/wire/__init__.py": "def f():\n    from hpsjax import net\n",
            "hpsjax/wire/_frames.py": "MAGIC = 1\n",
            "hpsjax/net/__init__.py": "from hpsjax.wire._frames import MAGIC\n",
        },
    )
    graph = import_graph(inner=True, package=package)
    layers = (("hpsjax",), ("hpsjax.net",), ("hpsjax.wire",))
    assert arrows_up(graph, layers) == [("hpsjax.wire", "hpsjax.net")]
    assert cycles(package_graph(graph)) == [["hpsjax.net", "hpsjax.wire"]]
    assert private_imports(package) == ["hpsjax.net -> hpsjax.wire._frames"]
    with pytest.raises(AssertionError, match="in no layer"):
        arrows_up(graph, layers[:2])


def test_the_check_finds_a_circle():
    # Two modules that import each other, one of them from inside a function.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]
    tree = ast.parse("import os\ndef f():\n    from hpsjax import launch\n")
    assert len(_imports(tree, inner=False)) == 1
    assert len(_imports(tree, inner=True)) == 2
    modules = _modules()
    node = ast.parse("from . import _job").body[0]
    path = modules["hpsjax.launch._ray"]
    assert _targets("hpsjax.launch._ray", path, node, modules) == ["hpsjax.launch._job"]


def test_importing_the_package_loads_no_jax_until_a_transform_is_used():
    code = (
        "import sys, hpsjax; assert 'jax' not in sys.modules, 'jax loaded'; "
        "from hpsjax import quantize; assert 'jax' in sys.modules; "
        "assert all(getattr(hpsjax, n) is not None for n in hpsjax.__all__); "
        "assert hpsjax.transforms.top_k is hpsjax.top_k; "
        "assert set(hpsjax.__all__) <= set(dir(hpsjax))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        import hpsjax

        hpsjax.nope  # noqa: B018
