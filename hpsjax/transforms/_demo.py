r"""DeMo (decoupled momentum): a worker pushes the fast components of its momentum.

A DeMo worker keeps its momentum to itself and sends only the few discrete
cosine transform (DCT) coefficients of it that are largest, chunk by chunk;
what it sent leaves its momentum, so the momentum is also the error feedback.
The server decodes every worker's coefficients back to the parameters' space
and takes a signed SGD step (:func:`demo_outer`). :func:`demo` is the
worker's push, :func:`demo_nbytes` its bytes on the wire (also in its state,
for the simulator: :func:`last_demo_nbytes`).

Read: Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization",
arXiv 2411.19870 (2024), Algorithm 1, and its reference optimizer
(``demo.py`` of github.com/bloc97/DeMo: ``compression_decay`` 0.999,
``compression_topk`` 32, ``compression_chunk`` 64, DCT-II with ``norm="ortho"``,
chunk sizes the largest divisor of each axis not above the target, top-k of
magnitudes per chunk, sign of the decoded sum, then SGD). Where hpsjax
differs: the learning rate is applied once, at the server (the reference also
scales the momentum by it, which the sign at the end makes immaterial); a leaf
of rank above 2 is chunked as a matrix of its leading axes by its last (the
reference chunks the first two axes only); the coefficients sit in place, in
the positions of the chunk they describe, so a push is a tree shaped like the
parameters and travels as the wire's top-k leaves; and the server averages
the pushes over all workers, where the reference's ``scatter_reduce(mean)``
averages each coefficient over the workers that sent it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_int, check_number, check_positive
from hpsjax.transforms._common import find_one_state
from hpsjax.transforms._topk import topk_index_dtype

__all__ = [
    "DeMoState",
    "block_dct",
    "block_idct",
    "demo",
    "demo_chunk",
    "demo_nbytes",
    "demo_outer",
    "last_demo_nbytes",
]

_F32 = jnp.float32


def demo_chunk(size: int, target: int) -> int:
    """The chunk length along an axis of ``size``: its largest divisor not
    above ``target`` (the reference's ``_get_smaller_split``).

    Examples:
      >>> demo_chunk(384, 64), demo_chunk(100, 64), demo_chunk(7, 64)
      (64, 50, 7)
    """
    size = check_int("size", size, low=1)
    target = check_int("chunk", target, low=1)
    return max(d for d in range(1, min(size, target) + 1) if size % d == 0)


@functools.lru_cache(maxsize=64)
def _dct_matrix(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix: ``(D @ x)[k]`` is coefficient ``k`` of
    ``x``; its transpose is the inverse."""
    k = np.arange(n)[:, None]
    i = np.arange(n)[None, :]
    matrix = np.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    matrix[0] /= math.sqrt(2.0)
    return matrix.astype(np.float32)


def _blocks(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    """A leaf's matrix view ``(rows, cols)`` cut into chunks ``(h, w)``:
    returns ``(rows, cols, h, w)``."""
    cols = shape[-1] if shape else 1
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    return rows, cols, demo_chunk(rows, chunk), demo_chunk(cols, chunk)


def _transform(x: jax.Array, chunk: int, *, inverse: bool) -> jax.Array:
    rows, cols, h, w = _blocks(x.shape, chunk)
    dh, dw = jnp.asarray(_dct_matrix(h)), jnp.asarray(_dct_matrix(w))
    view = x.astype(_F32).reshape(rows // h, h, cols // w, w)
    spec = "yaxb,ah,bw->yhxw" if inverse else "yhxw,ah,bw->yaxb"
    # Full float32 products: a GPU's default (TF32) loses about 3 of the 7
    # digits, enough to break the transform's orthonormality at 1e-5.
    high = jax.lax.Precision.HIGHEST
    return jnp.einsum(spec, view, dh, dw, precision=high).reshape(x.shape)


def block_dct(x: jax.Array, chunk: int) -> jax.Array:
    """The chunked DCT-II of a leaf, each chunk's coefficients in its place.

    A leaf is seen as a matrix (a vector as one row; a higher rank as its
    leading axes by its last), cut into chunks of :func:`demo_chunk` rows and
    columns, each transformed by the orthonormal 2-D DCT-II.

    Examples:
      >>> import jax.numpy as jnp
      >>> [round(float(v), 4) for v in block_dct(jnp.array([3.0, 1.0]), 2)]
      [2.8284, 1.4142]
    """
    return _transform(x, chunk, inverse=False)


def block_idct(x: jax.Array, chunk: int) -> jax.Array:
    """The inverse of :func:`block_dct` (the DCT is orthonormal)."""
    return _transform(x, chunk, inverse=True)


def _top_k_per_chunk(x: jax.Array, chunk: int, topk: int) -> jax.Array:
    """``x`` with all but the ``topk`` largest magnitudes of each chunk zeroed
    (ties broken by position, lowest first)."""
    rows, cols, h, w = _blocks(x.shape, chunk)
    k = min(topk, h * w)
    view = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
    flat = view.reshape(rows // h, cols // w, h * w)
    _, index = jax.lax.top_k(jnp.abs(flat), k)
    keep = jax.nn.one_hot(index, h * w, dtype=_F32).sum(axis=-2) > 0
    kept = jnp.where(keep, flat, 0).reshape(rows // h, cols // w, h, w)
    return kept.transpose(0, 2, 1, 3).reshape(x.shape)


class DeMoState(NamedTuple):
    """State of :func:`demo`."""

    momentum: Any  # float32 tree like the updates: what is not yet sent
    nbytes: jax.Array  # shape=(), int32: bytes of one push (demo_nbytes)


def demo(
    decay: float = 0.999, topk: int = 32, chunk: int = 64
) -> optax.GradientTransformation:
    r"""A DeMo worker's push: the top DCT coefficients of its momentum.

    .. math::

       m \leftarrow \beta m + g, \qquad
       q = \mathrm{top}_k(\mathrm{DCT}(m)) \text{ per chunk}, \qquad
       m \leftarrow m - \mathrm{DCT}^{-1}(q),

    and the output is :math:`q`: a tree shaped like the updates whose every
    chunk (see :func:`block_dct`) holds at most ``topk`` nonzero
    coefficients, sent as the wire's top-k leaves
    (:func:`~hpsjax.transforms.sparse_encoded`). The server turns the
    pushes back into a step with :func:`demo_outer`, built with the same
    ``chunk``.

    Args:
      decay: :math:`\beta` in [0, 1), the reference's ``compression_decay``.
      topk: coefficients sent per chunk (>= 1; a chunk smaller sends all).
      chunk: the target chunk length per axis (>= 1).

    Raises:
      ValueError: a hyperparameter out of range.

    Examples:
      >>> import jax.numpy as jnp
      >>> opt = demo(decay=0.5, topk=1, chunk=2)
      >>> state = opt.init(jnp.zeros(4))
      >>> q, state = opt.update(jnp.array([3.0, 1.0, 1.0, 4.0]), state)
      >>> [round(float(v), 4) for v in q]
      [2.8284, 0.0, 3.5355, 0.0]
      >>> [round(float(v), 4) for v in state.momentum]
      [1.0, -1.0, -1.5, 1.5]
    """
    decay = check_number("decay", decay, low=0.0)
    if decay >= 1:
        raise ValueError(f"decay must be in [0, 1), got {decay}.")
    topk = check_int("topk", topk, low=1)
    chunk = check_int("chunk", chunk, low=1)

    def init_fn(params):
        return DeMoState(
            jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params),
            jnp.asarray(demo_nbytes(params, topk, chunk), jnp.int32),
        )

    def push(m, g):
        m = decay * m + g.astype(_F32)
        q = _top_k_per_chunk(block_dct(m, chunk), chunk, topk)
        return q.astype(g.dtype), m - block_idct(q, chunk)

    def update_fn(updates, state, params=None):
        del params
        pairs = jax.tree.map(push, state.momentum, updates)
        is_pair = lambda node: isinstance(node, tuple)
        sent = jax.tree.map(lambda pair: pair[0], pairs, is_leaf=is_pair)
        left = jax.tree.map(lambda pair: pair[1], pairs, is_leaf=is_pair)
        return sent, DeMoState(left, state.nbytes)

    return optax.GradientTransformation(init_fn, update_fn)


def demo_outer(
    learning_rate: optax.ScalarOrSchedule, chunk: int = 64, sign: bool = True
) -> optax.GradientTransformation:
    r"""The server's step on DeMo pushes: decode, sign, descend.

    .. math::

       x \leftarrow x - \eta\, \mathrm{sign}\big(\mathrm{DCT}^{-1}(\bar q)\big),

    :math:`\bar q` the (averaged) pushes of :func:`demo` in its chunked DCT
    space; ``sign=False`` steps along the decoded average itself.

    Args:
      learning_rate: :math:`\eta` (> 0, or an optax schedule of the step count).
      chunk: the workers' :func:`demo` ``chunk``.
      sign: whether to take the sign of the decoded update (the paper's
        signum).

    Examples:
      >>> import jax.numpy as jnp
      >>> opt = demo_outer(0.1, chunk=2)
      >>> step, _ = opt.update(jnp.array([2.8284, 0.0, 3.5355, 0.0]),
      ...                      opt.init(jnp.zeros(4)))
      >>> [round(float(v), 4) for v in step]
      [-0.1, -0.1, -0.1, -0.1]
    """
    if not callable(learning_rate):
        check_positive("learning_rate", learning_rate)
    chunk = check_int("chunk", chunk, low=1)

    def decode(q):
        dense = block_idct(q, chunk)
        return (jnp.sign(dense) if sign else dense).astype(q.dtype)

    def decode_tree(updates, params=None):
        del params
        return jax.tree.map(decode, updates)

    return optax.chain(optax.stateless(decode_tree), optax.sgd(learning_rate))


def last_demo_nbytes(state: Any) -> int:
    """Bytes of one push of the :func:`demo` inside an optax state
    (:func:`demo_nbytes` of the tree it was built for).

    Raises:
      ValueError: no :func:`demo` (or more than one) in ``state``.
    """
    return int(find_one_state(state, DeMoState, "no demo").nbytes)


def demo_nbytes(params: Any, topk: int = 32, chunk: int = 64) -> int:
    """The bytes of one :func:`demo` push on the wire: per leaf, ``topk``
    coefficients a chunk (fewer in a smaller chunk), each a flat index
    (2 bytes up to 65536 entries, else 4) and a value of the leaf's width.

    Examples:
      >>> import jax.numpy as jnp
      >>> demo_nbytes({"w": jnp.zeros((128, 128)), "b": jnp.zeros(128)})
      1152
    """
    topk = check_int("topk", topk, low=1)
    chunk = check_int("chunk", chunk, low=1)
    total = 0
    for leaf in jax.tree.leaves(params):
        shape = tuple(np.shape(leaf))
        rows, cols, h, w = _blocks(shape, chunk)
        sent = (rows // h) * (cols // w) * min(topk, h * w)
        index = topk_index_dtype(max(1, math.prod(shape))).itemsize
        total += sent * (index + jnp.dtype(leaf.dtype).itemsize)
    return total
