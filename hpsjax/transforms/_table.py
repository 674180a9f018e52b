r"""Ringleader ASGD's gradient table: the server's step on every worker's gradients.

:func:`gradient_table` keeps, for each of :math:`n` workers (table slots), the
sum :math:`G_i` and the count :math:`b_i` of its gradients in the current
round's table, and a second table for the next round; each update adds one
gradient to a slot and, where the policy says so, steps with the average over
workers of their average gradients. The slot and the operation come from the
server's policy (:class:`~hpsjax.decisions.Ringleader`, through
:attr:`~hpsjax.decisions.Verdict.args`), which applies each push alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hpsjax._checks import check_int, check_positive

__all__ = ["TABLE_OPS", "GradientTableState", "gradient_table"]

TABLE_OPS: tuple[str, ...] = ("add", "add_step", "add_step_roll", "add_next")
"""The operations of :func:`gradient_table`, by their code (the index): add the
gradient to its slot of the table; add it and step; add it, step and start the
next round (the next round's table becomes the table); add it to the next
round's table."""


class GradientTableState(NamedTuple):
    """State of :func:`gradient_table`."""

    sums: Any  # float32 tree, leaves (n, *shape): G_i, this round's table
    counts: jax.Array  # shape=(n,), int32: b_i
    next_sums: Any  # float32 tree, leaves (n, *shape): the next round's table
    next_counts: jax.Array  # shape=(n,), int32


def _slot_shape(hot: jax.Array, leaf: jax.Array) -> jax.Array:
    return hot.reshape(hot.shape + (1,) * leaf.ndim)


def gradient_table(
    learning_rate: float, num_slots: int
) -> optax.GradientTransformationExtraArgs:
    r"""Ringleader ASGD's server step: SGD on the table's average.

    With :math:`G_i` the sum and :math:`b_i` the number of worker :math:`i`'s
    gradients in the current round's table, a step is

    .. math::

       x_{k+1} = x_k - \gamma\, \bar g^k, \qquad
       \bar g^k = \frac{1}{n} \sum_{i=1}^{n} \frac{G_i}{b_i}

    (a slot still empty counts as 0). Each update takes keyword arguments
    ``slot`` (:math:`i`, in ``[0, n)``) and ``op`` (a code of
    :data:`TABLE_OPS`): ``add`` puts the gradient into :math:`G_i` (so
    :math:`b_i` grows by one) and returns zeros; ``add_step`` does that and
    steps; ``add_step_roll`` steps, then makes the next round's table the
    table and empties the next round's; ``add_next`` puts the gradient into
    the next round's table and returns zeros.

    Args:
      learning_rate: :math:`\gamma > 0`.
      num_slots: :math:`n`, the workers (int >= 1).

    Returns:
      An optax ``GradientTransformationExtraArgs`` (keyword-only ``slot`` and
      ``op``; other extra arguments, such as ``staleness``, are ignored).

    Examples:
      >>> import jax.numpy as jnp
      >>> tx = gradient_table(1.0, num_slots=2)
      >>> g = {"w": jnp.ones(2)}
      >>> state = tx.init(g)
      >>> u, state = tx.update(g, state, slot=0, op=0)  # add: no step
      >>> u, state = tx.update({"w": 3 * jnp.ones(2)}, state, slot=1, op=1)
      >>> u["w"].tolist()  # -(1 + 3) / 2
      [-2.0, -2.0]

    References:
      Maranjyan, Richtárik, `Ringleader ASGD: The First Asynchronous SGD with
      Optimal Time Complexity under Data Heterogeneity
      <https://arxiv.org/abs/2509.22860>`_, 2025.
    """
    check_positive("learning_rate", learning_rate)
    n = check_int("num_slots", num_slots, low=1)
    lr = float(learning_rate)

    def init_fn(params):
        zeros = jax.tree.map(
            lambda p: jnp.zeros((n, *jnp.shape(p)), jnp.float32), params
        )
        count = jnp.zeros((n,), jnp.int32)
        return GradientTableState(zeros, count, zeros, count)

    def update_fn(updates, state, params=None, *, slot, op, **extra_args):
        del params, extra_args
        op = jnp.asarray(op, jnp.int32)
        hot = jax.nn.one_hot(jnp.asarray(slot, jnp.int32), n, dtype=jnp.float32)
        to_next = op == 3
        main_hot = jnp.where(to_next, 0.0, 1.0) * hot
        next_hot = hot - main_hot

        def added(sums, which):
            return jax.tree.map(
                lambda s, u: s + _slot_shape(which, u) * u.astype(jnp.float32)[None],
                sums,
                updates,
            )

        sums = added(state.sums, main_hot)
        counts = state.counts + main_hot.astype(jnp.int32)
        next_sums = added(state.next_sums, next_hot)
        next_counts = state.next_counts + next_hot.astype(jnp.int32)
        per = 1.0 / jnp.maximum(counts, 1).astype(jnp.float32)
        scale = jnp.where((op == 1) | (op == 2), -lr / n, 0.0)
        deltas = jax.tree.map(
            lambda s, u: (scale * jnp.sum(_slot_shape(per, u) * s, axis=0)).astype(
                u.dtype
            ),
            sums,
            updates,
        )
        roll = op == 2
        keep = jax.tree.map(lambda a, b: jnp.where(roll, b, a), sums, next_sums)
        state = GradientTableState(
            keep,
            jnp.where(roll, next_counts, counts),
            jax.tree.map(lambda a: jnp.where(roll, jnp.zeros_like(a), a), next_sums),
            jnp.where(roll, jnp.zeros_like(next_counts), next_counts),
        )
        return deltas, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
