r"""Local SGD: apply every update locally, push the accumulated sum every k steps.

With coarse-grained communication a worker takes :math:`k` optimizer steps on its
own copy of the parameters and only then sends the server what those steps did.
:func:`local_steps` is the bookkeeping for that, as an optax transform placed last
in the worker's chain: it passes updates through unchanged and keeps their running
sum; after :math:`k` updates its state says a push is due. :func:`push_due` and
:func:`pending_update` read that state from anywhere inside a nested optax state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hpsjax._checks import check_hyperparameter
from hpsjax.transforms._common import find_one_state

__all__ = [
    "LocalStepsState",
    "local_steps",
    "pending_update",
    "push_due",
]


class LocalStepsState(NamedTuple):
    """State of :func:`local_steps`.

    Attributes:
      count: updates accumulated since the last push, this one included.
      accumulated: sum of those updates (the update to push once due).
      push_due: whether ``accumulated`` is complete and should be pushed; the next
        update then starts a fresh sum.
    """

    count: jax.Array  # shape=(), int32
    accumulated: Any  # tree like params; dtype of params or accumulator_dtype
    push_due: jax.Array  # shape=(), bool


def _init_local_steps(params: Any, accumulator_dtype: Any) -> LocalStepsState:
    return LocalStepsState(
        count=jnp.zeros([], jnp.int32),
        accumulated=optax.tree.zeros_like(params, dtype=accumulator_dtype),
        push_due=jnp.zeros([], jnp.bool_),
    )


def _accumulate(
    updates: Any, state: LocalStepsState, k: Any, *, flush: Any = False
) -> LocalStepsState:
    """Adds ``updates`` to the running sum; due once ``k`` are summed or on flush."""
    fresh = state.push_due
    accumulated = jax.tree.map(
        lambda acc, u: jnp.where(fresh, jnp.zeros_like(acc), acc) + u.astype(acc.dtype),
        state.accumulated,
        updates,
    )
    count = optax.safe_increment(jnp.where(fresh, 0, state.count))
    # `>=` rather than `==`: k may shrink mid-accumulation (a new stage), and the
    # sum gathered so far is then due at once.
    due = jnp.logical_or(count >= k, flush)
    return LocalStepsState(count=count, accumulated=accumulated, push_due=due)


def local_steps(
    k: Any, *, accumulator_dtype: Any = None
) -> optax.GradientTransformationExtraArgs:
    r"""Passes updates through and accumulates them for a push every ``k`` steps.

    With :math:`u_t` the updates of step :math:`t` and :math:`t_0` the first step
    after the last push:

    .. math::

      a_t = \sum_{j=t_0}^{t} u_j, \qquad
      \text{push\_due}_t = (t - t_0 + 1 \ge k)

    Placed last in the worker's chain, :math:`a_t` is exactly how far the local
    parameters moved since the last push: the update to send the server. Once a
    push was due, the next update starts a fresh sum, so pushes fall on steps
    :math:`k, 2k, 3k, \ldots` while ``k`` is fixed.

    ``k`` may be an array, also a traced one (``optax.inject_hyperparams`` or a
    staged schedule change it during training); a traced ``k`` below 1 behaves as
    1. The keyword extra argument ``local_steps``, when given, overrides ``k`` for
    that update.

    Args:
      k: number of local updates per push, an integer >= 1.
      accumulator_dtype: dtype of the running sum; ``None`` uses the params'
        dtype. Pass a string (``"float32"``) when wrapping in
        ``optax.inject_hyperparams``, which takes callables for schedules.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`LocalStepsState`.

    Raises:
      ValueError: if a concrete ``k`` is not an integer >= 1.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from hpsjax.transforms import (
      ...     local_steps, pending_update, push_due)
      >>> tx = optax.chain(optax.sgd(0.5), local_steps(2))
      >>> params = jnp.array([1.0, 1.0])
      >>> state = tx.init(params)
      >>> for step in range(2):
      ...     updates, state = tx.update(jnp.array([1.0, -2.0]), state)
      ...     params = optax.apply_updates(params, updates)
      ...     print(step, bool(push_due(state)))
      0 False
      1 True
      >>> pending_update(state)
      Array([-1.,  2.], dtype=float32)

    References:
      Stich, `Local SGD Converges Fast and Communicates Little
      <https://arxiv.org/abs/1805.09767>`_, ICLR 2019.

      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 73(1),
      2024.
    """
    check_hyperparameter("k", k, low=1, integer=True)
    if accumulator_dtype is not None:
        try:
            accumulator_dtype = jax.dtypes.canonicalize_dtype(accumulator_dtype)
        except TypeError as error:
            raise ValueError(
                f"accumulator_dtype must be a dtype, got {accumulator_dtype!r}."
            ) from error

    def init_fn(params):
        return _init_local_steps(params, accumulator_dtype)

    def update_fn(updates, state, params=None, *, local_steps=None, **extra_args):
        del params, extra_args
        if local_steps is not None:
            check_hyperparameter("k", local_steps, low=1, integer=True)
        steps = k if local_steps is None else local_steps
        return updates, _accumulate(updates, state, steps)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_local_steps_state(state: Any) -> LocalStepsState:
    return find_one_state(
        state,
        LocalStepsState,
        error="Expected exactly one LocalStepsState in the optimizer state, found "
        "{found}; is `local_steps` (or `hybrid_stages`) in the chain, once?",
    )


def push_due(state: Any) -> jax.Array:
    """Whether the accumulated local update is due for a push.

    Args:
      state: any optax state holding exactly one :class:`LocalStepsState`
        (:func:`local_steps` alone or inside ``optax.chain``, ``named_chain``,
        ``inject_hyperparams``, ``MultiSteps``, :func:`hybrid_stages`...).

    Returns:
      A bool scalar array.

    Raises:
      ValueError: if the state holds no :class:`LocalStepsState`, or several.
    """
    return _find_local_steps_state(state).push_due


def pending_update(state: Any) -> Any:
    """The updates accumulated since the last push (complete when push_due).

    Args:
      state: any optax state holding exactly one :class:`LocalStepsState`.

    Returns:
      The running sum, a tree like the params.

    Raises:
      ValueError: if the state holds no :class:`LocalStepsState`, or several.
    """
    return _find_local_steps_state(state).accumulated
