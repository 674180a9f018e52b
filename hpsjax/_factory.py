"""Importing a user's factory from a ``"package.module:function"`` path.

Models (:func:`hpsjax.models.resolve_model`) and tasks
(:func:`hpsjax.tasks.get_task`) name a user's code so; both import it here,
with the same one-line errors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["import_factory"]


def import_factory(spec: str, what: str, form: str = "factory") -> Callable[..., Any]:
    """The callable that ``spec``, ``"package.module:attribute"``, names.

    The module is imported from the working directory or ``PYTHONPATH``;
    ``attribute`` may be dotted (``Class.method``).

    Args:
      spec: the path.
      what: what the callable builds, for messages (``"model"``, ``"task"``).
      form: the path's last part as the messages name it.

    Returns:
      The callable.

    Raises:
      ValueError: a malformed path, a module that does not import, a missing
        attribute or one that is not callable (one line each).
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{what} {spec!r} must be 'package.module:{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import module {module_name!r} of {spec!r}: {e}"
        ) from e
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"{spec!r} is not callable")
    return factory
