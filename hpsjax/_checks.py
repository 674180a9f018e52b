"""Argument checks shared across hpsjax: one version of each rule.

Each check raises ``ValueError`` naming the argument, what it must be and the
value given, and returns the value converted to a plain Python ``int`` or
``float`` (numpy scalars are accepted; ``bool`` is never a number). Every rule
lives here once: a module that needs one calls it rather than keeping a private
copy (``tests/test_checks.py`` scans the library for copies).
:func:`check_hyperparameter` is the array-aware form for an optax transform's
hyperparameters, which ``optax.inject_hyperparams`` turns into arrays.

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
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "check_choice",
    "check_float_dtype",
    "check_fraction",
    "check_hyperparameter",
    "check_int",
    "check_number",
    "check_positive",
    "check_worker_id",
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


def _interval(
    low: float, high: float, low_inclusive: bool, high_inclusive: bool
) -> str:
    """How a range reads in a message: ``>= 1``, ``> 0``, ``in [0, 1)``."""
    if high == math.inf:
        return f"{'>=' if low_inclusive else '>'} {low}"
    if low == -math.inf:
        return f"{'<=' if high_inclusive else '<'} {high}"
    left, right = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
    return f"in {left}{low}, {high}{right}"


def _inside(
    value: float, low: float, high: float, low_inclusive: bool, high_inclusive: bool
) -> bool:
    above = value >= low if low_inclusive else value > low
    below = value <= high if high_inclusive else value < high
    return above and below


def check_int(
    name: str,
    value: Any,
    *,
    low: int,
    high: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """``value`` as an ``int`` >= ``low`` (and <= ``high``; or ``None`` when
    ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not is_int(value) or value < low or (high is not None and value > high):
        none = " or None" if allow_none else ""
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}{none}, got {value!r}.")
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
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    allow_none: bool = False,
) -> float | None:
    """``value`` as a finite ``float`` >= ``low`` and <= ``high`` (strictly
    where not inclusive; or ``None`` when ``allow_none``).

    Examples:
      >>> check_number("momentum", 0.9, low=0, high=1, high_inclusive=False)
      0.9
      >>> check_number("momentum", 1, low=0, high=1, high_inclusive=False)
      Traceback (most recent call last):
      ...
      ValueError: momentum must be in [0, 1), got 1.0.
    """
    if value is None and allow_none:
        return None
    if not is_number(value) or not math.isfinite(value):
        none = " or None" if allow_none else ""
        raise ValueError(f"{name} must be a finite number{none}, got {value!r}.")
    value = float(value)
    if not _inside(value, low, high, low_inclusive, high_inclusive):
        bound = _interval(low, high, low_inclusive, high_inclusive)
        raise ValueError(f"{name} must be {bound}, got {value}.")
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


def check_worker_id(name: str, value: Any) -> int | str:
    """``value`` unchanged if it is a worker id: an ``int`` or a ``str``.

    Examples:
      >>> check_worker_id("worker_id", "gpu0")
      'gpu0'
      >>> check_worker_id("worker_id", True)
      Traceback (most recent call last):
      ...
      ValueError: worker_id must be an int or a str, got True.
    """
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{name} must be an int or a str, got {value!r}.")
    return value


def check_float_dtype(name: str, dtype: Any) -> np.dtype:
    """``dtype`` as a numpy dtype, if it is a floating one (bfloat16 included).

    Examples:
      >>> check_float_dtype("dtype", "bfloat16")
      dtype(bfloat16)
      >>> check_float_dtype("dtype", "int8")
      Traceback (most recent call last):
      ...
      ValueError: dtype must be a floating dtype, got int8.
    """
    # Imported here: the layers below JAX (hpsjax.planning) use this module.
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"{name} must be a floating dtype, got {dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dtype}.")
    return dtype


def check_hyperparameter(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
    schedule: bool = False,
) -> Any:
    """A transform's numeric hyperparameter, which may be an array.

    A Python or numpy number is checked like :func:`check_number` (or
    :func:`check_int` when ``integer``) and returned as a ``float`` (``int``).
    A scalar array, which is what ``optax.inject_hyperparams`` passes, must be
    0-d of a real (integer when ``integer``) dtype; its value is checked when
    it is concrete, not when it is traced, and it is returned unchanged. A
    callable passes unchanged when ``schedule`` (an optax schedule).

    Examples:
      >>> import jax.numpy as jnp
      >>> check_hyperparameter("gamma", jnp.float32(0.5), low=0, high=1)
      Array(0.5, dtype=float32)
      >>> check_hyperparameter("k", 0, low=1, integer=True)
      Traceback (most recent call last):
      ...
      ValueError: k must be an int >= 1, got 0.
    """
    if schedule and callable(value):
        return value
    # A JAX array exists only once JAX is loaded, which this module never does.
    jax = sys.modules.get("jax")
    arrays = np.ndarray if jax is None else (np.ndarray, jax.Array)
    if not isinstance(value, arrays):
        if integer:
            if not is_int(value) or not _inside(
                value, low, high, low_inclusive, high_inclusive
            ):
                bound = _interval(low, high, low_inclusive, high_inclusive)
                raise ValueError(f"{name} must be an int {bound}, got {value!r}.")
            return int(value)
        return check_number(
            name,
            value,
            low=low,
            high=high,
            low_inclusive=low_inclusive,
            high_inclusive=high_inclusive,
        )
    kinds = (np.integer,) if integer else (np.integer, np.floating)
    subdtype = np.issubdtype if jax is None else jax.numpy.issubdtype
    if np.ndim(value) != 0 or not any(subdtype(value.dtype, k) for k in kinds):
        what = "an integer" if integer else "a real"
        raise ValueError(
            f"{name} must be {what} scalar, got an array of shape "
            f"{np.shape(value)} and dtype {value.dtype}."
        )
    traced = jax is not None and isinstance(value, jax.core.Tracer)
    if not traced and not _inside(
        float(value), low, high, low_inclusive, high_inclusive
    ):
        bound = _interval(low, high, low_inclusive, high_inclusive)
        raise ValueError(f"{name} must be {bound}, got {float(value)}.")
    return value
