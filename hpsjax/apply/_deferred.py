r"""The simulator's aggregator: applies deferred and carried out in one call.

Simulated workers compute on a version only when the engine evaluates their
rounds, so the simulator's server core need not apply each version as it is
made. :class:`DeferredAggregator` keeps the updates of new versions and carries
them out, all in one compiled call (a ``lax.scan`` over the pushes), when the
parameters are next read (:attr:`~DeferredAggregator.params`,
:meth:`~DeferredAggregator.apply_deferred`). Every decision of the core is the
same (it never reads the arithmetic); the values are those of applying each
version at once, the same operations in the same order, up to the last bit of
rounding where XLA compiles the fused loop differently. A driver that reads the
parameters less often than it pushes saves a call per version, and may push a
:class:`LazyUpdate` (an update it has not evaluated yet).

Deferred applies are not checked for finiteness (``check_result`` is off) and
keep no stale copies.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax.apply._aggregate import (
    Aggregator,
    Pending,
    accumulate,
    optimizer_apply,
    scale,
)

__all__ = ["DeferredAggregator", "LazyUpdate"]


class LazyUpdate:
    """An update pushed to a deferring core before it is evaluated.

    A driver (the simulator) may push one in place of the update's tree: the
    aggregator only buffers it until its deferred applies are carried out.
    Then a version made of pushes of one ``group`` (all of them lazy) asks
    ``group.weighted_sum(rows, weights)`` for the buffered mean, the weights
    being those the pushes would have in it one by one; where that gives
    ``None``, and for any other lazy update, ``leaves()`` evaluates it.

    Attributes:
      group: what evaluates several of them at once.
      row: this update's index in ``group``.
    """

    __slots__ = ()
    group: Any
    row: int

    def leaves(self) -> tuple:
        """The update's leaves, in ``jax.tree.leaves`` order of the parameters."""
        raise NotImplementedError


def _folded(items: list) -> list:
    """A deferred version's ``(update, keep, weight)`` rows, lazy ones evaluated.

    The buffered mean after the rows is :math:`\\sum_j c_j u_j` with
    :math:`c_j = w_j \\prod_{k > j} keep_k`; a version of one group's lazy
    updates is one row of that sum where the group gives it.
    """
    group = getattr(items[0][0], "group", None)
    if isinstance(items[0][0], LazyUpdate) and all(
        isinstance(u, LazyUpdate) and u.group is group for u, _, _ in items
    ):
        weights, carry = [], 1.0
        for _, keep, weight in reversed(items):
            weights.append(float(weight) * carry)
            carry *= float(keep)
        weights.reverse()
        total = group.weighted_sum([u.row for u, _, _ in items], weights)
        if total is not None:
            return [(total, np.float32(0), np.float32(1))]
    return [
        (u.leaves() if isinstance(u, LazyUpdate) else u, keep, weight)
        for u, keep, weight in items
    ]


@functools.lru_cache(maxsize=32)
def _make_chain(optimizer: optax.GradientTransformation):
    """The jitted chain of deferred pushes for one optimizer (cached per
    optimizer object, so every simulator run on it reuses the compiled one)."""
    apply = optimizer_apply(optimizer)

    def apply_chain(
        params, opt_state, updates, keeps, weights, first, close, staleness, args
    ):
        """Deferred pushes, in order: buffer each; apply where a buffer closes.

        Row ``j`` of ``updates`` is buffered with ``keeps[j]`` and
        ``weights[j]`` (a new buffer where ``first[j]``), and where ``close[j]``
        the buffer is applied with ``staleness[j]`` (and the optimizer
        arguments ``args[key][j]``): the operations of the
        server aggregator's ``scale``, ``accumulate`` and ``apply`` in the same
        order, selected rather than branched. Returns the parameters after
        every row (a version where ``close``).
        """

        def step(carry, row):
            params, opt_state, total = carry
            u, k, w, is_first, is_close, tau, a = row
            # The barriers keep XLA from fusing across the boundaries of the
            # separate steps, which would round differently.
            u, k, w, tau = jax.lax.optimization_barrier((u, k, w, tau))
            total = jax.tree.map(
                lambda a, b: jnp.where(is_first, a, b),
                scale(u, w),
                accumulate(total, u, k, w),
            )
            total = jax.lax.optimization_barrier(total)
            new_params, new_state = apply(params, opt_state, total, tau, None, a)
            params, opt_state = jax.tree.map(
                lambda n, o: jnp.where(is_close, n, o),
                (new_params, new_state),
                (params, opt_state),
            )
            return (params, opt_state, total), params

        total = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        (params, opt_state, _), history = jax.lax.scan(
            step,
            (params, opt_state, total),
            (updates, keeps, weights, first, close, staleness, args),
        )
        return params, opt_state, history

    return jax.jit(apply_chain)


class DeferredAggregator(Aggregator):
    """An :class:`~hpsjax.apply._aggregate.Aggregator` whose applies wait until
    the parameters are read (see the module docstring).

    Takes the arguments of :class:`~hpsjax.apply._aggregate.Aggregator`;
    ``check_result`` is ignored (deferred applies are not checked).

    Raises:
      ValueError: with ``keep_stale_params`` (stale copies are the parameters
        of every version as it is made), or for the base class's reasons.
    """

    def __init__(
        self,
        params: Any,
        optimizer: optax.GradientTransformation,
        *,
        check_finite: bool = True,
        check_result: bool = True,
        keep_stale_params: bool = False,
        max_stale_copies: int | None = None,
    ):
        del check_result
        if keep_stale_params:
            raise ValueError(
                "deferred applies cannot be combined with keep_stale_params: stale "
                "copies are the parameters of every version as it is made."
            )
        super().__init__(
            params,
            optimizer,
            check_finite=check_finite,
            check_result=False,
            max_stale_copies=max_stale_copies,
        )
        self._chain = _make_chain(optimizer)
        # Per version, the buffered (update, keep, weight) rows, the staleness
        # it was made with and its number; self._params is the version before
        # the first of them.
        self._deferred: list[tuple[list, int, int]] = []

    @property
    def params(self) -> Any:
        if self._deferred:
            self.apply_deferred()
        return self._params

    @property
    def opt_state(self) -> Any:
        if self._deferred:
            self.apply_deferred()
        return self._opt_state

    @property
    def deferred_applies(self) -> int:
        """Number of versions made but not yet carried out."""
        return len(self._deferred)

    def candidate(
        self,
        update,
        weight,
        samples,
        staleness,
        version,
        stale,
        *,
        completes,
        args=None,
    ):
        del staleness, completes
        keep, w = self.mean_weights(weight, samples)
        buffer = [*(self._buffer or []), (update, keep, w)]
        first_version, first_stale = self._oldest(version, stale)
        args = None if not args else {k: int(v) for k, v in args.items()}
        return Pending(buffer, samples, first_version, first_stale, None, args)

    def apply(self, version: int, staleness: int) -> None:
        self._deferred.append((self._buffer, staleness, version, self._buffer_args))
        self.reset()

    def restore(self, params: Any, opt_state: Any) -> None:
        self.apply_deferred()
        super().restore(params, opt_state)

    def apply_deferred(self) -> tuple[dict[int, int], list[jax.Array]]:
        """Carries out the deferred applies in one call.

        Every update buffered for a deferred version goes through the same
        weighting, averaging and optimizer step as without deferral, in push
        order. Reading :attr:`params` or :attr:`opt_state` does this too.

        Returns:
          ``(rows, history)``: ``history`` holds, per parameter leaf (in
          ``jax.tree.leaves`` order), the parameters after every update stacked
          on a leading axis, and ``rows`` maps each version made to its row, so
          leaf ``i`` of version ``v`` is ``history[i][rows[v]]``. Both are
          empty when nothing was deferred.
        """
        deferred = self._deferred
        if not deferred:
            return {}, []
        self._deferred = []
        updates, keeps, weights, first, close, staleness = [], [], [], [], [], []
        keys = sorted({k for *_, args in deferred if args for k in args})
        args_rows: dict[str, list[int]] = {k: [] for k in keys}
        rows = {}
        for items, tau, version, args in deferred:
            items = _folded(items)
            for j, (update, k, w) in enumerate(items):
                updates.append(jax.tree.leaves(update))
                keeps.append(k)
                weights.append(w)
                first.append(j == 0)
                close.append(j == len(items) - 1)
                staleness.append(tau)
                for key in keys:
                    args_rows[key].append((args or {}).get(key, 0))
            rows[version] = len(updates) - 1
        n = len(updates)
        # A power-of-two number of rows (at least 8), so few shapes compile;
        # padding rows neither buffer nor apply anything.
        padded = max(8, 1 << (n - 1).bit_length())
        pad = padded - n
        stacked = []
        for i, column in enumerate(zip(*updates, strict=True)):
            if all(isinstance(x, np.ndarray) for x in column):
                column_rows = np.empty((padded, *self._shapes[i]), self._dtypes[i])
                for j, x in enumerate(column):
                    column_rows[j] = x
                column_rows[n:] = 0
            else:
                zeros = [jnp.zeros(self._shapes[i], self._dtypes[i])] * pad
                column_rows = jnp.stack([*column, *zeros])
            stacked.append(column_rows)
        flags = np.zeros((4, padded), np.bool_)
        flags[0, :n] = first
        flags[1, :n] = close
        self._params, self._opt_state, history = self._chain(
            self._params,
            self._opt_state,
            jax.tree.unflatten(self._treedef, stacked),
            np.asarray(keeps + [0.0] * pad, np.float32),
            np.asarray(weights + [0.0] * pad, np.float32),
            flags[0],
            flags[1],
            np.asarray(staleness + [0] * pad, np.int32),
            {k: np.asarray(v + [0] * pad, np.int32) for k, v in args_rows.items()},
        )
        return rows, jax.tree.leaves(history)
