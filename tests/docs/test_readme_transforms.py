"""The transform table (docs/api/hpsjax.md) lists every transform; examples import
public names."""

from __future__ import annotations

import inspect
import pathlib
import re

import hpsjax.transforms as transforms

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _transform_factories() -> list[str]:
    # The public functions that build an optax transformation.
    return [
        name
        for name in transforms.__all__
        if inspect.isfunction(getattr(transforms, name))
        and "GradientTransformation"
        in str(inspect.signature(getattr(transforms, name)).return_annotation)
    ]


def test_transform_table_has_a_row_for_every_transform():
    page = (ROOT / "docs" / "api" / "hpsjax.md").read_text()
    table = page[page.index("| transform | what it does | reference |") :]
    table = table[: table.index("\n\n")]
    rows = re.findall(r"^\| `(\w+)\(", table, re.MULTILINE)
    factories = _transform_factories()
    assert {"top_k", "power_sgd", "delayed_nesterov", "diloco_outer"} <= set(factories)
    assert sorted(rows) == sorted(factories)


def test_transform_docstring_examples_import_public_names_only():
    private = re.compile(r">>> (from|import) hpsjax(\.\w+)*\._\w+")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "hpsjax" / "transforms").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line)
    ]
    assert not found, f"docstring examples import private modules: {found}"
