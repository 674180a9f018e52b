"""hpsjax's modules import one another without circles.

The graph is read from the source (``ast``), not by importing: an edge from
module A to module B for every ``import`` in A that loads B, and to each
package above B that A is not inside (importing ``hpsjax.wire._frames`` runs
``hpsjax/ps/__init__.py`` first). Imports inside functions count too: an import
moved into a function to dodge a circle still makes one, only later.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hpsjax"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _targets(module: str, path: pathlib.Path, node: ast.AST, modules) -> list[str]:
    """The hpsjax modules an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if path.name != "__init__.py":
            package = package[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([node.module] if node.module else [])])
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


def import_graph(*, inner: bool) -> dict[str, set[str]]:
    modules = _modules()
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
