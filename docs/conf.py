"""Sphinx configuration of the hpsjax docs.

The source directory is the repository root (build with ``-c docs``), so that
PROTOCOL.md, LAUNCH.md, BENCHMARKS.md, CONTRIBUTING.md, experiments/RESULTS.md
and the tutorials in colab/ are pages as they are, with their links between
each other intact; ``include_patterns`` keeps every other file out. README.md
is the landing page (``docs/index.md`` includes it), not a page of its own:
each source is one page. One command::

  sphinx-build -W --keep-going -c docs . docs/_build/html
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import sys
import typing

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpsjax import __version__  # noqa: E402
from hpsjax._project import REPOSITORY_URL  # noqa: E402

project = "hpsjax"
author = "the hpsjax authors"
copyright = "the hpsjax authors"
version = release = __version__

root_doc = "docs/index"
include_patterns = [
    "docs/*.md",
    "docs/api/*.md",
    "PROTOCOL.md",
    "CONTRIBUTING.md",
    "LAUNCH.md",
    "BENCHMARKS.md",
    "experiments/RESULTS.md",
    "colab/*.ipynb",
]
exclude_patterns = ["docs/_build", ".venv", "**/.ipynb_checkpoints"]

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

# Docstrings follow the Google style (Args:, Returns:, Raises:).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of their class: autodoc documents NamedTuple fields as
# members already, and two descriptions of one name break the build.
napoleon_use_ivar = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Every name of a module's __all__ is listed, constants without a docstring too.
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "show-inheritance": True,
}

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

# The tutorials run at every build, so the pages show what the code does now.
# HPSJAX_TUTORIAL_SMALL=1 in the environment shrinks them, as in the tests.
# HPSJAX_DOCS_EXECUTED_TUTORIALS=DIR renders the tutorials of DIR (same names,
# executed already) as they are instead: the tests execute each tutorial once
# and build the site from those runs.
EXECUTED_TUTORIALS = os.environ.get("HPSJAX_DOCS_EXECUTED_TUTORIALS")
nb_execution_mode = "off" if EXECUTED_TUTORIALS else "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True

# The pages live under docs/ of the output; a top index.html leads there.
html_extra_path = ["root"]  # relative to this directory
html_theme = "sphinx_book_theme"
html_title = "hpsjax"
html_theme_options = {
    "repository_url": REPOSITORY_URL,
    "use_repository_button": True,
    "path_to_docs": "docs",
}

# A markdown link to a directory of the repository (``[colab/](colab/)``) has
# no page to go to: it goes to the directory on GitHub instead.
_LINK = re.compile(r"\]\(([\w./-]+/)\)")


def _link_directories(app, docname, source):
    here = (ROOT / docname).parent

    def repository_link(match):
        target = (here / match.group(1)).resolve()
        if not target.is_dir() or ROOT not in (target, *target.parents):
            return match.group(0)
        path = target.relative_to(ROOT).as_posix()
        return f"]({REPOSITORY_URL}/tree/main/{path})"

    source[0] = _LINK.sub(repository_link, source[0])


# A link of a page included into another (README.md into docs/index.md), made
# relative to the including page, so that it points at the same file there.
_RELATIVE_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#|/)([^)\s]+)\)")


def _relink_included(app, relative_path, parent_docname, content):
    # MyST names the parent by its file's stem alone; the page being read is
    # the environment's.
    here = (ROOT / app.env.docname).parent
    there = (ROOT / relative_path).parent
    if here == there:
        return

    def relink(match):
        target = (there / match.group(1)).resolve()
        if target.is_dir() and ROOT in (target, *target.parents):
            # A directory has no page: it goes to GitHub, as _link_directories.
            path = target.relative_to(ROOT).as_posix()
            return f"]({REPOSITORY_URL}/tree/main/{path})"
        return f"]({os.path.relpath(target, here)})"

    content[0] = _RELATIVE_LINK.sub(relink, content[0])


def _attribute_doc(package, name: str) -> str:
    """The docstring written under ``name = ...`` in one of the package's modules."""
    from sphinx.pycode import ModuleAnalyzer

    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        if info.name.endswith(".__main__"):  # reading it would run the command
            continue
        try:
            docs = ModuleAnalyzer.for_module(info.name).find_attr_docs()
        except Exception:  # a module without source: nothing to read there
            continue
        if ("", name) in docs:
            return "\n".join(f"   {line}" for line in docs[("", name)] if line)
    return f"   ``{name} = {getattr(package, name)!r}``"


def _imported_data(module_name: str) -> str:
    """``py:data`` entries for the data of ``__all__`` that automodule skips.

    automodule documents the classes and functions a package imports from its
    private modules, but not imported data (tuples, dicts, type aliases), nor
    data the module defines itself without a docstring under it.
    """
    from sphinx.pycode import ModuleAnalyzer

    module = importlib.import_module(module_name)
    own = (pathlib.Path(module.__file__)).read_text(encoding="utf-8")
    documented = ModuleAnalyzer.for_module(module_name).find_attr_docs()
    entries = []
    for name in module.__all__:
        value = getattr(module, name)
        alias = typing.get_origin(value) is not None  # e.g. Sequence[...]: data
        if not alias and (
            inspect.isclass(value) or callable(value) or inspect.ismodule(value)
        ):
            continue
        if re.search(rf"^{name}\s*[:=]", own, re.MULTILINE):
            if ("", name) in documented:
                continue  # defined here with its docstring: automodule has it
            doc = f"   ``{name} = {value!r}``"
        elif hasattr(module, "__path__"):
            doc = _attribute_doc(module, name)
        else:
            doc = ""
        entries.append(f".. py:data:: {name}\n   :module: {module_name}\n\n{doc}\n")
    return "\n".join(entries)


# The directive with its option lines: the entries go after them.
_AUTOMODULE = re.compile(
    r"^\.\. automodule:: ([\w.]+)\n(?:   :[\w-]+:.*\n)*", re.MULTILINE
)


def _add_imported_data(app, docname, source):
    if docname.startswith("docs/api/"):
        source[0] = _AUTOMODULE.sub(
            lambda m: f"{m.group(0)}\n{_imported_data(m.group(1))}\n", source[0]
        )


def _executed_tutorial(app, docname, source):
    if docname.startswith("colab/"):
        name = docname.removeprefix("colab/") + ".ipynb"
        source[0] = (pathlib.Path(EXECUTED_TUTORIALS) / name).read_text("utf-8")


def setup(app):
    if EXECUTED_TUTORIALS:
        app.connect("source-read", _executed_tutorial)
    app.connect("source-read", _link_directories)
    app.connect("source-read", _add_imported_data)
    app.connect("include-read", _relink_included)
