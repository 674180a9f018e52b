r"""Staleness damping and delay compensation for asynchronous updates.

A worker computes its gradient on parameters of version :math:`v_i`; when the push
reaches the server, the server is at version :math:`V`. The update's *staleness* is
:math:`\tau = V - v_i`. The transforms here act on such updates:

* :func:`scale_by_staleness` multiplies the update by a factor :math:`f(\tau)`
  (Zhang et al. 2016; PS+ applies the same factor on the worker side);
* :func:`delay_compensation` adds DC-ASGD's first-order correction for the
  parameters that moved while the gradient was in flight (Zheng et al. 2017).

:func:`staleness_factor` is the pure :math:`\tau \mapsto f(\tau)` behind
:func:`scale_by_staleness`, for code that scales a learning rate rather than an
update, and :data:`STALENESS_POLICIES` names the built-in policies.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from hpsjax._checks import check_hyperparameter

__all__ = [
    "STALENESS_POLICIES",
    "DelayCompensationState",
    "ScaleByStalenessState",
    "delay_compensation",
    "scale_by_staleness",
    "staleness_factor",
]

StalenessPolicy = str | Callable[[jax.Array], jax.Array]


def _inverse(tau, *, gamma, power):
    del gamma, power
    # Zhang et al. divide by tau and leave fresh gradients alone; clamping at 1
    # keeps that for integers and never amplifies a fractional staleness.
    return 1.0 / jnp.maximum(tau, 1.0)


def _inverse_plus_one(tau, *, gamma, power):
    del gamma, power
    return 1.0 / (1.0 + tau)


def _exponential(tau, *, gamma, power):
    del power
    return jnp.power(gamma, tau)


def _polynomial(tau, *, gamma, power):
    del gamma
    return jnp.power(1.0 + tau, -power)


def _drop(tau, *, gamma, power):
    del gamma, power
    # The cut-off at ``max_staleness`` (mandatory for this policy) does the work.
    return jnp.ones_like(tau)


STALENESS_POLICIES: Mapping[str, Callable[..., jax.Array]] = types.MappingProxyType(
    {
        "inverse": _inverse,
        "inverse_plus_one": _inverse_plus_one,
        "exponential": _exponential,
        "polynomial": _polynomial,
        "drop": _drop,
    }
)
"""Built-in staleness policies: name -> ``f(tau, *, gamma, power)``.

The functions return the factor before the ``max_staleness`` cut-off.
"""


class ScaleByStalenessState(NamedTuple):
    """State of :func:`scale_by_staleness` (it keeps none)."""


class DelayCompensationState(NamedTuple):
    """State of :func:`delay_compensation`.

    Attributes:
      mean_square: running mean of ``g * g`` per element, used by the adaptive
        variant; an empty tuple otherwise. Same tree, shapes and dtypes as the
        params.
    """

    mean_square: Any  # tree like params (adaptive) or () (constant lam)


def _is_traced(value: Any) -> bool:
    return isinstance(value, jax.core.Tracer)


def _check_policy(
    policy: StalenessPolicy, gamma: Any, power: Any, max_staleness: Any
) -> None:
    if isinstance(policy, str):
        if policy not in STALENESS_POLICIES:
            raise ValueError(
                f"Unknown staleness policy {policy!r}; valid names are "
                f"{', '.join(sorted(STALENESS_POLICIES))}, or pass a callable "
                "tau -> factor."
            )
    elif not callable(policy):
        raise ValueError(
            f"policy must be a policy name or a callable tau -> factor, got {policy!r}."
        )
    check_hyperparameter("gamma", gamma, low=0, high=1, low_inclusive=False)
    check_hyperparameter("power", power, low=0)
    if max_staleness is not None:
        check_hyperparameter("max_staleness", max_staleness, low=0)
    elif policy == "drop":
        raise ValueError("policy='drop' needs max_staleness (an int >= 0).")


def _as_staleness(staleness: Any) -> jax.Array:
    """Validates ``staleness`` and returns it as a float scalar array, clipped at 0."""
    if staleness is None:
        raise ValueError(
            "Missing the keyword extra argument `staleness` (the number of "
            "server versions the update is behind, an int >= 0): call "
            "update(updates, state, params, staleness=tau)."
        )
    check_hyperparameter("staleness", staleness, low=0)
    tau = jnp.asarray(staleness)
    tau = tau.astype(jnp.promote_types(tau.dtype, jnp.float32))
    # A traced value cannot raise; `tau > 0` is False for negatives and NaN, so
    # both count as fresh (0) and no NaN reaches the factor.
    return jnp.where(tau > 0, tau, jnp.zeros_like(tau))


def staleness_factor(
    policy: StalenessPolicy,
    staleness: Any,
    *,
    gamma: Any = 0.9,
    power: Any = 0.5,
    max_staleness: Any = None,
) -> jax.Array:
    r"""Returns the factor :math:`f(\tau)` that damps an update of staleness tau.

    .. math::

      \begin{array}{ll}
        \text{inverse:} & f(\tau) = 1 / \max(\tau, 1)
          \quad (1 \text{ at } \tau = 0) \\
        \text{inverse\_plus\_one:} & f(\tau) = 1 / (1 + \tau) \\
        \text{exponential:} & f(\tau) = \gamma^{\tau} \\
        \text{polynomial:} & f(\tau) = (1 + \tau)^{-p} \\
        \text{drop:} & f(\tau) = 1 \\
      \end{array}

    and, when ``max_staleness`` :math:`s` is given, :math:`f(\tau) = 0` for
    :math:`\tau > s` whatever the policy (for ``"drop"`` that cut-off is the whole
    policy: keep updates up to :math:`s`, drop the rest).

    A ``staleness`` known at trace time (a Python number or a concrete array) must
    be a scalar >= 0, else ``ValueError``. A traced staleness cannot be checked, so
    negative or NaN values count as 0 (a fresh update) and the factor is never
    NaN.

    Args:
      policy: a name in :data:`STALENESS_POLICIES`, or a callable mapping the
        staleness (float32 scalar array, >= 0) to a scalar factor with ``jnp``
        operations.
      staleness: :math:`\tau`, a scalar int or float (Python or array).
      gamma: base of ``"exponential"``, in (0, 1].
      power: exponent :math:`p` of ``"polynomial"``, >= 0.
      max_staleness: optional hard cut-off :math:`s >= 0`; required by ``"drop"``.

    Returns:
      The factor, a float scalar array (float32 unless the staleness is float64).

    Examples:
      >>> from hpsjax.transforms import staleness_factor
      >>> [float(staleness_factor("inverse", t)) for t in (0, 1, 4)]
      [1.0, 1.0, 0.25]
      >>> float(staleness_factor("exponential", 2, gamma=0.5))
      0.25
      >>> float(staleness_factor("drop", 3, max_staleness=2))
      0.0

    References:
      Zhang, Gupta, Lian, Liu, `Staleness-Aware Async-SGD for Distributed Deep
      Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016.

      Jin et al., `PS+: A Simple yet Effective Framework for Fast Training on
      Parameter Server <https://doi.org/10.1109/TPDS.2022.3200518>`_, IEEE TPDS
      33(12), 2022.
    """
    _check_policy(policy, gamma, power, max_staleness)
    tau = _as_staleness(staleness)
    if isinstance(policy, str):
        factor = STALENESS_POLICIES[policy](tau, gamma=gamma, power=power)
    else:
        factor = policy(tau)
    factor = jnp.asarray(factor)
    if factor.shape != ():
        raise ValueError(
            f"A staleness policy must return a scalar, got shape {factor.shape}."
        )
    factor = factor.astype(jnp.promote_types(factor.dtype, tau.dtype))
    if max_staleness is not None:
        factor = jnp.where(tau > max_staleness, jnp.zeros_like(factor), factor)
    return factor


def scale_by_staleness(
    policy: StalenessPolicy = "inverse",
    *,
    gamma: Any = 0.9,
    power: Any = 0.5,
    max_staleness: Any = None,
) -> optax.GradientTransformationExtraArgs:
    r"""Damps each update by a function of its staleness.

    With staleness :math:`\tau` (keyword extra argument ``staleness``) and the
    factor :math:`f(\tau)` of :func:`staleness_factor`:

    .. math::

      u \leftarrow f(\tau)\, u

    An update whose factor is 0 (beyond ``max_staleness``) comes out exactly zero,
    even if it held non-finite values. Updates keep their dtype.

    The hyperparameters are numbers (or ``None``), so the transform can be wrapped
    in ``optax.inject_hyperparams``; the policy name is then a static argument.
    A callable policy must be named in ``static_args="policy"`` there, since
    ``inject_hyperparams`` takes any other callable for a schedule.

    Args:
      policy: ``"inverse"`` (Zhang et al.: :math:`1/\tau`, 1 at :math:`\tau = 0`),
        ``"inverse_plus_one"``, ``"exponential"``, ``"polynomial"``, ``"drop"``,
        or a callable ``tau -> factor`` in ``jnp``.
      gamma: base of ``"exponential"``, in (0, 1].
      power: exponent of ``"polynomial"``, >= 0.
      max_staleness: optional hard cut-off: updates with :math:`\tau` above it are
        zeroed, whatever the policy. Required by ``"drop"``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` requires the
      keyword argument ``staleness`` (a scalar int or float, >= 0; see
      :func:`staleness_factor` for how a traced negative value is handled).

    Raises:
      ValueError: at construction, for an unknown policy (the message lists the
        valid names), ``gamma`` outside (0, 1], negative ``power`` or
        ``max_staleness``, or ``"drop"`` without ``max_staleness``; at update, for
        a missing, non-scalar, negative or NaN static ``staleness``.

    Examples:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> from hpsjax.transforms import scale_by_staleness
      >>> tx = optax.chain(scale_by_staleness("inverse"), optax.sgd(1.0))
      >>> params = jnp.array([1.0, 2.0])
      >>> state = tx.init(params)
      >>> updates, state = tx.update(jnp.array([4.0, 8.0]), state, staleness=4)
      >>> updates
      Array([-1., -2.], dtype=float32)

    References:
      Zhang, Gupta, Lian, Liu, `Staleness-Aware Async-SGD for Distributed Deep
      Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016.

      Yu et al., `Accelerating Distributed Training in Heterogeneous Clusters via
      a Straggler-Aware Parameter Server
      <https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042>`_ (SaPS), IEEE HPCC
      2019.
    """
    _check_policy(policy, gamma, power, max_staleness)

    def init_fn(params):
        del params
        return ScaleByStalenessState()

    def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
        del params, extra_args
        factor = staleness_factor(
            policy,
            staleness,
            gamma=gamma,
            power=power,
            max_staleness=max_staleness,
        )
        dropped = factor == 0
        updates = jax.tree.map(
            lambda u: jnp.where(dropped, jnp.zeros_like(u), u * factor).astype(u.dtype),
            updates,
        )
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def delay_compensation(
    lam: Any = 0.04,
    *,
    adaptive: bool = False,
    decay: Any = 0.95,
    eps: Any = 1e-7,
) -> optax.GradientTransformationExtraArgs:
    r"""DC-ASGD's delay compensation of a stale gradient.

    A worker computed :math:`g` at the backup parameters :math:`w_\text{bak}`; the
    server is now at :math:`w`. DC-ASGD approximates the gradient at :math:`w` by a
    first-order Taylor step with the diagonal outer product :math:`g \odot g` as a
    cheap Hessian estimate:

    .. math::

      u = g + \lambda\, g \odot g \odot (w - w_\text{bak})

    With ``adaptive=True`` (DC-ASGD-a) :math:`\lambda` is divided, element by
    element, by the root of a running mean square of the gradients:

    .. math::

      m_t = \beta m_{t-1} + (1 - \beta) g \odot g, \qquad
      \lambda_t = \lambda / \sqrt{m_t + \epsilon}

    Put it first in the server's chain, before the optimizer
    (``optax.chain(delay_compensation(), optax.sgd(lr))`` is the paper's update
    :math:`w \leftarrow w - \eta u`).

    Args:
      lam: variance-control parameter :math:`\lambda >= 0` (0.04 in the paper's
        constant variant).
      adaptive: use the adaptive :math:`\lambda_t` of DC-ASGD-a.
      decay: :math:`\beta` of the running mean square, in [0, 1) (adaptive only).
      eps: :math:`\epsilon > 0` under the root (adaptive only).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``
      (the server's current parameters :math:`w`) and the keyword extra argument
      ``stale_params`` (:math:`w_\text{bak}`, the parameters the worker computed
      on, same tree as ``params``).

    Raises:
      ValueError: at construction, for negative ``lam``, ``decay`` outside [0, 1)
        or ``eps <= 0``; at update, when ``params`` or ``stale_params`` is missing
        or its tree structure differs from the updates'.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import delay_compensation
      >>> tx = delay_compensation(lam=0.5)
      >>> w, w_bak, g = jnp.array([1.0, 3.0]), jnp.array([0.0, 1.0]), jnp.array(
      ...     [2.0, -1.0])
      >>> u, _ = tx.update(g, tx.init(w), w, stale_params=w_bak)
      >>> u  # 2 + 0.5*4*1, -1 + 0.5*1*2
      Array([4., 0.], dtype=float32)

    References:
      Zheng, Meng, Wang, Chen, Yu, Ma, Liu, `Asynchronous Stochastic Gradient
      Descent with Delay Compensation <https://arxiv.org/abs/1609.08326>`_, ICML
      2017.
    """
    check_hyperparameter("lam", lam, low=0)
    if not isinstance(adaptive, bool):
        raise ValueError(f"adaptive must be a bool, got {adaptive!r}.")
    check_hyperparameter("decay", decay, low=0, high=1, high_inclusive=False)
    check_hyperparameter("eps", eps, low=0, low_inclusive=False)

    def init_fn(params):
        if not adaptive:
            return DelayCompensationState(mean_square=())
        return DelayCompensationState(mean_square=optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None, *, stale_params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "delay_compensation needs params: the server's current "
                "parameters w, passed as update(updates, state, params, "
                "stale_params=...)."
            )
        if stale_params is None:
            raise ValueError(
                "Missing the keyword extra argument `stale_params`: the "
                "parameters the worker computed its gradient on."
            )
        structure = jax.tree.structure(updates)
        for name, tree in (("params", params), ("stale_params", stale_params)):
            if jax.tree.structure(tree) != structure:
                raise ValueError(
                    f"{name} must have the tree structure of the updates: "
                    f"{jax.tree.structure(tree)} != {structure}."
                )

        if adaptive:
            mean_square = jax.tree.map(
                lambda m, g: (decay * m + (1 - decay) * g * g).astype(m.dtype),
                state.mean_square,
                updates,
            )
            lams = jax.tree.map(lambda m: lam / jnp.sqrt(m + eps), mean_square)
        else:
            mean_square = state.mean_square
            lams = jax.tree.map(lambda g: lam, updates)

        def compensate(g, w, w_bak, lam_t):
            drift = (w - w_bak).astype(g.dtype)
            return (g + lam_t * g * g * drift).astype(g.dtype)

        updates = jax.tree.map(compensate, updates, params, stale_params, lams)
        return updates, DelayCompensationState(mean_square=mean_square)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
