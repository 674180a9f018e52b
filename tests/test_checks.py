"""The shared helpers: argument checks, one state in an optax chain, npz names."""

import doctest

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax import _checks, _npz
from hpsjax._checks import check_int, check_number, check_positive, is_int, is_number
from hpsjax.transforms import LocalStepsState, _common, local_steps
from hpsjax.transforms._common import find_one_state


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
