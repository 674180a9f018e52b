"""Helpers shared by the transforms: finding one transform's state in a chain."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["find_one_state"]


def find_one_state(
    state: Any, state_type: type, what: str = "", *, error: str | None = None
) -> Any:
    """Returns the one ``state_type`` node anywhere inside an optax state.

    Looks through chains, named chains, ``inject_hyperparams``, ``MultiSteps``...

    Args:
      state: an optax state.
      state_type: the state class to find, e.g. ``QuantizeState``.
      what: said after the class's name when there is none, e.g. ``"no quantize"``.
      error: the message for both failures instead, ``{found}`` standing for
        ``no`` or the number found.

    Returns:
      The one ``state_type`` node.

    Raises:
      ValueError: there is none, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import LocalStepsState, local_steps
      >>> state = optax.chain(optax.sgd(0.1), local_steps(2)).init(jnp.ones(3))
      >>> type(find_one_state(state, LocalStepsState)).__name__
      'LocalStepsState'
      >>> find_one_state(optax.sgd(0.1).init(jnp.ones(3)), LocalStepsState, "x")
      Traceback (most recent call last):
      ...
      ValueError: the optimizer state holds no LocalStepsState (x)
    """
    found = [
        node
        for node in jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, state_type))
        if isinstance(node, state_type)
    ]
    if len(found) == 1:
        return found[0]
    name = state_type.__name__
    if error is not None:
        raise ValueError(error.format(found=len(found) if found else "no"))
    if not found:
        raise ValueError(f"the optimizer state holds no {name} ({what})")
    raise ValueError(
        f"the optimizer state holds {len(found)} {name}s; take "
        f"state.encoded from the one you want"
    )
