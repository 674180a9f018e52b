"""Per-leaf optimizer steps for leaf-separable server optimizers.

An optax chain is *leaf-separable* when its update of a tree is the update of
each leaf on its own: every elementwise transform (sgd, momentum, nesterov,
adam, :func:`~hpsjax.transforms.scale_by_staleness`...) is; one that reads
several leaves at once (global-norm clipping) is not. For a separable
optimizer the server can apply a push leaf by leaf as the leaves arrive
(PHub's optimizer step fused per chunk) rather than after the whole tree.

Which optimizers are separable is decided by running both: the whole-tree
update and the per-leaf updates, for two steps, on random parameters and
updates with the tree's structure and dtypes (shapes cut to at most 3 per
axis), and calling the optimizer separable only where the parameters and the
optimizer state agree to the last bit. A chain that raises on a single leaf,
or whose state cannot be split per leaf, is not separable.

The optimizer state is split by structure: each subtree of the state with the
parameters' tree structure holds one entry per leaf; every other state leaf
(a step count, an injected hyperparameter) is shared, advanced the same by
every leaf's step, and taken from the last leaf's.
"""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LeafApply", "LeafSteps", "all_finite", "finite", "leaf_steps"]


def _leaf_apply(opt, param, state, update, staleness, stale):
    extra = {"staleness": staleness}
    if stale is not None:
        extra["stale_params"] = stale
    delta, state = opt.update(update, state, param, **extra)
    return optax.apply_updates(param, delta), state


def finite(x: Any) -> jax.Array:
    """Whether an array (any dtype) holds only finite values."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.array(True)
    return jnp.all(jnp.isfinite(x))


def all_finite(leaves: list[Any]) -> jax.Array:
    """Whether every array of ``leaves`` holds only finite values."""
    checks = [finite(x) for x in leaves]
    return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def _checked_leaf_apply(opt, param, state, update, staleness):
    """:func:`_leaf_apply`, and whether the new leaf and its state are finite."""
    param, state = _leaf_apply(opt, param, state, update, staleness, None)
    return param, state, finite(param), all_finite(jax.tree.leaves(state))


def _mixed_leaf_apply(opt, param, state, total, update, keep, weight, staleness):
    """The buffered mean ``keep * total + weight * update`` (``total`` None:
    ``weight * update``) in float32 at least, as the core's whole-tree
    buffer, then :func:`_checked_leaf_apply` of it; returns the mean too."""
    wide = jnp.result_type(update.dtype, jnp.float32)
    mixed = update.astype(wide) * weight
    if total is not None:
        mixed = total.astype(wide) * keep + mixed
    mixed = mixed.astype(update.dtype)
    return (mixed, *_checked_leaf_apply(opt, param, state, mixed, staleness))


class LeafSteps:
    """The per-leaf step of one optimizer on one tree structure.

    Args:
      optimizer: an optax ``GradientTransformation``.
      treedef: the parameters' tree structure.
      shapes, dtypes: the parameters' leaf shapes and dtypes (for the check).

    Attributes:
      separable: whether per-leaf steps give the whole-tree step's result.
    """

    def __init__(self, optimizer, treedef, shapes, dtypes):
        self._opt = optax.with_extra_args_support(optimizer)
        self._treedef = treedef
        self._n = treedef.num_leaves
        self.step = jax.jit(functools.partial(_leaf_apply, self._opt))
        self.mixed_step = jax.jit(functools.partial(_mixed_leaf_apply, self._opt))
        self.separable = self._n > 1 and self._check(shapes, dtypes)

    def _is_node(self, x: Any) -> bool:
        return jax.tree.structure(x) == self._treedef

    def split(self, opt_state: Any) -> list[Any]:
        """The optimizer state of each parameter leaf, in leaf order."""
        nodes, outer = jax.tree.flatten(opt_state, is_leaf=self._is_node)
        per_leaf = [jax.tree.leaves(n) if self._is_node(n) else None for n in nodes]
        return [
            jax.tree.unflatten(
                outer,
                [
                    n if p is None else p[i]
                    for n, p in zip(nodes, per_leaf, strict=True)
                ],
            )
            for i in range(self._n)
        ]

    def merge(self, opt_state: Any, leaf_states: list[Any]) -> Any:
        """The whole-tree state from each leaf's (``opt_state`` gives the shape)."""
        nodes, outer = jax.tree.flatten(opt_state, is_leaf=self._is_node)
        columns = [jax.tree.leaves(s, is_leaf=lambda x: x is None) for s in leaf_states]
        merged = []
        for j, node in enumerate(nodes):
            if self._is_node(node):
                merged.append(
                    jax.tree.unflatten(self._treedef, [c[j] for c in columns])
                )
            else:
                merged.append(columns[-1][j])
        return jax.tree.unflatten(outer, merged)

    def apply(self, params, opt_state, update, staleness, stale=None):
        """The whole tree applied leaf by leaf: ``(params, opt_state)``."""
        p_leaves = self._treedef.flatten_up_to(params)
        u_leaves = self._treedef.flatten_up_to(update)
        s_leaves = (
            [None] * self._n if stale is None else self._treedef.flatten_up_to(stale)
        )
        states = self.split(opt_state)
        out_p, out_s = [], []
        for i in range(self._n):
            p, s = self.step(
                p_leaves[i], states[i], u_leaves[i], staleness, s_leaves[i]
            )
            out_p.append(p)
            out_s.append(s)
        return jax.tree.unflatten(self._treedef, out_p), self.merge(opt_state, out_s)

    def _check(self, shapes, dtypes) -> bool:
        rng = np.random.default_rng(0)
        small = [tuple(min(d, 3) for d in s) for s in shapes]

        def tree(scale):
            return jax.tree.unflatten(
                self._treedef,
                [
                    jnp.asarray((rng.standard_normal(s) * scale).astype(d))
                    for s, d in zip(small, dtypes, strict=True)
                ],
            )

        opt = self._opt
        try:
            # Compiled, as the core's whole-tree step is: eager ops round
            # differently from the same ops fused.
            step = jax.jit(functools.partial(_leaf_apply, opt))
            params = tree(1.0)
            whole = (params, opt.init(params))
            parts = whole
            for tau in (0, 2):
                update = tree(0.1 if tau == 0 else 100.0)
                staleness = jnp.asarray(np.int32(tau))
                whole = step(*whole, update, staleness, None)
                parts = self.apply(*parts, update, staleness)
            a, b = jax.tree.leaves(whole), jax.tree.leaves(parts)
            if jax.tree.structure(whole) != jax.tree.structure(parts):
                return False
            return all(_close(x, y) for x, y in zip(a, b, strict=True))
        except Exception:  # any failure means: not separable
            return False


# One thread, so a push's leaves are applied in order, each after the last.
_APPLIER = concurrent.futures.ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="hpsjax-leaf-apply"
)


class LeafApply:
    """One push averaged into the buffer and applied leaf by leaf, each leaf as
    soon as it is known.

    The server's aggregator starts one for a push whose apply follows at once
    (``ServerCore.completing_push`` says when that is: an ASP push, the last
    push of a BSP round; see ``hpsjax.apply._overlap``), the server feeds it each
    leaf of the update as its bytes arrive, and the aggregator takes its
    result in place of the whole-tree average and apply, if nothing changed
    meanwhile: the parameters, optimizer state
    and buffer it started from are still the server's, with the same weights
    and staleness. The leaves' steps run in order on one thread of their own
    (XLA releases the GIL while it computes), so the optimizer works while the
    event loop receives the next leaves.

    Args:
      steps: the optimizer's :class:`LeafSteps` (separable).
      params, opt_state: what the update is applied to.
      buffer: the buffered mean the push joins, or ``None`` (the push alone).
      keep, weight: the buffer's and the push's weights in the new mean
        (float32 scalars, as the core computes them).
      staleness: the apply's staleness, a device scalar as the core passes it.
      tau: the same staleness as an int, to compare with the core's.
    """

    def __init__(
        self, steps: LeafSteps, params, opt_state, buffer, keep, weight, staleness, tau
    ):
        self.params, self.opt_state, self.buffer = params, opt_state, buffer
        self.keep, self.weight, self.tau = keep, weight, tau
        self._steps = steps
        self._staleness = staleness
        self._p = steps._treedef.flatten_up_to(params)
        self._b = (
            [None] * steps._n
            if buffer is None
            else steps._treedef.flatten_up_to(buffer)
        )
        self._states = steps.split(opt_state)
        self._out: list[Any] = [None] * steps._n

    def add(self, index: int, leaf: Any) -> None:
        """Starts the step of leaf ``index`` of the update (``leaf``)."""
        self._out[index] = _APPLIER.submit(self._step, index, leaf)

    def _step(self, index: int, leaf: Any) -> tuple:
        out = self._steps.mixed_step(
            self._p[index],
            self._states[index],
            self._b[index],
            leaf,
            self.keep,
            self.weight,
            self._staleness,
        )
        return jax.block_until_ready(out)

    @property
    def complete(self) -> bool:
        """Whether every leaf was added."""
        return all(o is not None for o in self._out)

    def matches(self, params, opt_state, buffer, keep, weight, tau: int) -> bool:
        """Whether the result is this apply: same inputs, weights, staleness."""
        return (
            self.complete
            and params is self.params
            and opt_state is self.opt_state
            and buffer is self.buffer
            and keep == self.keep
            and weight == self.weight
            and tau == self.tau
        )

    def result(self) -> tuple[Any, Any, Any, np.ndarray]:
        """``(buffer, params, opt_state, flags)``: the new buffered mean, the
        applied parameters and state, and flags per parameter leaf, then one
        for the optimizer state, true where finite (as the core's check)."""
        steps = self._steps
        out = [f.result() for f in self._out]
        treedef = steps._treedef
        buffer = jax.tree.unflatten(treedef, [o[0] for o in out])
        params = jax.tree.unflatten(treedef, [o[1] for o in out])
        opt_state = steps.merge(self.opt_state, [o[2] for o in out])
        leaf_flags, state_flags = jax.device_get(
            ([o[3] for o in out], [o[4] for o in out])
        )
        flags = np.asarray([*leaf_flags, all(state_flags)])
        return buffer, params, opt_state, flags


def _close(x: Any, y: Any) -> bool:
    """Equal up to a few units in the last place (the rounding of fused ops).

    Integer leaves (step counts) must be equal; float leaves may differ by 8
    machine epsilons of their dtype relative to the leaf's largest magnitude, far
    below what reading another leaf (a global norm) changes.
    """
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return bool(np.array_equal(x, y))
    eps = 8 * float(jnp.finfo(x.dtype).eps)
    x, y = x.astype(np.float64), y.astype(np.float64)
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        return False
    scale = float(np.max(np.abs(x), initial=0.0))
    return bool(np.all(np.abs(x - y) <= eps * scale))


@functools.lru_cache(maxsize=32)
def leaf_steps(optimizer, treedef, shapes, dtypes) -> LeafSteps:
    """:class:`LeafSteps`, cached per optimizer object and tree spec."""
    return LeafSteps(optimizer, treedef, shapes, dtypes)
