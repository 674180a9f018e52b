r"""The parameter server's decisions as a sans-I/O state machine.

:class:`ServerCore` holds the model (parameters, optimizer state, version) and the
bookkeeping of every worker, and decides, event by event, what is applied, who
waits, who is released and who is dropped. It does no I/O, starts no task and reads
no clock: the driver (the asyncio server, or the virtual-clock simulator) passes the
time ``now`` (float seconds, never decreasing) into every call, and carries out the
list of *actions* each call returns, in order.

Events (methods), each returning ``list[Action]``:

* ``join(worker_id, now)``: a worker (re)joins; it is answered like a pull.
* ``pull(worker_id, now)``: the worker asks for parameters to compute on.
* ``push(worker_id, update, *, version, now, ...)``: the worker sends an update
  computed on parameters of ``version``; ``push_message(worker_id, update, meta,
  now=now)`` is the same push already validated where it became an object (a
  :class:`~hpsjax.ps.PushMeta` from the wire, an update checked against the
  model).
* ``leave(worker_id, now)``: the worker says goodbye (or its connection died).
* ``tick(now)``: time passed; call it at ``next_deadline()``.
* ``set_stage(index, now)``: a staged policy moves to stage ``index``.

Actions (frozen dataclasses):

* :class:`SendParams`: send ``core.params`` (at ``core.version``) to the worker; the
  answer to its pull or join.
* :class:`~hpsjax.ps.PushAck`: answer the push (applied, buffered or dropped; its
  staleness; a ``local_steps`` hint for the next commit; a forced pull; the stage
  a staged policy moved to).
* :class:`Wait`: the worker's pull is blocked; answer nothing yet.
* :class:`Release`: a blocked pull may go on; a :class:`SendParams` follows it.
* :class:`ForcePull`: tell the worker to discard its local work and pull.
* :class:`Drop`: the worker was removed (missed deadline); close it, it may rejoin.
* :class:`Applied`: a new version exists (for logs and for subscribers that get
  fresh parameters pushed to them, PHub-style).

Sign convention. A worker pushes a *gradient-like* update :math:`u`: its gradient,
or, after local steps, its pseudo-gradient :math:`w_{\text{pulled}} -
w_{\text{local}}`. The server optimizer turns it into the applied delta, exactly as
optax does on one machine:

.. math::

   \Delta, s \leftarrow \operatorname{opt.update}(\bar u, s, w;\ \tau, w_{v}),
   \qquad w \leftarrow w + \Delta,

so with ``optax.sgd(1.0)`` a pushed pseudo-gradient moves the server by exactly the
worker's local delta. :math:`\bar u` is the (weighted, damped) average of the
buffered updates, :math:`\tau` (keyword extra argument ``staleness``) the largest
staleness among them, and :math:`w_v` (keyword extra argument ``stale_params``,
only with ``keep_stale_params=True``) the parameters of the oldest version they
were computed on, as delay-compensated updates (DC-ASGD) need.

Driving the core (the asyncio server does this with sockets, the simulator with a
virtual clock)::

    core = ServerCore(params, optax.sgd(0.1), "ssp",
                      policy_kwargs={"staleness_bound": 2})

    def carry_out(actions):
        for action in actions:
            if isinstance(action, SendParams):
                send(action.worker_id, core.params, action.version)
            elif isinstance(action, PushAck):
                reply(action.worker_id, action)
            elif isinstance(action, (ForcePull, Drop)):
                notify(action.worker_id, action)
            # Wait, Release and Applied need nothing more (log them).

    carry_out(core.join("w0", now=clock()))
    while serving:
        event = receive(timeout=deadline_in(core.next_deadline()))
        now = clock()
        if event is None:
            carry_out(core.tick(now))
        elif event.kind == "pull":
            carry_out(core.pull(event.worker, now))
        elif event.kind == "push":
            try:
                carry_out(core.push(event.worker, event.update,
                                    version=event.version, now=now))
            except HpsError as err:   # nothing changed; report it to that worker
                reply_error(event.worker, err)
        elif event.kind == "closed":
            carry_out(core.leave(event.worker, now))

Workers block only in a pull (or join): a push is always answered at once, and a
policy that makes a worker wait does so by holding its next pull. A worker that
pushes again without pulling (local steps, or pulls decoupled from pushes) is
never held, but its clock advances and it is judged by its staleness.

``SendParams`` carries the version only: the driver sends ``core.params`` as they
are when it carries the action out, which is the version named, because actions
are carried out before the next event is fed in.

Errors: a call that raises changes nothing. Bad arguments raise ``ValueError``;
requests the protocol does not allow raise classes of :mod:`hpsjax.ps._errors`:
``UnexpectedMessage`` (a worker that never joined), ``WorkerDropped`` (a worker
that left or was dropped and must rejoin), ``InvalidUpdate`` (a version from the
future, or one whose stale copy was dropped), ``SpecMismatch`` (tree structure,
shape or dtype differs from the parameters) and ``NonFiniteUpdate``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax._ewma import ewma
from hpsjax.ps._errors import (
    InvalidUpdate,
    NonFiniteUpdate,
    SpecMismatch,
    UnexpectedMessage,
    WorkerDropped,
)
from hpsjax.ps._messages import PushAck, PushMeta
from hpsjax.ps._policies import ASP, BSP, Hybrid, Policy, Verdict, get_policy
from hpsjax.ps._separable import (
    LeafApply,
    LeafSteps,
    all_finite,
    finite,
    leaf_steps,
)

__all__ = [
    "Action",
    "Applied",
    "Drop",
    "ForcePull",
    "PushAck",
    "Release",
    "SendParams",
    "ServerCore",
    "Wait",
    "WorkerInfo",
]

WorkerId = Hashable
"""A worker's name: a ``str`` or an ``int`` (msgpack-able)."""

# Equal to no admission key: blocked workers must be examined again.
_UNKNOWN_KEY = object()


@dataclasses.dataclass(frozen=True, slots=True)
class SendParams:
    """Send the current parameters to a worker (answer to its pull or join).

    Attributes:
      worker_id: the worker.
      version: the version of ``core.params`` to send (the current one).
      local_steps: the policy's hint for how many local steps the worker takes
        before its next push, or ``None`` for no hint.
    """

    worker_id: WorkerId
    version: int
    local_steps: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """The worker's pull is blocked: send nothing until its :class:`Release`.

    Attributes:
      worker_id: the worker.
      until: the earliest deadline now pending (``core.next_deadline()``): when
        a worker that has not made progress by then is dropped and the wait is
        examined again; it moves later as workers make progress. ``None`` when no
        deadline applies.
      reason: what it waits for.
    """

    worker_id: WorkerId
    until: float | None
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    """A blocked pull may proceed; the :class:`SendParams` to carry out follows.

    Attributes:
      worker_id: the worker.
      version: the version it is released at.
      waited: seconds it waited.
    """

    worker_id: WorkerId
    version: int
    waited: float


@dataclasses.dataclass(frozen=True, slots=True)
class ForcePull:
    """Tell the worker to discard its local work and pull fresh parameters.

    Attributes:
      worker_id: the worker.
      reason: why (for example its update was too stale).
    """

    worker_id: WorkerId
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Drop:
    """The worker was removed from the live set; it may join again later.

    Attributes:
      worker_id: the worker.
      reason: why (for example a missed deadline).
    """

    worker_id: WorkerId
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Applied:
    """A new parameter version was made from buffered updates.

    Attributes:
      version: the new version.
      contributors: the workers whose updates it includes, in push order (a
        worker that pushed twice appears twice).
      staleness: the staleness passed to the optimizer (largest of the updates).
      num_updates: how many updates were averaged.
    """

    version: int
    contributors: tuple[WorkerId, ...]
    staleness: int
    num_updates: int


Action = SendParams | PushAck | Wait | Release | ForcePull | Drop | Applied
"""Any action returned by a :class:`ServerCore` event."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A read-only snapshot of one worker's bookkeeping.

    Attributes:
      worker_id: the worker.
      live: whether it is in the live set.
      waiting: whether its pull is blocked.
      clock: its iteration count (pushes since it joined, starting from the clock
        it joined at).
      pulled_version: the version last sent to it.
      pushed_version: the version its last push was computed on, or ``None``.
      pushes: pushes since it first joined (all joins).
      applied: its updates that went into a version.
      dropped_updates: its updates that were discarded.
      interval: EWMA of the time (s) from getting parameters (or its previous
        push) to its push, as measured by the server, or ``None``.
      step_time: EWMA of the compute time per push (s) it reported, else of
        ``interval``, or ``None``.
      time_per_step: EWMA of ``step_time / local_steps`` (s), or ``None``.
      overhead: EWMA of ``interval - step_time`` (communication, s), or ``None``.
      deadline: the time by which it must make progress, or ``None``.
      last_loss: the last loss it reported, or ``None``.
      joins: how many times it joined.
      dropped_reason: why it was last dropped, or ``None``.
    """

    worker_id: WorkerId
    live: bool
    waiting: bool
    clock: int
    pulled_version: int
    pushed_version: int | None
    pushes: int
    applied: int
    dropped_updates: int
    interval: float | None
    step_time: float | None
    time_per_step: float | None
    overhead: float | None
    deadline: float | None
    last_loss: float | None
    joins: int
    dropped_reason: str | None


class _Worker:
    """Mutable bookkeeping of one worker (the public view is :class:`WorkerInfo`)."""

    __slots__ = (
        "applied",
        "clock",
        "deadline",
        "dropped_reason",
        "dropped_updates",
        "interval",
        "joins",
        "last_loss",
        "last_start",
        "live",
        "overhead",
        "progress_at",
        "pulled_version",
        "pushed_version",
        "pushes",
        "refs",
        "rounds",
        "step_time",
        "time_per_step",
        "timeout",
        "worker_id",
    )

    def __init__(self, worker_id: WorkerId):
        self.worker_id = worker_id
        self.live = False
        self.clock = 0
        self.pulled_version = 0
        self.pushed_version: int | None = None
        self.pushes = 0
        self.applied = 0
        self.dropped_updates = 0
        self.interval: float | None = None
        self.step_time: float | None = None
        self.time_per_step: float | None = None
        self.overhead: float | None = None
        self.last_start = 0.0
        self.deadline: float | None = None
        # When the deadline was set (its last progress) and the timeout it got.
        self.progress_at = 0.0
        self.timeout = 0.0
        # Pushes since it last joined: until one is measured, its timeout is
        # the initial one (its first round may compile).
        self.rounds = 0
        self.last_loss: float | None = None
        self.joins = 0
        self.dropped_reason: str | None = None
        # Versions sent to this worker that it may still push against (sorted).
        self.refs: list[int] = []


# Fields of a worker record that a checkpoint keeps; times are the driver's clock
# and do not survive a restart, so they are left out.
_SAVED_FIELDS = (
    "clock",
    "pulled_version",
    "pushed_version",
    "pushes",
    "applied",
    "dropped_updates",
    "interval",
    "step_time",
    "time_per_step",
    "overhead",
    "last_loss",
    "joins",
    "dropped_reason",
)
_STATE_FORMAT = 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not (
        isinstance(value, bool)
    )


def _check_worker_id(worker_id: Any) -> None:
    if isinstance(worker_id, bool) or not isinstance(worker_id, str | int):
        raise ValueError(
            f"A worker id must be a str or an int, got {type(worker_id).__name__}."
        )


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


def _wide(dtype: Any) -> Any:
    """The dtype weights are applied in: ``dtype``, at least float32."""
    return jnp.result_type(dtype, jnp.float32)


@functools.lru_cache(maxsize=32)
def _make_steps(optimizer: optax.GradientTransformation):
    """Jitted apply, accumulate and check steps for one optimizer.

    Each is traced once per tree structure and dtypes, so no event recompiles;
    cached per optimizer object, so that cores built again on the same optimizer
    (every run of the simulator) reuse the compiled steps.
    """
    opt = optax.with_extra_args_support(optimizer)

    def apply(params, opt_state, update, staleness, stale_params):
        extra = {"staleness": staleness}
        if stale_params is not None:
            extra["stale_params"] = stale_params
        deltas, opt_state = opt.update(update, opt_state, params, **extra)
        return optax.apply_updates(params, deltas), opt_state

    def checked_apply(params, opt_state, update, staleness, stale_params):
        """``apply``, and per parameter leaf (then the optimizer state) whether
        the result is finite."""
        params, opt_state = apply(params, opt_state, update, staleness, stale_params)
        flags = [finite(x) for x in jax.tree.leaves(params)]
        flags.append(all_finite(jax.tree.leaves(opt_state)))
        return params, opt_state, jnp.stack(flags)

    def scale(update, weight):
        # In float32 at least, so a weight never overflows a narrow dtype.
        return jax.tree.map(
            lambda u: (u.astype(_wide(u.dtype)) * weight).astype(u.dtype), update
        )

    def accumulate(total, update, keep, weight):
        """The running weighted mean ``keep * total + weight * update``."""

        def mix(t, u):
            wide = _wide(t.dtype)
            return (t.astype(wide) * keep + u.astype(wide) * weight).astype(t.dtype)

        return jax.tree.map(mix, total, update)

    def apply_chain(
        params, opt_state, updates, keeps, weights, first, close, staleness
    ):
        """Deferred pushes, in order: buffer each; apply where a buffer closes.

        Row ``j`` of ``updates`` is buffered with ``keeps[j]`` and
        ``weights[j]`` (a new buffer where ``first[j]``), and where ``close[j]``
        the buffer is applied with ``staleness[j]``: the operations of
        ``scale``, ``accumulate`` and ``apply`` in the same order, selected
        rather than branched. Returns the parameters after every row (a
        version where ``close``).
        """

        def step(carry, row):
            params, opt_state, total = carry
            u, k, w, is_first, is_close, tau = row
            # The barriers keep XLA from fusing across the boundaries of the
            # separate steps, which would round differently.
            u, k, w, tau = jax.lax.optimization_barrier((u, k, w, tau))
            total = jax.tree.map(
                lambda a, b: jnp.where(is_first, a, b),
                scale(u, w),
                accumulate(total, u, k, w),
            )
            total = jax.lax.optimization_barrier(total)
            new_params, new_state = apply(params, opt_state, total, tau, None)
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
            (updates, keeps, weights, first, close, staleness),
        )
        return params, opt_state, history

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
        jax.jit(apply_chain),
        jax.jit(checked_scale),
        jax.jit(checked_accumulate),
    )


class _Steps(NamedTuple):
    """The compiled steps of one optimizer (see :func:`_make_steps`)."""

    apply: Any
    checked_apply: Any
    scale: Any
    accumulate: Any
    all_finite: Any
    apply_chain: Any
    checked_scale: Any
    checked_accumulate: Any


class ServerCore:
    r"""The parameter server's state machine: model, versions, workers, policy.

    Args:
      params: the initial parameters, a pytree of arrays (version 0).
      optimizer: any optax ``GradientTransformation`` (extra args supported); it
        is called as ``optimizer.update(u, opt_state, params, staleness=tau)``
        (plus ``stale_params=w_v`` with ``keep_stale_params``), jitted once.
      policy: a policy name (see :func:`hpsjax.ps.get_policy`), a policy class,
        or a :class:`~hpsjax.ps.Policy` object (one core per policy object).
      policy_kwargs: keyword arguments for the policy given by name or class.
      expected_workers: hold every pull until this many workers are live, or
        until ``start_timeout`` after the first join; ``None`` starts at once.
        A core restored by :meth:`load_state_dict` holds again.
      start_timeout: seconds after the first join after which a start held for
        ``expected_workers`` begins with whoever joined.
      deadline_factor: :math:`k` in the deadline rule below, > 0.
      min_timeout: :math:`T_{\min}` (s), > 0.
      max_timeout: :math:`T_{\max}` (s), or ``None``.
      initial_timeout: timeout (s) of a worker that has not pushed since it
        (re)joined (its first step may include compilation).
      ewma_alpha: weight of a new sample in every moving average, in (0, 1].
      straggler_factor: a live worker whose ``interval`` exceeds this many times
        the median of the live workers' is listed in :attr:`stragglers`.
      keep_stale_params: keep the parameters of every version a live worker may
        still push against, and pass them to the optimizer as ``stale_params``.
        A worker may push against any version sent to it since its last push;
        versions no live worker can push against are freed.
      max_stale_copies: bound on the number of kept copies (oldest evicted first;
        a push on an evicted version is dropped and its worker force-pulled), or
        ``None`` for no bound beyond the live references.
      check_finite: reject updates holding NaN or infinity.
      check_result: reject a push whose update, applied, would make the
        parameters or the optimizer state non-finite (``NonFiniteUpdate``,
        nothing changes). A push that completes a version (or one whose
        policy cannot tell before it is recorded) has the buffer with it
        applied on trial, the result the apply commits; a push that leaves
        the buffer open has only the buffer checked, so a round of many pushes
        costs one optimizer step. A round whose finite buffer would apply to
        non-finite values thus refuses the push that completes it; a version
        made with no push to refuse (a deadline, a leave) whose result would
        be non-finite keeps the parameters as they were. Not with
        ``defer_applies`` (deferred applies are not checked).
      defer_applies: keep the updates of new versions and carry them out, all
        in one compiled call, when the parameters are next read
        (:attr:`params`, :attr:`opt_state`, :meth:`apply_deferred`). Every
        decision (versions, staleness, acks, waits) is the same; the values are
        those of applying each version at once, the same operations in the
        same order, up to the last bit of rounding where XLA compiles the
        fused loop differently. A driver that reads the parameters less often
        than it pushes saves a call per version, and may push a
        :class:`LazyUpdate` (an update it has not evaluated yet). Not with
        ``keep_stale_params``.
      push_weights: a factor :math:`p_j` per worker id on every push of that
        worker (a work plan's ``push_weight``: ASHL's reference adds
        :math:`p_j` times each delta), multiplied into the policy's weight;
        workers not named get 1. ``None`` (the default) for none.

    Aggregation. Updates accepted by the policy are buffered with a weight
    :math:`n_j d_j`, :math:`n_j` the ``num_samples`` of the push (1 when not
    given) and :math:`d_j` the policy's damping factor (times the worker's
    ``push_weights`` entry where one is given); when the policy says
    :meth:`~hpsjax.ps.Policy.ready`, their weighted average

    .. math::

       \bar u = \frac{\sum_j n_j d_j u_j}{\sum_j n_j}

    (kept as a running mean with the normalised weights :math:`n_j / \sum n`,
    computed in float32 at least, so no count of samples overflows a leaf's
    dtype) is given to the optimizer with the largest staleness of the
    buffered updates (and the parameters of the oldest version they were
    computed on), and the version increases by one. A damped update thus
    moves the average less.
    This average is the one place where batches are weighted: a BSP round of
    unequal batches is one step on the mean gradient of all their samples, and
    a work plan's ``lr_scale`` (:func:`hpsjax.profiling.plan`) is the same for
    every worker, so no split of the batch changes the step.

    Deadlines. While any pull is blocked, every live worker that is not blocked
    itself must make progress (a push, or getting parameters) within

    .. math::

       T = \operatorname{clip}\big(k \cdot \max_{j\ \text{live}} \bar t_j,\
           T_{\min},\ T_{\max}\big)

    of its last progress, :math:`\bar t_j` the EWMA of worker :math:`j`'s
    measured ``interval`` (``initial_timeout`` for a worker that has not
    pushed since it joined: its first round may compile, and a worker joining
    a running or restarted server is judged by its own rounds). A worker that
    misses its deadline is dropped (:class:`Drop`), the barriers proceed
    without it, and it may join again. Deadlines thus follow the
    measured step times of the slowest live worker.

    Attributes:
      overlapped_applies: how many pushes were applied with the result of an
        :meth:`overlapped_apply` (leaf by leaf as they arrived).

    Raises:
      ValueError: for bad arguments or an unknown policy name.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.ps._core import ServerCore
      >>> core = ServerCore({"w": jnp.zeros(2)}, optax.sgd(0.5), "asp")
      >>> core.join("a", now=0.0)
      [SendParams(worker_id='a', version=0, local_steps=None)]
      >>> core.push("a", {"w": jnp.ones(2)}, version=0, now=1.0)[0].status
      'applied'
      >>> core.version, core.params["w"].tolist()
      (1, [-0.5, -0.5])
    """

    def __init__(
        self,
        params: Any,
        optimizer: optax.GradientTransformation,
        policy: Any = "asp",
        *,
        policy_kwargs: Mapping[str, Any] | None = None,
        expected_workers: int | None = None,
        start_timeout: float = 300.0,
        deadline_factor: float = 4.0,
        min_timeout: float = 1.0,
        max_timeout: float | None = None,
        initial_timeout: float = 120.0,
        ewma_alpha: float = 0.25,
        straggler_factor: float = 2.0,
        keep_stale_params: bool = False,
        max_stale_copies: int | None = None,
        check_finite: bool = True,
        check_result: bool = True,
        defer_applies: bool = False,
        push_weights: Mapping[Any, float] | None = None,
    ):
        self._check_args(
            optimizer,
            policy_kwargs=policy_kwargs,
            expected_workers=expected_workers,
            start_timeout=start_timeout,
            deadline_factor=deadline_factor,
            min_timeout=min_timeout,
            max_timeout=max_timeout,
            initial_timeout=initial_timeout,
            ewma_alpha=ewma_alpha,
            max_stale_copies=max_stale_copies,
            push_weights=push_weights,
            straggler_factor=straggler_factor,
            defer_applies=defer_applies,
            keep_stale_params=keep_stale_params,
        )
        self._push_weights = None if push_weights is None else dict(push_weights)
        self._policy = get_policy(policy, **dict(policy_kwargs or {}))
        self._init_model(params, optimizer)
        self._version = 0
        self._scalars: dict[tuple[float, type], jax.Array] = {}
        self._expected_workers = expected_workers
        self._start_timeout = float(start_timeout)
        self._deadline_factor = float(deadline_factor)
        self._min_timeout = float(min_timeout)
        self._max_timeout = None if max_timeout is None else float(max_timeout)
        self._initial_timeout = float(initial_timeout)
        self._alpha = float(ewma_alpha)
        self._straggler_factor = float(straggler_factor)
        self._keep_stale = bool(keep_stale_params)
        self._max_stale_copies = max_stale_copies
        self._check_finite = bool(check_finite)
        self._check_result = bool(check_result) and not defer_applies
        self._leaf_paths = tuple(
            jax.tree_util.keystr(path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
        )
        self._defer = bool(defer_applies)
        # Deferred applies (defer_applies): per version, the buffered
        # (update, keep, weight) rows and the staleness it was made with;
        # self._params is the version before the first of them.
        self._deferred: list[tuple[list, int]] = []
        self._init_workers()

    @staticmethod
    def _check_args(
        optimizer: Any,
        *,
        policy_kwargs: Any,
        expected_workers: Any,
        start_timeout: Any,
        deadline_factor: Any,
        min_timeout: Any,
        max_timeout: Any,
        initial_timeout: Any,
        ewma_alpha: Any,
        max_stale_copies: Any,
        push_weights: Any,
        straggler_factor: Any,
        defer_applies: bool,
        keep_stale_params: bool,
    ) -> None:
        """Raises ``ValueError`` for a bad constructor argument."""
        if not isinstance(optimizer, optax.GradientTransformation):
            raise ValueError(
                "optimizer must be an optax GradientTransformation, got "
                f"{type(optimizer).__name__}."
            )
        if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
            raise ValueError("policy_kwargs must be a mapping or None.")
        if expected_workers is not None and (
            not _is_int(expected_workers) or expected_workers < 1
        ):
            raise ValueError(
                f"expected_workers must be an int >= 1 or None, got "
                f"{expected_workers!r}."
            )
        for name, value in (
            ("start_timeout", start_timeout),
            ("deadline_factor", deadline_factor),
            ("min_timeout", min_timeout),
            ("initial_timeout", initial_timeout),
            ("straggler_factor", straggler_factor),
        ):
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
        if max_timeout is not None and (
            not _is_number(max_timeout)
            or not math.isfinite(max_timeout)
            or max_timeout < min_timeout
        ):
            raise ValueError(
                f"max_timeout must be None or a number >= min_timeout "
                f"({min_timeout}), got {max_timeout!r}."
            )
        if not _is_number(ewma_alpha) or not 0 < ewma_alpha <= 1:
            raise ValueError(f"ewma_alpha must lie in (0, 1], got {ewma_alpha!r}.")
        if max_stale_copies is not None and (
            not _is_int(max_stale_copies) or max_stale_copies < 1
        ):
            raise ValueError(
                f"max_stale_copies must be an int >= 1 or None, got "
                f"{max_stale_copies!r}."
            )
        if push_weights is not None and (
            not isinstance(push_weights, Mapping)
            or not all(
                _is_number(v) and math.isfinite(v) and v >= 0
                for v in push_weights.values()
            )
        ):
            raise ValueError(
                f"push_weights must map worker ids to finite numbers >= 0, got "
                f"{push_weights!r}."
            )
        if defer_applies and keep_stale_params:
            raise ValueError(
                "defer_applies cannot be combined with keep_stale_params: stale "
                "copies are the parameters of every version as it is made."
            )

    def _init_model(self, params: Any, optimizer: optax.GradientTransformation) -> None:
        """The parameters (version 0), their spec, optimizer state and steps."""
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
        self._opt_state = optimizer.init(self._params)
        steps = _make_steps(optimizer)
        self._apply_fn = steps.apply
        self._checked_apply_fn = steps.checked_apply
        self._scale_fn = steps.scale
        self._accumulate_fn = steps.accumulate
        self._finite_fn = steps.all_finite
        self._chain_fn = steps.apply_chain
        self._checked_scale_fn = steps.checked_scale
        self._checked_accumulate_fn = steps.checked_accumulate
        self._optimizer = optimizer
        self._leaf_steps: LeafSteps | bool | None = False
        # Pushes whose apply was taken from an overlapped_apply.
        self.overlapped_applies = 0

    def _init_workers(self) -> None:
        """No workers, no waits, no deadlines, no stale copies, an empty buffer."""
        self._now = -math.inf
        self._epoch = 0
        self._workers: dict[WorkerId, _Worker] = {}
        self._live: set[WorkerId] = set()
        self._live_view: frozenset = frozenset()
        self._waiting: dict[WorkerId, float] = {}
        # The policy's admission key at which every blocked worker was last
        # refused; while it holds, re-examining them cannot release anyone.
        self._admit_key: Any = _UNKNOWN_KEY
        self._max_clock = 0
        # How many live workers are at each clock.
        self._clock_counts: dict[int, int] = {}
        self._min_clock_cache: int | None = None
        self._min_clock_valid = False
        self._max_interval_cache: float | None = None
        self._max_interval_valid = False
        self._heap: list[tuple[float, int, WorkerId]] = []
        self._heap_seq = 0
        self._started = self._expected_workers is None
        self._start_deadline: float | None = None
        self._copies: dict[int, Any] = {}
        self._refcount: dict[int, int] = {}
        self._reset_buffer()

    # Read-only state.

    @property
    def params(self) -> Any:
        """The current parameters (pytree of jax arrays) at :attr:`version`."""
        if self._deferred:
            self.apply_deferred()
        return self._params

    @property
    def opt_state(self) -> Any:
        """The optimizer state."""
        if self._deferred:
            self.apply_deferred()
        return self._opt_state

    @property
    def version(self) -> int:
        """Number of versions applied since version 0."""
        return self._version

    @property
    def policy(self) -> Any:
        """The policy object."""
        return self._policy

    @property
    def live(self) -> frozenset:
        """Ids of the live workers."""
        return self._live_view

    @property
    def waiting(self) -> tuple:
        """Ids of the workers whose pull is blocked, in the order they blocked."""
        return tuple(self._waiting)

    @property
    def started(self) -> bool:
        """Whether the start (held for ``expected_workers``) is over."""
        return self._started

    @property
    def deferred_applies(self) -> int:
        """Number of versions made but not yet carried out (``defer_applies``)."""
        return len(self._deferred)

    @property
    def buffered(self) -> int:
        """Number of updates buffered and not yet applied."""
        return len(self._buffer_contributors)

    @property
    def buffer_contributors(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        if self._buffer_contributor_view is None:
            self._buffer_contributor_view = frozenset(self._buffer_contributors)
        return self._buffer_contributor_view

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        if not self._min_clock_valid:
            self._min_clock_cache = min(self._clock_counts, default=None)
            self._min_clock_valid = True
        return self._min_clock_cache

    @property
    def stragglers(self) -> tuple:
        """Live workers whose ``interval`` exceeds ``straggler_factor`` x median."""
        timed = [
            (w, self._workers[w].interval)
            for w in self._live
            if self._workers[w].interval is not None
        ]
        if len(timed) < 2:
            return ()
        median = float(np.median([t for _, t in timed]))
        return tuple(
            sorted(
                (w for w, t in timed if t > self._straggler_factor * median), key=str
            )
        )

    @property
    def stale_versions(self) -> tuple[int, ...]:
        """Versions whose parameters are kept for ``stale_params``."""
        return tuple(sorted(self._copies))

    @property
    def leaf_steps(self) -> LeafSteps | None:
        """The optimizer's per-leaf step, or ``None`` where it is not separable.

        Decided on first use by running the whole-tree and the per-leaf steps
        on random inputs (see :mod:`hpsjax.ps._separable`); a tree of one leaf
        has no per-leaf step. Applies still run on the whole tree: this is the
        step an apply overlapped with receipt can run leaf by leaf.
        """
        if self._leaf_steps is False:
            steps = leaf_steps(
                self._optimizer, self._treedef, self._shapes, self._dtypes
            )
            self._leaf_steps = steps if steps.separable else None
        return self._leaf_steps

    @property
    def can_overlap_apply(self) -> bool:
        """Whether this core's setup lets :meth:`overlapped_apply` ever start
        one: applies checked (``check_result``), not deferred, no stale copies
        (``keep_stale_params``). Whether the optimizer is separable is
        :attr:`leaf_steps`'s question."""
        return self._check_result and not self._defer and not self._keep_stale

    def overlapped_apply(
        self, worker_id: WorkerId, version: Any, num_samples: Any = None
    ) -> LeafApply | None:
        """An apply of ``worker_id``'s coming push to feed leaf by leaf.

        PHub's aggregation and optimizer step fused per chunk: where the push,
        on ``version`` with ``num_samples``, completes the buffer so that the
        policy applies at once (BSP's last push of a round, ASP's push;
        readiness that depends only on the buffer and the live workers), with
        ``check_result``, and the optimizer is leaf-separable
        (:attr:`leaf_steps`), the driver feeds the returned
        :class:`LeafApply` each leaf as it arrives and passes it to
        :meth:`push_message`, which takes its buffered mean and apply instead
        of working them out on the whole tree after the last byte. ``None``
        where that does not hold or cannot be known yet. Changes nothing:
        every decision is still :meth:`push_message`'s, and a result that no
        longer matches (another push came first, the policy weighted this one
        otherwise than by its samples) is ignored.
        """
        if (
            not self.can_overlap_apply
            or type(version) is not int
            or not 0 <= version <= self._version
            or worker_id not in self._live
            or self._push_completes(worker_id) is not True
        ):
            return None
        steps = self.leaf_steps
        if steps is None:
            return None
        samples = num_samples if type(num_samples) is int and num_samples > 0 else 1
        weight = 1.0
        if self._push_weights is not None:
            weight = float(self._push_weights.get(worker_id, 1.0))
        keep, w = self._mean_weights(weight, samples)
        tau = max(self._buffer_staleness, self._version - version)
        return LeafApply(
            steps,
            self._params,
            self._opt_state,
            self._buffer,
            keep,
            w,
            self._device_scalar(tau, np.int32),
            tau,
        )

    def _mean_weights(self, weight: float, samples: int) -> tuple[Any, Any]:
        """The buffer's and a push's weights in the buffered mean with it."""
        total = self._buffer_samples + samples
        # Each in [0, weight]: a count of samples never multiplies a value.
        keep = np.float32(self._buffer_samples / total)
        return keep, np.float32(weight * (samples / total))

    @property
    def epoch(self) -> int:
        """Counts the events handled; policies may key caches on it."""
        return self._epoch

    def _record(self, worker_id: WorkerId) -> _Worker:
        try:
            return self._workers[worker_id]
        except (KeyError, TypeError):
            raise UnexpectedMessage(
                f"worker {worker_id!r} has not joined; join first"
            ) from None

    def _live_record(self, worker_id: WorkerId) -> _Worker:
        rec = self._record(worker_id)
        if not rec.live:
            how = rec.dropped_reason or "left"
            raise WorkerDropped(f"worker {worker_id!r} is not live ({how}); join again")
        return rec

    def check_live(self, worker_id: WorkerId) -> None:
        """Refuses a worker whose pulls and pushes the core would refuse.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped (saying why).
        """
        self._live_record(worker_id)

    def clock(self, worker_id: WorkerId) -> int:
        """A worker's clock (iterations done); raises for an unknown worker."""
        return self._record(worker_id).clock

    def pulled_version(self, worker_id: WorkerId) -> int:
        """The version last sent to a worker; raises for an unknown worker."""
        return self._record(worker_id).pulled_version

    def is_waiting(self, worker_id: WorkerId) -> bool:
        """Whether a worker's pull is blocked."""
        return worker_id in self._waiting

    def worker(self, worker_id: WorkerId) -> WorkerInfo:
        """A snapshot of a (live or past) worker's bookkeeping.

        Raises:
          UnexpectedMessage: for a worker that never joined.
        """
        rec = self._record(worker_id)
        return WorkerInfo(
            worker_id=rec.worker_id,
            live=rec.live,
            waiting=rec.worker_id in self._waiting,
            clock=rec.clock,
            pulled_version=rec.pulled_version,
            pushed_version=rec.pushed_version,
            pushes=rec.pushes,
            applied=rec.applied,
            dropped_updates=rec.dropped_updates,
            interval=rec.interval,
            step_time=rec.step_time,
            time_per_step=rec.time_per_step,
            overhead=rec.overhead,
            deadline=rec.deadline if rec.live else None,
            last_loss=rec.last_loss,
            joins=rec.joins,
            dropped_reason=rec.dropped_reason,
        )

    def workers(self) -> dict:
        """Snapshots of every worker ever seen, by id."""
        return {w: self.worker(w) for w in self._workers}

    def stale_params(self, version: int) -> Any:
        """The parameters of ``version`` (kept copy, or the current ones).

        Raises:
          KeyError: if that version is not kept.
        """
        if version == self._version:
            return self.params
        return self._copies[version]

    # Events.

    def _check_now(self, now: Any) -> float:
        if not _is_number(now) or not math.isfinite(now):
            raise ValueError(f"now must be a finite number of seconds, got {now!r}.")
        now = float(now)
        if now < self._now:
            raise ValueError(
                f"Time went backwards: now={now} after an event at {self._now}."
            )
        return now

    def _begin(self, now: float) -> None:
        self._now = now
        self._epoch += 1

    def join(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker joins, or joins again; it is answered like a pull.

        A worker joins at the smallest clock among the live workers, so it never
        holds the others back more than the slowest already does; a worker that
        joins while live starts afresh (its blocked pull, if any, is cancelled;
        its buffered update stays).

        Args:
          worker_id: a ``str`` or ``int``.
          now: the time (s).

        Returns:
          ``[SendParams]`` or ``[Wait]`` for the worker, then any releases.

        Raises:
          ValueError: for a bad id or time.
        """
        now = self._check_now(now)
        _check_worker_id(worker_id)
        self._begin(now)
        rec = self._workers.get(worker_id)
        if rec is None:
            rec = self._workers[worker_id] = _Worker(worker_id)
        elif rec.live:
            self._remove(rec, reason=None)
        others = self.min_clock
        rec.clock = self._max_clock if others is None else others
        rec.live = True
        rec.joins += 1
        rec.dropped_reason = None
        rec.pushed_version = None
        rec.last_start = now
        rec.deadline = None
        rec.rounds = 0
        self._live.add(worker_id)
        self._clock_counts[rec.clock] = self._clock_counts.get(rec.clock, 0) + 1
        self._live_changed()
        if not self._started:
            if self._start_deadline is None:
                self._start_deadline = now + self._start_timeout
            if len(self._live) >= self._expected_workers:
                self._started = True
        actions: list[Action] = []
        self._pull(rec, now, actions)
        self._settle(now, actions)
        return actions

    def leave(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker leaves (or its connection closed).

        Its buffered update stays; barriers proceed without it. Leaving a
        worker that is no longer live does nothing.

        Args:
          worker_id: a worker that joined.
          now: the time (s).

        Returns:
          Releases (and an apply) the departure allows.

        Raises:
          UnexpectedMessage: for a worker that never joined.
        """
        now = self._check_now(now)
        rec = self._record(worker_id)
        if not rec.live:
            return []
        self._begin(now)
        self._remove(rec, reason=None)
        actions: list[Action] = []
        self._settle(now, actions)
        return actions

    def pull(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker asks for parameters.

        Args:
          worker_id: a live worker.
          now: the time (s).

        Returns:
          ``[SendParams]`` if the policy admits it now, else ``[Wait]`` (and a
          later event returns ``Release`` and ``SendParams`` for it); then any
          releases of others the pull allows (a worker that refreshes its
          parameters may unblock workers waiting on its staleness). A pull from
          a worker already waiting is examined again like a new one.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped.
        """
        now = self._check_now(now)
        rec = self._live_record(worker_id)
        self._begin(now)
        actions: list[Action] = []
        self._pull(rec, now, actions)
        self._release(now, actions)
        return actions

    def push(
        self,
        worker_id: WorkerId,
        update: Any,
        *,
        version: int,
        now: float,
        step_time: float | None = None,
        num_samples: int | None = None,
        local_steps: int | None = None,
        loss: float | None = None,
        stage: int | None = None,
    ) -> list[Action]:
        r"""A worker pushes an update computed on parameters of ``version``.

        The update is gradient-like (see the module docstring). Its staleness is
        :math:`\tau = V - v`; the policy weighs it, it is buffered, and the buffer
        is applied when the policy says so.

        Args:
          worker_id: a live worker.
          update: a pytree with the structure and shapes of the parameters.
          version: the version :math:`v \le V` the update was computed on.
          now: the time (s).
          step_time: the compute time (s) the worker spent on this update, if it
            measured it.
          num_samples: samples behind the update (its weight in an average).
          local_steps: local steps behind the update (default 1).
          loss: the worker's training loss, for policies that search on it.
          stage: the stage of the worker's staged optimizer (ASHL); under the
            hybrid policy a stage beyond the server's moves the server to it.

        Returns:
          ``[PushAck, ForcePull?, Applied?, Release/SendParams...]``.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped.
          InvalidUpdate: for a version out of range or a bad measurement.
          SpecMismatch: tree structure, shape or dtype differs from the params.
          NonFiniteUpdate: NaN or infinity in the update (``check_finite``).
        """
        self._check_now(now)
        self._live_record(worker_id)
        fields = {
            "version": version,
            "step_time": step_time,
            "num_samples": num_samples,
            "local_steps": local_steps,
            "loss": loss,
            "stage": stage,
        }
        fields = {
            k: v.item() if isinstance(v, np.generic) else v for k, v in fields.items()
        }
        meta = PushMeta.from_wire(fields, error=InvalidUpdate)
        return self.push_message(worker_id, self.check_update(update), meta, now=now)

    def push_message(
        self,
        worker_id: WorkerId,
        update: Any,
        meta: PushMeta,
        *,
        now: float,
        prepared: LeafApply | None = None,
    ) -> list[Action]:
        """A push validated where it became an object; see :meth:`push`.

        Nothing the wire (or the driver) checked is checked again: ``meta`` comes
        from :meth:`PushMeta.from_wire` (or is built from known-good values), and
        ``update`` has the parameters' tree structure, shapes and dtypes and,
        with ``check_finite``, only finite values (:meth:`check_update` checks a
        tree that does not come from the wire). What depends on the server's
        state is checked here: the worker, ``meta.version`` against the server
        version and ``meta.stage`` against the policy's stages.

        ``prepared`` is the apply of ``update`` started as it arrived
        (:meth:`overlapped_apply`); it is used only where it is this push's
        apply, and ignored otherwise.

        Returns:
          ``[PushAck, ForcePull?, Applied?, Release/SendParams...]``.
        """
        now = self._check_now(now)
        rec = self._live_record(worker_id)
        version = meta.version
        if not 0 <= version <= self._version:
            raise InvalidUpdate(
                f"push version must be an int in [0, {self._version}] (the server "
                f"version), got {version!r}"
            )
        policy = self._policy
        stage_before = policy.stage if isinstance(policy, Hybrid) else None
        switch = meta.stage is not None and stage_before is not None
        switch = switch and meta.stage > stage_before
        if switch and meta.stage >= len(policy.stages):
            raise InvalidUpdate(
                f"push stage {meta.stage} is past the policy's last stage "
                f"{len(policy.stages) - 1}"
            )
        staleness = self._version - version
        verdict_weight, force_pull, reason, stale = self._judge(
            worker_id, version, staleness
        )
        pending = None
        if verdict_weight > 0:
            pending = self._buffer_candidate(
                update,
                verdict_weight,
                meta.num_samples or 1,
                staleness,
                version,
                stale,
                completes=self._push_completes(worker_id),
                prepared=prepared,
            )
        self._begin(now)
        self._record_push(rec, meta, now)

        if pending is not None:
            self._buffer_add(rec, pending)
            status = "buffered"
        else:
            rec.dropped_updates += 1
            status = "dropped"
        self._policy.on_push(self, worker_id, now)
        tail: list[Action] = []
        if self._buffer_contributors and self._policy.ready(self):
            self._apply(now, tail)
            if status == "buffered":
                status = "applied"
        self._release(now, tail)
        if switch:
            # The worker's staged optimizer moved on (ASHL: a flat loss): the
            # server follows, after the push was handled in the stage it was
            # computed in.
            policy.set_stage(self, meta.stage)
            self._admit_key = _UNKNOWN_KEY
            self._settle(now, tail)
        stage = policy.stage if stage_before is not None else None
        actions: list[Action] = [
            PushAck(
                worker_id=worker_id,
                version=self._version,
                staleness=staleness,
                status=status,
                weight=float(verdict_weight),
                local_steps=self._policy.local_steps(self, worker_id),
                reason=reason if reason or not force_pull else "pull fresh parameters",
                force_pull=force_pull,
                stage=None if stage == stage_before else stage,
            )
        ]
        if force_pull:
            actions.append(ForcePull(worker_id, reason or "pull fresh parameters"))
        actions.extend(tail)
        return actions

    def _judge(
        self, worker_id: WorkerId, version: int, staleness: int
    ) -> tuple[float, bool, str, Any]:
        """The policy's verdict on a push: ``(weight, force_pull, reason, stale)``.

        ``weight`` includes the worker's ``push_weights`` entry; ``stale`` is the
        kept copy of ``version`` (``keep_stale_params``), and a push on a
        version no copy is kept of gets weight 0 and a forced pull.
        """
        stale = None
        if self._keep_stale:
            stale = self._params if version == self._version else None
            stale = self._copies.get(version, stale)
        if self._keep_stale and stale is None:
            verdict_weight, force_pull = 0.0, True
            reason = f"no stale copy of version {version} is kept"
        else:
            verdict = self._policy.judge(self, worker_id, staleness)
            if not isinstance(verdict, Verdict):
                raise ValueError(
                    f"Policy {self._policy.name!r}.judge returned "
                    f"{type(verdict).__name__}, not a Verdict."
                )
            verdict_weight = verdict.weight
            force_pull, reason = bool(verdict.force_pull), verdict.reason
            if not _is_number(verdict_weight) or not (
                math.isfinite(verdict_weight) and verdict_weight >= 0
            ):
                raise ValueError(
                    f"Policy {self._policy.name!r} returned weight "
                    f"{verdict_weight!r}; weights are finite and >= 0."
                )
            if self._push_weights is not None:
                verdict_weight *= float(self._push_weights.get(worker_id, 1.0))
        return verdict_weight, force_pull, reason, stale

    def _record_push(self, rec: _Worker, meta: PushMeta, now: float) -> None:
        """A push's measurements and clock in its worker's record."""
        version, step_time = meta.version, meta.step_time
        local_steps, loss = meta.local_steps, meta.loss
        worker_id = rec.worker_id
        interval = now - rec.last_start
        old_interval = rec.interval
        rec.interval = ewma(old_interval, interval, self._alpha)
        if self._max_interval_valid:
            # The largest interval of the live workers, kept without a pass
            # over them unless the largest one shrank.
            largest = self._max_interval_cache
            if largest is None or rec.interval >= largest:
                self._max_interval_cache = rec.interval
            elif old_interval is not None and old_interval >= largest:
                self._max_interval_valid = False
        compute = interval if step_time is None else float(step_time)
        rec.step_time = ewma(rec.step_time, compute, self._alpha)
        rec.time_per_step = ewma(
            rec.time_per_step, compute / (local_steps or 1), self._alpha
        )
        if step_time is not None:
            rec.overhead = ewma(
                rec.overhead, max(0.0, interval - float(step_time)), self._alpha
            )
        if worker_id in self._waiting:
            # Its own clock, which admission reads, changes while it is blocked.
            self._admit_key = _UNKNOWN_KEY
        counts = self._clock_counts
        clock = rec.clock
        if counts[clock] == 1:
            del counts[clock]
            if clock == self._min_clock_cache:
                self._min_clock_valid = False
        else:
            counts[clock] -= 1
        rec.clock = clock = clock + 1
        counts[clock] = counts.get(clock, 0) + 1
        self._max_clock = max(self._max_clock, clock)
        rec.pushes += 1
        rec.rounds += 1
        rec.pushed_version = version
        rec.last_loss = None if loss is None else float(loss)
        rec.last_start = now
        refs = rec.refs
        while refs and refs[0] < version:
            self._unref(refs.pop(0))
        self._progress(rec, now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: ends a held start, drops workers past their deadline.

        Call it at :meth:`next_deadline` (calling it earlier or more often is
        harmless).

        Args:
          now: the time (s).

        Returns:
          ``Drop`` actions, then the applies and releases they allow.
        """
        now = self._check_now(now)
        self._begin(now)
        actions: list[Action] = []
        if (
            not self._started
            and self._start_deadline is not None
            and now >= self._start_deadline
        ):
            self._started = True
        if self._waiting:
            expired = {}
            while self._heap and self._heap[0][0] <= now:
                deadline, _, w = heapq.heappop(self._heap)
                rec = self._workers[w]
                if self._deadline_valid(rec, deadline):
                    expired[w] = (rec, deadline)
            for rec, _ in expired.values():
                reason = (
                    f"worker {rec.worker_id!r} made no progress for "
                    f"{now - rec.progress_at:.1f} s (deadline {rec.timeout:.1f} s)"
                )
                self._remove(rec, reason=reason)
                actions.append(Drop(rec.worker_id, reason))
        self._settle(now, actions)
        return actions

    def next_deadline(self) -> float | None:
        """When :meth:`tick` should be called next, or ``None`` for never."""
        candidates = []
        if not self._started and self._start_deadline is not None:
            candidates.append(self._start_deadline)
        if self._waiting:
            heap = self._heap
            while heap and not self._deadline_valid(
                self._workers[heap[0][2]], heap[0][0]
            ):
                heapq.heappop(heap)
            if heap:
                candidates.append(heap[0][0])
        return min(candidates, default=None)

    def set_stage(self, index: int, now: float) -> list[Action]:
        """Moves a staged policy (``"hybrid"``) to stage ``index``.

        Blocked workers and buffered updates are examined again under the new
        stage.

        Args:
          index: the stage index.
          now: the time (s).

        Returns:
          The applies and releases the new stage allows.

        Raises:
          ValueError: if the policy has no stages or the index is out of range.
        """
        now = self._check_now(now)
        self._policy.set_stage(self, index)
        self._begin(now)
        self._admit_key = _UNKNOWN_KEY
        actions: list[Action] = []
        self._settle(now, actions)
        return actions

    # Internals.

    def _live_changed(self) -> None:
        self._live_view = frozenset(self._live)
        self._min_clock_valid = False
        self._max_interval_valid = False

    def _timeout(self, rec: _Worker) -> float:
        if rec.interval is None or not rec.rounds:
            # Nothing measured since it joined: its first round may compile,
            # and what was measured before (another process, before a
            # restart) says nothing of this one.
            return self._initial_timeout
        if not self._max_interval_valid:
            workers = self._workers
            self._max_interval_cache = max(
                (
                    workers[w].interval
                    for w in self._live
                    if workers[w].interval is not None
                ),
                default=None,
            )
            self._max_interval_valid = True
        timeout = self._deadline_factor * (self._max_interval_cache or 0.0)
        timeout = max(timeout, self._min_timeout)
        if self._max_timeout is not None:
            timeout = min(timeout, self._max_timeout)
        return timeout

    def _progress(self, rec: _Worker, now: float) -> None:
        rec.timeout = self._timeout(rec)
        rec.progress_at = now
        rec.deadline = now + rec.timeout
        self._heap_seq += 1
        heapq.heappush(self._heap, (rec.deadline, self._heap_seq, rec.worker_id))
        if len(self._heap) > 4 * len(self._live) + 64:
            # Entries go stale as workers progress; rebuild rather than grow.
            heap = []
            for w in self._live:
                r = self._workers[w]
                if r.deadline is not None and w not in self._waiting:
                    self._heap_seq += 1
                    heap.append((r.deadline, self._heap_seq, w))
            heapq.heapify(heap)
            self._heap = heap

    def _deadline_valid(self, rec: _Worker, deadline: float) -> bool:
        return (
            rec.live and rec.deadline == deadline and rec.worker_id not in self._waiting
        )

    def _pull(self, rec: _Worker, now: float, actions: list[Action]) -> None:
        worker_id = rec.worker_id
        since = self._waiting.get(worker_id)
        if since is None:
            # A worker counts as waiting while the policy judges its pull, so
            # "the workers not waiting" never includes the one asking.
            self._waiting[worker_id] = now
        if self._started and self._policy.admit(self, worker_id):
            del self._waiting[worker_id]
            if since is not None:
                actions.append(Release(worker_id, self._version, now - since))
            self._send(rec, now, actions)
            return
        if not self._started:
            self._admit_key = _UNKNOWN_KEY
        else:
            key = self._policy.admit_key(self)
            if key is None or (len(self._waiting) > 1 and key != self._admit_key):
                self._admit_key = _UNKNOWN_KEY
            else:
                self._admit_key = key
        actions.append(
            Wait(worker_id, until=self.next_deadline(), reason=self._wait_reason(rec))
        )

    def _wait_reason(self, rec: _Worker) -> str:
        if not self._started:
            return (
                f"start: {len(self._live)} of {self._expected_workers} expected "
                "workers live"
            )
        return self._policy.wait_reason(self, rec.worker_id)

    def _send(self, rec: _Worker, now: float, actions: list[Action]) -> None:
        version = self._version
        rec.pulled_version = version
        rec.last_start = now
        if self._keep_stale and (not rec.refs or rec.refs[-1] != version):
            rec.refs.append(version)
            self._refcount[version] = self._refcount.get(version, 0) + 1
            if version not in self._copies:
                self._copies[version] = self._params
                if (
                    self._max_stale_copies is not None
                    and len(self._copies) > self._max_stale_copies
                ):
                    del self._copies[min(self._copies)]
        self._progress(rec, now)
        actions.append(
            SendParams(
                rec.worker_id, version, self._policy.local_steps(self, rec.worker_id)
            )
        )

    def _unref(self, version: int) -> None:
        count = self._refcount.get(version, 0) - 1
        if count > 0:
            self._refcount[version] = count
        else:
            self._refcount.pop(version, None)
            self._copies.pop(version, None)

    def _remove(self, rec: _Worker, *, reason: str | None) -> None:
        rec.live = False
        rec.dropped_reason = reason
        rec.deadline = None
        self._waiting.pop(rec.worker_id, None)
        self._live.discard(rec.worker_id)
        count = self._clock_counts.pop(rec.clock) - 1
        if count:
            self._clock_counts[rec.clock] = count
        self._admit_key = _UNKNOWN_KEY
        for version in rec.refs:
            self._unref(version)
        rec.refs = []
        self._live_changed()

    def _release(self, now: float, actions: list[Action]) -> None:
        if not self._waiting or not self._started:
            return
        policy = self._policy
        key = policy.admit_key(self)
        if key is not None and key == self._admit_key:
            return
        for worker_id, since in list(self._waiting.items()):
            if policy.admit(self, worker_id):
                del self._waiting[worker_id]
                actions.append(Release(worker_id, self._version, now - since))
                self._send(self._workers[worker_id], now, actions)
        # Releases may have moved the key; then the refusals say nothing.
        if key is not None and policy.admit_key(self) == key:
            self._admit_key = key
        else:
            self._admit_key = _UNKNOWN_KEY

    def _settle(self, now: float, actions: list[Action]) -> None:
        if self._buffer_contributors and self._policy.ready(self):
            self._apply(now, actions)
        self._release(now, actions)

    def _reset_buffer(self) -> None:
        self._buffer = None
        # The buffer applied (checked), when check_result: what _apply commits.
        self._buffer_result: tuple[Any, Any] | None = None
        self._buffer_samples = 0
        self._buffer_contributors: list[WorkerId] = []
        self._buffer_contributor_view: frozenset | None = None
        self._buffer_staleness = 0
        self._buffer_version: int | None = None
        self._buffer_stale = None

    def _push_completes(self, worker_id: WorkerId) -> bool | None:
        """Whether a buffered push of ``worker_id`` makes the policy apply.

        Known before the push is recorded only for policies whose readiness
        depends on the buffer and the live workers alone (BSP's and ASP's
        ``ready``, with no ``on_push`` of their own); ``None`` for any other.
        """
        policy = self._policy
        cls = type(policy)
        if cls.on_push is not Policy.on_push:
            return None
        if cls.ready is BSP.ready:
            missing = self._live.difference(self.buffer_contributors)
            return not missing or missing == {worker_id}
        if cls.ready is ASP.ready:
            need = min(policy.aggregate, max(1, len(self._live)))
            return len(self._buffer_contributors) + 1 >= need
        return None

    def _buffer_candidate(
        self,
        update: Any,
        weight: float,
        samples: int,
        staleness: int,
        version: int,
        stale: Any,
        *,
        completes: bool | None,
        prepared: LeafApply | None = None,
    ) -> _Pending:
        """The buffer with one more update, and (``check_result``) its apply.

        Changes nothing: the push commits it with :meth:`_buffer_add`. With
        ``check_result``, a push that completes the buffer (``completes``;
        ``None`` where not known) has the buffer applied on trial, a result
        the apply commits; any other has only the buffer checked, one
        elementwise pass rather than an optimizer step per push.

        Raises:
          NonFiniteUpdate: the buffer, or the apply of a completed buffer,
            would be non-finite.
        """
        keep, w = self._mean_weights(weight, samples)
        trial = self._check_result and completes is not False
        checked = self._check_result and not trial
        tau = max(self._buffer_staleness, staleness)
        if (
            trial
            and prepared is not None
            and stale is None
            and prepared.matches(
                self._params, self._opt_state, self._buffer, keep, w, tau
            )
        ):
            # The mean and its apply, worked out leaf by leaf as they came.
            buffer, params, opt_state, flags = prepared.result()
            bad = self._non_finite(flags)
            if bad is not None:
                raise NonFiniteUpdate(
                    f"update refused: applied, it would make {bad} non-finite "
                    "(NaN or infinity); nothing changed"
                )
            self.overlapped_applies += 1
            first_version = version
            if self._buffer_version is not None:
                first_version = min(version, self._buffer_version)
            return _Pending(
                buffer, samples, tau, first_version, None, (params, opt_state)
            )
        finite = True
        if self._defer:
            buffer = [*(self._buffer or []), (update, keep, w)]
        elif self._buffer is None and w == 1:
            buffer = update
        elif self._buffer is None and checked:
            buffer, finite = self._checked_scale_fn(update, w)
        elif self._buffer is None:
            buffer = self._scale_fn(update, w)
        elif checked:
            buffer, finite = self._checked_accumulate_fn(self._buffer, update, keep, w)
        else:
            buffer = self._accumulate_fn(self._buffer, update, keep, w)
        if not finite:
            raise NonFiniteUpdate(
                "update refused: the buffered average with it would be non-finite "
                "(NaN or infinity); nothing changed"
            )
        if self._buffer_version is None or version < self._buffer_version:
            first_version, first_stale = version, stale
        else:
            first_version, first_stale = self._buffer_version, self._buffer_stale
        result = None
        if trial:
            params, opt_state, bad = self._trial_apply(buffer, tau, first_stale)
            if bad is not None:
                raise NonFiniteUpdate(
                    f"update refused: applied, it would make {bad} non-finite "
                    "(NaN or infinity); nothing changed"
                )
            result = (params, opt_state)
        return _Pending(buffer, samples, tau, first_version, first_stale, result)

    def _trial_apply(
        self, buffer: Any, staleness: int, stale: Any
    ) -> tuple[Any, Any, str | None]:
        """``buffer`` applied, and what it would make non-finite (or ``None``)."""
        params, opt_state, flags = self._checked_apply_fn(
            self._params,
            self._opt_state,
            buffer,
            self._device_scalar(staleness, np.int32),
            stale,
        )
        return params, opt_state, self._non_finite(flags)

    def _non_finite(self, flags: Any) -> str | None:
        """What a checked apply's flags say it made non-finite, or ``None``."""
        flags = np.asarray(flags)
        if flags.all():
            return None
        bad = int(np.argmin(flags))
        if bad < len(self._leaf_paths):
            return f"parameter {self._leaf_paths[bad] or 'leaf'}"
        return "the optimizer state"

    def _buffer_add(self, rec: _Worker, pending: _Pending) -> None:
        self._buffer = pending.buffer
        self._buffer_result = pending.result
        self._buffer_samples += pending.samples
        self._buffer_contributors.append(rec.worker_id)
        self._buffer_contributor_view = None
        self._buffer_staleness = pending.staleness
        self._buffer_version = pending.version
        self._buffer_stale = pending.stale

    def _apply(self, now: float, actions: list[Action]) -> None:
        if self._defer:
            self._deferred.append((self._buffer, self._buffer_staleness))
        elif self._buffer_result is not None:
            self._params, self._opt_state = self._buffer_result
        elif self._check_result:
            # Applied with no push to refuse (a deadline, a leave): a result
            # that would be non-finite is discarded, the version made with the
            # parameters and optimizer state as they were.
            params, opt_state, bad = self._trial_apply(
                self._buffer, self._buffer_staleness, self._buffer_stale
            )
            if bad is None:
                self._params, self._opt_state = params, opt_state
        else:
            self._params, self._opt_state = self._apply_fn(
                self._params,
                self._opt_state,
                self._buffer,
                self._device_scalar(self._buffer_staleness, np.int32),
                self._buffer_stale,
            )
        self._version += 1
        contributors = tuple(self._buffer_contributors)
        for worker_id in contributors:
            self._workers[worker_id].applied += 1
        actions.append(
            Applied(
                version=self._version,
                contributors=contributors,
                staleness=self._buffer_staleness,
                num_updates=len(contributors),
            )
        )
        self._reset_buffer()
        self._policy.on_apply(self, now)

    def apply_deferred(self) -> tuple[dict[int, int], list[jax.Array]]:
        """Carries out the deferred applies (``defer_applies``) in one call.

        Every update buffered for a deferred version goes through the same
        weighting, averaging and optimizer step as without deferral, in push
        order (see ``defer_applies``). Reading :attr:`params` or
        :attr:`opt_state` does this too.

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
        rows = {}
        version = self._version - len(deferred)
        for items, tau in deferred:
            items = _folded(items)
            for j, (update, k, w) in enumerate(items):
                updates.append(jax.tree.leaves(update))
                keeps.append(k)
                weights.append(w)
                first.append(j == 0)
                close.append(j == len(items) - 1)
                staleness.append(tau)
            version += 1
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
        self._params, self._opt_state, history = self._chain_fn(
            self._params,
            self._opt_state,
            jax.tree.unflatten(self._treedef, stacked),
            np.asarray(keeps + [0.0] * pad, np.float32),
            np.asarray(weights + [0.0] * pad, np.float32),
            flags[0],
            flags[1],
            np.asarray(staleness + [0] * pad, np.int32),
        )
        return rows, jax.tree.leaves(history)

    def _device_scalar(self, value: float, dtype: type) -> jax.Array:
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
        return not on_device or bool(self._finite_fn(on_device))

    # Checkpoints.

    def state_dict(self) -> dict:
        """The bookkeeping as plain Python values (msgpack-able).

        Holds the version, every worker's clock, counters and measured times, and
        the policy's state. Parameters and optimizer state are arrays, saved
        separately (``core.params``, ``core.opt_state``, e.g. with tensorstore)
        at the same moment; buffered updates not yet applied and times of the
        driver's clock (deadlines, start) are not saved.

        Returns:
          A dict of str keys and plain values.
        """
        return {
            "format": _STATE_FORMAT,
            "policy": self._policy.name,
            "policy_state": self._policy.state_dict(),
            "version": self._version,
            "max_clock": self._max_clock,
            "workers": [
                {"worker_id": rec.worker_id}
                | {name: getattr(rec, name) for name in _SAVED_FIELDS}
                for rec in self._workers.values()
            ],
        }

    def load_state_dict(
        self, state: Mapping, *, params: Any = None, opt_state: Any = None
    ) -> None:
        """Restores :meth:`state_dict` (and optionally params and optimizer state).

        Every worker comes back not live: after a restart the workers join again
        (and a core with ``expected_workers`` holds the start again). Their clocks,
        counters and measured times are kept. Buffered updates are discarded.
        Everything is checked before anything changes.

        Args:
          state: a dict from :meth:`state_dict` (possibly through msgpack).
          params: parameters to restore, with the structure, shapes and dtypes of
            the current ones, or ``None`` to keep the current ones.
          opt_state: optimizer state to restore, with the structure of the
            current one, or ``None`` to keep it.

        Raises:
          ValueError: for a malformed state, another policy, or params/opt_state
            that do not match.
        """
        if not isinstance(state, Mapping):
            raise ValueError(f"state must be a mapping, got {type(state).__name__}.")
        expected = {
            "format",
            "policy",
            "policy_state",
            "version",
            "max_clock",
            "workers",
        }
        if set(state) != expected:
            raise ValueError(
                f"state needs exactly the keys {sorted(expected)}, got {sorted(state)}."
            )
        if state["format"] != _STATE_FORMAT:
            raise ValueError(f"Unknown state format {state['format']!r}.")
        if state["policy"] != self._policy.name:
            raise ValueError(
                f"state was saved with policy {state['policy']!r}, this core runs "
                f"{self._policy.name!r}."
            )
        for key in ("version", "max_clock"):
            if not _is_int(state[key]) or state[key] < 0:
                raise ValueError(f"state[{key!r}] must be an int >= 0.")
        records = {}
        for entry in state["workers"]:
            if not isinstance(entry, Mapping) or set(entry) != {
                "worker_id",
                *_SAVED_FIELDS,
            }:
                raise ValueError(f"Malformed worker entry in state: {entry!r}.")
            worker_id = entry["worker_id"]
            _check_worker_id(worker_id)
            rec = _Worker(worker_id)
            try:
                for name in _SAVED_FIELDS:
                    setattr(rec, name, _restore_field(name, entry[name]))
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"Malformed worker entry for {worker_id!r}: {err}"
                ) from None
            records[worker_id] = rec
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
            new_params = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])
        new_opt_state = None
        if opt_state is not None:
            if jax.tree.structure(opt_state) != jax.tree.structure(self._opt_state):
                raise ValueError(
                    "opt_state to restore differs in structure from the optimizer's."
                )
            new_opt_state = jax.tree.map(jnp.asarray, opt_state)
        # The policy checks its state before changing anything, and nothing
        # after it can fail, so a bad state leaves the core as it was.
        self._policy.load_state_dict(state["policy_state"])
        self.apply_deferred()
        self._epoch += 1
        self._version = int(state["version"])
        self._max_clock = int(state["max_clock"])
        self._workers = records
        self._live = set()
        self._clock_counts = {}
        self._live_changed()
        self._waiting = {}
        self._admit_key = _UNKNOWN_KEY
        self._heap = []
        self._started = self._expected_workers is None
        self._start_deadline = None
        self._copies = {}
        self._refcount = {}
        self._reset_buffer()
        if new_params is not None:
            self._params = new_params
        if new_opt_state is not None:
            self._opt_state = new_opt_state


class LazyUpdate:
    """An update pushed to a core with ``defer_applies`` before it is evaluated.

    A driver (the simulator) may push one in place of the update's tree: the
    core only buffers it until its deferred applies are carried out. Then a
    version made of pushes of one ``group`` (all of them lazy) asks
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


class _Pending(NamedTuple):
    """A push's contribution to the buffer, worked out before it is committed."""

    buffer: Any  # the buffer with the push (a list of rows when deferred)
    samples: int  # the push's num_samples
    staleness: int  # the buffer's largest staleness with the push
    version: int  # the oldest version the buffered updates were computed on
    stale: Any  # that version's parameters (keep_stale_params), or None
    result: tuple[Any, Any] | None  # (params, opt_state) the buffer applies to


def _restore_field(name: str, value: Any) -> Any:
    if name in ("interval", "step_time", "time_per_step", "overhead", "last_loss"):
        if value is None:
            return None
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite")
        return value
    if name == "dropped_reason":
        if value is not None and not isinstance(value, str):
            raise ValueError("dropped_reason must be a str or None")
        return value
    if name == "pushed_version" and value is None:
        return None
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)
