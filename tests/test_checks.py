"""The shared argument checks."""

import doctest

import numpy as np
import pytest

from hpsjax import _checks
from hpsjax._checks import check_int, check_number, check_positive, is_int, is_number


def test_module_doctests():
    assert doctest.testmod(_checks).failed == 0


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
