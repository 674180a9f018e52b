"""Argument checks shared across hpsjax: one version of each.

Each check raises ``ValueError`` naming the argument, what it must be and the
value given, and returns the value converted to a plain Python ``int`` or
``float`` (numpy scalars are accepted; ``bool`` is never a number).

Examples:
  >>> check_int("local_steps", 4, low=1)
  4
  >>> check_positive("lr", 0.5)
  0.5
  >>> check_int("local_steps", None, low=1, allow_none=True) is None
  True
  >>> check_int("local_steps", 0, low=1)
  Traceback (most recent call last):
  ...
  ValueError: local_steps must be an int >= 1, got 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "check_choice",
    "check_fraction",
    "check_int",
    "check_number",
    "check_positive",
    "is_int",
    "is_number",
]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python or numpy), not a ``bool``."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number (Python or numpy), not a ``bool``."""
    return isinstance(value, int | float | np.integer | np.floating) and not (
        isinstance(value, bool)
    )


def check_int(
    name: str, value: Any, *, low: int, allow_none: bool = False
) -> int | None:
    """``value`` as an ``int`` >= ``low`` (or ``None`` when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < low:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be an int >= {low}{none}, got {value!r}.")
    return int(value)


def check_positive(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a finite ``float`` > 0 (or ``None`` when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a finite number > 0{none}, got {value!r}.")
    return float(value)


def check_number(
    name: str, value: Any, *, low: float, low_inclusive: bool = True
) -> float:
    """``value`` as a finite ``float`` >= ``low`` (> ``low`` if not inclusive)."""
    if not is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    value = float(value)
    if value < low or (value == low and not low_inclusive):
        bound = ">=" if low_inclusive else ">"
        raise ValueError(f"{name} must be {bound} {low}, got {value}.")
    return value


def check_fraction(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """``value`` as a ``float`` in (0, 1] (or ``None`` when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_number(value) or not 0 < value <= 1:
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be in (0, 1]{none}, got {value!r}.")
    return float(value)


def check_choice(
    name: str, value: Any, choices: Sequence[Any], *, allow_none: bool = False
) -> Any:
    """``value`` unchanged if it is one of ``choices`` (or ``None`` when
    ``allow_none``), else a ``ValueError`` listing them.

    Examples:
      >>> check_choice("on_nonfinite", "skip", ("stop", "skip"))
      'skip'
      >>> check_choice("on_nonfinite", "go", ("stop", "skip"))
      Traceback (most recent call last):
      ...
      ValueError: on_nonfinite must be one of stop, skip, got 'go'.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or value not in choices:
        valid = ", ".join(map(str, choices))
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be one of {valid}{none}, got {value!r}.")
    return value
