r"""Batched, lazy evaluation of the simulated workers' computations.

The virtual clock decides *when* a worker computes; what it computes is fixed the
moment it starts: the parameters it holds, the batches it will draw, its step-size
scale. The result is needed only when its compute ends (its push). So a round is
*submitted* when it starts and *evaluated* when some worker's result is first
needed: then every submitted round is evaluated together, one local step at a
time, each step of all of them in one ``jax.vmap``-ed call (per batch size). With
:math:`n` workers in flight this turns :math:`n` small dispatches into one.

Parameters travel as flat host vectors (one per version; a worker's local copy is
a row of the last step's output), so stacking them for a batched call is one
``numpy`` copy and a pushed update is a zero-copy view. Per-worker state that must
persist across rounds (the worker optimizer's, the push transform's error
feedback and random key) stays on the device, stacked over workers, and is read
and written by row inside the same jitted call.

Fixed shapes keep compilation bounded: a call evaluates a power-of-two number of
rows (padded, or split into power-of-two chunks), so each batch size compiles at
most :math:`\log_2 n` shapes, each once.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__: list[str] = []


class FlatSpec:
    """Flattens a parameter pytree into one vector and back.

    All leaves must be floating point; the vector has their common dtype and is
    cast back to each leaf's dtype when unflattened.
    """

    def __init__(self, params: Any):
        leaves, self.treedef = jax.tree.flatten(params)
        if not leaves:
            raise ValueError("params must hold at least one array.")
        self.shapes = tuple(tuple(np.shape(x)) for x in leaves)
        self.dtypes = tuple(np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
                            for x in leaves)
        for i, dtype in enumerate(self.dtypes):
            if not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(
                    f"params leaf {i} has dtype {dtype}; the simulator trains "
                    "floating-point parameters only."
                )
        self.dtype = np.dtype(jnp.result_type(*self.dtypes))
        self.sizes = tuple(math.prod(s) for s in self.shapes)
        self.offsets = tuple(np.cumsum((0, *self.sizes[:-1])).tolist())
        self.size = int(sum(self.sizes))
        self.signature = (self.treedef, self.shapes, self.dtypes)

    def ravel_host(self, tree: Any) -> np.ndarray:
        """A read-only host vector of a tree's leaves (jax or numpy arrays)."""
        leaves = jax.tree.leaves(tree)
        flat = np.concatenate(
            [np.asarray(x, dtype=self.dtype).reshape(-1) for x in leaves]
        )
        flat.flags.writeable = False
        return flat

    def unravel_host(self, flat: np.ndarray) -> Any:
        """The tree of a host vector, as zero-copy numpy views where dtypes agree."""
        leaves = []
        for offset, size, shape, dtype in zip(
            self.offsets, self.sizes, self.shapes, self.dtypes, strict=True
        ):
            leaf = flat[offset : offset + size].reshape(shape)
            if dtype != flat.dtype:
                leaf = leaf.astype(dtype)
            leaves.append(leaf)
        return jax.tree.unflatten(self.treedef, leaves)

    def ravel(self, tree: Any) -> jax.Array:
        """Traceable flattening (inside ``jit``)."""
        return jnp.concatenate(
            [jnp.ravel(x).astype(self.dtype) for x in jax.tree.leaves(tree)]
        )

    def unravel(self, flat: jax.Array) -> Any:
        """Traceable unflattening (inside ``jit``)."""
        leaves = [
            flat[offset : offset + size].reshape(shape).astype(dtype)
            for offset, size, shape, dtype in zip(
                self.offsets, self.sizes, self.shapes, self.dtypes, strict=True
            )
        ]
        return jax.tree.unflatten(self.treedef, leaves)


class IndexStream:
    """An endless, shuffled walk over a worker's example indices.

    Epoch ``e`` visits every index of the shard once, in the order of a
    permutation drawn from ``(seed, e)``; a batch is the next ``b`` positions of
    the walk and may cross an epoch boundary (as :class:`hpsjax.data.BatchStream`
    walks a shard).
    """

    __slots__ = ("_epoch", "_indices", "_offset", "_order", "_seed")

    def __init__(self, indices: np.ndarray, seed: Sequence[int]):
        self._indices = indices
        self._seed = tuple(seed)
        self._epoch = 0
        self._offset = 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        rng = np.random.default_rng([*self._seed, self._epoch])
        return self._indices[rng.permutation(len(self._indices))]

    def next(self, size: int) -> np.ndarray:
        n = len(self._order)
        if self._offset + size <= n:
            out = self._order[self._offset : self._offset + size]
            self._offset += size
            if self._offset == n:
                self._epoch += 1
                self._offset = 0
                self._order = self._permutation()
            return out
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
        return np.concatenate(parts)


def chunk_sizes(n: int, max_rows: int) -> list[tuple[int, int]]:
    """Splits ``n`` rows into calls of ``(rows, padded rows)``.

    Padded sizes are powers of two (or ``max_rows``); a call is padded when that
    wastes at most a quarter of it, else split, so few shapes ever compile and
    little work is thrown away.
    """
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

    Attributes set at submission: ``slot`` (the worker's row in the stacked
    states), ``base`` (flat parameters it starts from), ``steps``, ``batch_size``,
    ``scale`` (step-size scale of its local steps, or of its gradient),
    ``push_scale`` (factor on the pushed update), ``stream`` (its batch indices).
    Set by evaluation: ``update`` (flat pushed update, decoded if compressed),
    ``loss`` (mean training loss over its steps), ``stage`` (the worker
    optimizer's stage after it, or ``None``), ``done``.
    """

    __slots__ = (
        "base",
        "batch_size",
        "done",
        "done_steps",
        "loss",
        "loss_sum",
        "params",
        "push_scale",
        "scale",
        "slot",
        "stage",
        "steps",
        "stream",
        "update",
    )

    def __init__(self, slot, base, steps, batch_size, scale, push_scale, stream):
        self.slot = slot
        self.base = base
        self.params = base
        self.steps = steps
        self.batch_size = batch_size
        self.scale = scale
        self.push_scale = push_scale
        self.stream = stream
        self.done_steps = 0
        self.loss_sum = 0.0
        self.update = None
        self.loss = None
        self.stage = None
        self.done = False


class Kernels:
    """The jitted batched functions for one loss, parameter layout and transforms.

    Built once per combination and kept (see :func:`kernels`), so that repeated
    simulations of the same model reuse their compiled code.
    """

    def __init__(self, loss_fn, flat, worker_optimizer, push_transform, init_params):
        self.flat = flat
        value_and_grad = jax.value_and_grad(loss_fn)

        def gather(data, idx):
            return jax.tree.map(lambda a: a[idx], data)

        self.has_stages = False
        self.opt = None
        if worker_optimizer is None:

            def grad_rows(params, idx, scale, data, *, shared):
                def one(p, ix, s):
                    loss, g = value_and_grad(flat.unravel(p), gather(data, ix))
                    return flat.ravel(g) * s.astype(flat.dtype), loss

                return jax.vmap(one, in_axes=(None if shared else 0, 0, 0))(
                    params, idx, scale
                )

            self.grad = jax.jit(grad_rows, static_argnames=("shared",))
        else:
            opt = self.opt = optax.with_extra_args_support(worker_optimizer)
            has_stages = self.has_stages = _has_stages(opt.init(init_params))

            def local_rows(params, idx, scale, data, states, rows, *, shared):
                picked = jax.tree.map(lambda s: s[rows], states)

                def one(p, ix, s, st):
                    tree = flat.unravel(p)
                    loss, g = value_and_grad(tree, gather(data, ix))
                    updates, st = opt.update(g, st, tree, loss=loss)
                    updates = jax.tree.map(lambda u: (u * s).astype(u.dtype), updates)
                    tree = optax.apply_updates(tree, updates)
                    return flat.ravel(tree), loss, st

                new_params, loss, new_states = jax.vmap(
                    one, in_axes=(None if shared else 0, 0, 0, 0)
                )(params, idx, scale, picked)
                states = jax.tree.map(
                    lambda s, n: s.at[rows].set(n), states, new_states
                )
                stage = _current_stage(new_states) if has_stages else None
                return new_params, loss, states, stage

            self.local = jax.jit(
                local_rows, static_argnames=("shared",), donate_argnames=("states",)
            )

        self.ptx = None
        if push_transform is not None:
            ptx = self.ptx = optax.with_extra_args_support(push_transform)

            def push_rows(updates, states, rows):
                picked = jax.tree.map(lambda s: s[rows], states)

                def one(u, st):
                    out, st = ptx.update(flat.unravel(u), st)
                    return flat.ravel(out), st

                out, new_states = jax.vmap(one)(updates, picked)
                states = jax.tree.map(
                    lambda s, n: s.at[rows].set(n), states, new_states
                )
                return out, states

            self.push = jax.jit(push_rows, donate_argnames=("states",))


_KERNELS: collections.OrderedDict = collections.OrderedDict()
_KERNELS_KEPT = 8


def kernels(loss_fn, flat, worker_optimizer, push_transform, init_params) -> Kernels:
    """The :class:`Kernels` of a combination, from a small cache when possible."""
    key = (loss_fn, flat.signature, worker_optimizer, push_transform)
    try:
        hit = _KERNELS.get(key)
    except TypeError:  # an unhashable loss or transform: build afresh
        return Kernels(loss_fn, flat, worker_optimizer, push_transform, init_params)
    if hit is None:
        hit = Kernels(loss_fn, flat, worker_optimizer, push_transform, init_params)
        _KERNELS[key] = hit
        while len(_KERNELS) > _KERNELS_KEPT:
            _KERNELS.popitem(last=False)
    else:
        _KERNELS.move_to_end(key)
    return hit


class Engine:
    """Evaluates submitted rounds in batches (see the module docstring).

    Args:
      loss_fn: ``(params, batch) -> scalar`` mean loss of a batch.
      flat: the :class:`FlatSpec` of the parameters.
      data: the training data on the device, a pytree of arrays with a leading
        example axis.
      num_slots: number of workers (one persistent state row each).
      worker_optimizer: optax transform of the local steps, or ``None`` to push
        plain gradients (one step per round).
      push_transform: optax transform applied, per worker, to every pushed update
        (quantization with error feedback), or ``None``.
      init_params: parameters to initialise the per-worker states with.
      max_rows: the most rows evaluated in one call.
      seed: seed of the per-worker random keys of ``push_transform``.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        flat: FlatSpec,
        data: Any,
        num_slots: int,
        *,
        worker_optimizer: optax.GradientTransformation | None,
        push_transform: optax.GradientTransformation | None,
        init_params: Any,
        max_rows: int,
        seed: int,
    ):
        self.flat = flat
        self.data = data
        self.max_rows = max_rows
        self.local = worker_optimizer is not None
        self.pending: list[Round] = []
        self.evaluations = 0
        self.padded_evaluations = 0
        self._dummy = num_slots  # padding rows read and write this extra slot
        self.k = kernels(loss_fn, flat, worker_optimizer, push_transform, init_params)
        self.has_stages = self.k.has_stages
        self.states = None
        if self.k.opt is not None:
            self.states = _stack(self.k.opt.init(init_params), num_slots + 1)
        self.push_states = None
        if self.k.ptx is not None:
            self.push_states = _decorrelate(
                _stack(self.k.ptx.init(init_params), num_slots + 1), seed
            )

    def submit(self, round_: Round) -> Round:
        """Queues a round for evaluation."""
        self.pending.append(round_)
        return round_

    def cancel(self, round_: Round) -> None:
        """Forgets a round not evaluated yet (its worker discarded it)."""
        if not round_.done:
            self.pending.remove(round_)

    def flush(self) -> None:
        """Evaluates every pending round."""
        active = self.pending
        self.pending = []
        finished = []
        while active:
            groups: dict[int, list[Round]] = {}
            for r in active:
                groups.setdefault(r.batch_size, []).append(r)
            for batch_size, group in groups.items():
                start = 0
                for rows, padded in chunk_sizes(len(group), self.max_rows):
                    self._step(group[start : start + rows], batch_size, padded)
                    start += rows
            still = []
            for r in active:
                (finished if r.done_steps == r.steps else still).append(r)
            active = still
        self._finish(finished)

    def _step(self, rows: list[Round], batch_size: int, padded: int) -> None:
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
            stage = None if stage is None else np.asarray(stage)
        else:
            out, loss = self.k.grad(params, idx, scale, self.data, shared=shared)
            stage = None
        out = np.asarray(out)
        loss = np.asarray(loss).tolist()
        for j, r in enumerate(rows):
            r.params = out[j]
            r.loss_sum += loss[j]
            r.done_steps += 1
            if stage is not None:
                r.stage = int(stage[j])
        self.evaluations += len(rows)
        self.padded_evaluations += pad

    def _finish(self, finished: list[Round]) -> None:
        for r in finished:
            # Gradient mode: the row is the scaled gradient itself. Local mode:
            # the pseudo-gradient w_start - w_end, what the local steps moved.
            update = r.params if not self.local else r.base - r.params
            if r.push_scale != 1.0:
                update = update * update.dtype.type(r.push_scale)
            r.update = update
            r.loss = r.loss_sum / r.steps
        if self.push_states is not None and finished:
            start = 0
            for rows, padded in chunk_sizes(len(finished), self.max_rows):
                chunk = finished[start : start + rows]
                start += rows
                pad = padded - rows
                slots = np.full(padded, self._dummy, np.int32)
                slots[:rows] = [r.slot for r in chunk]
                out, self.push_states = self.k.push(
                    _stack_rows([r.update for r in chunk], pad),
                    self.push_states,
                    slots,
                )
                out = np.asarray(out)
                for j, r in enumerate(chunk):
                    r.update = out[j]
        for r in finished:
            r.done = True
            r.params = None


def _stack_rows(rows: list[np.ndarray], pad: int) -> np.ndarray:
    out = np.empty((len(rows) + pad, rows[0].shape[0]), rows[0].dtype)
    for j, row in enumerate(rows):
        out[j] = row
    if pad:
        out[len(rows) :] = rows[0]
    return out


def _stack(state: Any, n: int) -> Any:
    return jax.tree.map(
        lambda x: jnp.broadcast_to(jnp.asarray(x), (n, *jnp.shape(x))).copy(), state
    )


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(
        x.dtype, jax.dtypes.prng_key
    )


def _decorrelate(stacked: Any, seed: int) -> Any:
    """Gives every worker's row its own random key (typed key leaves only)."""

    def fix(x):
        if not _is_key(x):
            return x
        return jax.vmap(
            lambda k, j: jax.random.fold_in(jax.random.fold_in(k, seed), j)
        )(x, jnp.arange(x.shape[0]))

    return jax.tree.map(fix, stacked)


def _has_stages(state: Any) -> bool:
    from hpsjax.transforms._stages import current_stage

    try:
        current_stage(state)
    except ValueError:
        return False
    return True


def _current_stage(state: Any) -> jax.Array:
    from hpsjax.transforms._stages import current_stage

    return current_stage(state)
