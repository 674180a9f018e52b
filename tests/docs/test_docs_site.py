"""The docs site (``docs/``): it builds with warnings as errors, and covers the API.

Building it renders the tutorials executed (with their small settings),
so the build test is slow; the checks of what the configuration covers are
fast. The test build renders the tutorials as ``tests/docs/test_notebooks.py``'s
tests executed them (``tests/_tutorials.py``: each runs once a session), not
executing them a second time; a build outside the tests executes them itself.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import pkgutil
import re
import runpy
import subprocess
import sys

import nbformat
import pytest
from _tutorials import executed, without_claims

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MODULES = (
    "hpsjax",
    "hpsjax.transforms",
    "hpsjax.tasks",
    "hpsjax.data",
    "hpsjax.models",
    "hpsjax.export",
    "hpsjax.ps",
    "hpsjax.launch",
    "hpsjax.config",
    "hpsjax.planning",
    "hpsjax.profiling",
    "hpsjax.sim",
    "hpsjax.worker",
    "hpsjax.cli",
    "hpsjax.telemetry",
    "hpsjax.metrics",
)
# Layers beneath hpsjax.ps, which re-exports their public names (CONTRIBUTING.md,
# "Layers"): documented there, not on pages of their own.
BENEATH_PS = (
    "hpsjax.apply",
    "hpsjax.decisions",
    "hpsjax.net",
    "hpsjax.storage",
    "hpsjax.wire",
)
# Each a page of its own; README.md is the landing page (docs/index.md), once.
PAGES = ("PROTOCOL", "LAUNCH", "BENCHMARKS", "CONTRIBUTING", "experiments/RESULTS")
TUTORIALS = sorted(p.stem for p in (ROOT / "colab").glob("*.ipynb"))


def _api_page(module: str) -> pathlib.Path:
    return DOCS / "api" / f"{module.removeprefix('hpsjax.') or 'hpsjax'}.md"


def test_every_public_package_and_module_is_in_the_reference():
    import hpsjax

    public = {
        info.name
        for info in pkgutil.iter_modules(hpsjax.__path__, "hpsjax.")
        if not info.name.rpartition(".")[2].startswith("_")
    }
    assert public == set(MODULES[1:]) | set(BENEATH_PS)


@pytest.mark.parametrize("module", MODULES)
def test_every_public_module_has_an_api_page(module):
    page = _api_page(module).read_text()
    assert f".. automodule:: {module}\n" in page


def test_index_lists_every_page_tutorial_and_api_page():
    index = (DOCS / "index.md").read_text()
    for page in PAGES:
        assert f"\n/{page}\n" in index
    for tutorial in TUTORIALS:
        assert f"\n/colab/{tutorial}\n" in index
    for module in MODULES:
        assert f"\napi/{_api_page(module).stem}\n" in index


def test_index_shows_the_readme_itself_and_only_there():
    # The landing page is the README's text, not a pointer to it, and the
    # README is no page of its own: one source, one page.
    index = (DOCS / "index.md").read_text()
    assert index.count("```{include} ../README.md\n```") == 1
    assert "README follows" not in index
    assert "\n/README\n" not in index
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert "README.md" not in conf["include_patterns"]
    for page in PAGES:
        assert f"{page}.md" in conf["include_patterns"]


def test_included_readme_links_point_at_the_same_files_from_the_index():
    sys.path.insert(0, str(DOCS))
    try:
        conf = importlib.import_module("conf")
    finally:
        sys.path.remove(str(DOCS))
    readme = (ROOT / "README.md").read_text()
    content = [readme]
    app = type("App", (), {"env": type("Env", (), {"docname": "docs/index"})()})()
    conf._relink_included(app, pathlib.Path("README.md"), "index", content)
    before = re.findall(r"\]\(([^)\s]+)\)", readme)
    after = re.findall(r"\]\(([^)\s]+)\)", content[0])
    assert len(before) == len(after) and before != after
    for old, new in zip(before, after, strict=True):
        if old.startswith(("http", "#")):
            assert new == old
        elif (ROOT / old).is_dir():
            assert new.startswith("https://") and new.endswith(old.rstrip("/"))
        else:  # a file: the same file, seen from docs/
            assert (DOCS / new).resolve() == (ROOT / old).resolve(), (old, new)


def test_a_build_executes_the_tutorials_unless_given_executed_ones(monkeypatch):
    monkeypatch.delenv("HPSJAX_DOCS_EXECUTED_TUTORIALS", raising=False)
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert conf["nb_execution_mode"] == "force"
    assert conf["nb_execution_raise_on_error"]
    monkeypatch.setenv("HPSJAX_DOCS_EXECUTED_TUTORIALS", "/x")
    conf = runpy.run_path(str(DOCS / "conf.py"))
    assert conf["nb_execution_mode"] == "off"


# Classes two pages would describe (Sphinx warns of the second description):
# docs/api/transforms.md leaves them to the hpsjax page.
TOP_PAGE_ONLY = {"hpsjax.transforms": ("Codec", "Stage")}


def _described_on_the_top_page(module: str, name: str, out: pathlib.Path) -> bool:
    if name not in TOP_PAGE_ONLY.get(module, ()):
        return False
    import hpsjax

    same = getattr(hpsjax, name) is getattr(importlib.import_module(module), name)
    html = (out / "docs" / "api" / "hpsjax.html").read_text()
    return same and f'id="hpsjax.{name}"' in html


def test_classes_left_to_the_top_page_are_excluded_there_only():
    for module, names in TOP_PAGE_ONLY.items():
        page = _api_page(module).read_text()
        assert f":exclude-members: {', '.join(names)}\n" in page
        assert ":exclude-members:" not in _api_page("hpsjax").read_text()


@pytest.mark.slow
def test_docs_build_without_warnings_and_document_every_public_name(tmp_path):
    out = tmp_path / "html"
    runs = tmp_path / "tutorials"
    runs.mkdir()
    # Last first: a test process running tests/docs/test_notebooks.py's tests at the
    # same time starts with the first (tests/_tutorials.py).
    for tutorial in reversed(TUTORIALS):
        nb = without_claims(executed(f"{tutorial}.ipynb"))
        nbformat.write(nb, runs / f"{tutorial}.ipynb")
    env = dict(
        os.environ,
        HPSJAX_TUTORIAL_SMALL="1",
        JAX_PLATFORMS="cpu",
        HPSJAX_DOCS_EXECUTED_TUTORIALS=str(runs),
    )
    build = subprocess.run(
        [
            sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q",
            "-c", str(DOCS), str(ROOT), str(out),
        ],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    warnings = [
        line for line in build.stderr.splitlines() if "[IPKernelApp]" not in line
    ]
    assert build.returncode == 0, "\n".join(warnings[-40:])
    assert "docs/index.html" in (out / "index.html").read_text()
    # The landing page carries the README's text.
    landing = (out / "docs" / "index.html").read_text()
    assert "Train one JAX model on workers of unequal speed" in landing
    assert "Your model on your machines" in landing
    assert not (out / "README.html").exists()
    for page in PAGES:
        assert (out / f"{page}.html").is_file()
    for module in MODULES:
        html = (out / "docs" / "api" / f"{_api_page(module).stem}.html").read_text()
        names = importlib.import_module(module).__all__
        missing = [
            n
            for n in names
            if f'id="{module}.{n}"' not in html
            and not _described_on_the_top_page(module, n, out)
        ]
        assert not missing, f"{module}: undocumented {missing}"
    for tutorial in TUTORIALS:
        html = (out / "colab" / f"{tutorial}.html").read_text()
        # Executed: the page carries the cells' outputs and plots.
        assert re.search(r'class="cell_output', html), tutorial
        assert "<img" in html, tutorial


def test_imported_data_entries_follow_the_directives_options():
    sys.path.insert(0, str(DOCS))
    try:
        conf = importlib.import_module("conf")
    finally:
        sys.path.remove(str(DOCS))
    source = [_api_page("hpsjax.transforms").read_text()]
    conf._add_imported_data(None, "docs/api/transforms", source)
    directive = ".. automodule:: hpsjax.transforms\n   :exclude-members: Codec, Stage\n"
    assert directive in source[0]
    assert ".. py:data:: SCHEMES\n" in source[0].split(directive)[1]
