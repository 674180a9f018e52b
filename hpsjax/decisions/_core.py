r"""The parameter server's decisions as a sans-I/O state machine.

:class:`ServerCore` holds the version and the bookkeeping of every worker, and
decides, event by event, what is applied, who waits, who is released and who is
dropped; the arithmetic (parameters, optimizer state, the buffered mean, stale
copies) is its aggregator's (:mod:`hpsjax.apply._aggregate`), and its policy sees a
:class:`~hpsjax.decisions.PolicyView` of it. It does no I/O, starts no task and reads
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
* ``observe_speed(worker_id, batch_size, time_per_step, now)``: a worker's
  measured speed, for the re-planner (pushes feed it by default).

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
* :class:`StageChanged`: a staged policy moved to another stage; tell every
  worker (the event that moved it returns it, once).
* :class:`PlanChanged`: the re-planner revised the work plan; hand each worker
  its entry (a push's measured speed, or :meth:`~ServerCore.observe_speed`).

The core decides what to announce and when; a driver only carries the
announcements out (the asyncio server as NOTICEs, the simulator on its
simulated workers).

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
            elif isinstance(action, (StageChanged, PlanChanged)):
                announce(action)  # to every worker
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
requests the protocol does not allow raise classes of :mod:`hpsjax.wire._errors`:
``UnexpectedMessage`` (a worker that never joined), ``WorkerDropped`` (a worker
that left or was dropped and must rejoin), ``InvalidUpdate`` (a version from the
future, or one whose stale copy was dropped), ``SpecMismatch`` (tree structure,
shape or dtype differs from the parameters) and ``NonFiniteUpdate``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from hpsjax._checks import (
    check_fraction,
    check_int,
    check_positive,
    check_worker_id,
    is_int,
    is_number,
)
from hpsjax._ewma import ewma
from hpsjax.apply import Aggregator
from hpsjax.decisions._events import (
    ServerEvent,
    SpeedMeasured,
    StageSet,
    Tick,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.decisions._policies import PolicyView, Verdict, get_policy
from hpsjax.wire import (
    InvalidUpdate,
    PushAck,
    PushMeta,
    UnexpectedMessage,
    WorkerDropped,
)

__all__ = [
    "Action",
    "Applied",
    "Drop",
    "ForcePull",
    "PlanChanged",
    "PushAck",
    "Release",
    "SaveCheckpoint",
    "SendParams",
    "ServerCore",
    "StageChanged",
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


@dataclasses.dataclass(frozen=True, slots=True)
class SaveCheckpoint:
    """Save a checkpoint of version ``version``: the parameters, the optimizer
    state and :meth:`ServerCore.state_dict` as they are now.

    Returned after the :class:`Applied` of every ``checkpoint_every_updates``
    new versions; the driver saves (the asyncio server, on its checkpoint
    thread) and the simulator, which keeps none, never asks for it.
    """

    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class StageChanged:
    """A staged policy moved to another stage: tell every worker.

    Returned by the event in which the stage changed, whatever moved it (a
    version reaching the stage's ``until_version``, a pushed ``stage``, the
    policy's own rule, :meth:`ServerCore.set_stage`), once per change and
    before the releases the new stage allows. A worker whose push moved the
    stage also learns it from its :class:`~hpsjax.ps.PushAck`'s ``stage``.

    Attributes:
      stage: the new stage index.
      version: the server version when it changed.
    """

    stage: int
    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class PlanChanged:
    """The re-planner revised the work plan: hand every worker its entry.

    Attributes:
      plan: the revised :class:`~hpsjax.planning.WorkPlan`.
      version: the server version when it was revised.
      reason: why (whose measured speed drifted).
    """

    plan: Any
    version: int
    reason: str


Action = (
    SendParams
    | PushAck
    | Wait
    | Release
    | ForcePull
    | Drop
    | Applied
    | SaveCheckpoint
    | StageChanged
    | PlanChanged
)
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
        be non-finite keeps the parameters as they were.
      push_weights: a factor :math:`p_j` per worker id on every push of that
        worker (a work plan's ``push_weight``: ASHL's reference adds
        :math:`p_j` times each delta), multiplied into the policy's weight;
        workers not named get 1. ``None`` (the default) for none.
      aggregator: what builds the arithmetic behind the decisions, called as
        ``aggregator(params, optimizer, check_finite=..., check_result=...,
        keep_stale_params=..., max_stale_copies=...)``: by default
        :class:`~hpsjax.apply._aggregate.Aggregator`; the simulator's defers its
        applies (``hpsjax.apply._deferred``), the asyncio server's applies a
        push leaf by leaf as it arrives (``hpsjax.apply._overlap``). The core
        reads no array: any object with the aggregator's methods will do.
      replanner: a :class:`~hpsjax.decisions.ReplannerProtocol` (H-PS dynamic
        scheduling) that :meth:`observe_speed` feeds, or ``None``; a revised
        plan is returned as a :class:`PlanChanged` action.
      replan_from_pushes: feed the re-planner every push's measured speed (its
        ``step_time`` over its ``num_samples`` and ``local_steps``), so the
        push that revises the plan returns the :class:`PlanChanged`. ``False``
        where the driver measures speeds otherwise and calls
        :meth:`observe_speed` itself (the simulator, as each round's compute
        ends).
      checkpoint_every_updates: return a :class:`SaveCheckpoint` after the
        :class:`Applied` of every this many new versions (counted from the last
        one asked for, or the version restored); ``None`` for never.

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
    a work plan's ``lr_scale`` (:func:`hpsjax.planning.plan`) is the same for
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

    Raises:
      ValueError: for bad arguments or an unknown policy name.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.decisions._core import ServerCore
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
        optimizer: Any,
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
        push_weights: Mapping[Any, float] | None = None,
        aggregator: Callable[..., Aggregator] = Aggregator,
        replanner: Any = None,
        replan_from_pushes: bool = True,
        checkpoint_every_updates: int | None = None,
    ):
        check_int(
            "checkpoint_every_updates", checkpoint_every_updates, low=1, allow_none=True
        )
        self._check_args(
            policy_kwargs=policy_kwargs,
            expected_workers=expected_workers,
            start_timeout=start_timeout,
            deadline_factor=deadline_factor,
            min_timeout=min_timeout,
            max_timeout=max_timeout,
            initial_timeout=initial_timeout,
            ewma_alpha=ewma_alpha,
            push_weights=push_weights,
            straggler_factor=straggler_factor,
        )
        self._push_weights = None if push_weights is None else dict(push_weights)
        self._policy = get_policy(policy, **dict(policy_kwargs or {}))
        self._agg = aggregator(
            params,
            optimizer,
            check_finite=check_finite,
            check_result=check_result,
            keep_stale_params=keep_stale_params,
            max_stale_copies=max_stale_copies,
        )
        self._view = PolicyView(self)
        self._version = 0
        self._expected_workers = expected_workers
        self._start_timeout = float(start_timeout)
        self._deadline_factor = float(deadline_factor)
        self._min_timeout = float(min_timeout)
        self._max_timeout = None if max_timeout is None else float(max_timeout)
        self._initial_timeout = float(initial_timeout)
        self._alpha = float(ewma_alpha)
        self._straggler_factor = float(straggler_factor)
        self._keep_stale = bool(keep_stale_params)
        self._replanner = replanner
        self._replan_from_pushes = bool(replan_from_pushes)
        self._checkpoint_every = checkpoint_every_updates
        self._checkpointed_version = 0
        # The stage last announced (StageChanged), or None for a policy
        # without stages.
        self._stage = self._policy.stage
        self._init_workers()

    @staticmethod
    def _check_args(
        *,
        policy_kwargs: Any,
        expected_workers: Any,
        start_timeout: Any,
        deadline_factor: Any,
        min_timeout: Any,
        max_timeout: Any,
        initial_timeout: Any,
        ewma_alpha: Any,
        push_weights: Any,
        straggler_factor: Any,
    ) -> None:
        """Raises ``ValueError`` for a bad constructor argument."""
        if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
            raise ValueError("policy_kwargs must be a mapping or None.")
        check_int("expected_workers", expected_workers, low=1, allow_none=True)
        for name, value in (
            ("start_timeout", start_timeout),
            ("deadline_factor", deadline_factor),
            ("min_timeout", min_timeout),
            ("initial_timeout", initial_timeout),
            ("straggler_factor", straggler_factor),
        ):
            check_positive(name, value)
        if max_timeout is not None and (
            not is_number(max_timeout)
            or not math.isfinite(max_timeout)
            or max_timeout < min_timeout
        ):
            raise ValueError(
                f"max_timeout must be None or a number >= min_timeout "
                f"({min_timeout}), got {max_timeout!r}."
            )
        check_fraction("ewma_alpha", ewma_alpha)
        if push_weights is not None and (
            not isinstance(push_weights, Mapping)
            or not all(
                is_number(v) and math.isfinite(v) and v >= 0
                for v in push_weights.values()
            )
        ):
            raise ValueError(
                f"push_weights must map worker ids to finite numbers >= 0, got "
                f"{push_weights!r}."
            )

    def _init_workers(self) -> None:
        """No workers, no waits, no deadlines, no stale references, no buffer."""
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
        # Live references to each version kept for stale_params.
        self._refcount: dict[int, int] = {}
        self._reset_buffer()

    # Read-only state.

    @property
    def params(self) -> Any:
        """The current parameters (pytree of jax arrays) at :attr:`version`."""
        return self._agg.params

    @property
    def opt_state(self) -> Any:
        """The optimizer state."""
        return self._agg.opt_state

    @property
    def aggregator(self) -> Aggregator:
        """The arithmetic behind the decisions (parameters, optimizer state,
        the buffered mean, stale copies)."""
        return self._agg

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

    def check_push(self, worker_id: WorkerId, version: int) -> None:
        """Refuses a push the core would refuse before reading its update.

        A driver may call it as soon as it has the push's metadata, to refuse
        the push before it receives or decodes the payload; :meth:`push_message`
        makes the same checks.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped (saying why).
          InvalidUpdate: for a version past the server's.
        """
        self._pusher(worker_id, version)

    def _pusher(self, worker_id: WorkerId, version: int) -> _Worker:
        rec = self._live_record(worker_id)
        if not 0 <= version <= self._version:
            raise InvalidUpdate(
                f"push version must be an int in [0, {self._version}] (the server "
                f"version), got {version!r}"
            )
        return rec

    def completing_push(
        self, worker_id: WorkerId, version: Any, num_samples: Any = None
    ) -> tuple[float, int, int] | None:
        """How a coming push would be aggregated, where it completes a version.

        For a push of ``worker_id`` on ``version`` with ``num_samples`` that
        the policy applies at once (:meth:`~hpsjax.ps.Policy.completes`: BSP's
        last push of a round, ASP's push), ``(weight, samples, staleness)`` of
        its apply: what an aggregator needs to start it before the push is
        whole (``hpsjax.apply._overlap``). ``None`` where that does not hold or
        cannot be known yet. Changes nothing: the weight is the one known
        before the policy judges the push (its ``push_weights`` entry), and a
        push the policy weighs otherwise is aggregated whole.
        """
        if (
            type(version) is not int
            or not 0 <= version <= self._version
            or worker_id not in self._live
            or self._policy.completes(self._view, worker_id) is not True
        ):
            return None
        samples = num_samples if type(num_samples) is int and num_samples > 0 else 1
        weight = 1.0
        if self._push_weights is not None:
            weight = float(self._push_weights.get(worker_id, 1.0))
        return weight, samples, max(self._buffer_staleness, self._version - version)

    @property
    def replanner(self) -> Any:
        """The re-planner :meth:`observe_speed` feeds, or ``None``."""
        return self._replanner

    @property
    def stage(self) -> int | None:
        """The staged policy's stage as last announced (:class:`StageChanged`),
        or ``None`` for a policy without stages."""
        return self._stage

    def observe_speed(
        self, worker_id: WorkerId, batch_size: int, time_per_step: float, now: float
    ) -> list[Action]:
        """Feeds a worker's measured speed to the re-planner.

        Both drivers give the same input: one local step of ``batch_size``
        samples (over the worker's devices) took ``time_per_step`` seconds of
        compute (a push's ``num_samples``, ``local_steps`` and ``step_time``,
        fed by :meth:`push_message` itself unless ``replan_from_pushes`` is
        off; the simulator's worker's report of a kept round).

        Returns:
          ``[PlanChanged]`` when the speeds drifted and the plan was revised,
          else ``[]`` (and always without a re-planner, or for a worker its
          plan does not name).
        """
        replanner = self._replanner
        if replanner is None or worker_id not in {
            entry.worker_id for entry in replanner.plan.workers
        }:
            return []
        revised = replanner.observe(worker_id, batch_size, time_per_step, now)
        if revised is None:
            return []
        reason = getattr(replanner, "reason", None)  # a Pilot's phase
        reason = reason or f"worker {worker_id}'s speed drifted"
        return [PlanChanged(revised, self._version, reason)]

    def _note_stage(self, actions: list[Action]) -> None:
        """Announces a change of the policy's stage (once)."""
        stage = self._policy.stage
        if stage != self._stage:
            self._stage = stage
            actions.append(StageChanged(stage, self._version))

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

    @property
    def stale_versions(self) -> tuple[int, ...]:
        """Versions whose parameters are kept for ``stale_params``."""
        return self._agg.stale_versions

    def stale_params(self, version: int) -> Any:
        """The parameters of ``version`` (kept copy, or the current ones).

        Raises:
          KeyError: if that version is not kept.
        """
        return self._agg.params_at(version, self._version)

    # Events.

    def _check_now(self, now: Any) -> float:
        if not is_number(now) or not math.isfinite(now):
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
        check_worker_id("worker_id", worker_id)
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
          ``[PushAck, ForcePull?, Applied?, StageChanged?,
          Release/SendParams..., PlanChanged?]``.

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
        return self.push_message(
            worker_id, self._agg.check_update(update), meta, now=now
        )

    def handle(self, event: ServerEvent) -> list[Action]:
        """Takes one event, returns the actions it calls for, in order.

        The one way in for a driver: each event (:mod:`hpsjax.decisions._events`)
        goes to the method of its decision (:meth:`join`, :meth:`leave`,
        :meth:`pull`, :meth:`push_message`, :meth:`tick`, :meth:`set_stage`,
        :meth:`observe_speed`), whose docstring says what it returns and
        raises; a call that raises changes nothing.

        Raises:
          TypeError: ``event`` is not a server event.
        """
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not a server event: {event!r}")
        return handler(self, event)

    def push_message(
        self,
        worker_id: WorkerId,
        update: Any,
        meta: PushMeta,
        *,
        now: float,
    ) -> list[Action]:
        """A push validated where it became an object; see :meth:`push`.

        Nothing the wire (or the driver) checked is checked again: ``meta`` comes
        from :meth:`PushMeta.from_wire` (or is built from known-good values), and
        ``update`` has the parameters' tree structure, shapes and dtypes and,
        with ``check_finite``, only finite values (the aggregator's
        ``check_update`` checks a tree that does not come from the wire). What
        depends on the server's state is checked here: the worker and
        ``meta.version`` against the server version (:meth:`check_push`), and
        ``meta.stage`` against the policy's stages.

        Returns:
          ``[PushAck, ForcePull?, Applied?, StageChanged?,
          Release/SendParams..., PlanChanged?]``.
        """
        now = self._check_now(now)
        version = meta.version
        rec = self._pusher(worker_id, version)
        policy = self._policy
        view = self._view
        stage_before = policy.stage
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
        tau = max(self._buffer_staleness, staleness)
        if verdict_weight > 0:
            pending = self._agg.candidate(
                update,
                verdict_weight,
                meta.num_samples or 1,
                tau,
                version,
                stale,
                completes=policy.completes(view, worker_id),
            )
        self._begin(now)
        self._record_push(rec, meta, now)
        tail: list[Action] = []

        if pending is not None:
            self._agg.commit(pending)
            self._buffer_contributors.append(worker_id)
            self._buffer_contributor_view = None
            self._buffer_staleness = tau
            status = "buffered"
        else:
            rec.dropped_updates += 1
            status = "dropped"
        policy.on_push(view, worker_id, now)
        if policy.stage != self._stage:
            self._note_stage(tail)
        if self._buffer_contributors and policy.ready(view):
            self._apply(now, tail)
            if status == "buffered":
                status = "applied"
        self._release(now, tail)
        if switch:
            # The worker's staged optimizer moved on (ASHL: a flat loss): the
            # server follows, after the push was handled in the stage it was
            # computed in.
            policy.set_stage(view, meta.stage)
            self._note_stage(tail)
            self._admit_key = _UNKNOWN_KEY
            self._settle(now, tail)
        if self._replanner is not None and self._replan_from_pushes:
            tail += self._observe_push(worker_id, meta, now)
        stage = policy.stage if stage_before is not None else None
        actions: list[Action] = [
            PushAck(
                worker_id=worker_id,
                version=self._version,
                staleness=staleness,
                status=status,
                weight=float(verdict_weight),
                local_steps=policy.local_steps(view, worker_id),
                reason=reason if reason or not force_pull else "pull fresh parameters",
                force_pull=force_pull,
                stage=None if stage == stage_before else stage,
            )
        ]
        if force_pull:
            actions.append(ForcePull(worker_id, reason or "pull fresh parameters"))
        actions.extend(tail)
        return actions

    def _observe_push(
        self, worker_id: WorkerId, meta: PushMeta, now: float
    ) -> list[Action]:
        """Feeds one push's measured speed to the re-planner."""
        step_time, samples = meta.step_time, meta.num_samples
        if not step_time or not samples:
            return []
        steps = meta.local_steps or 1
        # A pilot (hpsjax.profiling.Pilot) plans with the link's seconds too.
        observe_link = getattr(self._replanner, "observe_link", None)
        overhead = self._record(worker_id).overhead
        if observe_link is not None and overhead is not None:
            observe_link(worker_id, overhead)
        return self.observe_speed(
            worker_id, max(1, samples // steps), step_time / steps, now
        )

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
            stale = self._agg.copy_of(version, self._version)
        if self._keep_stale and stale is None:
            verdict_weight, force_pull = 0.0, True
            reason = f"no stale copy of version {version} is kept"
        else:
            verdict = self._policy.judge(self._view, worker_id, staleness)
            if not isinstance(verdict, Verdict):
                raise ValueError(
                    f"Policy {self._policy.name!r}.judge returned "
                    f"{type(verdict).__name__}, not a Verdict."
                )
            verdict_weight = verdict.weight
            force_pull, reason = bool(verdict.force_pull), verdict.reason
            if not is_number(verdict_weight) or not (
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
          ``[StageChanged]`` where the stage changed, then the applies and
          releases the new stage allows.

        Raises:
          ValueError: if the policy has no stages or the index is out of range.
        """
        now = self._check_now(now)
        self._policy.set_stage(self._view, index)
        self._begin(now)
        self._admit_key = _UNKNOWN_KEY
        actions: list[Action] = []
        self._note_stage(actions)
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
        if self._started and self._policy.admit(self._view, worker_id):
            del self._waiting[worker_id]
            if since is not None:
                actions.append(Release(worker_id, self._version, now - since))
            self._send(rec, now, actions)
            return
        if not self._started:
            self._admit_key = _UNKNOWN_KEY
        else:
            key = self._policy.admit_key(self._view)
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
        return self._policy.wait_reason(self._view, rec.worker_id)

    def _send(self, rec: _Worker, now: float, actions: list[Action]) -> None:
        version = self._version
        rec.pulled_version = version
        rec.last_start = now
        if self._keep_stale and (not rec.refs or rec.refs[-1] != version):
            rec.refs.append(version)
            self._refcount[version] = self._refcount.get(version, 0) + 1
            self._agg.keep_copy(version)
        self._progress(rec, now)
        actions.append(
            SendParams(
                rec.worker_id,
                version,
                self._policy.local_steps(self._view, rec.worker_id),
            )
        )

    def _unref(self, version: int) -> None:
        count = self._refcount.get(version, 0) - 1
        if count > 0:
            self._refcount[version] = count
        else:
            self._refcount.pop(version, None)
            self._agg.drop_copy(version)

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
        view = self._view
        key = policy.admit_key(view)
        if key is not None and key == self._admit_key:
            return
        for worker_id, since in list(self._waiting.items()):
            if policy.admit(view, worker_id):
                del self._waiting[worker_id]
                actions.append(Release(worker_id, self._version, now - since))
                self._send(self._workers[worker_id], now, actions)
        # Releases may have moved the key; then the refusals say nothing.
        if key is not None and policy.admit_key(view) == key:
            self._admit_key = key
        else:
            self._admit_key = _UNKNOWN_KEY

    def _settle(self, now: float, actions: list[Action]) -> None:
        if self._buffer_contributors and self._policy.ready(self._view):
            self._apply(now, actions)
        self._release(now, actions)

    def _reset_buffer(self) -> None:
        self._buffer_contributors: list[WorkerId] = []
        self._buffer_contributor_view: frozenset | None = None
        self._buffer_staleness = 0

    def _apply(self, now: float, actions: list[Action]) -> None:
        self._version += 1
        self._agg.apply(self._version, self._buffer_staleness)
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
        every = self._checkpoint_every
        if every and self._version - self._checkpointed_version >= every:
            self._checkpointed_version = self._version
            actions.append(SaveCheckpoint(self._version))
        policy = self._policy
        policy.on_apply(self._view, now)
        if policy.stage != self._stage:
            self._note_stage(actions)

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
            if not is_int(state[key]) or state[key] < 0:
                raise ValueError(f"state[{key!r}] must be an int >= 0.")
        records = {}
        for entry in state["workers"]:
            if not isinstance(entry, Mapping) or set(entry) != {
                "worker_id",
                *_SAVED_FIELDS,
            }:
                raise ValueError(f"Malformed worker entry in state: {entry!r}.")
            worker_id = entry["worker_id"]
            check_worker_id("worker_id", worker_id)
            rec = _Worker(worker_id)
            try:
                for name in _SAVED_FIELDS:
                    setattr(rec, name, _restore_field(name, entry[name]))
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"Malformed worker entry for {worker_id!r}: {err}"
                ) from None
            records[worker_id] = rec
        new_params, new_opt_state = self._agg.check_restore(params, opt_state)
        # The policy checks its state before changing anything, and nothing
        # after it can fail, so a bad state leaves the core as it was.
        self._policy.load_state_dict(state["policy_state"])
        # The restored stage is in force; workers learn it as they join again.
        self._stage = self._policy.stage
        self._agg.restore(new_params, new_opt_state)
        self._epoch += 1
        self._version = self._checkpointed_version = int(state["version"])
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
        self._refcount = {}
        self._reset_buffer()


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
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


_HANDLERS: dict[type, Callable[[ServerCore, Any], list[Action]]] = {
    WorkerJoined: lambda core, e: core.join(e.worker_id, e.now),
    WorkerLeft: lambda core, e: core.leave(e.worker_id, e.now),
    WorkerPulled: lambda core, e: core.pull(e.worker_id, e.now),
    WorkerPushed: lambda core, e: core.push_message(
        e.worker_id, e.update, e.meta, now=e.now
    ),
    Tick: lambda core, e: core.tick(e.now),
    StageSet: lambda core, e: core.set_stage(e.index, e.now),
    SpeedMeasured: lambda core, e: core.observe_speed(
        e.worker_id, e.batch_size, e.time_per_step, e.now
    ),
}
