"""Helpers shared by the transforms: finding one transform's state in a chain, and
the error feedback, seed check and tree decoding of the compressors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import is_int

__all__ = [
    "check_seed",
    "decode_leaves",
    "error_feedback_step",
    "find_one_state",
    "initial_error",
]

_F32 = jnp.float32


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


def check_seed(seed: Any) -> None:
    """Raises ValueError unless ``seed`` is an int or a 0-D integer array."""
    if isinstance(seed, bool) or not (
        is_int(seed)
        or (
            isinstance(seed, (jax.Array, np.ndarray))
            and seed.shape == ()
            and jnp.issubdtype(seed.dtype, jnp.integer)
        )
    ):
        raise ValueError(f"seed must be an int, got {seed!r}")


def initial_error(params: Any, error_feedback: bool) -> Any:
    """The residual ``e_0``: float32 zeros like ``params``, or ``optax.EmptyState()``
    when error feedback is off."""
    if error_feedback:
        return jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)
    return optax.EmptyState()


def error_feedback_step(
    updates: Any,
    error: Any,
    error_feedback: bool,
    compress: Callable[[Any], tuple[Any, Any]],
) -> tuple[Any, Any, Any]:
    """One step of a compressor with error feedback.

    .. math::

      p_t = g_t + e_t, \\qquad \\text{output } C(p_t), \\qquad
      e_{t+1} = p_t - C(p_t),

    with ``p_t`` and ``e`` in float32; without error feedback ``p_t = g_t`` and the
    residual (``optax.EmptyState()``) is kept as it is.

    Args:
      updates: the update tree ``g_t``.
      error: the residual ``e_t`` (see :func:`initial_error`).
      error_feedback: whether the residual is added and carried over.
      compress: takes ``p_t`` and returns ``(encoded, C(p_t))``, the latter a tree
        like ``updates``.

    Returns:
      ``(C(p_t), e_{t+1}, encoded)``.
    """
    if error_feedback:
        sent = jax.tree.map(lambda g, e: g.astype(_F32) + e, updates, error)
    else:
        sent = updates
    encoded, out = compress(sent)
    if error_feedback:
        error = jax.tree.map(lambda p, o: p - o.astype(_F32), sent, out)
    return out, error, encoded


def decode_leaves(
    encoded_leaves: Sequence[Any],
    like_tree: Any,
    decode_leaf: Callable[[Any, Any], jax.Array],
) -> Any:
    """Decodes one encoded leaf per leaf of ``like_tree`` into a tree like it.

    Args:
      encoded_leaves: the encoded leaves, in leaf order.
      like_tree: a pytree whose leaves (arrays or ``jax.ShapeDtypeStruct``) give
        the structure, shapes and dtypes of the result.
      decode_leaf: takes an encoded leaf and its leaf of ``like_tree`` and
        returns the decoded array.

    Raises:
      ValueError: the number of encoded leaves differs from ``like_tree``'s.
    """
    leaves, treedef = jax.tree.flatten(like_tree)
    encoded_leaves = list(encoded_leaves)
    if len(encoded_leaves) != len(leaves):
        raise ValueError(
            f"got {len(encoded_leaves)} encoded leaves for a tree of {len(leaves)}"
        )
    return treedef.unflatten(
        [
            decode_leaf(enc, leaf)
            for enc, leaf in zip(encoded_leaves, leaves, strict=True)
        ]
    )
