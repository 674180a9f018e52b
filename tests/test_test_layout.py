"""The tests mirror the packages (CONTRIBUTING.md, "Tests").

A package's unit tests are in ``tests/<package>/`` and those that start
servers, processes or sockets in ``tests/<package>/e2e/``; the root holds only
the tests of rules the whole project keeps. A new test file elsewhere, or one
whose base name another already has (pytest imports test files by base name),
fails here with where it should go.
"""

from __future__ import annotations

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

# The project-wide rules, and the one test that starts a Ray cluster of its own.
AT_THE_ROOT = frozenset(
    {
        "test_checks.py",
        "test_cli_bad_values.py",
        "test_cli_help.py",
        "test_config_backbone.py",
        "test_decisions_regression.py",
        "test_function_length.py",
        "test_import_graph.py",
        "test_ray_launch.py",
        "test_test_layout.py",
    }
)
# Folders for what is not a package of hpsjax.
NOT_PACKAGES = frozenset({"benchmarks", "docs", "experiments"})


def _packages() -> set[str]:
    """hpsjax's packages and top-level modules, by their folder name in tests."""
    names = set()
    for path in (ROOT / "hpsjax").iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            names.add(path.name)
        elif path.suffix == ".py" and not path.name.startswith("_"):
            names.add(path.stem)
    return names


def _test_files() -> list[pathlib.Path]:
    return sorted(TESTS.rglob("test_*.py"))


def misplaced(files, packages) -> list[str]:
    """The test files outside the layout, each with the rule it breaks."""
    wrong = []
    allowed = set(packages) | NOT_PACKAGES
    for path in files:
        parts = path.relative_to(TESTS).parts
        if len(parts) == 1:
            if parts[0] not in AT_THE_ROOT:
                wrong.append(f"{parts[0]}: move it to tests/<package>/ (or e2e/)")
        elif parts[0] not in allowed:
            wrong.append(f"{'/'.join(parts)}: {parts[0]!r} is no package of hpsjax")
        elif len(parts) > 3 or (len(parts) == 3 and parts[1] != "e2e"):
            wrong.append(f"{'/'.join(parts)}: only tests/<package>/e2e/ goes deeper")
    return wrong


def test_every_test_file_sits_under_its_package():
    assert not misplaced(_test_files(), _packages())


def test_base_names_are_unique():
    seen: dict[str, list[str]] = {}
    for path in _test_files():
        seen.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    assert not {name: where for name, where in seen.items() if len(where) > 1}


def cross_folder_imports(files) -> list[str]:
    """Test modules imported by base name from another folder.

    pytest puts each test file's own folder on ``sys.path``: ``from test_x
    import ...`` finds a ``test_x.py`` of another folder only when pytest
    happened to collect that folder first, so such a test fails when run
    alone. Shared helpers go to ``tests/_*.py``.
    """
    wrong = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if (
                    name.startswith("test_")
                    and not (path.parent / f"{name}.py").exists()
                ):
                    wrong.append(f"{path.relative_to(TESTS)} imports {name}")
    return wrong


def test_tests_import_test_modules_only_from_their_own_folder():
    assert not cross_folder_imports(_test_files())


def test_the_rule_catches_a_file_out_of_place():
    files = [
        TESTS / "test_new_feature.py",
        TESTS / "nowhere" / "test_x.py",
        TESTS / "wire" / "deep" / "test_y.py",
        TESTS / "wire" / "e2e" / "test_z.py",
        TESTS / "docs" / "test_w.py",
    ]
    found = misplaced(files, {"wire"})
    assert [entry.split(":")[0] for entry in found] == [
        "test_new_feature.py",
        "nowhere/test_x.py",
        "wire/deep/test_y.py",
    ]
