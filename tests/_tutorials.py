"""The Colab tutorials executed once per test session (imported as ``_tutorials``).

``tests/docs/test_notebooks.py`` checks what each tutorial computes, and
``tests/docs/test_docs_site.py`` renders the same executed tutorials into the docs
site: :func:`executed` runs a tutorial the first time a test of the session
asks for it and hands every later test, in any test process, the notebook it
wrote then. A file lock per tutorial makes a second test process wait for the
run in progress instead of starting one of its own.

Each tutorial runs top to bottom in a fresh ``python3`` kernel of this
interpreter, with ``HPSJAX_TUTORIAL_SMALL=1``, ``PIP_NO_INDEX=1`` (were its
install cell ever to run pip, it would fail instead of reaching the network)
and a timeout on every cell, followed by one cell that prints the values its
text makes claims about (:data:`CLAIMS`) as JSON after :data:`CLAIM_MARK`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import tempfile

import nbformat
from nbclient import NotebookClient

COLAB = pathlib.Path(__file__).resolve().parent.parent / "colab"
SMALL_VARIABLE = "HPSJAX_TUTORIAL_SMALL"
# Per cell, on a busy 2-core machine; the longest cell of a small run takes about
# 20 seconds there.
CELL_TIMEOUT_S = 300
KERNEL_START_TIMEOUT_S = 120
CLAIM_MARK = "HPSJAX-CLAIMS "

# Per tutorial, the expression (in the tutorial's namespace) whose value the
# claims cell prints.
CLAIMS = {
    "01_transforms.ipynb": "{'final_loss': final_loss}",
    "02_parameter_server.ipynb": (
        "{'checkpoint_dir_exists': os.path.exists(checkpoint_dir),"
        " 'resumed_equal': bool(equal)}"
    ),
    "03_heterogeneity.ipynb": (
        "{'balanced': bool(balanced), 'unbalanced': bool(unbalanced),"
        " 'quarter': float(quarter),"
        " 'planned_idle': {k: p.idle_fraction for k, p in plans.items()},"
        " 'results': {k: {'versions': r.num_updates,"
        " 'idle': r.idle_fraction(),"
        " 'accuracy': float(r.metrics['accuracy'][-1]),"
        " 'loss': float(r.metrics['loss'][-1]),"
        " 'late_loss': float(sum(r.metrics['loss'][-5:]) / 5)}"
        " for k, r in results.items()}}"
    ),
    "04_custom_scheme.ipynb": (
        "{'learning_rates': ASP_LEARNING_RATES,"
        " 'final_accuracy': {str(lr): {k: float(r.metrics['accuracy'][-1])"
        " for k, r in rs.items()} for lr, rs in stale_results.items()}}"
    ),
    "05_language_model.ipynb": (
        "{k: {'time_to_target': s['time_to_target'], 'updates': s['updates'],"
        " 'losses': [e['loss'] for e in evals[k]]} for k, s in summaries.items()}"
    ),
}

# The session's directory of executed tutorials: made by the session's first
# process (tests/conftest.py) and named to the test processes in this variable.
SESSION_DIR_VARIABLE = "HPSJAX_TESTS_TUTORIALS"


def load(path: pathlib.Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=nbformat.NO_CONVERT)


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _execute(name: str) -> nbformat.NotebookNode:
    import hpsjax  # the kernel runs this interpreter: its install cell is a no-op

    del hpsjax
    nb = load(COLAB / name)
    claims = CLAIMS.get(name)
    if claims is not None:
        nb.cells.append(
            nbformat.v4.new_code_cell(
                f"import json as _json\nprint({CLAIM_MARK!r} + _json.dumps({claims}))"
            )
        )
    with (
        tempfile.TemporaryDirectory(prefix="hpsjax-tutorial-run-") as cwd,
        _environment(**{SMALL_VARIABLE: "1", "PIP_NO_INDEX": "1"}),
    ):
        client = NotebookClient(
            nb,
            timeout=CELL_TIMEOUT_S,
            startup_timeout=KERNEL_START_TIMEOUT_S,
            kernel_name="python3",
            resources={"metadata": {"path": cwd}},
        )
        # Raises CellExecutionError, with the failing cell and its traceback, on
        # any error; a cell over the timeout raises as well.
        client.execute()
    return nb


def executed(name: str) -> nbformat.NotebookNode:
    """Tutorial ``name`` of ``colab/`` executed, with the claims cell last
    (where :data:`CLAIMS` has one): run now, or read from this session's run."""
    where = os.environ.get(SESSION_DIR_VARIABLE)
    if where is None:  # outside a test session
        return _execute(name)
    done = pathlib.Path(where) / name
    with open(done.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be running it
        if not done.exists():
            nb = _execute(name)
            partial = done.with_suffix(".partial")
            nbformat.write(nb, partial)
            partial.replace(done)
    return nbformat.read(done, as_version=nbformat.NO_CONVERT)


def without_claims(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """``nb`` less the claims cell :func:`executed` appended: the tutorial as
    its readers run it."""
    cells = list(nb.cells)
    if cells and CLAIM_MARK in cells[-1].source:
        cells.pop()
    copy = nbformat.from_dict(dict(nb))
    copy.cells = cells
    return copy
