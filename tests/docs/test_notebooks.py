"""The Colab tutorials in ``colab/``: how they are committed, and that they run.

Every tutorial must open with an "Open in Colab" badge that points at itself, hold
exactly one install cell that is a no-op where hpsjax is importable (so executing
it here never reaches the network), read ``HPSJAX_TUTORIAL_SMALL`` for its small
settings, and be committed without outputs or execution counts. Those checks are
fast. Executing each notebook top to bottom in a fresh ``python3`` kernel of this
interpreter, with ``HPSJAX_TUTORIAL_SMALL=1`` and a timeout on every cell, takes
tens of seconds (mostly compiling), so those tests are marked slow; each tutorial
runs once a session, shared with the docs build (``tests/_tutorials.py``).
"""

from __future__ import annotations

import itertools
import json
import re

import nbformat
import pytest
from _tutorials import CLAIM_MARK, COLAB, SMALL_VARIABLE, executed, load

from hpsjax._project import colab_badge, install_spec

TUTORIALS = (
    "01_transforms.ipynb",
    "02_parameter_server.ipynb",
    "03_heterogeneity.ipynb",
    "04_custom_scheme.ipynb",
    "05_language_model.ipynb",
)
# Badges and install lines name the repository of hpsjax._project, nothing else.
BADGE = colab_badge("{name}")
INSTALL = f'%pip install -q "{install_spec()}"'

_INSTALL = re.compile(r"\bpip\s+install\b")
# The guard that makes the install cell safe: try importing first, install only
# on ImportError.
_GUARD = re.compile(r"^try:\n\s+import hpsjax\nexcept ImportError:\n", re.MULTILINE)


def committed_problems(nb: nbformat.NotebookNode, name: str) -> list[str]:
    """What is wrong with how notebook ``name`` is committed (empty: nothing)."""
    problems = []
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        problems.append(f"invalid notebook: {e.message}")
    cells = nb.cells
    if not cells or cells[0].cell_type != "markdown":
        problems.append("the first cell is not a markdown cell")
    elif BADGE.format(name=name) not in cells[0].source:
        problems.append(f"the first cell lacks the Open in Colab badge for {name}")
    code = [i for i, c in enumerate(cells) if c.cell_type == "code"]
    installs = [i for i in code if _INSTALL.search(cells[i].source)]
    if len(installs) != 1:
        problems.append(f"{len(installs)} cells install packages, expected one")
    else:
        (index,) = installs
        if index != code[0]:
            problems.append("the install cell is not the first code cell")
        elif not _GUARD.search(cells[index].source):
            problems.append(
                "the install cell does not try `import hpsjax` before installing"
            )
        elif INSTALL not in cells[index].source:
            problems.append(f"the install cell does not run {INSTALL}")
    if not any(SMALL_VARIABLE in cells[i].source for i in code):
        problems.append(f"no code cell reads {SMALL_VARIABLE}")
    for i in code:
        cell = cells[i]
        if cell.outputs:
            problems.append(f"cell {i} has stored outputs")
        if cell.execution_count is not None:
            problems.append(f"cell {i} has an execution count")
        if "execution" in cell.metadata:
            problems.append(f"cell {i} has execution timings in its metadata")
    return problems


def test_every_tutorial_is_present():
    assert sorted(p.name for p in COLAB.glob("*.ipynb")) == sorted(TUTORIALS)


@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_is_committed_clean(name):
    assert committed_problems(load(COLAB / name), name) == []


def _good_notebook(name: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell(BADGE.format(name=name) + "\n# Title"),
        nbformat.v4.new_code_cell(
            "try:\n    import hpsjax\nexcept ImportError:\n"
            f"    {INSTALL}\n"
            "    import hpsjax"
        ),
        nbformat.v4.new_code_cell(
            f'import os\nSMALL = os.environ.get("{SMALL_VARIABLE}") == "1"'
        ),
    ]
    return nb


def test_checks_accept_a_clean_notebook():
    assert committed_problems(_good_notebook("x.ipynb"), "x.ipynb") == []


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        (lambda nb: nb.cells.pop(0), "not a markdown cell"),
        (
            lambda nb: setattr(nb.cells[0], "source", "# No badge"),
            "lacks the Open in Colab badge",
        ),
        (
            lambda nb: nb.cells.append(nbformat.v4.new_code_cell("!pip install x")),
            "2 cells install packages",
        ),
        (
            lambda nb: nb.cells.pop(1),
            "0 cells install packages",
        ),
        (
            lambda nb: setattr(nb.cells[1], "source", "%pip install hpsjax"),
            "does not try `import hpsjax`",
        ),
        (
            lambda nb: setattr(
                nb.cells[1],
                "source",
                nb.cells[1].source.replace("github.com/", "github.com/elsewhere/"),
            ),
            "the install cell does not run",
        ),
        (
            lambda nb: nb.cells.insert(1, nbformat.v4.new_code_cell("x = 1")),
            "not the first code cell",
        ),
        (
            lambda nb: setattr(nb.cells[2], "source", "SMALL = True"),
            f"no code cell reads {SMALL_VARIABLE}",
        ),
        (
            lambda nb: nb.cells[2].outputs.append(
                nbformat.v4.new_output("stream", name="stdout", text="hi\n")
            ),
            "has stored outputs",
        ),
        (
            lambda nb: setattr(nb.cells[2], "execution_count", 3),
            "has an execution count",
        ),
        (
            lambda nb: nb.cells[2].metadata.update(execution={"a": 1}),
            "execution timings",
        ),
    ],
)
def test_checks_catch_a_badly_committed_notebook(spoil, problem):
    nb = _good_notebook("x.ipynb")
    spoil(nb)
    problems = committed_problems(nb, "x.ipynb")
    assert any(problem in p for p in problems), problems


def test_badge_must_point_at_the_notebook_itself():
    problems = committed_problems(_good_notebook("x.ipynb"), "y.ipynb")
    assert any("badge for y.ipynb" in p for p in problems), problems


def _outputs(nb: nbformat.NotebookNode, output_type: str) -> list:
    return [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == output_type
    ]


# What each tutorial says in words, checked on what it computed: a cell run after
# the tutorial's own prints values of its namespace as JSON (_tutorials.CLAIMS),
# and the function asserts the claim on them.


def _ef_claims(v):
    loss = v["final_loss"]
    # "Error feedback helps a biased compressor" (sign, nearest rounding) ...
    for biased in ("1-bit sign", "2-bit nearest"):
        assert loss[f"{biased} + EF"] < loss[biased] - 0.05, (biased, loss)
    # ... "and gains nothing on an unbiased one" (stochastic rounding).
    stochastic = loss["2-bit stochastic"]
    assert loss["2-bit stochastic + EF"] > stochastic - 0.02, loss
    gain = loss["2-bit nearest"] - loss["2-bit nearest + EF"]
    assert gain > stochastic - loss["2-bit stochastic + EF"], loss


def _cleanup_claims(v):
    # The checkpoints written to the temporary directory are removed.
    assert not v["checkpoint_dir_exists"]
    assert v["resumed_equal"]


def _heterogeneity_claims(v):
    planned, results = v["planned_idle"], v["results"]
    bsp, hps = results["BSP"], results["H-PS"]
    # The notebook says which case its profile is in: from what a quarter of
    # the batch costs the simulated workers, and (balanced) the plan.
    halves = planned["hps"] < planned["equal"] / 2
    assert v["balanced"] == (halves and v["quarter"] < 0.5), v
    assert v["unbalanced"] == (v["quarter"] > 0.8), v
    if v["balanced"]:
        # "in the same time it applies two to three times as many versions, its
        # workers are idle a fraction of the time BSP's are, and over its last
        # evaluations its test loss stays well below BSP's" (the mean of the
        # last five of 30: late in the run H-PS's curve spikes, from about 1.0
        # to 1.3-1.6 in three runs beside two busy processes, and one run's
        # final point, 1.72, was no lower than BSP's).
        assert hps["versions"] >= 2 * bsp["versions"], results
        assert hps["idle"] < bsp["idle"] / 2, results
        assert hps["late_loss"] < 0.9 * bsp["late_loss"], results
    elif v["unbalanced"]:
        # "H-PS cannot balance the round, and its workers sit idle about as
        # much as BSP's" (a loaded machine's profile can be all fixed cost).
        assert hps["idle"] > bsp["idle"] / 2, results
    else:
        # Between the two: "so does H-PS", part of the way.
        assert bsp["idle"] > hps["idle"], results
    # "The asynchronous schemes apply even more versions".
    assert results["ASP"]["versions"] > hps["versions"], results


def _staleness_rule_claims(v):
    large, small = (v["final_accuracy"][str(lr)] for lr in v["learning_rates"])
    # At the large step size: 1/tau first, grace_then_halving in between, no
    # damping last ("the server overshoots and barely learns") ...
    assert large["inverse (1/tau)"] > large["grace_then_halving"] + 0.1, large
    assert large["grace_then_halving"] > large["no damping"] + 0.1, large
    assert large["no damping"] < 0.3, large
    # ... and at the small one "the order reverses".
    assert small["no damping"] > small["grace_then_halving"] + 0.03, small
    assert small["grace_then_halving"] > small["inverse (1/tau)"] + 0.03, small


def _language_model_claims(v):
    bsp, asp, hps = v["bsp"], v["asp"], v["hps"]

    def time(run):  # never reaching the target: the budget's end, at least
        return run["time_to_target"] or float("inf")

    # "H-PS reaches the target first" ...
    assert hps["time_to_target"] is not None, v
    assert time(hps) < time(bsp) and time(hps) < time(asp), v
    # ... "in the same time it applies more updates than BSP"; "ASP applies
    # many more updates".
    assert hps["updates"] > bsp["updates"] and asp["updates"] > hps["updates"], v

    # "its loss jumps where a slow worker's stale gradient lands, while BSP's
    # and H-PS's fall smoothly" (after the first seconds' fall to the plateau).
    def largest_rise(losses):
        return max(b - a for a, b in itertools.pairwise(losses[3:]))

    assert largest_rise(asp["losses"]) > 0.1, v
    for smooth in (bsp, hps):
        assert largest_rise(smooth["losses"]) < largest_rise(asp["losses"]) / 2, v


CLAIMS = {
    "01_transforms.ipynb": _ef_claims,
    "02_parameter_server.ipynb": _cleanup_claims,
    "03_heterogeneity.ipynb": _heterogeneity_claims,
    "04_custom_scheme.ipynb": _staleness_rule_claims,
    "05_language_model.ipynb": _language_model_claims,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_top_to_bottom(name):
    # Raises CellExecutionError, with the failing cell and its traceback, on
    # any error; a cell over the timeout raises as well.
    nb = executed(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    assert _outputs(nb, "error") == []
    install = next(c for c in code if _INSTALL.search(c.source))
    assert not install.outputs, "the install cell printed something: did pip run?"
    assert any("image/png" in o.data for o in _outputs(nb, "display_data")), (
        "the tutorial drew no plot"
    )
    (line,) = [
        line
        for o in _outputs(nb, "stream")
        for line in o.text.splitlines()
        if line.startswith(CLAIM_MARK)
    ]
    CLAIMS[name](json.loads(line.removeprefix(CLAIM_MARK)))
