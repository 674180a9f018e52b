r"""Transforms of the newer asynchronous and low-communication methods.

* :func:`ordered_momentum` (OrMo): the server's momentum for asynchronous SGD,
  each gradient placed in the momentum at the iteration it was computed at
  (keyword extra argument ``staleness``, as :func:`scale_by_staleness` takes).
* :func:`sparseloco`: a worker's push of SparseLoCo, its pseudo-gradient added
  to a decayed error-feedback accumulator that is sent top-k sparsified and
  quantized to a few bits; :func:`sparseloco_nbytes` counts its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_hyperparameter
from hpsjax.transforms._common import find_one_state
from hpsjax.transforms._quantize import Codec, decode, encode, encoded_nbytes
from hpsjax.transforms._staleness import _as_staleness
from hpsjax.transforms._topk import (
    TopKEncoded,
    topk_count,
    topk_decode,
    topk_encode,
    topk_nbytes,
)

__all__ = [
    "OrderedMomentumState",
    "SparseLoCoState",
    "last_sparseloco_nbytes",
    "ordered_momentum",
    "sparseloco",
    "sparseloco_nbytes",
]

_F32 = jnp.float32


class OrderedMomentumState(NamedTuple):
    """State of :func:`ordered_momentum`."""

    count: jax.Array  # shape=(), int32: updates so far (for a schedule)
    momentum: Any  # float32 tree like the updates: u


def ordered_momentum(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
) -> optax.GradientTransformationExtraArgs:
    r"""OrMo: heavy-ball momentum for asynchronous SGD, ordered by iteration.

    Sequential heavy-ball momentum, :math:`u_k = \beta u_{k-1} + g_k`,
    :math:`x_{k+1} = x_k - \eta u_k`, moves the parameters by
    :math:`\eta \beta^{j-k} g_k` at every iteration :math:`j \ge k` for the
    gradient of iteration :math:`k`: :math:`\eta g_k / (1 - \beta)` in all.
    In asynchronous SGD the gradient computed at iteration :math:`k` arrives
    at iteration :math:`k + \tau` (:math:`\tau` its staleness); naive momentum
    adds it to :math:`u` as if it were fresh. OrMo puts it where its
    iteration index says: the part it would already have moved the parameters
    by is applied at once, the rest joins the momentum at its decayed weight:

    .. math::

       u \leftarrow \beta u + \beta^{\tau} g, \qquad
       x \leftarrow x - \eta \Big(u + \frac{1 - \beta^{\tau}}{1 - \beta}\, g\Big).

    So every gradient moves the parameters by :math:`\eta g / (1 - \beta)` in
    all, whatever its delay, in the order of the iteration it was computed
    at; with :math:`\tau = 0` always this is ``optax.sgd(eta, momentum=beta)``,
    and with :math:`\beta = 0` plain SGD. The iteration index is the server's
    version (one per applied push in ASP), so :math:`\tau` is the push's
    staleness, which :class:`~hpsjax.ps.ServerCore` passes as the extra
    argument ``staleness``.

    Our reading: the paper's abstract ("momentum is incorporated into ASGD by
    organizing the gradients in order based on their iteration indexes";
    convergence without the maximum delay). Its algorithm's exact bookkeeping
    (when its iteration index advances, and its delay-adaptive learning rate,
    OrMo-DA) was not readable here; the rule above is the one that keeps
    each gradient's total weight and its order, as the abstract says.

    Args:
      learning_rate: :math:`\eta` (a number > 0 or an optax schedule of the
        update count).
      momentum: :math:`\beta` in [0, 1).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` requires
      the keyword argument ``staleness`` (an int or float >= 0).

    Raises:
      ValueError: a hyperparameter out of range; at update, a missing or
        negative ``staleness``.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import ordered_momentum
      >>> opt = ordered_momentum(1.0, momentum=0.5)
      >>> state = opt.init(jnp.zeros(1))
      >>> updates, state = opt.update(jnp.ones(1), state, staleness=2)
      >>> updates, state.momentum  # 1 + 0.5 at once, 0.25 left in u
      (Array([-1.75], dtype=float32), Array([0.25], dtype=float32))

    References:
      Shi, Yang, Li, `Ordered Momentum for Asynchronous SGD
      <https://arxiv.org/abs/2407.19234>`_, NeurIPS 2024.
    """
    check_hyperparameter(
        "learning_rate", learning_rate, low=0, low_inclusive=False, schedule=True
    )
    beta = check_hyperparameter(
        "momentum", momentum, low=0, high=1, high_inclusive=False
    )

    def init_fn(params):
        return OrderedMomentumState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params),
        )

    def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
        del params, extra_args
        tau = _as_staleness(staleness).astype(_F32)
        decay = jnp.power(jnp.asarray(beta, _F32), tau)
        # (1 - beta^tau) / (1 - beta) = sum_{i < tau} beta^i (0^0 = 1 in jnp).
        catch_up = (1 - decay) / (1 - beta)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, _F32)
        u = jax.tree.map(
            lambda m, g: beta * m + decay * g.astype(_F32), state.momentum, updates
        )
        steps = jax.tree.map(
            lambda m, g: (-lr * (m + catch_up * g.astype(_F32))).astype(g.dtype),
            u,
            updates,
        )
        return steps, OrderedMomentumState(optax.safe_increment(state.count), u)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SparseLoCoState(NamedTuple):
    """State of :func:`sparseloco`."""

    count: jax.Array  # shape=(), int32: pushes so far
    key: jax.Array  # shape=(2,), uint32: PRNG key data, split every push
    error: Any  # float32 tree like the updates: the accumulator e
    nbytes: jax.Array  # shape=(), int32: bytes of one push (sparseloco_nbytes)


def _value_codec(bits: int) -> Codec:
    return Codec("sign", 1) if bits == 1 else Codec("uniform", bits)


def _zero_errors(params: Any) -> Any:
    """An error-feedback accumulator's start: float32 zeros like ``params``."""
    return jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)


def _push_leaves(
    updates: Any,
    errors: Any,
    key_data: jax.Array,
    per_leaf: Callable[[int, jax.Array, jax.Array, jax.Array], tuple[Any, Any]],
) -> tuple[Any, jax.Array, Any]:
    """One push of an error-feedback push transform, leaf by leaf.

    ``per_leaf(i, g, e, key)`` takes leaf ``i``'s update, its accumulator and
    a key of its own (``key_data``'s step key folded with ``i``) and returns
    what is sent (float32) and what the accumulator keeps.

    Returns:
      ``(sent, key_data, errors)``: the sent tree in the updates' dtypes, the
      next key data and the new accumulator.
    """
    key, step_key = jax.random.split(jax.random.wrap_key_data(key_data))
    leaves, treedef = jax.tree.flatten(updates)
    sent, kept = [], []
    for i, (g, e) in enumerate(zip(leaves, treedef.flatten_up_to(errors), strict=True)):
        out, rest = per_leaf(i, g, e, jax.random.fold_in(step_key, i))
        sent.append(out.astype(g.dtype))
        kept.append(rest)
    return (
        jax.tree.unflatten(treedef, sent),
        jax.random.key_data(key),
        jax.tree.unflatten(treedef, kept),
    )


def sparseloco(
    ratio: float = 0.02,
    *,
    bits: int = 2,
    decay: float = 0.95,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo's push: decayed error feedback, top-k, few-bit values.

    A worker's pseudo-gradient :math:`\Delta` (the global parameters it
    started from minus its local ones after :math:`H` inner steps) is added to
    its error-feedback accumulator, of which the largest ``ratio`` of entries
    per leaf are sent, their values quantized to ``bits`` bits; what was not
    sent stays in the accumulator:

    .. math::

       e \leftarrow \beta e + \Delta, \qquad
       \hat\Delta = Q_b(\mathrm{TopK}_r(e)), \qquad
       e \leftarrow e - \hat\Delta.

    The server averages the :math:`\hat\Delta` and takes a plain step,
    :math:`\theta \leftarrow \theta - \alpha \operatorname{mean}(\hat\Delta)`
    (``optax.sgd(alpha)``): the decayed accumulator stands in for DiLoCo's
    outer momentum, which SparseLoCo drops. :math:`Q_b` is hpsjax's uniform
    quantizer (:func:`~hpsjax.transforms.encode`, one scale per leaf, stochastic
    rounding; the scaled sign at ``bits=1``) applied to the :math:`k` kept
    values; :math:`\mathrm{TopK}` is :func:`~hpsjax.transforms.topk_encode`.
    :func:`sparseloco_nbytes` gives the bytes one push takes: :math:`k` indices
    and :math:`k` codes of ``bits`` bits per leaf, plus its scale.

    Our reading: the paper's abstract and a public summary of its update (the
    accumulator :math:`e \leftarrow \beta e + \Delta`, top-k per chunk, 2-bit
    values, :math:`e \leftarrow e - \hat\Delta`, a plain averaged outer step).
    The paper takes the top-k per chunk of a tensor; here it is per leaf.

    Args:
      ratio: the fraction of each leaf's entries sent, in (0, 1] (the paper:
        1-3%).
      bits: bits per value sent: 1 (scaled sign), 2, 4, 8 or 16.
      decay: :math:`\beta` in [0, 1], the accumulator's decay.
      seed: seed of the PRNG key of the stochastic rounding and top-k sampling.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`SparseLoCoState`.

    Raises:
      ValueError: a hyperparameter out of range.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import sparseloco
      >>> push = sparseloco(0.25, bits=2, decay=0.9)
      >>> state = push.init(jnp.zeros(8))
      >>> delta = jnp.array([0.5, 0, 0, 4, 0, 0, -4, 0.1])
      >>> sent, state = push.update(delta, state)
      >>> sent  # 2 of 8 entries, their values on 2 bits
      Array([ 0.,  0.,  0.,  4.,  0.,  0., -4.,  0.], dtype=float32)
      >>> state.error  # what was not sent, kept for the next push
      Array([0.5, 0. , 0. , 0. , 0. , 0. , 0. , 0.1], dtype=float32)

    References:
      Sarfi, Thérien, Lidin, Belilovsky, `Communication Efficient LLM
      Pre-training with SparseLoCo <https://arxiv.org/abs/2508.15706>`_, 2025.
    """
    topk_count(1, ratio)  # checks the ratio
    if isinstance(bits, bool) or bits not in (1, 2, 4, 8, 16):
        raise ValueError(f"bits must be one of 1, 2, 4, 8, 16, got {bits!r}")
    beta = check_hyperparameter("decay", decay, low=0, high=1)
    codec = _value_codec(bits)

    def init_fn(params):
        return SparseLoCoState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key_data(jax.random.PRNGKey(seed)),
            error=_zero_errors(params),
            nbytes=jnp.asarray(sparseloco_nbytes(params, ratio, bits), jnp.int32),
        )

    def send(e, key):
        k_top, k_q = jax.random.split(key)
        sparse = topk_encode(e, ratio, k_top)
        if sparse.values.size == 0:
            return jnp.zeros_like(e)
        values = decode(
            encode(sparse.values, codec, k_q), codec, sparse.values.shape, _F32
        )
        return topk_decode(TopKEncoded(sparse.indices, values), e.shape, _F32)

    def leaf(i, g, e, key):
        del i
        acc = beta * e + g.astype(_F32)
        out = send(acc, key)
        return out, acc - out

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        sent, key, error = _push_leaves(updates, state.error, state.key, leaf)
        return sent, SparseLoCoState(
            count=optax.safe_increment(state.count),
            key=key,
            error=error,
            nbytes=state.nbytes,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_sparseloco_nbytes(state: Any) -> int:
    """Bytes of one push of the :func:`sparseloco` inside an optax state.

    Raises:
      ValueError: ``state`` holds no :class:`SparseLoCoState`, or more than one.
    """
    return int(find_one_state(state, SparseLoCoState, "no sparseloco").nbytes)


def sparseloco_nbytes(params: Any, ratio: float, bits: int = 2) -> int:
    """Bytes of one :func:`sparseloco` push of a tree like ``params``: per leaf,
    ``k`` indices (2 bytes up to 65536 entries, else 4) and the ``k`` values'
    codes of ``bits`` bits with their scale (:func:`encoded_nbytes`).

    Examples:
      >>> import numpy as np
      >>> from hpsjax.transforms import sparseloco_nbytes
      >>> sparseloco_nbytes({"w": np.zeros(1000, np.float32)}, 0.01, bits=2)
      27
    """
    codec = _value_codec(bits)
    total = 0
    for leaf in jax.tree.leaves(params):
        size = int(math.prod(np.shape(leaf)))
        k = topk_count(size, ratio)
        index_bytes = topk_nbytes((size,), np.float16, ratio) - 2 * k  # indices
        total += index_bytes + (encoded_nbytes((k,), codec) if k else 0)
    return total
