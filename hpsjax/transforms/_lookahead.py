r"""Heavy-ball momentum whose parameters look ahead over a known delay.

A pipelined worker (H-PS's ``overlap="pipeline"``) computes its gradient on the
parameters of one version and the server applies it one version later: every
gradient is :math:`\tau = 1` round stale. With heavy-ball momentum :math:`\beta`
the iterate keeps moving by the momentum while the gradient is in flight, and
on a quadratic of curvature :math:`h` the stale recursion is stable only for
:math:`\eta h < 1 - \beta` (against :math:`\eta h < 2 (1 + \beta)` fresh): at
:math:`\beta = 0.9`, a 38 times smaller step.

Most of the way the iterate moves in :math:`\tau` versions is known when the
parameters are sent: the momentum's own part, :math:`-\eta \sum_{j=1}^{\tau}
\beta^j m`. :func:`lookahead_momentum` keeps the heavy-ball iterate :math:`x`
implicit and holds (and so serves) the parameters :math:`w = x - \eta c\, m`,
:math:`c = \sum_{j=1}^{\tau} \beta^j` (:func:`lookahead_coefficient`): where
the momentum takes :math:`x` by the time the next gradient comes back. That
gradient's error is then the last gradient's step alone, not the momentum's. At
:math:`\tau = 0` it is heavy-ball momentum (``optax.sgd(lr, momentum)``), at a
constant :math:`\tau = 1` Nesterov's momentum (``optax.sgd(lr, momentum,
nesterov=True)``), whose stale recursion is stable up to :math:`\eta h = 0.25`
at :math:`\beta = 0.9`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hpsjax._checks import check_hyperparameter
from hpsjax.transforms._staleness import (
    _as_staleness,
    staleness_factor,
)

__all__ = [
    "LookaheadMomentumState",
    "lookahead_coefficient",
    "lookahead_momentum",
]


class LookaheadMomentumState(NamedTuple):
    r"""State of :func:`lookahead_momentum`'s direction.

    Attributes:
      momentum: the heavy-ball trace :math:`m`, same tree, shapes and dtypes as
        the params.
      lookahead: the look-ahead the parameters hold now, :math:`s\,c` in
        steps of the momentum at the base step size (0 before the first
        update).
    """

    momentum: Any  # tree like params
    lookahead: jax.Array  # shape=(), float32


def lookahead_coefficient(momentum: Any, staleness: Any) -> jax.Array:
    r"""The look-ahead :math:`c(\tau) = \sum_{j=1}^{\tau} \beta^j` in momentum steps.

    .. math::

      c(\tau) = \beta \frac{1 - \beta^{\tau}}{1 - \beta}

    (the same closed form for a fractional :math:`\tau`): how many steps of the
    momentum :math:`m` the heavy-ball iterate moves in :math:`\tau` versions,
    gradients aside.

    Args:
      momentum: :math:`\beta`, in [0, 1).
      staleness: :math:`\tau`, a scalar >= 0 (see
        :func:`hpsjax.transforms.staleness_factor` for a traced value).

    Returns:
      :math:`c`, a float32 scalar array.

    Raises:
      ValueError: ``momentum`` outside [0, 1), or a static ``staleness`` that is
        missing, not a scalar, negative or NaN.

    Examples:
      >>> from hpsjax.transforms import lookahead_coefficient
      >>> [round(float(lookahead_coefficient(0.5, t)), 3) for t in (0, 1, 2)]
      [0.0, 0.5, 0.75]
    """
    check_hyperparameter("momentum", momentum, low=0, high=1, high_inclusive=False)
    tau = _as_staleness(staleness).astype(jnp.float32)
    beta = jnp.asarray(momentum, jnp.float32)
    return beta * (1 - beta**tau) / (1 - beta)


def _scale_by_lookahead(
    momentum: Any, gamma: Any
) -> optax.GradientTransformationExtraArgs:
    """The direction of :func:`lookahead_momentum`, before the step size."""

    def init_fn(params):
        return LookaheadMomentumState(
            momentum=optax.tree.zeros_like(params),
            lookahead=jnp.zeros((), jnp.float32),
        )

    def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
        del params, extra_args
        scale = staleness_factor("exponential", staleness, gamma=gamma)
        ahead = scale * lookahead_coefficient(momentum, staleness)
        before = state.lookahead
        trace = jax.tree.map(
            lambda m, g: (momentum * m + g).astype(m.dtype), state.momentum, updates
        )
        # w' - w = -lr ((s + s c) m' - (s c)_before m): the heavy-ball step,
        # plus moving the look-ahead from (s c)_before m to s c m'.
        updates = jax.tree.map(
            lambda m_new, m, g: ((scale + ahead) * m_new - before * m).astype(g.dtype),
            trace,
            state.momentum,
            updates,
        )
        return updates, LookaheadMomentumState(momentum=trace, lookahead=ahead)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def lookahead_momentum(
    learning_rate: optax.ScalarOrSchedule, momentum: Any = 0.9, *, gamma: Any = 1.0
) -> optax.GradientTransformationExtraArgs:
    r"""Heavy-ball SGD whose parameters run ahead by the update's staleness.

    With the trace :math:`m_k = \beta m_{k-1} + g_k`, the staleness :math:`\tau`
    of the update (keyword extra argument ``staleness``, which the server
    passes with every update) and :math:`c_k = c(\tau)` of
    :func:`lookahead_coefficient` and the step's factor :math:`s_k =
    \gamma^{\tau}` (a step size tied to the delay, the ``"exponential"`` rule of
    :func:`hpsjax.transforms.staleness_factor`):

    .. math::

      w_{k+1} = w_k - \eta \left( s_k (1 + c_k)\, m_k
        - s_{k-1} c_{k-1}\, m_{k-1} \right),

    which keeps :math:`w_k = x_k - \eta s_{k-1} c_{k-1} m_{k-1}` for the
    heavy-ball iterate :math:`x_{k+1} = x_k - \eta s_k m_k`: the parameters
    served are where the momentum takes :math:`x` in :math:`\tau` versions, so
    that a gradient computed on them and applied :math:`\tau` versions later was
    computed near the iterate it moves. The next update is assumed as stale as
    this one (a pipelined worker's are all one version late). :math:`\tau = 0`
    gives ``optax.sgd(learning_rate, momentum)`` whatever :math:`\gamma`; a
    constant :math:`\tau = 1` ``optax.sgd(gamma * learning_rate, momentum,
    nesterov=True)`` after the first update.

    Not ``optax.lookahead`` (Zhang et al.'s slow and fast weights).

    Args:
      learning_rate: the step size :math:`\eta` (a number or an optax
        schedule).
      momentum: :math:`\beta`, in [0, 1).
      gamma: the step's factor per version of staleness, :math:`\gamma` in
        (0, 1]; 1 (the default) leaves the step alone.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` requires the
      keyword argument ``staleness`` (a scalar >= 0).

    Raises:
      ValueError: at construction, for ``momentum`` outside [0, 1) or ``gamma``
        outside (0, 1]; at update, for a missing, non-scalar, negative or NaN
        static ``staleness``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import lookahead_momentum
      >>> tx = lookahead_momentum(1.0, momentum=0.5)
      >>> w = jnp.array([0.0])
      >>> state = tx.init(w)
      >>> u, state = tx.update(jnp.array([1.0]), state, staleness=1)
      >>> u  # -(1 + 0.5) * 1: the step and half of it again ahead
      Array([-1.5], dtype=float32)
      >>> u, state = tx.update(jnp.array([1.0]), state, staleness=1)
      >>> u  # -((1.5 * 1.5) - 0.5 * 1), Nesterov's -(0.5 * 1.5 + 1)
      Array([-1.75], dtype=float32)

    References:
      Hakimi, Barkai, Gabel, Schuster, `Taming Momentum in a Distributed
      Asynchronous Environment <https://arxiv.org/abs/1907.11612>`_ (DANA),
      2019.

      Mitliagkas, Zhang, Hadjis, Re, `Asynchrony begets Momentum, with an
      Application to Deep Learning <https://arxiv.org/abs/1605.09774>`_,
      Allerton 2016.
    """
    check_hyperparameter("momentum", momentum, low=0, high=1, high_inclusive=False)
    check_hyperparameter("gamma", gamma, low=0, high=1, low_inclusive=False)
    return optax.chain(
        _scale_by_lookahead(momentum, gamma),
        optax.scale_by_learning_rate(learning_rate),
    )
