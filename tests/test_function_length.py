"""No function in the library grows past 80 code lines without saying why.

A function's code lines are the lines from its ``def`` to its end that hold
code: blank lines, comment-only lines and its docstring do not count; a nested
function counts toward the function around it (it is read as part of it). A
function over :data:`LIMIT` passes only with a paragraph of its docstring that
starts with :data:`REASON` and says why it is long (a flag table, a main that
wires the pieces together). :data:`KNOWN` lists the long functions there were
when the check came, each with its length then: they may shrink, never grow,
and one that drops under the limit is to be taken off the list.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hpsjax"
LIMIT = 80
REASON = "Long because"
# Path, qualified name -> code lines when the check came.
KNOWN = {
    ("hpsjax/worker/_cli.py", "parse_args"): 196,
    ("hpsjax/transforms/_streaming.py", "streaming_local"): 144,
    ("hpsjax/launch/_ray.py", "launch_ray"): 135,
    ("hpsjax/net/_server.py", "Server.__init__"): 130,
    ("hpsjax/transforms/_stages.py", "hybrid_stages"): 120,
    ("hpsjax/launch/_cli.py", "main"): 114,
    ("hpsjax/launch/_local.py", "launch"): 98,
    ("hpsjax/transforms/_stages.py", "hybrid_stages.update_fn"): 86,
}


def code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node`` (from the source's ``lines``) that hold code."""
    docstring = range(0)
    first = node.body[0]
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        docstring = range(first.lineno, first.end_lineno + 1)
    count = 0
    for number in range(node.lineno, node.end_lineno + 1):
        text = lines[number - 1].strip()
        if number in docstring or not text or text.startswith("#"):
            continue
        count += 1
    return count


def functions(path: pathlib.Path):
    """``(qualified name, node)`` of every function of the module at ``path``."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def long_functions(package: pathlib.Path = PACKAGE) -> dict[tuple[str, str], int]:
    """Every function over :data:`LIMIT` code lines whose docstring gives no
    reason, by ``(path from the repository root, qualified name)``."""
    long = {}
    for path in sorted(package.rglob("*.py")):
        lines = path.read_text().splitlines()
        for name, node in functions(path):
            n = code_lines(lines, node)
            if n <= LIMIT:
                continue
            doc = ast.get_docstring(node) or ""
            if any(p.strip().startswith(REASON) for p in doc.split("\n\n")):
                continue
            long[(path.relative_to(package.parent).as_posix(), name)] = n
    return long


def test_no_new_function_over_the_limit_without_a_reason():
    new = {k: n for k, n in long_functions().items() if k not in KNOWN}
    assert not new, (
        f"functions over {LIMIT} code lines: {new}; split them, or give the "
        f"reason in a docstring paragraph starting {REASON!r}"
    )


def test_the_known_long_functions_do_not_grow():
    found = long_functions()
    grown = {k: (KNOWN[k], n) for k, n in found.items() if k in KNOWN and n > KNOWN[k]}
    assert not grown, f"(was, now) code lines: {grown}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # The def line and 80 more: one too many.
        ("def f():\n" + "    x = 1\n" * 80, {"f": 81}),
        # Blank lines, comments and the docstring do not count.
        ('def f():\n    """Doc.\n\n    More.\n    """\n'
         + "    # why\n\n    x = 1\n" * 79, {}),
        # A nested function counts toward the one around it, and on its own;
        # methods are named by their class.
        ("class C:\n    def m(self):\n        def g():\n"
         + "            x = 1\n" * 80 + "        return g\n",
         {"C.m": 83, "C.m.g": 81}),
        # A reason in the docstring lets it pass.
        (f'def f():\n    """Doc.\n\n    {REASON} it is a table."""\n'
         + "    x = 1\n" * 90, {}),
    ],
)  # fmt: skip
def test_the_count(tmp_path, source, expected):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "m.py").write_text(source)
    found = {name: n for (_, name), n in long_functions(package).items()}
    assert found == expected
