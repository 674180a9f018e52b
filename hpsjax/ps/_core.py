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
  computed on parameters of ``version``.
* ``leave(worker_id, now)``: the worker says goodbye (or its connection died).
* ``tick(now)``: time passed; call it at ``next_deadline()``.
* ``set_stage(index, now)``: a staged policy moves to stage ``index``.

Actions (frozen dataclasses):

* :class:`SendParams`: send ``core.params`` (at ``core.version``) to the worker; the
  answer to its pull or join.
* :class:`PushAck`: answer the push (applied, buffered or dropped; its staleness; a
  ``local_steps`` hint for the next commit).
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
import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hpsjax.ps._errors import (
    InvalidUpdate,
    NonFiniteUpdate,
    SpecMismatch,
    UnexpectedMessage,
    WorkerDropped,
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
class PushAck:
    """The answer to a push.

    Attributes:
      worker_id: the worker.
      version: the server version after the push was handled.
      staleness: :math:`\\tau = V - v`, the server version when the push arrived
        minus the version it was computed on.
      status: ``"applied"`` (a new version includes it), ``"buffered"`` (waiting
        for other updates to be aggregated with) or ``"dropped"`` (discarded).
      weight: the damping factor the update was scaled by (0 when dropped).
      local_steps: hint: local steps to take before the next push, or ``None``.
      reason: why it was damped or dropped, else ``None``.
    """

    worker_id: WorkerId
    version: int
    staleness: int
    status: Literal["applied", "buffered", "dropped"]
    weight: float = 1.0
    local_steps: int | None = None
    reason: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """The worker's pull is blocked: send nothing until its :class:`Release`.

    Attributes:
      worker_id: the worker.
      until: the current deadline by which the workers it waits for must make
        progress (they are dropped otherwise); it moves later as they do. ``None``
        when no deadline applies.
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


class ServerCore:
    r"""The parameter server's state machine: model, versions, workers, policy.

    Args:
      params: the initial parameters, a pytree of arrays (version 0).
      optimizer: any optax ``GradientTransformation`` (extra args supported); it
        is called as ``optimizer.update(u, opt_state, params, staleness=tau)``
        (plus ``stale_params=w_v`` with ``keep_stale_params``).
      policy: a policy name (see :func:`hpsjax.ps.get_policy`) or a
        :class:`~hpsjax.ps.Policy` object (one core per policy object).
      policy_kwargs: keyword arguments for the policy when it is given by name.
      expected_workers: hold every pull until this many workers are live, or
        until ``start_timeout`` after the first join; ``None`` starts at once.
      start_timeout: seconds after the first join after which a start held for
        ``expected_workers`` begins with whoever joined.
      deadline_factor: :math:`k` in the deadline rule below, > 0.
      min_timeout: lower bound of a deadline's timeout (s), > 0.
      max_timeout: upper bound (s), or ``None``.
      initial_timeout: timeout (s) for a worker with no measured step yet (its
        first step may include compilation).
      ewma_alpha: weight of a new sample in every moving average, in (0, 1].
      straggler_factor: a live worker whose ``interval`` exceeds this many times
        the median of the live workers' is reported in :attr:`stragglers`.
      keep_stale_params: keep the parameters of every version a live worker may
        still push against, and pass them as ``stale_params``.
      max_stale_copies: bound on the number of kept copies (oldest evicted first;
        a push on an evicted version is dropped and its worker force-pulled), or
        ``None`` for only the bound by live references.
      check_finite: reject updates holding NaN or infinity.

    Deadlines. While any pull is blocked, every live worker that is not blocked
    itself must make progress (a push, or getting parameters) within

    .. math::

       T = \operatorname{clip}\big(k \cdot \max_{j\ \text{live}} \bar t_j,\
           T_{\min},\ T_{\max}\big)

    of its last progress, :math:`\bar t_j` the EWMA of worker :math:`j`'s measured
    ``interval`` (``initial_timeout`` for a worker with no measurement yet). A worker
    that misses its deadline is dropped (:class:`Drop`), the barriers proceed
    without it, and it may join again. Deadlines are adaptive: they follow the
    measured step times of the slowest live worker.

    Raises:
      ValueError: for bad arguments or an unknown policy name.
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
    ):
        raise NotImplementedError

    # Read-only state.

    @property
    def params(self) -> Any:
        """The current parameters (pytree of jax arrays) at :attr:`version`."""
        raise NotImplementedError

    @property
    def opt_state(self) -> Any:
        """The optimizer state."""
        raise NotImplementedError

    @property
    def version(self) -> int:
        """Number of applied updates (aggregates) since version 0."""
        raise NotImplementedError

    @property
    def policy(self) -> Any:
        """The policy object."""
        raise NotImplementedError

    @property
    def live(self) -> frozenset:
        """Ids of the live workers."""
        raise NotImplementedError

    @property
    def waiting(self) -> tuple:
        """Ids of the workers whose pull is blocked, in the order they blocked."""
        raise NotImplementedError

    @property
    def started(self) -> bool:
        """Whether the start (``expected_workers``) is over."""
        raise NotImplementedError

    @property
    def buffered(self) -> int:
        """Number of updates buffered and not yet applied."""
        raise NotImplementedError

    @property
    def buffer_contributors(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        raise NotImplementedError

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        raise NotImplementedError

    @property
    def stragglers(self) -> tuple:
        """Live workers slower than ``straggler_factor`` times the median."""
        raise NotImplementedError

    @property
    def stale_versions(self) -> tuple[int, ...]:
        """Versions whose parameters are kept for ``stale_params``."""
        raise NotImplementedError

    @property
    def epoch(self) -> int:
        """Counts the events handled; policies may key caches on it."""
        raise NotImplementedError

    def clock(self, worker_id: WorkerId) -> int:
        """A worker's clock (iterations done)."""
        raise NotImplementedError

    def pulled_version(self, worker_id: WorkerId) -> int:
        """The version last sent to a worker."""
        raise NotImplementedError

    def is_waiting(self, worker_id: WorkerId) -> bool:
        """Whether a worker's pull is blocked."""
        raise NotImplementedError

    def worker(self, worker_id: WorkerId) -> WorkerInfo:
        """A snapshot of a (live or past) worker's bookkeeping."""
        raise NotImplementedError

    def workers(self) -> dict:
        """Snapshots of every worker ever seen, by id."""
        raise NotImplementedError

    def stale_params(self, version: int) -> Any:
        """The kept parameters of ``version``."""
        raise NotImplementedError

    # Events.

    def join(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker joins (or rejoins); answered like a pull."""
        raise NotImplementedError

    def leave(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker leaves; the others' barriers proceed without it."""
        raise NotImplementedError

    def pull(self, worker_id: WorkerId, now: float) -> list[Action]:
        """A worker asks for parameters."""
        raise NotImplementedError

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
    ) -> list[Action]:
        """A worker pushes an update computed on parameters of ``version``."""
        raise NotImplementedError

    def tick(self, now: float) -> list[Action]:
        """Time passed: start or drop on expired deadlines."""
        raise NotImplementedError

    def next_deadline(self) -> float | None:
        """When :meth:`tick` should be called next, or ``None``."""
        raise NotImplementedError

    def set_stage(self, index: int, now: float) -> list[Action]:
        """Moves a staged policy (``"hybrid"``) to stage ``index``."""
        raise NotImplementedError

    # Checkpoints.

    def state_dict(self) -> dict:
        """The bookkeeping as plain Python values (msgpack-able)."""
        raise NotImplementedError

    def load_state_dict(
        self, state: Mapping, *, params: Any = None, opt_state: Any = None
    ) -> None:
        """Restores bookkeeping (and optionally params and optimizer state)."""
        raise NotImplementedError
