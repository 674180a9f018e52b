"""The docs site (``docs/``): it builds with warnings as errors, and covers the API.

Building it executes the four tutorials (with their small settings), so the
build test is slow; the checks of what the configuration covers are fast.
"""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MODULES = ("hpsjax", "hpsjax.ps", "hpsjax.profiling", "hpsjax.sim", "hpsjax.worker")
PAGES = ("README", "PROTOCOL", "LAUNCH", "BENCHMARKS", "experiments/RESULTS")
TUTORIALS = sorted(p.stem for p in (ROOT / "colab").glob("*.ipynb"))


def _api_page(module: str) -> pathlib.Path:
    return DOCS / "api" / f"{module.removeprefix('hpsjax.') or 'hpsjax'}.md"


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


@pytest.mark.slow
def test_docs_build_without_warnings_and_document_every_public_name(tmp_path):
    out = tmp_path / "html"
    env = dict(os.environ, HPSJAX_TUTORIAL_SMALL="1", JAX_PLATFORMS="cpu")
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
    for page in PAGES:
        assert (out / f"{page}.html").is_file()
    for module in MODULES:
        html = (out / "docs" / "api" / f"{_api_page(module).stem}.html").read_text()
        names = importlib.import_module(module).__all__
        missing = [n for n in names if f'id="{module}.{n}"' not in html]
        assert not missing, f"{module}: undocumented {missing}"
    for tutorial in TUTORIALS:
        html = (out / "colab" / f"{tutorial}.html").read_text()
        # Executed at build time: the page carries the cells' outputs and plots.
        assert re.search(r'class="cell_output', html), tutorial
        assert "<img" in html, tutorial
