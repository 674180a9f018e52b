r"""Streaming DiLoCo: fragments of the parameters synchronised in turn.

DiLoCo (:func:`~hpsjax.transforms.diloco_outer`) sends every parameter once a
round of :math:`H` inner steps: its peak bandwidth is the whole model at once.
Streaming DiLoCo splits the parameters into :math:`P` fragments and
synchronises one of them every :math:`H / P` inner steps, in turn, so each
fragment is still synchronised every :math:`H` steps but a message carries
:math:`1 / P` of the model; its outer gradient travels while the next inner
steps run and is quantized to a few bits. In hpsjax a round is :math:`H / P`
inner steps (``worker.local_steps``) and three transforms share the work:

* :func:`streaming_local` wraps the workers' inner optimizer: it keeps each
  worker's own parameters from round to round and merges a fragment the server
  has synchronised into them (mixing factor :math:`\alpha`);
* :func:`streaming_push` is each worker's push: the outer gradient of the
  fragment due, quantized (:func:`streaming_fragment_nbytes` counts it);
* :func:`streaming_outer` is the server's outer step: Nesterov momentum on the
  averaged outer gradient of the fragment due, the other fragments untouched.

The fragment due at a worker's :math:`c`-th push and at the server's
:math:`c`-th update is :math:`c \bmod P`, so workers and server agree without a
message as long as every worker pushes every round (BSP, all workers from the
start); fragment :math:`p` is either the :math:`p`-th of :math:`P` equal
contiguous chunks of the flattened parameters (:func:`fragment_bounds`) or,
``layout="strided"``, every :math:`P`-th top-level block (a layer) from block
:math:`p` (:func:`check_layout`).

Read: the paper (Douillard et al., arXiv 2501.18512: fragments synchronised
in turn, strided blocks of layers, the outer gradient overlapped with
:math:`\tau` inner steps, 4-bit floating-point outer gradients, the merge
with a mixing factor :math:`\alpha`) and torchft's ``torchft/local_sgd.py``
(``DiLoCo`` with ``fragment_sync_delay`` = :math:`\tau` < :math:`H/P`,
``fragment_update_alpha`` = :math:`\alpha` in [0, 1], the merge
``global.lerp(local, alpha)``; fragments are the modules the user passes).
Here :math:`\tau` is ``streaming_local(delay=...)`` (the merge held for
:math:`\tau` inner steps) or, with ``delay=0`` and the worker's
``overlap='pipeline'``, one round of :math:`H/P` steps; :math:`\alpha` is
``mixing``; the 4-bit float is ``bits="e2m1"``. What differs: a pull brings
the whole model, not only the fragment synchronised; a strided block is a
top-level child of the parameters (a layer of hpsjax's models; the paper
strides transformer blocks); the E2M1 scale is one float32 per leaf of a
fragment.

**Eager updates** (Kale, Douillard, Donchev 2025, arXiv 2502.12996) are
``streaming_local(..., eager=True)``: while a fragment's outer gradient
travels, the worker steps that fragment with a stand-in for the average (its
own fresh outer gradient and the others' last ones), and corrects the step
when the true global fragment arrives; see :func:`streaming_local`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_choice, check_hyperparameter, check_int
from hpsjax.transforms._common import find_one_state
from hpsjax.transforms._frontier import (
    _push_leaves,
    _value_codec,
    _zero_errors,
)
from hpsjax.transforms._quantize import decode, encode, encoded_nbytes

__all__ = [
    "E2M1_GRID",
    "LAYOUTS",
    "StreamingDelayState",
    "StreamingEagerState",
    "StreamingLocalState",
    "StreamingOuterState",
    "StreamingPushState",
    "check_layout",
    "e2m1_round",
    "fragment_bounds",
    "last_streaming_nbytes",
    "leaf_blocks",
    "streaming_fragment_nbytes",
    "streaming_local",
    "streaming_outer",
    "streaming_push",
]

_F32 = jnp.float32
_BITS = (1, 2, 4, 8, 16)
_QUANTIZERS = (*_BITS, "e2m1")
LAYOUTS: tuple[str, ...] = ("contiguous", "strided")
"""How parameters are cut into fragments (:func:`check_layout`)."""
# A leaf within this distance (relative to its largest magnitude) of the
# worker's own is its own: the driver applied the last update, up to rounding.
_SAME_RTOL = 1e-6


def fragment_bounds(tree: Any, fragments: int) -> tuple[int, ...]:
    r"""Where each fragment starts in the flattened parameters, and the end.

    The leaves of ``tree`` (in ``jax.tree.leaves`` order) laid end to end make
    one vector of :math:`N` elements; fragment :math:`p` is its elements
    :math:`[\lfloor pN/P \rfloor, \lfloor (p+1)N/P \rfloor)`: equal
    contiguous chunks, so that the peak a link carries is :math:`1/P` of the
    model. It depends on the leaves' shapes only, so every worker and the
    server find the same fragments.

    Raises:
      ValueError: ``fragments`` is not an int >= 1, or exceeds the elements.

    Examples:
      >>> import numpy as np
      >>> from hpsjax.transforms import fragment_bounds
      >>> tree = {"b": np.zeros(8), "w": np.zeros((8, 8)), "v": np.zeros((8, 4))}
      >>> fragment_bounds(tree, 2)  # b, v, w: 104 elements
      (0, 52, 104)
    """
    fragments = check_int("fragments", fragments, low=1)
    total = sum(int(math.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree))
    if fragments > total:
        raise ValueError(
            f"fragments ({fragments}) must not exceed the tree's {total} elements"
        )
    return tuple(p * total // fragments for p in range(fragments + 1))


def _key(entry: Any) -> Any:
    for name in ("key", "idx", "name"):
        if hasattr(entry, name):
            return getattr(entry, name)
    return str(entry)


def _numbered(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit())


def leaf_blocks(tree: Any) -> tuple[int, ...]:
    """Per leaf of ``tree`` (``jax.tree.leaves`` order), the block (a layer)
    it is in, numbered in order: below the nodes every leaf shares, each child
    is a block, except that a child whose own children are numbered (a list
    of layers, ``{"0": ..., "1": ...}``) gives a block each. A bare leaf is
    one block.

    Examples:
      >>> import numpy as np
      >>> layer = {"b": np.zeros(2), "w": np.zeros(4)}
      >>> leaf_blocks({"layers": {"0": layer, "1": layer, "2": layer}})
      (0, 0, 1, 1, 2, 2)
      >>> leaf_blocks({"blocks": [layer, layer], "head": layer})
      (0, 0, 1, 1, 2, 2)
    """
    paths = [tuple(_key(k) for k in path) for path, _ in
             jax.tree_util.tree_flatten_with_path(tree)[0]]  # fmt: skip
    while paths and all(len(q) > 1 and q[0] == paths[0][0] for q in paths):
        paths = [q[1:] for q in paths]  # one child: go down
    numbered = {
        q[0] for q in paths if len(q) > 1 and _numbered(q[1])
    }  # children that are lists of layers
    ids: dict[tuple, int] = {}
    out = []
    for q in paths:
        block = q[:2] if q and q[0] in numbered else q[:1]
        out.append(ids.setdefault(block, len(ids)))
    return tuple(out)


def check_layout(tree: Any, fragments: int, layout: str) -> str:
    r"""``layout`` checked against ``tree``: ``"contiguous"`` (equal chunks
    of the flat parameters, :func:`fragment_bounds`) or ``"strided"`` (block
    :math:`i` of :func:`leaf_blocks`, a top-level child of the tree such as a
    layer, in fragment :math:`i \bmod P`: the paper's strided layers), which
    needs at least ``fragments`` blocks.

    Raises:
      ValueError: an unknown layout, or too few blocks to stride.
    """
    layout = check_choice("layout", layout, LAYOUTS)
    if layout == "contiguous" or tree is None:
        return layout
    fragments = check_int("fragments", fragments, low=1)
    count = len(set(leaf_blocks(tree)))
    if fragments > count:
        raise ValueError(
            f"strided fragments ({fragments}) must not exceed the tree's {count} "
            "top-level blocks"
        )
    return layout


def _masks(
    tree: Any, fragments: int, due: jax.Array, layout: str = "contiguous"
) -> list[jax.Array]:
    """Per leaf of ``tree``, a bool array: its elements in fragment ``due``
    (traced)."""
    leaves = jax.tree.leaves(tree)
    if layout == "strided":
        return [
            jnp.broadcast_to(jnp.asarray(b % fragments) == due, np.shape(leaf))
            for b, leaf in zip(leaf_blocks(tree), leaves, strict=True)
        ]
    bounds = jnp.asarray(fragment_bounds(leaves, fragments), jnp.int32)
    lo, hi = bounds[due], bounds[due + 1]
    out, offset = [], 0
    for leaf in leaves:
        size = int(math.prod(np.shape(leaf)))
        flat = offset + jnp.arange(size, dtype=jnp.int32)
        out.append(((flat >= lo) & (flat < hi)).reshape(np.shape(leaf)))
        offset += size
    return out


def streaming_fragment_nbytes(
    tree: Any, fragments: int, bits: int | str | None = 4, layout: str = "contiguous"
) -> tuple[int, ...]:
    """Bytes of one :func:`streaming_push` of each fragment of a tree like
    ``tree``: the codes of its elements at ``bits`` bits and a float32 scale
    per leaf it reaches into (as :func:`~hpsjax.transforms.encoded_nbytes`
    counts them; ``"e2m1"`` as 4 bits), or its float32 bytes for
    ``bits=None``, the fragments laid out as ``layout`` (see
    :func:`check_layout`). The largest is the peak a link must carry at once.

    Examples:
      >>> import numpy as np
      >>> from hpsjax.transforms import streaming_fragment_nbytes
      >>> tree = {"b": np.zeros(8), "w": np.zeros((8, 8)), "v": np.zeros((8, 4))}
      >>> streaming_fragment_nbytes(tree, 2, bits=4)  # b, v, 12 of w | 52 of w
      (38, 30)
    """
    bits = check_choice("bits", bits, _QUANTIZERS, allow_none=True)
    layout = check_layout(tree, fragments, layout)
    bounds = fragment_bounds(tree, fragments)
    sizes = [int(math.prod(np.shape(leaf))) for leaf in jax.tree.leaves(tree)]
    totals = []
    for p in range(fragments):
        total, offset = 0, 0
        for block, size in zip(leaf_blocks(tree), sizes, strict=True):
            n = max(0, min(bounds[p + 1], offset + size) - max(bounds[p], offset))
            if layout == "strided":
                n = size if block % fragments == p else 0
            offset += size
            if n and bits is None:
                total += 4 * n
            elif n:
                total += encoded_nbytes(
                    (n,), _value_codec(4 if bits == "e2m1" else bits)
                )
        totals.append(total)
    return tuple(totals)


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of a 4-bit float with 2 exponent bits and 1 mantissa bit
(E2M1, the OCP microscaling FP4 element), largest 6."""


def e2m1_round(x: jax.Array) -> jax.Array:
    r"""``x`` rounded to 4-bit floats (E2M1) on one scale: :math:`s\,
    \mathrm{sign}(x_i)\, g(|x_i| / s)`, :math:`s = \max_i |x_i| / 6` and
    :math:`g` the nearest of :data:`E2M1_GRID` (ties to the smaller), so the
    largest magnitude is kept exactly.

    Examples:
      >>> import jax.numpy as jnp
      >>> [float(v) for v in e2m1_round(jnp.array([6.0, -2.6, 0.2, 1.3]))]
      [6.0, -3.0, 0.0, 1.5]
    """
    x = x.astype(_F32)
    scale = jnp.max(jnp.abs(x)) / 6.0
    safe = jnp.where(scale > 0, scale, 1.0)
    grid = jnp.asarray(E2M1_GRID, _F32)
    nearest = jnp.argmin(jnp.abs((jnp.abs(x) / safe)[..., None] - grid), axis=-1)
    return jnp.sign(x) * grid[nearest] * scale


class StreamingEagerState(NamedTuple):
    """The eager updates' part of :class:`StreamingLocalState`."""

    merges: jax.Array  # shape=(), int32: rounds merged (push c's fragment: c mod P)
    momentum: Any  # float32 tree: the server's outer momentum, as its steps show it
    average: Any  # float32 tree: each fragment's last averaged outer gradient
    own: Any  # float32 tree: each fragment's last outer gradient of this worker
    pending: Any  # float32 tree: the eager step not yet corrected (0 elsewhere)


class StreamingDelayState(NamedTuple):
    """The delayed merge's part of :class:`StreamingLocalState`."""

    wait: jax.Array  # shape=(), int32: inner steps left before the merge (0: none)
    held: Any  # tree like the params: the global values to merge
    hold: Any  # bool tree like the params: the elements to merge


class StreamingLocalState(NamedTuple):
    """State of :func:`streaming_local`."""

    count: jax.Array  # shape=(), int32: steps so far (merges included)
    local: Any  # tree like the params: the worker's own parameters
    anchor: Any  # tree like the params: each leaf's global value last merged
    inner_state: Any  # the inner optimizer's state
    eager: StreamingEagerState | None = None  # with eager=True only
    delayed: StreamingDelayState | None = None  # with delay > 0 only


def streaming_local(
    inner: optax.GradientTransformation,
    mixing: float = 0.0,
    *,
    eager: bool = False,
    fragments: int = 2,
    outer_learning_rate: float = 0.7,
    outer_momentum: float = 0.9,
    workers: int = 1,
    delay: int = 0,
    layout: str = "contiguous",
) -> optax.GradientTransformationExtraArgs:
    r"""Streaming DiLoCo's inner optimizer: the worker's own parameters kept.

    A round of a parameter-server worker starts from the parameters it pulled;
    in Streaming DiLoCo a worker goes on from its *own* parameters
    :math:`\theta_m`, and only a fragment the server has just synchronised
    comes from the global parameters :math:`\tilde\theta`, merged as

    .. math::

       \theta_{m,p} \leftarrow \alpha\, \theta_{m,p} + (1 - \alpha)\,
       \tilde\theta_p

    (:math:`\alpha` = ``mixing``; 0 takes the global fragment as it is). This
    wrapper does it from the parameters alone: it keeps :math:`\theta_m`
    (``local``) and the global values it last merged (``anchor``). When a
    step's parameters are not the worker's own (a new round started from the
    pulled ones), it takes no inner step: its update moves every element to
    where the worker's rule says (its own value where the global one equals the
    anchor, the merge where the server changed it) and the gradient is not
    used. Otherwise it is the ``inner`` optimizer. So a round of :math:`k`
    local steps takes :math:`k - 1` inner steps after the merge, and the
    round's pseudo-gradient (pulled minus local parameters, what the worker
    pushes) is, on the fragment due, :math:`\tilde\theta_p - \theta_{m,p}`:
    Streaming DiLoCo's outer gradient.

    **The overlap** :math:`\tau` (``delay``). With ``delay`` = :math:`\tau
    > 0` the merge waits: the step that sees the synchronised fragment keeps
    the worker's own values, and the fragment merges (with :math:`\alpha`)
    after the :math:`\tau`-th inner step since, as torchft's
    ``fragment_sync_delay`` does (``perform_sync`` after :math:`\tau` steps:
    ``lerp`` of the new global and the local parameters by
    ``fragment_update_alpha``). The round-trip time is not hidden behind those
    steps unless the driver overlaps it (see ``streaming_diloco.py``).

    The driver must apply each update as it is returned (a step-size scale of
    1: no work plan's ``lr_scale``), so that the worker can tell its own
    parameters from pulled ones.

    **Eager updates** (``eager=True``). With the pipelined rounds
    (``overlap='pipeline'``, BSP, every worker from the start) the fragment
    :math:`q` pushed at the end of round :math:`k - 1` travels during round
    :math:`k` and merges at the start of round :math:`k + 1`. Without eager
    updates the worker goes on from its own values of :math:`q` and the merge
    overwrites them (:math:`\alpha = 0`): the :math:`\tau` inner steps taken on
    :math:`q` meanwhile are lost. With them, round :math:`k`'s merge step
    also steps :math:`q` from its global value :math:`\tilde\theta_q` with
    the server's outer rule (Nesterov, ``outer_learning_rate`` :math:`\eta`,
    ``outer_momentum`` :math:`\beta`) on a stand-in for the average the server
    will use, built as the paper builds it: this worker's fresh outer gradient
    :math:`\Delta^m_q` in place of its share of the others' last average,

    .. math::

       \hat\Delta_q = \bar\Delta^{\text{prev}}_q
       + (\Delta^m_q - \Delta^{m,\text{prev}}_q) / M, \qquad
       d_q = -\eta\,(\beta(\beta m_q + \hat\Delta_q) + \hat\Delta_q), \qquad
       \theta_{m,q} \leftarrow \tilde\theta_q + d_q,

    (:math:`M` = ``workers``), and when the server's step :math:`s_q` on
    :math:`q` arrives, replaces the estimate by it and keeps the inner steps
    taken since: :math:`\theta_{m,q} \leftarrow \theta_{m,q} + s_q - d_q`.
    The worker needs the server's momentum :math:`m_q`, the last average
    :math:`\bar\Delta^\text{prev}_q` and its own last outer gradient: it
    reads the first two off the server's steps (:math:`s = -\eta((1 + \beta)
    m' - \beta m)` gives :math:`m'`, and :math:`\bar\Delta = m' - \beta m`)
    and keeps the third (state ``eager``, a :class:`StreamingEagerState`).
    The :math:`c`-th merge steps fragment :math:`c \bmod P`: the workers'
    :func:`streaming_push` order (``fragments`` must be the same :math:`P`,
    at least 2 so that the fragment stepped and the one merged differ).

    Our reading: the paper's abstract and public summaries of it (outer
    gradients overlapped with the next inner phase; the *eager* variant
    applies, before the others' outer gradients arrive, a mixture of the
    worker's current local outer gradient and the delayed outer gradients of
    the other replicas), not its full text. Its setting is DiLoCo with the
    outer optimizer run on every worker after an all-reduce; here the server
    runs it, so the worker mirrors it from its steps and its estimate is
    replaced by the server's step when that arrives. Not read: the paper's
    exact algorithm, its handling of the first rounds (here: no last average,
    zero momentum) and of a fragment schedule (it studies whole-model DiLoCo).

    Args:
      inner: the inner optimizer (DiLoCo's AdamW).
      mixing: :math:`\alpha` in [0, 1] (without ``eager``: with it, a merge
        keeps the inner steps taken since the eager step).
      eager: take eager updates.
      fragments: :math:`P` of the workers' pushes (``eager`` only; >= 2).
      outer_learning_rate: the server's :math:`\eta` (``eager`` only; > 0).
      outer_momentum: the server's :math:`\beta` in [0, 1) (``eager`` only).
      workers: :math:`M`, the workers averaged (``eager`` only; >= 1).
      delay: :math:`\tau`, inner steps between a fragment's arrival and its
        merge (>= 0; not with ``eager``); it shapes the state, so
        ``optax.inject_hyperparams`` must take it as a static argument.
      layout: the fragments' layout (``eager`` only; :func:`check_layout`).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
      ``params``; its state is a :class:`StreamingLocalState`.

    Raises:
      ValueError: an argument out of range; at update, no ``params``.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import streaming_local
      >>> tx = streaming_local(optax.sgd(1.0))
      >>> params = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
      >>> state = tx.init(params)
      >>> grads = {"a": jnp.ones(1), "b": jnp.ones(1)}
      >>> u, state = tx.update(grads, state, params)  # an inner step: to -1
      >>> pulled = {"a": jnp.array([0.5]), "b": jnp.zeros(1)}  # 'a' synced
      >>> u, state = tx.update(grads, state, pulled)  # the merge, no step
      >>> optax.apply_updates(pulled, u)  # 'a' global, 'b' the worker's own
      {'a': Array([0.5], dtype=float32), 'b': Array([-1.], dtype=float32)}

    References:
      Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey, McIlroy,
      Shen, Ramé, Szlam, Ranzato, Barham, `Streaming DiLoCo with overlapping
      communication: Towards a Distributed Free Lunch
      <https://arxiv.org/abs/2501.18512>`_, 2025.

      Kale, Douillard, Donchev, `Eager Updates For Overlapped Communication
      and Computation in DiLoCo <https://arxiv.org/abs/2502.12996>`_, 2025.
    """
    alpha = check_hyperparameter("mixing", mixing, low=0, high=1)
    if not isinstance(eager, bool):
        raise ValueError(f"eager must be a bool, got {eager!r}")
    if eager:
        fragments = check_int("fragments", fragments, low=1)
        if fragments < 2:
            raise ValueError(f"eager updates need fragments >= 2, got {fragments}")
        eta = check_hyperparameter(
            "outer_learning_rate", outer_learning_rate, low=0, low_inclusive=False
        )
        beta = check_hyperparameter(
            "outer_momentum", outer_momentum, low=0, high=1, high_inclusive=False
        )
        check_int("workers", workers, low=1)
        layout = check_layout(None, fragments, layout)
    delay = check_int("delay", delay, low=0)
    if delay and eager:
        raise ValueError("delay (tau) needs eager=False: eager updates merge at once")
    inner = optax.with_extra_args_support(inner)

    def zeros(params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params)

    def init_fn(params):
        if eager:
            fragment_bounds(params, fragments)  # checks the count
            check_layout(params, fragments, layout)
        delayed = StreamingDelayState(
            wait=jnp.zeros([], jnp.int32),
            held=params,
            hold=jax.tree.map(lambda p: jnp.zeros(p.shape, bool), params),
        )
        return StreamingLocalState(
            count=jnp.zeros([], jnp.int32),
            local=params,
            anchor=params,
            inner_state=inner.init(params),
            eager=StreamingEagerState(
                merges=jnp.zeros([], jnp.int32),
                momentum=zeros(params),
                average=zeros(params),
                own=zeros(params),
                pending=zeros(params),
            )
            if eager
            else None,
            delayed=delayed if delay else None,
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("streaming_local needs params")
        first = state.count == 0  # a worker that joined late starts on them
        local = jax.tree.map(
            lambda p, own_: jnp.where(first, p, own_), params, state.local
        )
        anchor = jax.tree.map(lambda p, a: jnp.where(first, p, a), params, state.anchor)

        def own(p, mine):
            # Leaf-wide: a driver may round p + u differently (a fused
            # multiply-add), by far more than 1e-6 of an element near zero.
            p, mine = p.astype(_F32), mine.astype(_F32)
            scale = jnp.maximum(jnp.max(jnp.abs(p)), jnp.max(jnp.abs(mine)))
            return jnp.max(jnp.abs(p - mine)) <= _SAME_RTOL * scale

        is_own = jax.tree.map(own, params, local)
        merging = ~jnp.all(jnp.stack(jax.tree.leaves(is_own)))
        synced = jax.tree.map(lambda p, a: p != a, params, anchor)

        def target(p, kept, mine, changed):
            mixed = alpha * kept.astype(_F32) + (1 - alpha) * p.astype(_F32)
            return jnp.where(mine, p, jnp.where(changed, mixed.astype(p.dtype), kept))

        if eager:
            # The fragment synchronised is known from the count of merges, not
            # seen from the values: a 4-bit push may leave an element's step 0.
            treedef = jax.tree.structure(params)
            merges = state.eager.merges
            due = _masks(params, fragments, (merges - 1) % fragments, layout)
            synced = jax.tree.unflatten(treedef, [m & (merges >= 1) for m in due])
            is_own = jax.tree.map(lambda _: jnp.zeros((), bool), is_own)
            knobs = (fragments, layout, eta, beta, workers)
            goal, eager_state = _eager_goal(
                state.eager, params, local, anchor, is_own, synced, merging, knobs
            )
        elif delay:
            goal, delayed = _hold(state.delayed, alpha, delay, params, local,
                                  is_own, synced, merging)  # fmt: skip
            eager_state = None
        else:
            goal = jax.tree.map(target, params, local, is_own, synced)
            eager_state = None
        jump = jax.tree.map(lambda g, p: (g - p).astype(p.dtype), goal, params)
        step, inner_state = inner.update(
            updates, state.inner_state, params, **extra_args
        )
        out = jax.tree.map(lambda j, s: jnp.where(merging, j, s), jump, step)
        if delay:
            out, delayed = _merge_due(delayed, alpha, params, out, merging)
        inner_state = jax.tree.map(
            lambda old, new: jnp.where(merging, old, new),
            state.inner_state,
            inner_state,
        )
        new_anchor = jax.tree.map(
            lambda p, a, mine, changed: jnp.where(merging & ~mine & changed, p, a),
            params,
            anchor,
            is_own,
            synced,
        )
        return out, StreamingLocalState(
            count=optax.safe_increment(state.count),
            local=optax.apply_updates(params, out),
            anchor=new_anchor,
            inner_state=inner_state,
            eager=eager_state,
            delayed=delayed if delay else None,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _eager_goal(es, params, local, anchor, is_own, synced, merging, knobs):
    """Eager updates: where each element goes at this step, and the state.

    On a merge: the synchronised elements take the server's step in place of
    the eager one (the inner steps since are kept), then the fragment of
    the push just sent takes its eager step from its global value.
    """
    fragments, layout, eta, beta, workers = knobs
    p_leaves, treedef = jax.tree.flatten(params)
    flat = [
        treedef.flatten_up_to(t)
        for t in (local, anchor, is_own, synced, es.momentum, es.average)
    ]
    flat += [treedef.flatten_up_to(t) for t in (es.own, es.pending)]
    pushed = _masks(params, fragments, es.merges % fragments, layout)
    goals, moms, avgs, owns, pends = [], [], [], [], []
    for p, kept, a, mine, changed, m, avg, own, d, q in zip(
        p_leaves, *flat, pushed, strict=True
    ):
        p32, kept32, a32 = p.astype(_F32), kept.astype(_F32), a.astype(_F32)
        sync = merging & ~mine & changed
        # The server's step s = -eta ((1 + beta) m' - beta m) gives m'.
        s = p32 - a32
        m_seen = (-s / eta + beta * m) / (1 + beta)
        m_new = jnp.where(sync, m_seen, m)
        avg_new = jnp.where(sync, m_seen - beta * m, avg)
        corrected = jnp.where(sync, kept32 + s - d, kept32)
        d_left = jnp.where(sync, 0.0, d)
        # The eager step of the fragment just pushed, from its global value.
        step_now = merging & q
        delta = a32 - kept32  # what the worker pushed: global minus own
        proxy = avg_new + (delta - own) / workers
        d_new = -eta * (beta * (beta * m_new + proxy) + proxy)
        goal = jnp.where(step_now, a32 + d_new, corrected)
        goals.append(goal.astype(p.dtype))
        moms.append(m_new)
        avgs.append(avg_new)
        owns.append(jnp.where(step_now, delta, own))
        pends.append(jnp.where(step_now, d_new, d_left))
    unflat = functools.partial(jax.tree.unflatten, treedef)
    return unflat(goals), StreamingEagerState(
        merges=es.merges + merging.astype(jnp.int32),
        momentum=unflat(moms),
        average=unflat(avgs),
        own=unflat(owns),
        pending=unflat(pends),
    )


def _mix(alpha: Any, local: jax.Array, global_: jax.Array) -> jax.Array:
    """torchft's merge, ``global.lerp(local, alpha)``, in the leaf's dtype."""
    mixed = alpha * local.astype(_F32) + (1 - alpha) * global_.astype(_F32)
    return mixed.astype(local.dtype)


def _hold(dl, alpha, delay, params, local, is_own, synced, merging):
    """A delayed merge's step that sees the pulled parameters: every element
    goes to the worker's own value (a merge still held is done first), and the
    synchronised elements are held for ``delay`` inner steps."""

    def leaf(p, kept, mine, changed, held, hold):
        due = hold & (dl.wait > 0)
        kept = jnp.where(merging & due, _mix(alpha, kept, held), kept)
        goal = jnp.where(mine, p, kept)
        sync = merging & ~mine & changed
        return goal, jnp.where(sync, p, held), jnp.where(merging, sync, hold)

    trees = (params, local, is_own, synced, dl.held, dl.hold)
    out = jax.tree.map(leaf, *trees)
    pick = lambda i: jax.tree.map(lambda t: t[i], out, is_leaf=_is_triple)
    wait = jnp.where(merging, jnp.asarray(delay, jnp.int32), dl.wait)
    return pick(0), StreamingDelayState(wait=wait, held=pick(1), hold=pick(2))


def _is_triple(node: Any) -> bool:
    return isinstance(node, tuple) and len(node) == 3


def _merge_due(dl, alpha, params, out, merging):
    """After the ``delay``-th inner step since the fragment came: its merge,
    ``alpha`` of the worker's value and the rest of the held global one."""
    now = ~merging & (dl.wait == 1)

    def leaf(p, u, held, hold):
        stepped = p + u
        merged = jnp.where(now & hold, _mix(alpha, stepped, held), stepped)
        return (merged - p).astype(u.dtype)

    out = jax.tree.map(leaf, params, out, dl.held, dl.hold)
    wait = jnp.where(merging, dl.wait, jnp.maximum(dl.wait - 1, 0))
    return out, dl._replace(wait=wait)


class StreamingPushState(NamedTuple):
    """State of :func:`streaming_push`."""

    count: jax.Array  # shape=(), int32: pushes so far (fragment = count mod P)
    key: jax.Array  # shape=(2,), uint32: PRNG key data, split every push
    error: Any  # float32 tree like the updates (zeros without error feedback)
    nbytes: jax.Array  # shape=(), int32: bytes of a push, fragments' mean


def streaming_push(
    fragments: int,
    bits: int | str | None = 4,
    *,
    error_feedback: bool = False,
    seed: int = 0,
    layout: str = "contiguous",
) -> optax.GradientTransformationExtraArgs:
    r"""Streaming DiLoCo's push: the due fragment's outer gradient, few-bit.

    The :math:`c`-th push sends fragment :math:`p = c \bmod P`
    (:func:`fragment_bounds`): its elements of the pseudo-gradient
    :math:`\Delta` (the pulled minus the local parameters, which
    :func:`streaming_local` makes :math:`\tilde\theta_p - \theta_{m,p}`)
    quantized to ``bits`` bits (one scale per leaf it reaches into), every
    other element zero (not sent):

    .. math::

       \hat\Delta_p = Q_b(\Delta_p + e_p), \qquad e_p \leftarrow
       \Delta_p + e_p - \hat\Delta_p \text{ (with error feedback)}.

    :math:`Q_b` is hpsjax's uniform quantizer (one scale per leaf, stochastic
    rounding; the scaled sign at ``bits=1``), or with ``bits="e2m1"`` 4-bit
    floats (:func:`e2m1_round`: one scale per leaf's part of the fragment,
    round to nearest), the paper's choice; ``bits=None`` sends float32. The
    state's ``nbytes`` is the mean of :func:`streaming_fragment_nbytes`
    (what a simulator charges a push; over :math:`P` pushes the total is
    exact).

    Read: the paper (arXiv 2501.18512) quantizes the outer gradients to 4-bit
    floats without error feedback (so it is off by default) and cuts the model
    into strided fragments of layers (``layout="strided"``, a top-level block
    of the parameters standing for a layer; ``"contiguous"``, equal chunks of
    the flattened parameters, is the other option). What differs: the 4-bit
    float here is E2M1 on a float32 scale per leaf (the paper's exact float
    format and scaling were not read); the values travel as float32 top-k
    leaves on real workers (the simulator counts the 4-bit bytes).

    Args:
      fragments: :math:`P`, the number of fragments (at most the elements).
      bits: 1, 2, 4, 8, 16, ``"e2m1"`` (4-bit floats), or ``None`` for
        float32.
      error_feedback: carry each fragment's quantization error to its next push.
      seed: seed of the stochastic rounding.
      layout: ``"contiguous"`` or ``"strided"`` (:func:`check_layout`).

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`StreamingPushState`.

    Raises:
      ValueError: a bad argument; at init, more fragments than elements.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import streaming_push
      >>> push = streaming_push(2, bits=None)
      >>> delta = {"a": jnp.ones(2), "b": jnp.ones(3)}  # elements 0-1 | 2-4
      >>> state = push.init(delta)
      >>> sent, state = push.update(delta, state)
      >>> sent["a"], sent["b"]
      (Array([1., 1.], dtype=float32), Array([0., 0., 0.], dtype=float32))
      >>> sent, state = push.update(delta, state)
      >>> sent["a"], sent["b"]
      (Array([0., 0.], dtype=float32), Array([1., 1., 1.], dtype=float32))

    References:
      Douillard et al., `Streaming DiLoCo with overlapping communication
      <https://arxiv.org/abs/2501.18512>`_, 2025.
    """
    fragments = check_int("fragments", fragments, low=1)
    bits = check_choice("bits", bits, _QUANTIZERS, allow_none=True)
    layout = check_layout(None, fragments, layout)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be a bool, got {error_feedback!r}")
    codec = None if bits in (None, "e2m1") else _value_codec(bits)

    def init_fn(params):
        sizes = streaming_fragment_nbytes(params, fragments, bits, layout)
        return StreamingPushState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key_data(jax.random.PRNGKey(seed)),
            error=_zero_errors(params),
            nbytes=jnp.asarray(math.ceil(sum(sizes) / len(sizes)), jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        masks = _masks(updates, fragments, state.count % fragments, layout)

        def leaf(i, g, e, key):
            # The fragment's part of the leaf, quantized on its own scale.
            mine = masks[i]
            acc = jnp.where(mine, g.astype(_F32) + e, 0)
            if bits == "e2m1":
                acc_q = e2m1_round(acc)
            elif codec is not None:
                acc_q = decode(encode(acc, codec, key), codec, acc.shape, _F32)
            out = jnp.where(mine, acc if bits is None else acc_q, 0)
            rest = acc - out if error_feedback else jnp.zeros_like(acc)
            return out, jnp.where(mine, rest, e)

        sent, key, error = _push_leaves(updates, state.error, state.key, leaf)
        return sent, StreamingPushState(
            count=optax.safe_increment(state.count),
            key=key,
            error=error,
            nbytes=state.nbytes,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_streaming_nbytes(state: Any) -> int:
    """Bytes of one push of the :func:`streaming_push` inside an optax state
    (the fragments' mean).

    Raises:
      ValueError: ``state`` holds no :class:`StreamingPushState`, or several.
    """
    return int(find_one_state(state, StreamingPushState, "no streaming_push").nbytes)


class StreamingOuterState(NamedTuple):
    """State of :func:`streaming_outer`."""

    count: jax.Array  # shape=(), int32: updates so far (fragment = count mod P)
    momentum: Any  # float32 tree like the updates: each fragment's m


def streaming_outer(
    learning_rate: optax.ScalarOrSchedule = 0.7,
    momentum: float = 0.9,
    fragments: int = 1,
    layout: str = "contiguous",
) -> optax.GradientTransformationExtraArgs:
    r"""Streaming DiLoCo's outer step: Nesterov momentum on the due fragment.

    The server's :math:`c`-th update takes the averaged outer gradient
    :math:`\Delta` of fragment :math:`p = c \bmod P` (what the workers'
    :func:`streaming_push` sent) and steps that fragment with DiLoCo's
    Nesterov momentum; every other fragment, its parameters and its momentum,
    is left as it is:

    .. math::

       m_p \leftarrow \beta m_p + \Delta_p, \qquad
       \tilde\theta_p \leftarrow \tilde\theta_p - \varepsilon
       (\beta m_p + \Delta_p).

    With ``fragments=1`` this is :func:`~hpsjax.transforms.diloco_outer`.

    Args:
      learning_rate: :math:`\varepsilon` (a number >= 0 or a schedule of the
        update count).
      momentum: :math:`\beta` in [0, 1).
      fragments: :math:`P`, as the workers' :func:`streaming_push`.
      layout: the workers' :func:`streaming_push` layout.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`StreamingOuterState`.

    Raises:
      ValueError: a bad argument; at init, more fragments than elements.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import streaming_outer
      >>> outer = streaming_outer(1.0, momentum=0.5, fragments=2)
      >>> g = {"a": jnp.ones(2), "b": jnp.ones(3)}  # elements 0-1 | 2-4
      >>> state = outer.init(g)
      >>> step, state = outer.update(g, state)
      >>> step["a"], step["b"]  # a: -(0.5 * 1 + 1)
      (Array([-1.5, -1.5], dtype=float32), Array([0., 0., 0.], dtype=float32))

    References:
      Douillard et al., `Streaming DiLoCo with overlapping communication
      <https://arxiv.org/abs/2501.18512>`_, 2025.
    """
    check_hyperparameter("learning_rate", learning_rate, low=0, schedule=True)
    beta = check_hyperparameter(
        "momentum", momentum, low=0, high=1, high_inclusive=False
    )
    fragments = check_int("fragments", fragments, low=1)
    layout = check_layout(None, fragments, layout)

    def init_fn(params):
        fragment_bounds(params, fragments)  # checks the count
        check_layout(params, fragments, layout)
        return StreamingOuterState(
            count=jnp.zeros([], jnp.int32),
            momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, _F32), params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, _F32)
        leaves, treedef = jax.tree.flatten(updates)
        moms = treedef.flatten_up_to(state.momentum)
        masks = _masks(updates, fragments, state.count % fragments, layout)
        steps, new_moms = [], []
        for g, m, mine in zip(leaves, moms, masks, strict=True):
            g32 = g.astype(_F32)
            m_new = beta * m + g32
            steps.append(jnp.where(mine, -lr * (beta * m_new + g32), 0).astype(g.dtype))
            new_moms.append(jnp.where(mine, m_new, m))
        return jax.tree.unflatten(treedef, steps), StreamingOuterState(
            count=optax.safe_increment(state.count),
            momentum=jax.tree.unflatten(treedef, new_moms),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
