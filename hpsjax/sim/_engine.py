r"""Batched, lazy evaluation of the simulated workers' computations.

The virtual clock decides *when* a worker computes; what it computes is fixed the
moment it starts: the parameters it holds, the batches it will draw, its step-size
scale. The result is needed only when its compute ends (its push). So a round is
*submitted* when it starts and *evaluated* when some worker's result is first
needed: then every submitted round is evaluated together, one local step at a
time, the same step of many workers in one ``jax.vmap``-ed call (per batch size).
With :math:`n` workers in flight this turns :math:`n` small dispatches into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._lru import LruCache
from hpsjax.apply import LazyUpdate, all_finite
from hpsjax.transforms import QuantizeState, current_stage

__all__: list[str] = []

BATCH_FLOPS_LIMIT = 1e7
"""FLOPs of one gradient above which workers' steps are evaluated one per call."""

# Batched calls of cheap gradients hold at least this many rows (fewer workers:
# as many as there are), so that few shapes compile.
_MIN_ROWS = 8

# Rounds on one version, of one batch size, evaluated summed (see SummedRows)
# when at least this many are pending together.
SUM_MIN_ROWS = 2

# Parameters above which a push call holds one row (no padding).
_PUSH_PAD_LIMIT = 100_000

Leaves = tuple  # tuple of the parameters' leaves (numpy or jax arrays)


class IndexStream:
    """An endless, shuffled walk over a worker's example indices.

    Epoch ``e`` visits every index of the shard once, in the order of a
    permutation drawn from ``(seed, e)``; a batch is the next ``b`` positions of
    the walk and may cross an epoch boundary (as :class:`hpsjax.data.BatchStream`
    walks a shard).
    """

    __slots__ = ("_epoch", "_indices", "_offset", "_order", "_seed")

    def __init__(self, indices: np.ndarray, seed: tuple[int, ...]):
        self._indices = indices
        self._seed = tuple(seed)
        self._epoch = 0
        self._offset = 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        rng = np.random.default_rng([*self._seed, self._epoch])
        return self._indices[rng.permutation(len(self._indices))]

    def next(self, size: int) -> np.ndarray:
        """The next ``size`` example indices."""
        n = len(self._order)
        parts = []
        while size > 0:
            take = min(size, n - self._offset)
            parts.append(self._order[self._offset : self._offset + take])
            self._offset += take
            size -= take
            if self._offset == n:
                self._epoch += 1
                self._offset = 0
                self._order = self._permutation()
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def chunk_sizes(n: int, max_rows: int, min_rows: int = 1) -> list[tuple[int, int]]:
    """Splits ``n`` rows into calls of ``(rows, padded rows)``.

    Padded sizes are powers of two (or ``max_rows``); a call is padded when that
    wastes at most a quarter of it, else split, so few shapes ever compile and
    little work is thrown away. Calls of fewer than ``min_rows`` rows are padded
    to ``min_rows``: for cheap rows a compile costs more than the padding.
    """
    if n <= min_rows:
        return [(n, min_rows)]
    out = []
    while n > 0:
        if n >= max_rows:
            out.append((max_rows, max_rows))
            n -= max_rows
            continue
        up = 1 << (n - 1).bit_length()
        if up <= max_rows and up - n <= max(1, n // 4):
            out.append((n, up))
            break
        down = up >> 1
        out.append((down, down))
        n -= down
    return out


class Round:
    """One submitted round of one worker: ``steps`` local steps from ``base``.

    Set at submission: ``slot`` (the worker's row in the stacked states),
    ``base`` (the parameter leaves it starts from), ``steps``, ``batch_size``,
    ``scale`` (step-size scale of its local steps, or of its gradient),
    ``stream`` (its batch indices). Set by evaluation: ``update`` (leaves of the
    update it pushes, before any push transform), ``loss`` (mean training loss
    over its steps), ``stage`` (the worker optimizer's stage after it, or
    ``None``), ``finite`` (whether the update was checked to hold only finite
    values: plain gradients only; else ``None``), ``done``.

    ``base`` may be a :class:`DeferredLeaves` until the round is evaluated;
    ``update`` is a :class:`SummedRow` where the round was evaluated summed.
    """

    __slots__ = (
        "base",
        "batch_size",
        "done",
        "done_steps",
        "finite",
        "loss",
        "loss_sum",
        "params",
        "scale",
        "slot",
        "stage",
        "steps",
        "stream",
        "update",
    )

    def __init__(self, slot, base, steps, batch_size, scale, stream):
        self.slot = slot
        self.base = base
        self.params = base
        self.steps = steps
        self.batch_size = batch_size
        self.scale = scale
        self.stream = stream
        self.done_steps = 0
        self.loss_sum = 0.0
        self.update = None
        self.loss = None
        self.stage = None
        self.finite = None
        self.done = False


class DeferredLeaves:
    """The leaves of a version the server core has not carried out yet.

    ``leaves`` is ``None`` until the driver fills it in; the engine asks the
    driver to (its ``resolve``) before it evaluates rounds.
    """

    __slots__ = ("leaves", "version")

    def __init__(self, version: int):
        self.version = version
        self.leaves: Leaves | None = None


class SummedRows:
    r"""Rounds on one version evaluated summed: what the server core may use.

    ``total`` holds the leaves of :math:`\sum_j n_j u_j` over the rows, where
    :math:`u_j` is row ``j``'s update (its scaled gradient) and :math:`n_j` its
    batch size. :meth:`weighted_sum` gives a weighted sum of the updates from it
    where the weights are proportional to the batch sizes over all the rows;
    :meth:`row` evaluates the rows one by one (once, on first use), exactly as
    rounds evaluated alone, for any other use.
    """

    __slots__ = ("_engine", "_rows", "idx", "params", "scale", "sizes", "total")

    def __init__(self, engine, params, idx, scale, sizes):
        self._engine = engine
        self.params = params
        self.idx = idx
        self.scale = scale
        self.sizes = sizes
        self.total: Leaves | None = None
        self._rows: list[Leaves] | None = None

    def __len__(self) -> int:
        return len(self.sizes)

    def weighted_sum(self, rows: list[int], weights: list[float]) -> Leaves | None:
        r""":math:`\sum_j w_j u_j` over ``rows``, or ``None`` where not known.

        Known from the sum when ``rows`` are all the rows, each once, and the
        weights are proportional to their batch sizes.
        """
        if sorted(rows) != list(range(len(self.sizes))):
            return None
        ratios = [w / self.sizes[j] for j, w in zip(rows, weights, strict=True)]
        alpha = ratios[0]
        if not all(abs(r - alpha) <= 1e-6 * abs(alpha) for r in ratios):
            return None
        return self._engine.scaled(self.total, alpha)

    def row(self, j: int) -> Leaves:
        """Row ``j``'s update, as a round evaluated alone gives it."""
        if self._rows is None:
            self._rows = self._engine.evaluate_rows(self)
        return self._rows[j]


class SummedRow(LazyUpdate):
    """Row ``row`` of a :class:`SummedRows`: an update pushed before it is
    evaluated alone (:meth:`leaves`)."""

    __slots__ = ("group", "row")

    def __init__(self, group: SummedRows, row: int):
        self.group = group
        self.row = row

    def leaves(self) -> Leaves:
        return self.group.row(self.row)


class PushJob:
    """One update on its way out: scaled, then through the push transform.

    ``update`` holds the leaves to send; with a push transform they are replaced
    by its output (what the server decodes) when ``done``.
    """

    __slots__ = ("done", "slot", "update")

    def __init__(self, slot: int, update: Leaves, done: bool):
        self.slot = slot
        self.update = update
        self.done = done


class PushKernel:
    """The jitted push transform over rows of updates, for one parameter layout.

    The rows go through ``lax.map`` rather than ``vmap``: a quantizer is costly
    to compile and cheap to run, and mapping compiles its body once.
    """

    def __init__(self, treedef, push_transform):
        ptx = self.ptx = optax.with_extra_args_support(push_transform)

        def push_rows(updates, states, rows):
            picked = jax.tree.map(lambda s: s[rows], states)

            def one(operands):
                u, st = operands
                out, st = ptx.update(jax.tree.unflatten(treedef, list(u)), st)
                return jax.tree.leaves(out), st

            out, new_states = jax.lax.map(one, (updates, picked))
            states = jax.tree.map(lambda s, n: s.at[rows].set(n), states, new_states)
            return out, states

        def push_one(update, states, slot):
            picked = jax.tree.map(lambda s: s[slot], states)
            out, new = ptx.update(jax.tree.unflatten(treedef, list(update)), picked)
            states = jax.tree.map(lambda s, n: s.at[slot].set(n), states, new)
            return jax.tree.leaves(out), states

        self.push = jax.jit(push_rows, donate_argnames=("states",))
        self.push_one = jax.jit(push_one, donate_argnames=("states",))


class Kernels:
    """The jitted batched functions for one loss, parameter layout and transforms.

    Built once per combination and kept (see :func:`kernels`), so that repeated
    simulations of the same model reuse their compiled code.
    """

    def __init__(self, loss_fn, treedef, local_optimizer, params):
        self.treedef = treedef
        self.value_and_grad = value_and_grad = jax.value_and_grad(loss_fn)
        # Per data layout: the FLOPs counted at each of (at most) two batch sizes.
        self.flops: dict[Any, dict[int, float | None]] = {}

        def gather(data, idx):
            return jax.tree.map(lambda a: a[idx], data)

        def unflatten(leaves):
            return jax.tree.unflatten(treedef, list(leaves))

        self.has_stages = False
        self.opt = None
        if local_optimizer is None:

            def scaled(p, ix, s, data):
                loss, g = value_and_grad(unflatten(p), gather(data, ix))
                g = [(x * s).astype(x.dtype) for x in jax.tree.leaves(g)]
                # Checked here, with the gradient, rather than by the server
                # core one push at a time.
                return g, loss, all_finite(g)

            def grad_rows(params, idx, scale, data, *, shared):
                return jax.vmap(scaled, in_axes=(None if shared else 0, 0, 0, None))(
                    params, idx, scale, data
                )

            def grad_one(params, idx, scale, data):
                return scaled(params, idx, scale, data)

            def grad_sum(params, idx, weights, data):
                # The batches gathered in one go, then one row per worker.
                flat = gather(data, idx.reshape(-1))
                rows = jax.tree.map(lambda a: a.reshape(*idx.shape, *a.shape[1:]), flat)

                def total(p):
                    tree = unflatten(p)
                    losses = jax.vmap(lambda b: loss_fn(tree, b))(rows)
                    return jnp.sum(losses * weights), losses

                (_, losses), g = jax.value_and_grad(total, has_aux=True)(list(params))
                return g, losses, all_finite(g)

            self.grad = jax.jit(grad_rows, static_argnames=("shared",))
            self.grad_one = jax.jit(grad_one)
            self.grad_sum = jax.jit(grad_sum)
        else:
            opt = self.opt = optax.with_extra_args_support(local_optimizer)
            has_stages = self.has_stages = _has_stages(opt.init(params))

            def one(p, ix, s, st, data):
                tree = unflatten(p)
                loss, g = value_and_grad(tree, gather(data, ix))
                updates, st = opt.update(g, st, tree, loss=loss)
                updates = jax.tree.map(lambda u: (u * s).astype(u.dtype), updates)
                return jax.tree.leaves(optax.apply_updates(tree, updates)), loss, st

            def local_rows(params, idx, scale, data, states, rows, *, shared):
                picked = jax.tree.map(lambda s: s[rows], states)
                new_params, loss, new_states = jax.vmap(
                    one, in_axes=(None if shared else 0, 0, 0, 0, None)
                )(params, idx, scale, picked, data)
                states = jax.tree.map(
                    lambda s, n: s.at[rows].set(n), states, new_states
                )
                stage = _current_stage(new_states) if has_stages else None
                return new_params, loss, states, stage

            def local_one(params, idx, scale, data, states, slot):
                picked = jax.tree.map(lambda s: s[slot], states)
                new_params, loss, new = one(params, idx, scale, picked, data)
                states = jax.tree.map(lambda s, n: s.at[slot].set(n), states, new)
                stage = _current_stage(new) if has_stages else None
                return new_params, loss, states, stage

            self.local = jax.jit(
                local_rows, static_argnames=("shared",), donate_argnames=("states",)
            )
            self.local_one = jax.jit(local_one, donate_argnames=("states",))

        def subtract(a, b):
            return [x - y for x, y in zip(a, b, strict=True)]

        def scale_leaves(leaves, factor):
            return [(x * factor).astype(x.dtype) for x in leaves]

        self.subtract = jax.jit(subtract)
        self.scale_leaves = jax.jit(scale_leaves)

    def gradient_flops(self, params: Any, data: Any, batch_size: int) -> float | None:
        """XLA's FLOP count of one gradient on ``batch_size`` examples.

        Each count compiles the gradient, so two batch sizes are counted per
        data layout and the rest follow the line through them: a gradient's
        FLOPs are affine in the batch size (the same operations on a longer
        batch axis, plus the parameters' own).
        """
        layout = tuple((a.shape[1:], a.dtype) for a in jax.tree.leaves(data))
        counted = self.flops.setdefault(layout, {})
        if batch_size in counted:
            return counted[batch_size]
        if len(counted) >= 2:
            (b0, f0), (b1, f1) = list(counted.items())[:2]
            if f0 is None or f1 is None:
                return None
            return f0 + (f1 - f0) * (batch_size - b0) / (b1 - b0)
        batch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((batch_size, *a.shape[1:]), a.dtype), data
        )
        specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        try:
            cost = jax.jit(self.value_and_grad).lower(specs, batch).cost_analysis()
            flops = float(cost["flops"]) if cost and "flops" in cost else None
        except Exception:  # a backend without cost analysis: batch as usual
            flops = None
        counted[batch_size] = flops
        return flops


# The kernels of recent combinations, kept between simulations.
_KERNELS = LruCache(32)


def _layout(params: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(params)
    return treedef, tuple((np.shape(x), np.dtype(x.dtype)) for x in leaves)


def kernels(loss_fn, params, local_optimizer) -> Kernels:
    """The :class:`Kernels` of a combination, from a small cache when possible."""
    treedef, signature = _layout(params)
    return _KERNELS.get(
        ("grad", loss_fn, treedef, signature, local_optimizer),
        lambda: Kernels(loss_fn, treedef, local_optimizer, params),
    )


def push_kernel(params, push_transform) -> PushKernel:
    """The :class:`PushKernel` of a layout and transform, cached likewise."""
    treedef, signature = _layout(params)
    return _KERNELS.get(
        ("push", treedef, signature, push_transform),
        lambda: PushKernel(treedef, push_transform),
    )


class Engine:
    """Evaluates submitted rounds in batches (see the module docstring).

    Args:
      loss_fn: ``(params, batch) -> scalar`` mean loss of a batch.
      params: the initial parameters (a pytree of floating arrays).
      data: the training data on the device, a pytree of arrays with a leading
        example axis.
      num_slots: number of workers (one persistent state row each).
      local_optimizer: optax transform of the local steps, or ``None`` to push
        plain gradients (one step per round).
      push_transform: optax transform applied, per worker, to every pushed update
        (quantization with error feedback), or ``None``.
      batch_rows: rows per call, or ``None`` to choose from the FLOPs of a
        gradient (up to 256).
      batch_sizes: the workers' batch sizes at the start; when even the
        smallest makes an expensive gradient (or ``batch_rows`` is 1) the engine
        runs *sequentially*: one worker-step per call, parameters and updates
        kept on the device.
      seed: seed of the per-worker random keys of ``push_transform``.
      sum_rounds: evaluate rounds of plain gradients on one version summed
        (:class:`SummedRows`), for a driver whose server core takes their
        pushes as :class:`SummedRow` (see the module docstring).
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        params: Any,
        data: Any,
        num_slots: int,
        *,
        local_optimizer: optax.GradientTransformation | None,
        push_transform: optax.GradientTransformation | None,
        batch_rows: int | None,
        batch_sizes: tuple[int, ...],
        seed: int,
        sum_rounds: bool = True,
    ):
        leaves, self.treedef = jax.tree.flatten(params)
        for i, x in enumerate(leaves):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise ValueError(
                    f"params leaf {i} has dtype {x.dtype}; the simulator trains "
                    "floating-point parameters only."
                )
        self.params = params
        self.data = data
        self.batch_rows = batch_rows
        self.local = local_optimizer is not None
        # Rounds of plain gradients evaluated summed (see SummedRows).
        self.sums = sum_rounds and not self.local and push_transform is None
        self.pending: list[Round] = []
        self.push_pending: list[PushJob] = []
        # Called before rounds are evaluated, to fill in DeferredLeaves.
        self.resolve: Callable[[], None] | None = None
        self.evaluations = 0
        self.padded_evaluations = 0
        self._rows: dict[int, int] = {}
        self._dummy = num_slots  # padding rows read and write this extra slot
        # Batched calls hold at least this many rows (a power of two).
        self.min_rows = min(1 << (num_slots - 1).bit_length(), _MIN_ROWS)
        self.k = kernels(loss_fn, params, local_optimizer)
        self.has_stages = self.k.has_stages
        if batch_rows is not None:
            self.sequential = batch_rows == 1
        else:
            flops = self.k.gradient_flops(params, data, min(batch_sizes))
            self.sequential = flops is not None and flops > BATCH_FLOPS_LIMIT
        self.states = None
        if self.k.opt is not None:
            self.states = _stack(self.k.opt.init(params), num_slots + 1)
        self.push_states = None
        if push_transform is not None:
            self.pk = push_kernel(params, push_transform)
            self.push_states = _decorrelate(
                _stack(self.pk.ptx.init(params), num_slots + 1), seed
            )
        # One row count for every push call, so the quantizer compiles once:
        # a few rows for a small model, one row for a large one (padding rows
        # would cost real work).
        size = sum(math.prod(np.shape(x)) for x in leaves)
        self.push_rows = 1 if batch_rows == 1 or size > _PUSH_PAD_LIMIT else 8

    def version_leaves(self, tree: Any) -> Leaves:
        """A version's leaves as the engine keeps them.

        Read-only host arrays (zero-copy on the CPU) for batched calls, which
        stack them; the device arrays themselves when sequential.
        """
        if self.sequential:
            return tuple(jax.tree.leaves(tree))
        return tuple(np.asarray(x) for x in jax.tree.leaves(tree))

    def tree(self, leaves: Leaves) -> Any:
        """The pytree of a tuple of leaves."""
        return jax.tree.unflatten(self.treedef, list(leaves))

    def submit(self, round_: Round) -> Round:
        """Queues a round for evaluation."""
        self.pending.append(round_)
        return round_

    def cancel(self, round_: Round) -> None:
        """Forgets a round not evaluated yet (its worker discarded it)."""
        if not round_.done:
            self.pending.remove(round_)

    def rows_per_call(self, batch_size: int) -> int:
        """How many worker-steps of this batch size one call evaluates."""
        rows = self._rows.get(batch_size)
        if rows is None:
            if self.sequential:
                rows = 1
            elif self.batch_rows is not None:
                rows = self.batch_rows
            else:
                flops = self.k.gradient_flops(self.params, self.data, batch_size)
                rows = 256 if flops is None or flops <= BATCH_FLOPS_LIMIT else 1
            self._rows[batch_size] = rows
        return rows

    def flush(self) -> None:
        """Evaluates every pending round."""
        active = self.pending
        self.pending = []
        finished = []
        if self.resolve is not None:
            self.resolve()
        for r in active:
            if type(r.base) is DeferredLeaves:
                r.base = r.params = r.base.leaves
        if self.sums:
            active = self._sum(active, finished)
        while active:
            groups: dict[int, list[Round]] = {}
            for r in active:
                groups.setdefault(r.batch_size, []).append(r)
            for batch_size, group in groups.items():
                start = 0
                limit = self.rows_per_call(batch_size)
                for rows, padded in chunk_sizes(
                    len(group), limit, min(limit, self.min_rows)
                ):
                    self._step(group[start : start + rows], batch_size, padded)
                    start += rows
            still = []
            for r in active:
                (finished if r.done_steps == r.steps else still).append(r)
            active = still
        self._finish(finished)

    def _sum(self, active: list[Round], finished: list[Round]) -> list[Round]:
        """Evaluates summed the rounds that share a version and a batch size.

        A group whose sum is not finite is evaluated one round at a time (which
        gradient is not finite must be known before their pushes); its rounds
        join ``finished``. Returns the rounds of no group.
        """
        groups: dict[tuple[int, int], list[Round]] = {}
        for r in active:
            if r.steps == 1 and r.done_steps == 0:
                groups.setdefault((id(r.params), r.batch_size), []).append(r)
        taken = set()
        for (_, batch_size), group in groups.items():
            n = len(group)
            if n < SUM_MIN_ROWS:
                continue
            # A power-of-two number of rows, so few shapes compile; padding
            # rows weigh nothing.
            padded = max(self.min_rows, 1 << (n - 1).bit_length())
            idx = np.empty((padded, batch_size), np.int32)
            scale = np.zeros(padded, np.float32)
            for j, r in enumerate(group):
                idx[j] = r.stream.next(batch_size)
                scale[j] = r.scale
            idx[n:] = idx[0]
            total, loss, finite = self.k.grad_sum(
                group[0].params, idx, scale * np.float32(batch_size), self.data
            )
            self.evaluations += n
            self.padded_evaluations += padded - n
            rows = SummedRows(
                self, group[0].params, idx[:n], scale[:n], [batch_size] * n
            )
            taken.update(id(r) for r in group)
            if not bool(finite):
                # A gradient among them is not finite: each is evaluated
                # alone, from the batches drawn here.
                self._evaluate_alone(group, rows)
                finished.extend(group)
                continue
            rows.total = tuple(total)
            loss = np.asarray(loss).tolist()
            for j, r in enumerate(group):
                r.update = SummedRow(rows, j)
                r.loss = loss[j]
                r.finite = True
                r.done_steps = 1
                r.done = True
                r.params = None
        return [r for r in active if id(r) not in taken]

    def evaluate_rows(self, rows: SummedRows) -> list[Leaves]:
        """Each row of a :class:`SummedRows` evaluated alone."""
        params, idx, scale = rows.params, rows.idx, rows.scale
        if self.sequential:
            return [
                tuple(self.k.grad_one(params, idx[j], scale[j], self.data)[0])
                for j in range(len(rows))
            ]
        g, _, _ = self.k.grad(params, idx, scale, self.data, shared=True)
        g = [np.asarray(x) for x in g]
        return [tuple(x[j] for x in g) for j in range(len(rows))]

    def _evaluate_alone(self, group: list[Round], rows: SummedRows) -> None:
        """Rounds of a sum that is not finite, evaluated one by one from the
        batches the sum drew, each with its own finiteness."""
        for j, r in enumerate(group):
            g, loss, finite = self.k.grad_one(
                r.params, rows.idx[j], rows.scale[j], self.data
            )
            r.params = tuple(g) if self.sequential else tuple(np.asarray(x) for x in g)
            r.loss_sum = loss
            r.finite = bool(finite)
            r.done_steps = 1

    def scaled(self, leaves: Leaves, factor: float) -> Leaves:
        """``leaves`` times ``factor``, each in its dtype."""
        return tuple(self.k.scale_leaves(leaves, np.float32(factor)))

    def _step(self, rows: list[Round], batch_size: int, padded: int) -> None:
        if self.sequential:
            self._step_one(rows[0], batch_size)
            return
        pad = padded - len(rows)
        first = rows[0].params
        shared = all(r.params is first for r in rows)
        params = first if shared else _stack_rows([r.params for r in rows], pad)
        idx = np.empty((padded, batch_size), np.int32)
        scale = np.zeros(padded, np.float32)
        for j, r in enumerate(rows):
            idx[j] = r.stream.next(batch_size)
            scale[j] = r.scale
        if pad:
            idx[len(rows) :] = idx[0]
        if self.local:
            slots = np.full(padded, self._dummy, np.int32)
            slots[: len(rows)] = [r.slot for r in rows]
            out, loss, self.states, stage = self.k.local(
                params, idx, scale, self.data, self.states, slots, shared=shared
            )
            stage = None if stage is None else np.asarray(stage).tolist()
            finite = None
        else:
            out, loss, finite = self.k.grad(
                params, idx, scale, self.data, shared=shared
            )
            finite = np.asarray(finite).tolist()
            stage = None
        out = [np.asarray(x) for x in out]
        loss = np.asarray(loss).tolist()
        for j, r in enumerate(rows):
            r.params = tuple(x[j] for x in out)
            r.loss_sum += loss[j]
            r.done_steps += 1
            if stage is not None:
                r.stage = stage[j]
            if finite is not None:
                r.finite = finite[j]
        self.evaluations += len(rows)
        self.padded_evaluations += pad

    def _step_one(self, r: Round, batch_size: int) -> None:
        """One step of one worker, on the device, without host round trips."""
        idx = r.stream.next(batch_size)
        scale = np.float32(r.scale)
        if self.local:
            out, loss, self.states, stage = self.k.local_one(
                r.params, idx, scale, self.data, self.states, np.int32(r.slot)
            )
            if stage is not None:
                r.stage = int(stage)
        else:
            out, loss, r.finite = self.k.grad_one(r.params, idx, scale, self.data)
        r.params = tuple(out)
        # Kept on the device: summing it here would wait for the step.
        r.loss_sum = loss if r.done_steps == 0 else r.loss_sum + loss
        r.done_steps += 1
        self.evaluations += 1

    def _finish(self, finished: list[Round]) -> None:
        for r in finished:
            # Gradient mode: the leaves are the scaled gradient itself. Local
            # mode: the pseudo-gradient w_start - w_end, what the steps moved.
            if not self.local:
                r.update = r.params
            elif self.sequential:
                r.update = tuple(self.k.subtract(r.base, r.params))
            else:
                r.update = tuple(b - p for b, p in zip(r.base, r.params, strict=True))
            r.loss = float(r.loss_sum) / r.steps
            r.done = True
            r.params = None

    def prepare_push(self, slot: int, update: Leaves, factor: float) -> PushJob:
        """Scales an update by ``factor`` and queues it for the push transform."""
        if factor != 1.0 and type(update) is SummedRow:
            update = update.leaves()
        if factor != 1.0:
            if self.sequential:
                update = tuple(self.k.scale_leaves(update, np.float32(factor)))
            else:
                update = tuple(x * x.dtype.type(factor) for x in update)
        job = PushJob(slot, update, self.push_states is None)
        if not job.done:
            self.push_pending.append(job)
        return job

    def finish_pushes(self) -> None:
        """Runs every queued update through its worker's push transform.

        A worker's updates go through in the order they were queued (its error
        feedback and key are sequential): one call never holds two of them.
        """
        pending = self.push_pending
        self.push_pending = []
        if self.sequential:
            for job in pending:
                out, self.push_states = self.pk.push_one(
                    job.update, self.push_states, np.int32(job.slot)
                )
                job.update = tuple(out)
                job.done = True
            return
        while pending:
            seen, now, later = set(), [], []
            for job in pending:
                (later if job.slot in seen else now).append(job)
                seen.add(job.slot)
            pending = later
            start = 0
            for rows in _fixed_chunks(len(now), self.push_rows):
                padded = self.push_rows
                chunk = now[start : start + rows]
                start += rows
                slots = np.full(padded, self._dummy, np.int32)
                slots[:rows] = [job.slot for job in chunk]
                out, self.push_states = self.pk.push(
                    _stack_rows([job.update for job in chunk], padded - rows),
                    self.push_states,
                    slots,
                )
                out = [np.asarray(x) for x in out]
                for j, job in enumerate(chunk):
                    job.update = tuple(x[j] for x in out)
                    job.done = True


def _fixed_chunks(n: int, size: int) -> list[int]:
    return [min(size, n - start) for start in range(0, n, size)]


def _stack_rows(rows: list[Leaves], pad: int) -> list[np.ndarray]:
    if pad:
        rows = rows + [rows[0]] * pad
    return [np.stack(leaf) for leaf in zip(*rows, strict=True)]


def _stack(state: Any, n: int) -> Any:
    """``n`` copies of every leaf, stacked on a new first axis, on the device.

    Built on the host and put on the device once (a leaf's broadcast and copy
    as jitted calls would compile for every leaf shape); typed random keys,
    which the host cannot hold, are broadcast on the device.
    """

    def stack(x):
        if _is_key(x):
            return jnp.broadcast_to(x, (n, *x.shape)).copy()
        x = np.asarray(x, jnp.asarray(x).dtype)  # JAX's dtype of a Python number
        return jax.device_put(np.ascontiguousarray(np.broadcast_to(x, (n, *x.shape))))

    return jax.tree.map(stack, state)


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _fold_rows(keys: jax.Array, seed: int) -> jax.Array:
    """Row ``j`` of stacked keys (typed or raw ``uint32`` data) folded with
    ``(seed, j)``."""
    typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)

    def fold(k, j):
        k = k if typed else jax.random.wrap_key_data(k)
        k = jax.random.fold_in(jax.random.fold_in(k, seed), j)
        return k if typed else jax.random.key_data(k)

    return jax.vmap(fold)(keys, jnp.arange(keys.shape[0]))


def _decorrelate(stacked: Any, seed: int) -> Any:
    """Gives every worker's row its own random key.

    Every row starts as a copy of one initial state, so without this all
    workers would round their quantized pushes with the same random bits.
    Typed key leaves and the raw key of a ``QuantizeState`` are folded.
    """

    def fix(node):
        if isinstance(node, QuantizeState):
            return node._replace(key=_fold_rows(node.key, seed))
        if _is_key(node):
            return _fold_rows(node, seed)
        return node

    return jax.tree.map(
        fix, stacked, is_leaf=lambda node: isinstance(node, QuantizeState)
    )


def _has_stages(state: Any) -> bool:
    try:
        current_stage(state)
    except ValueError:
        return False
    return True


def _current_stage(state: Any) -> jax.Array:
    return current_stage(state)
