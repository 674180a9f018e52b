"""Outer optimizers: the server's step on pseudo-gradients (DiLoCo, async local SGD).

In local SGD a worker starts a round from the global parameters ``θ``, takes its
local (inner) steps to ``θ_local``, and pushes the **pseudo-gradient**

.. math::

  Δ = θ - θ_{\\text{local}},

the global parameters minus the local ones. It points *uphill*, like a gradient:
with a plain outer step of learning rate 1 (``θ <- θ - Δ``) the server lands on
``θ_local``. The outer optimizers here take ``Δ`` as their "gradient" and output
an optax update to be added to the global parameters
(``optax.apply_updates(θ, updates)``), so that they drop in wherever an optax
optimizer does. Averaging the pseudo-gradients of several workers first (the
synchronous DiLoCo round) is the caller's job.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hpsjax._checks import check_hyperparameter

__all__ = [
    "DelayedNesterovState",
    "delayed_nesterov",
    "diloco_outer",
]

_F32 = jnp.float32


class DelayedNesterovState(NamedTuple):
    """State of :func:`delayed_nesterov`."""

    count: jax.Array  # shape=(), int32: pseudo-gradients applied so far (t)
    momentum: Any  # float32 tree like the updates: m, changed every N updates
    buffer: Any  # float32 tree: the sum of the pseudo-gradients since m changed


def delayed_nesterov(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    delay: int = 1,
    momentum_fraction: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """Delayed Nesterov (DN): the outer optimizer of asynchronous local SGD.

    Each worker's pseudo-gradient ``g_t`` is applied as soon as it arrives (one
    update per arrival), but the momentum ``m`` changes only every ``N`` = ``delay``
    updates, from the mean of the ``N`` pseudo-gradients buffered since
    (Liu et al. 2024, Algorithm "Delayed Nesterov Update"; ``ε`` the learning
    rate, ``β`` the momentum, ``c`` = ``momentum_fraction``, ``Δ_0 = 0``,
    ``m_0 = 0``):

    .. math::

      Δ \\leftarrow Δ + g_t; \\quad \\text{if } (t + 1) \\bmod N = 0:
      \\; m_{t+1} = β m_t + Δ / N, \\;
      θ_{t+1} = θ_t - ε\\big((1 - cN + c)\\, β m_{t+1} + g_t / N\\big), \\;
      Δ \\leftarrow 0;

      \\text{else: } m_{t+1} = m_t, \\;
      θ_{t+1} = θ_t - ε\\big(c\\, β m_{t+1} + g_t / N\\big).

    With ``c = 0`` (the default) the steps between momentum updates are plain
    SGD steps of size ``ε / N``, and the momentum term is applied in full once
    every ``N`` updates; ``c`` in ``[0, 1/N]`` spreads part of it over the steps
    between (over a window of ``N`` updates the momentum term totals
    ``β m`` either way). With ``N = 1`` this is Nesterov momentum,
    ``optax.sgd(ε, β, nesterov=True)``, whatever ``c``. The paper sets ``N`` to
    the number of workers.

    The output is the optax update ``θ_{t+1} - θ_t``; feed the pseudo-gradients
    ``θ - θ_local`` as the updates (sign convention in the module docstring).

    Args:
      learning_rate: the outer learning rate ``ε``, or a schedule of ``t``.
      momentum: the momentum ``β`` in [0, 1].
      delay: ``N``, the number of updates between two momentum updates (>= 1).
      momentum_fraction: ``c`` in ``[0, 1/N]``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`DelayedNesterovState`.

    Raises:
      ValueError: a hyperparameter out of its range.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import delayed_nesterov
      >>> opt = delayed_nesterov(1.0, momentum=0.5, delay=2)
      >>> state = opt.init(jnp.zeros(1))
      >>> for g in (2.0, 4.0, 2.0):  # plain, momentum (m = 3), plain
      ...     updates, state = opt.update(jnp.array([g]), state)
      ...     print(updates, state.momentum)
      [-1.] [0.]
      [-3.5] [3.]
      [-1.] [3.]

    References:
      Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous
      Local-SGD Training for Language Modeling", 2024,
      https://arxiv.org/abs/2401.09135
    """
    check_hyperparameter("learning_rate", learning_rate, low=0, schedule=True)
    check_hyperparameter("momentum", momentum, low=0, high=1, schedule=True)
    delay = check_hyperparameter("delay", delay, low=1, integer=True)
    high = 1.0 / delay if isinstance(delay, int) else math.inf
    check_hyperparameter(
        "momentum_fraction", momentum_fraction, low=0, high=high, schedule=True
    )

    def init_fn(params):
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)
        return DelayedNesterovState(
            count=jnp.zeros([], jnp.int32), momentum=zeros, buffer=zeros
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        t = state.count
        lr = learning_rate(t) if callable(learning_rate) else learning_rate
        n = jnp.asarray(delay, _F32)
        beta = jnp.asarray(momentum, _F32)
        c = jnp.asarray(momentum_fraction, _F32)
        due = (t + 1) % jnp.asarray(delay, jnp.int32) == 0
        coef = jnp.where(due, 1 - c * n + c, c) * beta

        scale = -jnp.asarray(lr, _F32)
        buffer = jax.tree.map(lambda g, b: b + g.astype(_F32), updates, state.buffer)
        new_m = jax.tree.map(
            lambda m, b: jnp.where(due, beta * m + b / n, m), state.momentum, buffer
        )
        steps = jax.tree.map(
            lambda g, m: (scale * (coef * m + g.astype(_F32) / n)).astype(g.dtype),
            updates,
            new_m,
        )
        buffer = jax.tree.map(lambda b: jnp.where(due, jnp.zeros_like(b), b), buffer)
        return steps, DelayedNesterovState(
            count=optax.safe_increment(t), momentum=new_m, buffer=buffer
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def diloco_outer(
    learning_rate: optax.ScalarOrSchedule = 0.7,
    momentum: float = 0.9,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo's outer optimizer: Nesterov momentum on averaged pseudo-gradients.

    Each synchronous round the server averages the workers' pseudo-gradients
    ``Δ = θ - θ_local`` (global minus local, so that they point uphill like
    gradients: module docstring) and takes one step of SGD with Nesterov
    momentum on them:

    .. math::

      m_{t+1} = β m_t + Δ_t, \\qquad θ_{t+1} = θ_t - ε (β m_{t+1} + Δ_t).

    This is ``optax.sgd(learning_rate, momentum, nesterov=True)``; the defaults
    are the paper's (``ε = 0.7``, ``β = 0.9``; with ``ε = 1`` and ``β = 0`` it
    is plain federated averaging, the server jumping to the mean of the local
    parameters). :func:`delayed_nesterov` with ``delay=1`` is the same update.

    Args:
      learning_rate: the outer learning rate ``ε``, or a schedule.
      momentum: the momentum ``β`` in [0, 1].

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (the state is optax's).

    Raises:
      ValueError: a hyperparameter out of its range.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import diloco_outer
      >>> theta, local = jnp.array([1.0]), jnp.array([0.5])
      >>> opt = diloco_outer(1.0, momentum=0.0)
      >>> updates, _ = opt.update(theta - local, opt.init(theta))
      >>> optax.apply_updates(theta, updates)  # lands on the local parameters
      Array([0.5], dtype=float32)

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
      "DiLoCo: Distributed Low-Communication Training of Language Models", 2023,
      https://arxiv.org/abs/2311.08105
    """
    check_hyperparameter("learning_rate", learning_rate, low=0, schedule=True)
    check_hyperparameter("momentum", momentum, low=0, high=1, schedule=True)
    return optax.with_extra_args_support(
        optax.sgd(learning_rate, momentum=momentum, nesterov=True)
    )
