"""Top-k sparsification: a wire codec of indices and values, and its optax transform.

:func:`topk_encode` keeps ``k = ceil(ratio * d)`` entries of an array of ``d``
elements (at least one when ``d > 0``) as a :class:`TopKEncoded` pair, which is
exactly what travels on the wire:

* ``indices``: 1-D, ``k`` flat indices (row-major), increasing, ``uint16`` when
  ``d <= 65536`` and ``uint32`` otherwise (:func:`topk_index_dtype`);
* ``values``: 1-D, the ``k`` entries in the array's dtype (or the one asked for).

Nothing else is sent: ``k`` and both dtypes follow from the shape, the dtype and
the ratio, so the size on the wire is exactly ``k * (index bytes + value bytes)``
(:func:`topk_nbytes`). :func:`topk_decode` scatters the values back into zeros.

The kept entries are found as in Deep Gradient Compression (Lin et al. 2018): a
threshold is read off a random sample of the magnitudes (the ``ceil(ratio * s)``-th
largest of ``s`` sampled ones), then adjusted by bisection, a few passes inside
the jitted program, until the number of entries at or above it lies in
``[k, 1.3 k]``; if the passes run out, the last threshold known to keep at least
``k`` entries is used. Shapes under ``jax.jit`` are static, so exactly ``k``
entries are sent: the first ``k`` at or above the threshold, in index order. The
few above-threshold entries left out (at most 0.3 k when the search converged)
stay in the error-feedback residual of :func:`top_k` and go out later.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hpsjax._checks import check_float_dtype, check_fraction, is_int
from hpsjax.transforms._common import (
    check_seed,
    decode_leaves,
    error_feedback_step,
    find_one_state,
    initial_error,
)

__all__ = [
    "TopKEncoded",
    "TopKState",
    "last_topk_encoded",
    "top_k",
    "topk_count",
    "topk_decode",
    "topk_decode_tree",
    "topk_encode",
    "topk_encode_tree",
    "topk_index_dtype",
    "topk_nbytes",
]

_F32 = jnp.float32
# Magnitudes sampled to estimate the threshold; arrays this small are read whole.
SAMPLE_SIZE = 16384
# The search stops once the count at the threshold is within [k, SLACK * k], as
# in the reference implementation of ASHL (0.8-1.3 there; never below k here).
SLACK = 1.3
# Passes of the bisection over the whole array after the sampled estimate.
SEARCH_PASSES = 8


class TopKEncoded(NamedTuple):
    """One array as it travels on the wire (layout in the module docstring)."""

    indices: jax.Array  # shape=(k,), uint16 or uint32: flat indices, increasing
    values: jax.Array  # shape=(k,), the array's dtype


class TopKState(NamedTuple):
    """State of :func:`top_k`."""

    count: jax.Array  # shape=(), int32: number of updates so far
    key: jax.Array  # shape=(2,), uint32: raw PRNG key data, split every update
    # Error-feedback residual, a float32 tree like the updates, or
    # optax.EmptyState() when error feedback is off.
    error: Any
    # The TopKEncoded of each leaf of the last output, in leaf order.
    encoded: list[TopKEncoded]


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, (jax.Array, np.ndarray)):
        raise ValueError(
            "top_k's ratio fixes the number of entries sent and must be a Python "
            "float, got an array; under optax.inject_hyperparams pass "
            "static_args=('ratio',)"
        )
    return check_fraction("ratio", ratio)


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of ints, got {shape!r}") from None
    if not all(is_int(d) and d >= 0 for d in dims):
        raise ValueError(f"shape must hold non-negative ints, got {shape!r}")
    return tuple(int(d) for d in dims)


def topk_count(size: int, ratio: float) -> int:
    """Returns ``k``, the number of entries kept of ``size``: ``ceil(ratio * size)``.

    At least one entry is kept of a non-empty array, none of an empty one. The
    product is rounded to 12 significant digits first, so that ``0.01 * 300``
    keeps 3 entries, not 4.

    Examples:
      >>> from hpsjax.transforms import topk_count
      >>> topk_count(1000, 0.01), topk_count(5, 0.01), topk_count(0, 0.5)
      (10, 1, 0)
    """
    ratio = _check_ratio(ratio)
    if not is_int(size) or size < 0:
        raise ValueError(f"size must be a non-negative int, got {size!r}")
    if size == 0:
        return 0
    return max(1, min(size, math.ceil(float(f"{ratio * size:.12g}"))))


def topk_index_dtype(size: int) -> jnp.dtype:
    """``uint16`` for arrays of at most 65536 elements, ``uint32`` otherwise."""
    if size > 2**32:
        raise ValueError(f"top-k indexes arrays of at most 2**32 elements, got {size}")
    return jnp.dtype(jnp.uint16 if size <= 2**16 else jnp.uint32)


def topk_nbytes(shape: Sequence[int], dtype: Any, ratio: float) -> int:
    """Returns the exact size in bytes of :func:`topk_encode`'s output.

    .. math::

      k \\,(b_{\\text{index}} + b_{\\text{value}}), \\qquad k = \\lceil r d \\rceil,

    with 2 index bytes for ``d <= 65536`` elements and 4 above.

    Args:
      shape: shape of the original array.
      dtype: dtype of the values sent.
      ratio: the fraction ``r`` of entries kept.

    Returns:
      ``indices.nbytes + values.nbytes`` of the :class:`TopKEncoded`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import topk_nbytes
      >>> topk_nbytes((1000, 1000), jnp.float32, 0.01)  # 10000 * (4 + 4)
      80000
      >>> topk_nbytes((256, 256), jnp.bfloat16, 0.01)  # 656 * (2 + 2)
      2624
    """
    size = math.prod(_check_shape(shape))
    k = topk_count(size, ratio)
    value_bytes = check_float_dtype("dtype", dtype).itemsize
    return k * (topk_index_dtype(size).itemsize + value_bytes)


def _raw_key(key: jax.Array) -> jax.Array:
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def _threshold(mag: jax.Array, k: int, ratio: float, key: jax.Array | None):
    """A threshold t with at least k magnitudes >= t (at most SLACK k if found)."""
    size = mag.shape[0]
    if size <= SAMPLE_SIZE:
        # Small arrays: the k-th largest magnitude, exactly.
        return lax.top_k(mag, k)[0][-1]
    sample = mag[jax.random.randint(_raw_key(key), (SAMPLE_SIZE,), 0, size)]
    # Aim at the middle of [k, SLACK k] so that the estimate is often accepted.
    k_sample = min(SAMPLE_SIZE, math.ceil(ratio * SAMPLE_SIZE * (1 + SLACK) / 2))
    guess = lax.top_k(sample, k_sample)[0][-1]
    high = math.floor(SLACK * k)

    def count(t):
        return jnp.sum(mag >= t, dtype=jnp.int32)

    def searching(carry):
        _, _, _, n, passes = carry
        return ((n < k) | (n > high)) & (passes < SEARCH_PASSES)

    def bisect(carry):
        t, lo, hi, n, passes = carry
        # Too few: the threshold becomes an upper bound; too many: a lower one.
        lo = jnp.where(n >= k, t, lo)
        hi = jnp.where(n < k, t, hi)
        t = jnp.where(jnp.isfinite(hi), (lo + hi) * 0.5, jnp.maximum(2 * t, 1e-30))
        return t, lo, hi, count(t), passes + 1

    # lo = 0 keeps every element, so it always keeps at least k.
    init = (guess, _F32(0), _F32(jnp.inf), count(guess), jnp.int32(0))
    t, lo, _, n, _ = lax.while_loop(searching, bisect, init)
    return jnp.where(n >= k, t, lo)


def _encode(x: jax.Array, ratio: float, key, value_dtype) -> TopKEncoded:
    size = x.size
    k = topk_count(size, ratio)
    index_dtype = topk_index_dtype(size)
    flat = x.reshape(size)
    if k == 0:
        return TopKEncoded(jnp.zeros((0,), index_dtype), jnp.zeros((0,), value_dtype))
    if k == size:
        index = jnp.arange(size, dtype=index_dtype)
        return TopKEncoded(index, flat.astype(value_dtype))
    mag = jnp.abs(flat.astype(_F32))
    t = _threshold(mag, k, ratio, key)
    # The first k entries at or above t, in index order; t keeps at least k.
    (index,) = jnp.nonzero(mag >= t, size=k, fill_value=0)
    return TopKEncoded(index.astype(index_dtype), flat[index].astype(value_dtype))


def topk_encode(
    x: jax.Array,
    ratio: float,
    key: jax.Array | None = None,
    *,
    value_dtype: Any = None,
) -> TopKEncoded:
    """Keeps ``k = ceil(ratio * x.size)`` entries of largest magnitude (about).

    The threshold is estimated on a random sample of ``SAMPLE_SIZE`` magnitudes
    and adjusted until ``[k, 1.3 k]`` entries reach it (module docstring); the
    first ``k`` of those in index order are kept. Arrays of at most
    ``SAMPLE_SIZE`` elements keep exactly their ``k`` largest magnitudes (ties
    broken by index), and need no key.

    Args:
      x: a floating array of any shape.
      ratio: the fraction of entries kept, in (0, 1]; a Python float (static
        under ``jax.jit``).
      key: a PRNG key (typed or raw ``uint32[2]``) for the sample; required when
        ``x`` has more than ``SAMPLE_SIZE`` elements and ``ratio < 1``.
      value_dtype: dtype of the values sent; default ``x.dtype``.

    Returns:
      The :class:`TopKEncoded` indices and values (:func:`topk_nbytes` bytes).

    Raises:
      ValueError: ``x`` is not floating, ``ratio`` is not in (0, 1], or the key is
        missing.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import topk_encode, topk_decode
      >>> enc = topk_encode(jnp.array([0.1, -3.0, 0.2, 2.0, 0.0]), 0.4)
      >>> enc.indices, enc.values
      (Array([1, 3], dtype=uint16), Array([-3.,  2.], dtype=float32))
      >>> topk_decode(enc, (5,), jnp.float32)
      Array([ 0., -3.,  0.,  2.,  0.], dtype=float32)

    References:
      Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the
      Communication Bandwidth for Distributed Training", ICLR 2018,
      https://arxiv.org/abs/1712.01887
    """
    ratio = _check_ratio(ratio)
    x = jnp.asarray(x)
    check_float_dtype("topk_encode's input dtype", x.dtype)
    value_dtype = x.dtype if value_dtype is None else value_dtype
    value_dtype = check_float_dtype("value_dtype", value_dtype)
    size = x.size
    if key is None and size > SAMPLE_SIZE and topk_count(size, ratio) < size:
        raise ValueError(
            f"top-k of {size} > {SAMPLE_SIZE} elements samples the threshold and "
            f"needs a PRNG key, got key=None"
        )
    return _encode(x, ratio, key, value_dtype)


def topk_decode(
    encoded: TopKEncoded,
    shape: Sequence[int],
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Rebuilds an array from :func:`topk_encode`'s indices and values.

    Entries not sent are zero.

    Args:
      encoded: the :class:`TopKEncoded`.
      shape: shape of the original array.
      dtype: dtype of the result.

    Returns:
      The array of ``shape`` and ``dtype``.

    Raises:
      ValueError: the indices are not of the size and dtype the shape implies
        (the ratio is not needed: their length is ``k``), or the values' length
        differs from the indices'.
    """
    shape = _check_shape(shape)
    dtype = check_float_dtype("dtype", dtype)
    indices, values = encoded
    size = math.prod(shape)
    index_dtype = topk_index_dtype(size)
    if indices.dtype != index_dtype or indices.ndim != 1 or indices.shape[0] > size:
        raise ValueError(
            f"indices for shape {shape} must be 1-D {index_dtype} of at most {size} "
            f"entries, got {indices.dtype}{list(indices.shape)}"
        )
    if values.shape != indices.shape:
        raise ValueError(
            f"values must be 1-D like the indices {list(indices.shape)}, got "
            f"{list(values.shape)}"
        )
    flat = jnp.zeros((size,), dtype)
    flat = flat.at[indices.astype(jnp.int32)].set(
        values.astype(dtype), unique_indices=True, mode="drop"
    )
    return flat.reshape(shape)


def topk_encode_tree(
    tree: Any,
    ratio: float,
    key: jax.Array | None = None,
    *,
    value_dtypes: Sequence[Any] | None = None,
) -> list[TopKEncoded]:
    """Encodes every leaf of a pytree; leaf ``i`` samples with ``fold_in(key, i)``.

    Args:
      tree: a pytree of floating arrays.
      ratio: the fraction of entries kept of each leaf.
      key: a PRNG key (see :func:`topk_encode`).
      value_dtypes: the dtype of the values sent for each leaf; default each
        leaf's own.

    Returns:
      A list with the :class:`TopKEncoded` of each leaf, in leaf order.
    """
    ratio = _check_ratio(ratio)
    leaves = jax.tree.leaves(tree)
    if value_dtypes is None:
        value_dtypes = [None] * len(leaves)
    if len(value_dtypes) != len(leaves):
        raise ValueError(
            f"got {len(value_dtypes)} value dtypes for a tree of {len(leaves)} leaves"
        )
    out = []
    for i, (leaf, dtype) in enumerate(zip(leaves, value_dtypes, strict=True)):
        leaf_key = None if key is None else jax.random.fold_in(_raw_key(key), i)
        out.append(topk_encode(leaf, ratio, leaf_key, value_dtype=dtype))
    return out


def topk_decode_tree(encoded_leaves: Sequence[TopKEncoded], like_tree: Any) -> Any:
    """Decodes :func:`topk_encode_tree`'s output into a tree like ``like_tree``.

    Args:
      encoded_leaves: the :class:`TopKEncoded` of each leaf, in leaf order.
      like_tree: a pytree whose leaves (arrays or ``jax.ShapeDtypeStruct``) give
        the structure, shapes and dtypes of the result.

    Returns:
      The decoded pytree.

    Raises:
      ValueError: the number of encoded leaves differs from ``like_tree``'s, or
        one does not match its leaf (see :func:`topk_decode`).
    """
    return decode_leaves(
        encoded_leaves,
        like_tree,
        lambda enc, leaf: topk_decode(enc, leaf.shape, leaf.dtype),
    )


def top_k(
    ratio: float,
    *,
    error_feedback: bool = True,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Sparsifies updates to their largest ``ratio`` fraction, with error feedback.

    With error feedback (a float32 residual ``e_0 = 0``, DGC's "local gradient
    accumulation"):

    .. math::

      p_t = g_t + e_t, \\qquad \\text{output } C(p_t), \\qquad
      e_{t+1} = p_t - C(p_t),

    with ``C(p) = topk_decode(topk_encode(p))`` per leaf, so that ``sum_t C(p_t) +
    e_T = sum_t g_t``: nothing is lost, only delayed. Without it the output is
    ``C(g_t)``. The values are sent in each update leaf's dtype.

    The state keeps the :class:`TopKEncoded` leaves of the output
    (:func:`last_topk_encoded`): the bytes a worker sends, which decode to exactly
    what its optimizer applied. The key is split at every update.

    ``ratio`` fixes array shapes, so under ``optax.inject_hyperparams`` it must be
    static: ``optax.inject_hyperparams(top_k, static_args=("ratio",))``.

    Args:
      ratio: the fraction of each leaf's entries sent, in (0, 1].
      error_feedback: carry what was not sent over to the next update.
      seed: seed of the PRNG key kept in the state (threshold sampling).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`TopKState`.

    Raises:
      ValueError: ``ratio`` is not a float in (0, 1], or a bad flag or seed.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import top_k, last_topk_encoded
      >>> opt = optax.chain(top_k(0.25), optax.sgd(1.0))
      >>> state = opt.init({"w": jnp.zeros(8)})
      >>> updates, state = opt.update({"w": jnp.arange(8.0)}, state)
      >>> updates["w"]
      Array([-0., -0., -0., -0., -0., -0., -6., -7.], dtype=float32)
      >>> last_topk_encoded(state)[0].indices
      Array([6, 7], dtype=uint16)

    References:
      Lin, Han, Mao, Wang, Dally, "Deep Gradient Compression: Reducing the
      Communication Bandwidth for Distributed Training", ICLR 2018,
      https://arxiv.org/abs/1712.01887

      Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
      Gradient Compression Schemes", ICML 2019, https://arxiv.org/abs/1901.09847
    """
    ratio = _check_ratio(ratio)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be a bool, got {error_feedback!r}")
    check_seed(seed)

    def init_fn(params):
        encoded = []
        for leaf in jax.tree.leaves(params):
            size = math.prod(leaf.shape)
            k = topk_count(size, ratio)
            encoded.append(
                TopKEncoded(
                    jnp.zeros((k,), topk_index_dtype(size)), jnp.zeros((k,), leaf.dtype)
                )
            )
        return TopKState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            error=initial_error(params, error_feedback),
            encoded=encoded,
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        key, step_key = jax.random.split(state.key)
        dtypes = [u.dtype for u in jax.tree.leaves(updates)]

        def compress(sent):
            encoded = topk_encode_tree(sent, ratio, step_key, value_dtypes=dtypes)
            return encoded, topk_decode_tree(encoded, updates)

        out, error, encoded = error_feedback_step(
            updates, state.error, error_feedback, compress
        )
        return out, TopKState(
            count=optax.safe_increment(state.count),
            key=key,
            error=error,
            encoded=encoded,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_topk_encoded(state: Any) -> list[TopKEncoded]:
    """Returns the :class:`TopKEncoded` leaves of :func:`top_k`'s last output.

    Finds the one :class:`TopKState` anywhere inside an optax state (chains,
    ``inject_hyperparams``, ``MultiSteps``, ...).

    Args:
      state: an optax state holding exactly one :class:`TopKState`.

    Returns:
      Its ``encoded`` list, one :class:`TopKEncoded` per update leaf; pass it with
      the update tree to :func:`topk_decode_tree` to rebuild the update.

    Raises:
      ValueError: ``state`` holds no :class:`TopKState`, or more than one.
    """
    return find_one_state(state, TopKState, "no top_k").encoded
