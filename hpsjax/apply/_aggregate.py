r"""The parameter server's arithmetic: parameters, optimizer state, the buffer.

:class:`Aggregator` computes what :class:`~hpsjax.ps.ServerCore` decides. The
core judges a push (its weight, its staleness, whether it completes a version)
and asks the aggregator for the buffer with it (:meth:`Aggregator.candidate`,
which checks that the values stay finite and changes nothing), then commits it
(:meth:`Aggregator.commit`) and, when its policy says so, applies the buffer
(:meth:`Aggregator.apply`). The aggregator also checks updates against the
parameters (:meth:`Aggregator.check_update`) and keeps the parameters of older
versions that workers may still push against (stale copies, for
delay-compensated optimizers).

Two variants live beside their drivers: the simulator's, which defers applies
and carries many out in one compiled call (``hpsjax.apply._deferred``), and the
asyncio server's, which applies a push leaf by leaf as it arrives
(``hpsjax.apply._overlap``).

The weighted mean. A push of weight :math:`d_j` (the policy's damping, times
its ``push_weights`` entry) and :math:`n_j` samples joins the buffer as the
running mean

.. math::

   \bar u \leftarrow \frac{N}{N + n_j} \bar u + d_j \frac{n_j}{N + n_j} u_j,

:math:`N` the samples already buffered, computed in float32 at least so that no
count of samples overflows a leaf's dtype; the optimizer then applies
:math:`\bar u` with the buffer's largest staleness (and, with stale copies, the
parameters of the oldest version the buffered updates were computed on).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._checks import check_int
from hpsjax.apply._separable import all_finite, finite
from hpsjax.wire import NonFiniteUpdate, SpecMismatch

__all__ = ["Aggregator", "Pending"]


def _dtype_compatible(update: np.dtype, param: np.dtype) -> bool:
    """Whether an update leaf of dtype ``update`` may be cast to ``param``."""
    if update == param:
        return True
    if jnp.issubdtype(param, jnp.floating):
        return jnp.issubdtype(update, jnp.floating) or jnp.issubdtype(
            update, jnp.integer
        )
    if jnp.issubdtype(param, jnp.complexfloating):
        return jnp.issubdtype(update, jnp.number)
    if jnp.issubdtype(param, jnp.integer):
        return jnp.issubdtype(update, jnp.integer)
    return False


def wide(dtype: Any) -> Any:
    """The dtype weights are applied in: ``dtype``, at least float32."""
    return jnp.result_type(dtype, jnp.float32)


def scale(update: Any, weight: Any) -> Any:
    """``weight * update``, in float32 at least (a weight never overflows)."""
    return jax.tree.map(
        lambda u: (u.astype(wide(u.dtype)) * weight).astype(u.dtype), update
    )


def accumulate(total: Any, update: Any, keep: Any, weight: Any) -> Any:
    """The running weighted mean ``keep * total + weight * update``."""

    def mix(t, u):
        w = wide(t.dtype)
        return (t.astype(w) * keep + u.astype(w) * weight).astype(t.dtype)

    return jax.tree.map(mix, total, update)


def optimizer_apply(optimizer: optax.GradientTransformation):
    """The pure apply of ``optimizer``: ``(params, opt_state, update,
    staleness, stale_params, args=None) -> (params, opt_state)``, ``args``
    the policy's keyword arguments for the optimizer (a dict, or ``None``)."""
    opt = optax.with_extra_args_support(optimizer)

    def apply(params, opt_state, update, staleness, stale_params, args=None):
        extra = {"staleness": staleness}
        if stale_params is not None:
            extra["stale_params"] = stale_params
        if args:
            extra.update(args)
        deltas, opt_state = opt.update(update, opt_state, params, **extra)
        return optax.apply_updates(params, deltas), opt_state

    return apply


class _Steps(NamedTuple):
    """The compiled steps of one optimizer (see :func:`_make_steps`)."""

    apply: Any
    checked_apply: Any
    scale: Any
    accumulate: Any
    all_finite: Any
    checked_scale: Any
    checked_accumulate: Any


def _placed_like(tree: Any, leaf: jax.Array) -> Any:
    """``tree`` committed to ``leaf``'s device where ``leaf`` is committed to
    one (the server's ``device``), else as it is.

    A jitted step called first with an uncommitted state (an optimizer's
    ``init`` makes its counts uncommitted) and then with its own committed
    output is compiled twice.
    """
    if not getattr(leaf, "committed", False) or len(leaf.devices()) != 1:
        return tree
    (device,) = leaf.devices()
    return jax.device_put(tree, device)


@functools.lru_cache(maxsize=32)
def _make_steps(optimizer: optax.GradientTransformation) -> _Steps:
    """Jitted apply, accumulate and check steps for one optimizer.

    Each is traced once per tree structure and dtypes, so no event recompiles;
    cached per optimizer object, so that aggregators built again on the same
    optimizer (every run of the simulator) reuse the compiled steps.
    """
    apply = optimizer_apply(optimizer)

    def checked_apply(params, opt_state, update, staleness, stale_params, args=None):
        """``apply``, and per parameter leaf (then the optimizer state) whether
        the result is finite."""
        params, opt_state = apply(
            params, opt_state, update, staleness, stale_params, args
        )
        flags = [finite(x) for x in jax.tree.leaves(params)]
        flags.append(all_finite(jax.tree.leaves(opt_state)))
        return params, opt_state, jnp.stack(flags)

    def checked_scale(update, weight):
        """``scale``, and whether the result is finite."""
        total = scale(update, weight)
        return total, all_finite(jax.tree.leaves(total))

    def checked_accumulate(total, update, keep, weight):
        """``accumulate``, and whether the result is finite."""
        total = accumulate(total, update, keep, weight)
        return total, all_finite(jax.tree.leaves(total))

    return _Steps(
        jax.jit(apply),
        jax.jit(checked_apply),
        jax.jit(scale),
        jax.jit(accumulate),
        jax.jit(all_finite),
        jax.jit(checked_scale),
        jax.jit(checked_accumulate),
    )


class Pending(NamedTuple):
    """A push's contribution to the buffer, worked out before it is committed."""

    buffer: Any  # the buffer with the push (a list of rows when deferred)
    samples: int  # the push's num_samples
    version: int  # the oldest version the buffered updates were computed on
    stale: Any  # that version's parameters (keep_stale_params), or None
    result: tuple[Any, Any] | None  # (params, opt_state) the buffer applies to
    args: Any = None  # the optimizer's keyword arguments (device scalars)


class Aggregator:
    """Parameters, optimizer state and the buffer of one server core.

    Args:
      params: the initial parameters, a pytree of numeric arrays.
      optimizer: an optax ``GradientTransformation``, called as
        ``optimizer.update(u, opt_state, params, staleness=tau)`` (plus
        ``stale_params=w_v`` with ``keep_stale_params``), jitted once.
      check_finite: :meth:`check_update` refuses NaN and infinity.
      check_result: refuse a push whose buffer, or (for a push that completes
        a version) whose apply, would be non-finite; see
        :class:`~hpsjax.ps.ServerCore`.
      keep_stale_params: keep the parameters of the versions the core names
        (:meth:`keep_copy`) and pass them to the optimizer as ``stale_params``.
      max_stale_copies: bound on the number of kept copies (oldest evicted
        first), or ``None``.

    Raises:
      ValueError: for bad arguments.
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
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ValueError(
                "optimizer must be an optax GradientTransformation, got "
                f"{type(optimizer).__name__}."
            )
        check_int("max_stale_copies", max_stale_copies, low=1, allow_none=True)
        leaves, treedef = jax.tree.flatten(params)
        if not leaves:
            raise ValueError("params must hold at least one array.")
        leaves = [jnp.asarray(x) for x in leaves]
        for i, leaf in enumerate(leaves):
            if not jnp.issubdtype(leaf.dtype, jnp.number):
                raise ValueError(
                    f"params leaf {i} has dtype {leaf.dtype}; only numbers train."
                )
        self._treedef = treedef
        self._shapes = tuple(x.shape for x in leaves)
        self._dtypes = tuple(x.dtype for x in leaves)
        self._params = jax.tree.unflatten(treedef, leaves)
        self._opt_state = _placed_like(optimizer.init(self._params), leaves[0])
        self._optimizer = optimizer
        self._steps = _make_steps(optimizer)
        self._leaf_paths = tuple(
            jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        )
        self._check_finite = bool(check_finite)
        self._check_result = bool(check_result)
        self.keep_stale_params = bool(keep_stale_params)
        self._max_stale_copies = max_stale_copies
        self._copies: dict[int, Any] = {}
        self._scalars: dict[tuple[float, type], jax.Array] = {}
        self.reset()

    @property
    def params(self) -> Any:
        """The current parameters (pytree of jax arrays)."""
        return self._params

    @property
    def opt_state(self) -> Any:
        """The optimizer state."""
        return self._opt_state

    def reset(self) -> None:
        """Empties the buffer."""
        self._buffer = None
        # The buffer applied (checked), when check_result: what apply commits.
        self._buffer_result: tuple[Any, Any] | None = None
        self._buffer_samples = 0
        self._buffer_version: int | None = None
        self._buffer_stale = None
        self._buffer_args = None

    # Updates.

    def check_update(self, update: Any) -> Any:
        """``update`` checked against the parameters, its leaves cast to their dtypes.

        Raises:
          SpecMismatch: tree structure, shape or dtype differs from the params.
          NonFiniteUpdate: NaN or infinity in it (``check_finite``).
        """
        leaves, treedef = jax.tree.flatten(update)
        if treedef != self._treedef:
            raise SpecMismatch(
                f"update tree structure {treedef} differs from the parameters' "
                f"{self._treedef}"
            )
        cast = []
        for i, (leaf, shape, dtype) in enumerate(
            zip(leaves, self._shapes, self._dtypes, strict=True)
        ):
            leaf_shape = np.shape(leaf)
            if leaf_shape != shape:
                raise SpecMismatch(
                    f"update leaf {i}: shape {leaf_shape} != parameter shape {shape}"
                )
            leaf_dtype = getattr(leaf, "dtype", None)
            if leaf_dtype is None:
                leaf = np.asarray(leaf)
                leaf_dtype = leaf.dtype
            if leaf_dtype != dtype:
                if not _dtype_compatible(np.dtype(leaf_dtype), dtype):
                    raise SpecMismatch(
                        f"update leaf {i}: dtype {leaf_dtype} cannot update a "
                        f"parameter of dtype {dtype}"
                    )
                leaf = leaf.astype(dtype)
            cast.append(leaf)
        if self._check_finite and not self._all_finite(cast):
            raise NonFiniteUpdate("update holds NaN or infinite values")
        return jax.tree.unflatten(self._treedef, cast)

    def _all_finite(self, leaves: list[Any]) -> bool:
        # Host arrays (what the wire decodes) are checked in place; a device
        # round trip would cost more than the check. Device arrays are checked
        # on their device in one jitted call.
        on_device = []
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                on_device.append(leaf)
                continue
            kind = leaf.dtype.kind
            if kind in "iub":
                continue
            # Extension floats (bfloat16) are checked through float32.
            host = leaf if kind in "fc" else np.asarray(leaf, np.float32)
            if not np.isfinite(host).all():
                return False
        return not on_device or bool(self._steps.all_finite(on_device))

    # Stale copies.

    def copy_of(self, version: int, current: int) -> Any:
        """The parameters of ``version`` if kept (the current ones at
        ``current``), else ``None``."""
        stale = self._params if version == current else None
        return self._copies.get(version, stale)

    def keep_copy(self, version: int) -> None:
        """Keeps the current parameters as those of ``version`` (the current
        version); evicts the oldest copy beyond ``max_stale_copies``."""
        if version not in self._copies:
            self._copies[version] = self._params
            if (
                self._max_stale_copies is not None
                and len(self._copies) > self._max_stale_copies
            ):
                del self._copies[min(self._copies)]

    def drop_copy(self, version: int) -> None:
        """Frees the copy of ``version`` (no live worker may push against it)."""
        self._copies.pop(version, None)

    @property
    def stale_versions(self) -> tuple[int, ...]:
        """Versions whose parameters are kept for ``stale_params``."""
        return tuple(sorted(self._copies))

    def params_at(self, version: int, current: int) -> Any:
        """The parameters of ``version``: its kept copy, or the current ones
        where ``version`` is ``current``.

        Raises:
          KeyError: if that version is not kept.
        """
        if version == current:
            return self.params
        return self._copies[version]

    # The buffer.

    def mean_weights(self, weight: float, samples: int) -> tuple[Any, Any]:
        """The buffer's and a push's weights in the buffered mean with it."""
        total = self._buffer_samples + samples
        # Each in [0, weight]: a count of samples never multiplies a value.
        keep = np.float32(self._buffer_samples / total)
        return keep, np.float32(weight * (samples / total))

    def candidate(
        self,
        update: Any,
        weight: float,
        samples: int,
        staleness: int,
        version: int,
        stale: Any,
        *,
        completes: bool | None,
        args: Any = None,
    ) -> Pending:
        """The buffer with one more update, and (``check_result``) its apply.

        Changes nothing: :meth:`commit` installs it. With ``check_result``, a
        push that completes the buffer (``completes``; ``None`` where not
        known) has the buffer applied on trial, a result :meth:`apply`
        commits; any other has only the buffer checked, one elementwise pass
        rather than an optimizer step per push.

        Args:
          update: the update, checked against the parameters.
          weight: its weight (the policy's, times its ``push_weights`` entry).
          samples: its number of samples (>= 1).
          staleness: the buffer's largest staleness with it.
          version: the version it was computed on.
          stale: the parameters of ``version`` (:meth:`copy_of`) where stale
            copies are kept, else ``None``.
          completes: whether the push makes the core apply the buffer.
          args: the policy's int keyword arguments for the optimizer's update
            (:attr:`~hpsjax.decisions.Verdict.args`), or ``None``.

        Raises:
          NonFiniteUpdate: the buffer, or the apply of a completed buffer,
            would be non-finite.
        """
        keep, w = self.mean_weights(weight, samples)
        trial = self._check_result and completes is not False
        checked = self._check_result and not trial
        steps = self._steps
        finite = True
        if self._buffer is None and w == 1:
            buffer = update
        elif self._buffer is None and checked:
            buffer, finite = steps.checked_scale(update, w)
        elif self._buffer is None:
            buffer = steps.scale(update, w)
        elif checked:
            buffer, finite = steps.checked_accumulate(self._buffer, update, keep, w)
        else:
            buffer = steps.accumulate(self._buffer, update, keep, w)
        if not finite:
            raise NonFiniteUpdate(
                "update refused: the buffered average with it would be non-finite "
                "(NaN or infinity); nothing changed"
            )
        first_version, first_stale = self._oldest(version, stale)
        args = self.device_args(args)
        result = None
        if trial:
            params, opt_state, bad = self._trial_apply(
                buffer, staleness, first_stale, args
            )
            if bad is not None:
                raise NonFiniteUpdate(
                    f"update refused: applied, it would make {bad} non-finite "
                    "(NaN or infinity); nothing changed"
                )
            result = (params, opt_state)
        return Pending(buffer, samples, first_version, first_stale, result, args)

    def device_args(self, args: Any) -> dict[str, jax.Array] | None:
        """The policy's int optimizer arguments as device scalars (``None``:
        none)."""
        if not args:
            return None
        return {k: self.device_scalar(int(v), np.int32) for k, v in args.items()}

    def _oldest(self, version: int, stale: Any) -> tuple[int, Any]:
        """The oldest version of the buffer with a push on ``version``, and
        its parameters."""
        if self._buffer_version is None or version < self._buffer_version:
            return version, stale
        return self._buffer_version, self._buffer_stale

    def commit(self, pending: Pending) -> None:
        """Installs a :meth:`candidate` as the buffer."""
        self._buffer = pending.buffer
        self._buffer_result = pending.result
        self._buffer_samples += pending.samples
        self._buffer_version = pending.version
        self._buffer_stale = pending.stale
        self._buffer_args = pending.args

    def apply(self, version: int, staleness: int) -> None:
        """Applies the buffer with ``staleness``, making ``version``; empties it.

        A buffer with no push to refuse (made by a deadline or a leave) whose
        result would be non-finite leaves the parameters as they were
        (``check_result``).
        """
        del version
        if self._buffer_result is not None:
            self._params, self._opt_state = self._buffer_result
        elif self._check_result:
            params, opt_state, bad = self._trial_apply(
                self._buffer, staleness, self._buffer_stale, self._buffer_args
            )
            if bad is None:
                self._params, self._opt_state = params, opt_state
        else:
            self._params, self._opt_state = self._steps.apply(
                self._params,
                self._opt_state,
                self._buffer,
                self.device_scalar(staleness, np.int32),
                self._buffer_stale,
                self._buffer_args,
            )
        self.reset()

    def _trial_apply(
        self, buffer: Any, staleness: int, stale: Any, args: Any = None
    ) -> tuple[Any, Any, str | None]:
        """``buffer`` applied, and what it would make non-finite (or ``None``)."""
        params, opt_state, flags = self._steps.checked_apply(
            self._params,
            self._opt_state,
            buffer,
            self.device_scalar(staleness, np.int32),
            stale,
            args,
        )
        return params, opt_state, self.non_finite(flags)

    def non_finite(self, flags: Any) -> str | None:
        """What a checked apply's flags say it made non-finite, or ``None``."""
        flags = np.asarray(flags)
        if flags.all():
            return None
        bad = int(np.argmin(flags))
        if bad < len(self._leaf_paths):
            return f"parameter {self._leaf_paths[bad] or 'leaf'}"
        return "the optimizer state"

    def device_scalar(self, value: float, dtype: type) -> jax.Array:
        """``value`` as a 0-d device array, made once per distinct value.

        A host scalar given to a compiled step is copied to the device on every
        call, which for a small model costs as much as the step itself; the
        scale and staleness of an apply take few distinct values.
        """
        key = (value, dtype)
        scalar = self._scalars.get(key)
        if scalar is None:
            if len(self._scalars) >= 256:
                self._scalars.clear()
            scalar = self._scalars[key] = jnp.asarray(dtype(value))
        return scalar

    # Checkpoints.

    def check_restore(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``params`` and ``opt_state`` to restore as device trees (``None``
        where not given), checked against the current ones.

        Raises:
          ValueError: they differ in structure, shape or dtype.
        """
        # A leaf of the current parameters: where the restored trees go.
        home = jax.tree.leaves(self._params)[0]
        new_params = None
        if params is not None:
            leaves, treedef = jax.tree.flatten(params)
            if treedef != self._treedef or tuple(
                (np.shape(x), np.dtype(getattr(x, "dtype", np.asarray(x).dtype)))
                for x in leaves
            ) != tuple(zip(self._shapes, self._dtypes, strict=True)):
                raise ValueError(
                    "params to restore differ in structure, shape or dtype from the "
                    "core's parameters."
                )
            new_params = _placed_like(
                jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves]), home
            )
        new_opt_state = None
        if opt_state is not None:
            if jax.tree.structure(opt_state) != jax.tree.structure(self._opt_state):
                raise ValueError(
                    "opt_state to restore differs in structure from the optimizer's."
                )
            new_opt_state = _placed_like(jax.tree.map(jnp.asarray, opt_state), home)
        return new_params, new_opt_state

    def restore(self, params: Any, opt_state: Any) -> None:
        """Empties the buffer and the stale copies; takes ``params`` and
        ``opt_state`` (from :meth:`check_restore`) where not ``None``."""
        self._copies = {}
        self.reset()
        if params is not None:
            self._params = params
        if opt_state is not None:
            self._opt_state = opt_state
