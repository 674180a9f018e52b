"""PowerSGD: rank-r compression by one warm-started power iteration, with its codec.

Each leaf of shape ``(n, d_1, ..., d_j)`` with ``j >= 1`` is read as the matrix
``M`` of shape ``(n, m)``, ``m = d_1 ... d_j`` (row-major, as PyTorch's PowerSGD
hook does). It is compressed when rank-``r`` factors are smaller than it,
``r (n + m) < n m`` (:func:`powersgd_matrix_shape`); 0-D and 1-D leaves, and
matrices too thin to gain, are sent whole.

One step of power iteration from the factor ``Q`` (``m x r``):

.. math::

  P = M Q, \\qquad \\hat P = \\operatorname{orth}(P) \\text{ (reduced QR)}, \\qquad
  Q' = M^\\top \\hat P, \\qquad C(M) = \\hat P Q'^\\top.

What travels on the wire is the :class:`PowerSGDEncoded` pair: ``p`` = ``\\hat P``
(``n x r``) and ``q`` = ``Q'`` (``m x r``), both in the leaf's dtype, so exactly
``r (n + m)`` values; an uncompressed leaf travels as ``p`` = its flattened
values and an empty ``q``. :func:`powersgd_decode` computes ``p q^T``. The
transform :func:`power_sgd` outputs ``decode(encode(M))``, keeps ``Q'`` for the
next step (warm start) and the compression error for error feedback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_float_dtype, check_int
from hpsjax.transforms._common import (
    check_seed,
    decode_leaves,
    error_feedback_step,
    find_one_state,
    initial_error,
)
from hpsjax.transforms._topk import (
    _check_shape,
    _raw_key,
)

__all__ = [
    "PowerSGDEncoded",
    "PowerSGDState",
    "last_powersgd_encoded",
    "power_sgd",
    "powersgd_decode",
    "powersgd_decode_tree",
    "powersgd_encode",
    "powersgd_matrix_shape",
    "powersgd_nbytes",
]

_F32 = jnp.float32


class PowerSGDEncoded(NamedTuple):
    """One array as it travels on the wire (layout in the module docstring)."""

    p: jax.Array  # shape=(n, r), or (size,) for a leaf sent whole; leaf dtype
    q: jax.Array  # shape=(m, r), or (0,) for a leaf sent whole; leaf dtype


class PowerSGDState(NamedTuple):
    """State of :func:`power_sgd`."""

    count: jax.Array  # shape=(), int32: number of updates so far
    key: jax.Array  # shape=(2,), uint32: raw PRNG key data, split every update
    # The factor Q of each leaf for the warm start, float32 (m, r), or a (0,)
    # placeholder for leaves sent whole, in leaf order.
    q: list[jax.Array]
    # Error-feedback residual, a float32 tree like the updates, or
    # optax.EmptyState() when error feedback is off.
    error: Any
    # The PowerSGDEncoded of each leaf of the last output, in leaf order.
    encoded: list[PowerSGDEncoded]


def _check_rank(rank: Any) -> int:
    if isinstance(rank, (jax.Array, np.ndarray)):
        raise ValueError(
            "power_sgd's rank fixes the factors' shapes and must be a Python int, "
            "got an array; under optax.inject_hyperparams pass static_args=('rank',)"
        )
    return check_int("rank", rank, low=1)


def powersgd_matrix_shape(shape: Sequence[int], rank: int) -> tuple[int, int] | None:
    """The matrix ``(n, m)`` a leaf is compressed as, or None if it is sent whole.

    Examples:
      >>> from hpsjax.transforms import powersgd_matrix_shape
      >>> powersgd_matrix_shape((64, 3, 3, 16), 4), powersgd_matrix_shape((8, 2), 2)
      ((64, 144), None)
    """
    shape = _check_shape(shape)
    rank = _check_rank(rank)
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    if rank * (n + m) >= n * m:
        return None
    return n, m


def powersgd_nbytes(shape: Sequence[int], dtype: Any, rank: int) -> int:
    """Returns the exact size in bytes of :func:`powersgd_encode`'s output.

    ``r (n + m)`` values for a compressed leaf, its ``size`` values otherwise,
    each of ``dtype``'s size.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import powersgd_nbytes
      >>> powersgd_nbytes((1024, 1024), jnp.float32, 4)  # 4 * 2048 * 4 bytes
      32768
    """
    itemsize = check_float_dtype("dtype", dtype).itemsize
    matrix = powersgd_matrix_shape(shape, rank)
    if matrix is None:
        return math.prod(_check_shape(shape)) * itemsize
    return rank * sum(matrix) * itemsize


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def powersgd_encode(
    x: jax.Array,
    rank: int,
    q: jax.Array | None = None,
    *,
    key: jax.Array | None = None,
    value_dtype: Any = None,
) -> PowerSGDEncoded:
    """One power-iteration step: the factors ``(\\hat P, Q')`` of ``x``.

    Args:
      x: a floating array; compressed as in :func:`powersgd_matrix_shape`.
      rank: the rank ``r`` of the factors (a Python int, static under jit).
      q: the starting factor ``Q`` (``m x r``), e.g. the last step's ``q`` for a
        warm start; if None, drawn standard normal from ``key``.
      key: a PRNG key, needed when ``q`` is None and ``x`` is compressed.
      value_dtype: dtype of the factors sent; default ``x.dtype``.

    Returns:
      The :class:`PowerSGDEncoded` (:func:`powersgd_nbytes` bytes); its ``q``
      is the warm start of the next step.

    Raises:
      ValueError: bad rank or dtype, ``q`` of the wrong shape, or no ``q`` and no
        key.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from hpsjax.transforms import powersgd_encode, powersgd_decode
      >>> u, v = jnp.arange(1.0, 7.0), jnp.linspace(-1.0, 1.0, 5)
      >>> enc = powersgd_encode(jnp.outer(u, v), 1, key=jax.random.key(0))
      >>> enc.p.shape, enc.q.shape
      ((6, 1), (5, 1))
      >>> bool(jnp.allclose(powersgd_decode(enc, (6, 5)), jnp.outer(u, v), atol=1e-5))
      True

    References:
      Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
      Compression for Distributed Optimization", NeurIPS 2019,
      https://arxiv.org/abs/1905.13727
    """
    rank = _check_rank(rank)
    x = jnp.asarray(x)
    check_float_dtype("powersgd_encode's input dtype", x.dtype)
    value_dtype = check_float_dtype(
        "value_dtype", x.dtype if value_dtype is None else value_dtype
    )
    matrix = powersgd_matrix_shape(x.shape, rank)
    if matrix is None:
        return PowerSGDEncoded(
            x.reshape(x.size).astype(value_dtype), jnp.zeros((0,), value_dtype)
        )
    n, m = matrix
    if q is None:
        if key is None:
            raise ValueError("powersgd_encode needs q or a PRNG key, got neither")
        q = jax.random.normal(_raw_key(key), (m, rank), _F32)
    q = jnp.asarray(q)
    if q.shape != (m, rank):
        raise ValueError(f"q for shape {x.shape} must be ({m}, {rank}), got {q.shape}")
    mat = x.reshape(n, m).astype(_F32)
    p, _ = jnp.linalg.qr(_matmul(mat, q.astype(_F32)))
    q_new = _matmul(mat.T, p)
    return PowerSGDEncoded(p.astype(value_dtype), q_new.astype(value_dtype))


def powersgd_decode(
    encoded: PowerSGDEncoded,
    shape: Sequence[int],
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Rebuilds ``p q^T`` (or a leaf sent whole) as an array of ``shape``.

    The rank is read from the factors' shapes.

    Raises:
      ValueError: the factors do not fit ``shape``.
    """
    shape = _check_shape(shape)
    dtype = check_float_dtype("dtype", dtype)
    p, q = encoded
    size = math.prod(shape)
    if q.shape == (0,):
        if p.shape != (size,):
            raise ValueError(
                f"a leaf of shape {shape} sent whole must have p of shape ({size},), "
                f"got {p.shape}"
            )
        return p.astype(dtype).reshape(shape)
    rank = p.shape[-1] if p.ndim == 2 else 0
    matrix = powersgd_matrix_shape(shape, rank) if rank >= 1 else None
    if matrix is None or p.shape != (matrix[0], rank) or q.shape != (matrix[1], rank):
        raise ValueError(
            f"factors {p.shape} and {q.shape} do not fit a leaf of shape {shape}"
        )
    out = _matmul(p.astype(_F32), q.astype(_F32).T)
    return out.astype(dtype).reshape(shape)


def powersgd_decode_tree(
    encoded_leaves: Sequence[PowerSGDEncoded], like_tree: Any
) -> Any:
    """Decodes a list of :class:`PowerSGDEncoded` into a tree like ``like_tree``.

    Raises:
      ValueError: the number of leaves differs, or one does not fit its leaf.
    """
    return decode_leaves(
        encoded_leaves,
        like_tree,
        lambda enc, leaf: powersgd_decode(enc, leaf.shape, leaf.dtype),
    )


def _initial_q(leaves: Sequence[Any], rank: int, key: jax.Array) -> list[jax.Array]:
    qs = []
    for i, leaf in enumerate(leaves):
        matrix = powersgd_matrix_shape(leaf.shape, rank)
        if matrix is None:
            qs.append(jnp.zeros((0,), _F32))
        else:
            leaf_key = jax.random.fold_in(key, i)
            qs.append(jax.random.normal(leaf_key, (matrix[1], rank), _F32))
    return qs


def power_sgd(
    rank: int,
    *,
    error_feedback: bool = True,
    warm_start: bool = True,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Compresses each matrix-shaped update to rank ``r`` (PowerSGD).

    With error feedback (float32 residual ``e_0 = 0``), per leaf:

    .. math::

      M_t = g_t + e_t, \\qquad \\text{output } C(M_t) = \\hat P_t Q_t^\\top,
      \\qquad e_{t+1} = M_t - C(M_t),

    with ``\\hat P_t = orth(M_t Q_{t-1})`` and ``Q_t = M_t^\\top \\hat P_t`` (module
    docstring). With ``warm_start`` the iteration starts from the last step's
    ``Q`` (the paper's choice, which over steps converges to the top singular
    subspace); otherwise from a fresh standard normal ``Q``. Leaves that rank-r
    factors would not shrink are output as they are.

    The state keeps the :class:`PowerSGDEncoded` leaves of the output
    (:func:`last_powersgd_encoded`): the factors a worker sends, which decode to
    exactly what its optimizer applied.

    ``rank`` fixes array shapes, so under ``optax.inject_hyperparams`` it must be
    static: ``optax.inject_hyperparams(power_sgd, static_args=("rank",))``.

    Args:
      rank: the rank ``r`` of the factors.
      error_feedback: carry the compression error over to the next update.
      warm_start: start each power iteration from the previous ``Q``.
      seed: seed of the PRNG key kept in the state (initial ``Q``).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`PowerSGDState`.

    Raises:
      ValueError: ``rank`` is not a positive int, or a bad flag or seed.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import power_sgd, last_powersgd_encoded
      >>> opt = power_sgd(2)
      >>> state = opt.init({"w": jnp.zeros((32, 16)), "b": jnp.zeros(16)})
      >>> grads = {"w": jnp.ones((32, 16)), "b": jnp.ones(16)}
      >>> updates, state = opt.update(grads, state)
      >>> [(e.p.shape, e.q.shape) for e in last_powersgd_encoded(state)]
      [((16,), (0,)), ((32, 2), (16, 2))]
      >>> bool(jnp.allclose(updates["w"], 1.0, atol=1e-5))
      True

    References:
      Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient
      Compression for Distributed Optimization", NeurIPS 2019,
      https://arxiv.org/abs/1905.13727
    """
    rank = _check_rank(rank)
    for name, flag in (("error_feedback", error_feedback), ("warm_start", warm_start)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    check_seed(seed)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        key = jax.random.key(seed)
        key, q_key = jax.random.split(key)
        encoded = []
        for leaf in leaves:
            matrix = powersgd_matrix_shape(leaf.shape, rank)
            if matrix is None:
                size = math.prod(leaf.shape)
                p, q = jnp.zeros((size,), leaf.dtype), jnp.zeros((0,), leaf.dtype)
            else:
                p = jnp.zeros((matrix[0], rank), leaf.dtype)
                q = jnp.zeros((matrix[1], rank), leaf.dtype)
            encoded.append(PowerSGDEncoded(p, q))
        return PowerSGDState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key_data(key),
            q=_initial_q(leaves, rank, q_key),
            error=initial_error(params, error_feedback),
            encoded=encoded,
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
        dtypes = [u.dtype for u in jax.tree.leaves(updates)]

        def compress(sent):
            leaves = jax.tree.leaves(sent)
            qs = state.q if warm_start else _initial_q(leaves, rank, step_key)
            encoded = [
                powersgd_encode(leaf, rank, q if q.size else None, value_dtype=dtype)
                for leaf, q, dtype in zip(leaves, qs, dtypes, strict=True)
            ]
            return encoded, powersgd_decode_tree(encoded, updates)

        out, error, encoded = error_feedback_step(
            updates, state.error, error_feedback, compress
        )
        new_q = [
            enc.q.astype(_F32) if q.size else q
            for enc, q in zip(encoded, state.q, strict=True)
        ]
        return out, PowerSGDState(
            count=optax.safe_increment(state.count),
            key=jax.random.key_data(key),
            q=new_q,
            error=error,
            encoded=encoded,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_powersgd_encoded(state: Any) -> list[PowerSGDEncoded]:
    """Returns the :class:`PowerSGDEncoded` leaves of :func:`power_sgd`'s last output.

    Finds the one :class:`PowerSGDState` anywhere inside an optax state.

    Args:
      state: an optax state holding exactly one :class:`PowerSGDState`.

    Returns:
      Its ``encoded`` list, one per update leaf; pass it with the update tree to
      :func:`powersgd_decode_tree` to rebuild the update.

    Raises:
      ValueError: ``state`` holds no :class:`PowerSGDState`, or more than one.
    """
    return find_one_state(state, PowerSGDState, "no power_sgd").encoded
