"""The shared helpers: argument checks, one state in an optax chain, npz names."""

import ast
import doctest
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax import _checks, _npz
from hpsjax._checks import check_int, check_number, check_positive, is_int, is_number
from hpsjax.transforms import LocalStepsState, _common, local_steps
from hpsjax.transforms._common import find_one_state

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_module_doctests():
    assert doctest.testmod(_checks).failed == 0
    assert doctest.testmod(_common).failed == 0
    assert doctest.testmod(_npz).failed == 0


def test_numbers_exclude_bools_and_accept_numpy_scalars():
    assert is_int(np.int32(3)) and not is_int(True) and not is_int(3.0)
    assert is_number(np.float32(0.5)) and not is_number(False) and not is_number("1")
    assert check_int("n", np.int64(2), low=0) == 2
    assert check_positive("x", np.float32(0.5)) == 0.5
    assert check_number("x", 0, low=0) == 0.0


@pytest.mark.parametrize(
    "check, value, match",
    [
        (lambda v: check_int("n", v, low=1), True, "n must be an int >= 1"),
        (lambda v: check_int("n", v, low=1), 0, "got 0"),
        (lambda v: check_positive("x", v), float("inf"), "finite number > 0"),
        (lambda v: check_positive("x", v, allow_none=True), -1, "> 0 or None"),
        (lambda v: check_number("x", v, low=0, low_inclusive=False), 0, "> 0"),
    ],
)
def test_bad_values_name_the_argument(check, value, match):
    with pytest.raises(ValueError, match=match):
        check(value)


def test_find_one_state_words_none_and_several():
    one = optax.chain(optax.sgd(0.1), local_steps(2)).init(jnp.ones(2))
    two = optax.chain(local_steps(2), local_steps(3)).init(jnp.ones(2))
    assert isinstance(find_one_state(one, LocalStepsState), LocalStepsState)
    with pytest.raises(ValueError, match=r"holds 2 LocalStepsStates; take"):
        find_one_state(two, LocalStepsState, "no local_steps")
    error = "want one {found}"
    with pytest.raises(ValueError, match=r"^want one no$"):
        find_one_state(optax.sgd(0.1).init(jnp.ones(2)), LocalStepsState, error=error)
    with pytest.raises(ValueError, match=r"^want one 2$"):
        find_one_state(two, LocalStepsState, error=error)


# The messages of hpsjax._checks's rules, as a private copy would word them
# ("{}" stands for an interpolated value).
_NUMBER = r"(-?[\d.]+|\{\})"
_RANGE = r"in [(\[][^,]*, [^)\]]*[)\]]"
_RULE = re.compile(
    r"must (be|lie) (an int|an integer|a positive int|a non-negative int"
    r"|an int or a str|a str or an int|a (positive |non-negative )?(finite )?"
    r"(number|float|real scalar)|positive|non-negative|finite|(a )?floating( dtype)?"
    rf"|{_RANGE}|one of [^,]*(, [^,]*)*|[<>]=? {_NUMBER})"
    rf"( [<>]=? {_NUMBER}| {_RANGE})?( or None)?[.,]? *(got|\{{\}}|$)"
)
_CHECKER = ("_check", "_require", "_valid")
_SHARED = ("is_int", "is_number", "_is_int", "_is_number")


def _message(exc: ast.expr) -> str:
    """The constant text of a raised exception's message, ``{}`` for the rest."""
    node = exc.args[0] if isinstance(exc, ast.Call) and exc.args else exc
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else "{}" for v in node.values
        )
    return node.value if isinstance(node, ast.Constant) else ""


def private_rule_copies(root: pathlib.Path) -> list[str]:
    """Functions outside ``hpsjax/_checks.py`` that copy one of its rules: a
    check (``_check_*``, ``_require_*``, ``_valid*``) raising one of its
    messages, or a second ``is_int`` / ``is_number``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == ROOT / "hpsjax" / "_checks.py":
            continue
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            where = f"{path.relative_to(root.parent)}:{fn.lineno} {fn.name}"
            if fn.name in _SHARED:
                found.append(where)
            elif fn.name.startswith(_CHECKER):
                texts = [
                    _message(n.exc)
                    for n in ast.walk(fn)
                    if isinstance(n, ast.Raise) and n.exc is not None
                ]
                found += [f"{where}: {t!r}" for t in texts if _RULE.search(t)][:1]
    return found


def test_the_rule_scan_finds_a_private_copy(tmp_path):
    copy = tmp_path / "copy.py"
    copy.write_text(
        "def _check_positive_int(name, value):\n"
        "    if value < 1:\n"
        "        raise ValueError(f'{name} must be an int >= 1, got {value}')\n"
        "def _check_shape(shape):\n"
        "    raise ValueError(f'shape must hold non-negative ints, got {shape}')\n"
        "def is_number(value):\n"
        "    return True\n"
    )
    found = private_rule_copies(tmp_path)
    assert [_name(f) for f in found] == [
        "_check_positive_int",
        "is_number",
    ]


# Copies in modules being moved by their owners as this is written, each to be
# replaced by a call to hpsjax._checks; the list only shrinks.
_PENDING: set[str] = set()


def _name(found: str) -> str:
    return found.split(":")[1].split()[1]


@pytest.mark.parametrize("package", ["hpsjax", "experiments"])
def test_no_private_copies_of_the_shared_checks(package):
    """Every rule of ``hpsjax._checks`` lives there once: call it."""
    found = private_rule_copies(ROOT / package)
    assert [f for f in found if _name(f) not in _PENDING] == []


def test_the_pending_copies_still_exist():
    """A copy replaced by a call leaves the pending list too."""
    found = private_rule_copies(ROOT / "hpsjax") + private_rule_copies(
        ROOT / "experiments"
    )
    assert _PENDING - {_name(f) for f in found} == set()
