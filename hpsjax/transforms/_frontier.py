r"""Transforms of the newer asynchronous and low-communication methods.

* :func:`ordered_momentum` (OrMo, OrMo-DA): the server's momentum for
  asynchronous SGD over iterations of K gradients, each gradient placed in the
  momentum at the iteration it was computed at (keyword extra argument
  ``staleness``, as :func:`scale_by_staleness` takes).
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

from hpsjax._checks import check_hyperparameter, check_int
from hpsjax.transforms._common import find_one_state
from hpsjax.transforms._demo import _blocks
from hpsjax.transforms._quantize import Codec
from hpsjax.transforms._staleness import _as_staleness
from hpsjax.transforms._topk import topk_count

__all__ = [
    "OrderedMomentumState",
    "SparseLoCoState",
    "centroid_quantize",
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


def _ormo_lag(count: jax.Array, staleness: jax.Array, per_iteration: int) -> jax.Array:
    """Iterations between the one a gradient was computed at and now: the
    iteration index is ``count // per_iteration``, the gradient's version
    ``count - staleness`` (floor division, so a delay is never negative)."""
    now = jnp.floor_divide(count, per_iteration)
    return now - jnp.floor_divide(count - staleness, per_iteration)


def ordered_momentum(
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.9,
    *,
    gradients_per_iteration: int = 1,
    delay_adaptive: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""OrMo: heavy-ball momentum for asynchronous SGD, ordered by iteration.

    Sequential heavy-ball momentum over iterations of :math:`K` gradients
    (``gradients_per_iteration``), :math:`u_t = \beta u_{t-1} + G_t`,
    :math:`x_{t+1} = x_t - \eta u_t` with :math:`G_t` the sum of iteration
    :math:`t`'s gradients, moves the parameters by :math:`\eta \beta^{j-k} g`
    at every iteration :math:`j \ge k` for a gradient of iteration :math:`k`:
    :math:`\eta g / (1 - \beta)` in all. In asynchronous SGD a gradient
    computed at iteration :math:`k` arrives at iteration :math:`t = k + d`;
    OrMo puts it where its iteration index says. The first gradient of each
    iteration applies the momentum's step of that iteration; every gradient
    then applies at once what it would have moved the parameters by in
    iterations :math:`k..t` and joins the momentum at its decayed weight:

    .. math::

       \text{new iteration: } u \leftarrow \beta u,\; x \leftarrow x - \eta u;
       \qquad x \leftarrow x - \eta \frac{1 - \beta^{d+1}}{1 - \beta}\, g,
       \qquad u \leftarrow u + \beta^{d} g.

    The iteration index is the count of gradients applied divided by
    :math:`K` (the server's version in ASP, one per applied push, over
    :math:`K`), and :math:`d` follows from the push's staleness (the extra
    argument ``staleness``, which :class:`~hpsjax.ps.ServerCore` passes).
    With :math:`K = 1` and :math:`\tau = 0` always this is
    ``optax.sgd(eta, momentum=beta)``; with :math:`\beta = 0` plain SGD.
    OrMo-DA (``delay_adaptive=D``) scales each gradient by
    :math:`\min(1, D / d)`: the step of a gradient more than :math:`D`
    iterations late shrinks as its delay grows.

    What was read: the paper's abstract and public summaries (momentum
    "organised by the gradients' iteration indexes", an iteration of the
    sequential method taking :math:`K` gradients, a delay-adaptive variant
    OrMo-DA); the algorithm's text was not readable here. Our reading: the
    bookkeeping above, which keeps each gradient's total weight and its
    order; OrMo-DA's rule :math:`\min(1, D/d)` is the delay-adaptive step of
    Mishchenko et al. (2022) that such analyses use, not a quote.

    Args:
      learning_rate: :math:`\eta` (a number > 0 or an optax schedule of the
        update count).
      momentum: :math:`\beta` in [0, 1).
      gradients_per_iteration: :math:`K`, an int >= 1 (the paper: the
        number of workers).
      delay_adaptive: :math:`D` > 0 for OrMo-DA, or ``None`` (OrMo).

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
      >>> updates, state.momentum  # 1 + 0.5 + 0.25 at once, 0.25 left in u
      (Array([-1.75], dtype=float32), Array([0.25], dtype=float32))

    References:
      Shi, Yang, Li, `Ordered Momentum for Asynchronous SGD
      <https://arxiv.org/abs/2407.19234>`_, NeurIPS 2024; Mishchenko,
      Bach, Even, Woodworth, `Asynchronous SGD Beats Minibatch SGD Under
      Arbitrary Delays <https://arxiv.org/abs/2206.07638>`_, NeurIPS 2022.
    """
    check_hyperparameter(
        "learning_rate", learning_rate, low=0, low_inclusive=False, schedule=True
    )
    beta = check_hyperparameter(
        "momentum", momentum, low=0, high=1, high_inclusive=False
    )
    per_iteration = check_hyperparameter(
        "gradients_per_iteration", gradients_per_iteration, low=1, integer=True
    )
    if delay_adaptive is not None:
        delay_adaptive = check_hyperparameter(
            "delay_adaptive", delay_adaptive, low=0, low_inclusive=False
        )

    def init_fn(params):
        return OrderedMomentumState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params),
        )

    def update_fn(updates, state, params=None, *, staleness=None, **extra_args):
        del params, extra_args
        tau = jnp.round(_as_staleness(staleness)).astype(jnp.int32)
        lag = _ormo_lag(state.count, tau, per_iteration).astype(_F32)
        weight = jnp.ones([], _F32)
        if delay_adaptive is not None:
            weight = jnp.minimum(1.0, delay_adaptive / jnp.maximum(lag, 1.0))
        new_iteration = (state.count % per_iteration) == 0
        carry = jnp.where(new_iteration, beta, 1.0)
        decay = jnp.power(jnp.asarray(beta, _F32), lag)
        # sum_{i <= d} beta^i = (1 - beta^(d+1)) / (1 - beta).
        catch_up = weight * (1 - decay * beta) / (1 - beta)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, _F32)
        u = jax.tree.map(lambda m: carry * m, state.momentum)
        steps = jax.tree.map(
            lambda m, g: (
                -lr * (jnp.where(new_iteration, m, 0.0) + catch_up * g.astype(_F32))
            ).astype(g.dtype),
            u,
            updates,
        )
        u = jax.tree.map(lambda m, g: m + weight * decay * g.astype(_F32), u, updates)
        return steps, OrderedMomentumState(optax.safe_increment(state.count), u)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SparseLoCoState(NamedTuple):
    """State of :func:`sparseloco`."""

    count: jax.Array  # shape=(), int32: pushes so far
    error: Any  # float32 tree like the updates: the accumulator e
    nbytes: jax.Array  # shape=(), int32: bytes of one push (sparseloco_nbytes)


def _value_codec(bits: int) -> Codec:
    """The quantizer of a few-bit push's values: the scaled sign at 1 bit,
    else uniform (:func:`~hpsjax.transforms.encode`)."""
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


def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``x`` as ``(chunks, entries)``: DeMo's chunks (``_blocks``: a matrix's
    ``h x w`` blocks, leading axes merged into its rows; a vector's runs of
    ``w`` entries), each block's entries row by row.

    Examples:
      >>> import jax.numpy as jnp
      >>> _to_chunks(jnp.arange(8).reshape(2, 4), 2).tolist()
      [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    rows, cols, h, w = _blocks(tuple(x.shape), chunk)
    blocks = x.reshape(rows // h, h, cols // w, w).transpose(0, 2, 1, 3)
    return blocks.reshape(-1, h * w)


def _from_chunks(chunks: jax.Array, shape: tuple[int, ...], chunk: int) -> jax.Array:
    """The inverse of :func:`_to_chunks`: the leaf of ``shape`` back."""
    rows, cols, h, w = _blocks(tuple(shape), chunk)
    blocks = chunks.reshape(rows // h, cols // w, h, w).transpose(0, 2, 1, 3)
    return blocks.reshape(shape)


def _chunk_topk(shape: tuple[int, ...], ratio: float, chunk: int) -> tuple[int, int]:
    """``(chunks, k)``: a leaf's number of chunks and the entries kept per
    chunk, ``ceil(ratio * chunk**2)`` but at most a chunk's entries."""
    rows, cols, h, w = _blocks(tuple(shape), chunk)
    return (rows // h) * (cols // w), min(topk_count(chunk * chunk, ratio), h * w)


def centroid_quantize(
    values: jax.Array, bits: int = 2, range_in_sigmas: float = 6.0
) -> jax.Array:
    r"""SparseLoCo's value quantizer as templar runs it: ``2**bits`` bins, each
    ``range_in_sigmas / 2**bits`` standard deviations wide, centred on
    :math:`-2^{b-1}, \dots, 2^{b-1} - 1` bin widths about the mean (the ends
    take what lies beyond), each value decoded to the mean of the values in
    its bin.

    .. math::

       \mu = \bar v,\quad s = \frac{\rho\, \sigma}{2^b},\quad
       q_i = \operatorname{clip}(\operatorname{round}((v_i - \mu)/s) + 2^{b-1},
       0, 2^b - 1),\quad \hat v_i = \mu + \operatorname{mean}\{v_j - \mu : q_j = q_i\}

    with :math:`\sigma = \lVert v - \mu\rVert / \sqrt{n - 1}` and
    :math:`\rho` = ``range_in_sigmas``; deterministic and biased, as the bins'
    centroids are. What is sent per leaf: a ``bits``-bit code per value, the
    mean and the ``2**bits`` centroids (float32).

    Raises:
      ValueError: ``bits`` is not an int in [1, 16].

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import centroid_quantize
      >>> centroid_quantize(jnp.array([4.0, -4.0, 2.0, -2.0])).tolist()
      [4.0, -4.0, 0.0, 0.0]

    References:
      templar, ``src/tplr/compress.py``, ``TopKCompressor._quantize_values``
      (``quantization_bins`` 4, ``quantization_range`` 6 in its hparams).
    """
    bins = 2 ** check_int("bits", bits, low=1, high=16)
    v = values.astype(_F32).reshape(-1)
    shift = jnp.mean(v)
    centred = v - shift
    std = jnp.linalg.norm(centred) / math.sqrt(max(v.size - 1, 1))
    scale = range_in_sigmas * std / bins
    scale = jnp.where((scale > 0) & jnp.isfinite(scale), scale, 1.0)
    q = jnp.clip(jnp.round(centred / scale) + bins // 2, 0, bins - 1).astype(jnp.int32)
    sums = jax.ops.segment_sum(centred, q, num_segments=bins)
    counts = jax.ops.segment_sum(jnp.ones_like(centred), q, num_segments=bins)
    centroids = jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0)
    return (centroids[q] + shift).reshape(values.shape)


def _sparseloco_send(
    e: jax.Array, ratio: float, bits: int, chunk: int, range_in_sigmas: float
) -> jax.Array:
    """What one leaf's push sends: the accumulator's top-k per chunk, their
    values quantized together (:func:`centroid_quantize`), zero elsewhere."""
    if e.size == 0:
        return e
    _, k = _chunk_topk(tuple(e.shape), ratio, chunk)
    blocks = _to_chunks(e, chunk)
    _, idx = jax.lax.top_k(jnp.abs(blocks), k)
    picked = jnp.take_along_axis(blocks, idx, axis=-1)
    if bits < 32:
        picked = centroid_quantize(picked, bits, range_in_sigmas)
    rows = jnp.arange(blocks.shape[0])[:, None]
    sent = jnp.zeros_like(blocks).at[rows, idx].set(picked)
    return _from_chunks(sent, tuple(e.shape), chunk)


_SPARSELOCO_BITS = (1, 2, 4, 8, 32)


def sparseloco(
    ratio: float = 1 / 64,
    *,
    bits: int = 2,
    decay: float = 0.95,
    chunk: int = 64,
    range_in_sigmas: float = 6.0,
) -> optax.GradientTransformationExtraArgs:
    r"""SparseLoCo's push: decayed error feedback, top-k per chunk, 2-bit values.

    A worker's pseudo-gradient :math:`\Delta` (the global parameters it
    started from minus its local ones after :math:`H` inner steps) is added to
    its error-feedback accumulator; each leaf is cut in chunks
    as DeMo's are (:func:`~hpsjax.transforms.demo_chunk`: ``chunk x chunk``
    blocks of a matrix, runs of ``chunk`` entries of a vector, each side the
    largest divisor not above ``chunk``) and the :math:`k` entries of largest
    magnitude of every chunk are sent, their values quantized together per leaf
    (:func:`centroid_quantize`); what was sent leaves the accumulator:

    .. math::

       e \leftarrow \beta e + \Delta, \qquad
       \hat\Delta = Q_b(\mathrm{TopK}_{k}^{\text{chunk}}(e)), \qquad
       e \leftarrow e - \hat\Delta,

    with :math:`k = \lceil r\,c^2\rceil` (``ratio``, ``chunk``) but at most a
    chunk's entries: templar's 64 of a 64 x 64 chunk is ``ratio=1/64``, and
    a vector's 64-entry chunks are then sent whole. The server averages the
    :math:`\hat\Delta` and takes a plain step,
    :math:`\theta \leftarrow \theta - \alpha \operatorname{mean}(\hat\Delta)`
    (``optax.sgd(alpha)``, :math:`\alpha` the outer step, to be tuned): the
    decayed accumulator stands in for DiLoCo's outer momentum.
    :func:`sparseloco_nbytes` counts one push's bytes.

    What was read: the paper's Algorithm 1 as summarised publicly (the update
    above, averaged over the :math:`R` workers) and templar's code
    (``src/tplr/neurons.py``: the accumulator, ``compress.py``:
    ``ChunkingTransformer`` with ``target_chunk`` 64, ``TopKCompressor`` with
    ``topk_compression`` 64 and its 4-bin quantizer, ``hparams.json``:
    ``momentum_decay`` 0.95, outer SGD at ``outer_learning_rate`` 1.0). What
    differs from templar: it adds ``outer_learning_rate * Delta`` to the
    accumulator (the step enters twice; the same at 1.0), its aggregator
    averages each entry over the peers that sent it after clipping each
    peer's norm to their median (here: the mean over all workers, as the
    paper writes it), it keeps an even :math:`k` for its 12-bit index packing
    and its codes travel as bytes; a leaf of more than two axes is a matrix
    of its leading axes here, and 32 ``bits`` sends the values unquantized.

    Args:
      ratio: :math:`r` in (0, 1]: the entries sent per full chunk, as a
        fraction of ``chunk**2``.
      bits: bits per value sent: 1, 2, 4 or 8 (``2**bits`` bins), or 32 (the
        values as they are).
      decay: :math:`\beta` in [0, 1], the accumulator's decay.
      chunk: the chunks' target side (an int >= 1).
      range_in_sigmas: the quantizer's range in standard deviations (> 0).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`SparseLoCoState`.

    Raises:
      ValueError: a hyperparameter out of range.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import sparseloco
      >>> push = sparseloco(2 / 16, bits=2, decay=0.5, chunk=4)
      >>> delta = jnp.array([4, -1, 0.5, -4, 0.1, 2, -2, 0.2])
      >>> sent, state = push.update(delta, push.init(delta))
      >>> sent  # 2 per 4-entry chunk; 2 and -2 share a bin, its centroid 0
      Array([ 4.,  0.,  0., -4.,  0.,  0.,  0.,  0.], dtype=float32)
      >>> state.error  # what was not sent, kept for the next push
      Array([ 0. , -1. ,  0.5,  0. ,  0.1,  2. , -2. ,  0.2], dtype=float32)

    References:
      Sarfi, Thérien, Lidin, Belilovsky, `Communication Efficient LLM
      Pre-training with SparseLoCo <https://arxiv.org/abs/2508.15706>`_, 2025;
      templar (tplr-ai/templar), ``src/tplr/compress.py``, ``neurons.py``.
    """
    topk_count(1, ratio)  # checks the ratio
    if isinstance(bits, bool) or bits not in _SPARSELOCO_BITS:
        raise ValueError(f"bits must be one of 1, 2, 4, 8, 32, got {bits!r}")
    beta = check_hyperparameter("decay", decay, low=0, high=1)
    chunk = check_int("chunk", chunk, low=1)
    spread = check_hyperparameter(
        "range_in_sigmas", range_in_sigmas, low=0, low_inclusive=False
    )

    def init_fn(params):
        return SparseLoCoState(
            count=jnp.zeros([], jnp.int32),
            error=_zero_errors(params),
            nbytes=jnp.asarray(
                sparseloco_nbytes(params, ratio, bits, chunk=chunk), jnp.int32
            ),
        )

    def leaf(g, e):
        acc = beta * e + g.astype(_F32)
        out = _sparseloco_send(acc, ratio, bits, chunk, spread)
        return out.astype(g.dtype), acc - out

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        pairs = jax.tree.map(leaf, updates, state.error)
        outer = jax.tree.structure(updates)
        sent, error = jax.tree.transpose(outer, jax.tree.structure((0, 0)), pairs)
        return sent, SparseLoCoState(
            count=optax.safe_increment(state.count), error=error, nbytes=state.nbytes
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_sparseloco_nbytes(state: Any) -> int:
    """Bytes of one push of the :func:`sparseloco` inside an optax state.

    Raises:
      ValueError: ``state`` holds no :class:`SparseLoCoState`, or more than one.
    """
    return int(find_one_state(state, SparseLoCoState, "no sparseloco").nbytes)


def _index_bits(entries: int) -> int:
    """Bits of an index inside a chunk: templar packs them on 12 bits (chunks
    of at most 4096 entries); larger chunks take 16 or 32."""
    return 12 if entries <= 4096 else 16 if entries <= 65536 else 32


def sparseloco_nbytes(
    params: Any, ratio: float = 1 / 64, bits: int = 2, *, chunk: int = 64
) -> int:
    """Bytes of one :func:`sparseloco` push of a tree like ``params``: per leaf,
    ``k`` indices per chunk (12 bits in chunks of up to 4096 entries), the
    values' ``bits``-bit codes, and the quantizer's mean and ``2**bits``
    centroids on 4 bytes each (values of 32 bits: 4 bytes each, no table).

    Examples:
      >>> import numpy as np
      >>> from hpsjax.transforms import sparseloco_nbytes
      >>> sparseloco_nbytes({"w": np.zeros((128, 64), np.float32)}, 1 / 64)
      244
    """
    total = 0
    for leaf in jax.tree.leaves(params):
        shape = tuple(np.shape(leaf))
        if math.prod(shape) == 0:
            continue
        chunks, k = _chunk_topk(shape, ratio, chunk)
        _, _, h, w = _blocks(shape, chunk)
        sent = chunks * k
        table = 0 if bits == 32 else 4 * (1 + 2**bits)
        total += math.ceil(sent * _index_bits(h * w) / 8)
        total += math.ceil(sent * bits / 8) + table
    return total
