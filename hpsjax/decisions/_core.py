r"""The parameter server's decisions as a sans-I/O state machine.

:class:`ServerCore` takes one event at a time (:meth:`ServerCore.handle`: a
worker joined, pulled, began a push, pushed, left; time passed; the stage was
set; a speed was measured) and returns the actions to carry out, in order
(:mod:`hpsjax.decisions._actions`), reading no clock and doing no I/O: the
asyncio server and the virtual-clock simulator drive it alike, through one
:class:`~hpsjax.decisions.ActionInterpreter`. It is a thin composition of
three parts, each its own module: membership and deadlines
(:mod:`~hpsjax.decisions._membership`), versions and stale copies
(:mod:`~hpsjax.decisions._versions`), stages and re-planning
(:mod:`~hpsjax.decisions._stages`); it keeps only the start, who waits, and
the order in which the parts are asked. The arithmetic sits behind its
aggregator (:mod:`hpsjax.apply`), and its policy sees a
:class:`~hpsjax.decisions.PolicyView`. A call that raises changes nothing;
the sign convention (a worker pushes a gradient-like update, the server
optimizer turns it into the applied delta, as optax does on one machine) and
how to drive it are in the API documentation of :mod:`hpsjax.decisions`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from hpsjax._checks import check_int, check_worker_id, is_number
from hpsjax.apply import Aggregator
from hpsjax.decisions._actions import (
    Action,
    Applied,
    Drop,
    ForcePull,
    Joined,
    PlanChanged,
    PushAck,
    Release,
    SaveCheckpoint,
    SendParams,
    StageChanged,
    StartApply,
    Wait,
)
from hpsjax.decisions._admission import Admission
from hpsjax.decisions._events import (
    PushBegun,
    ServerEvent,
    SpeedMeasured,
    StageSet,
    Tick,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.decisions._membership import (
    STATE_FORMAT,
    Membership,
    WorkerInfo,
    WorkerRecord,
    restore_records,
)
from hpsjax.decisions._policies import PolicyView, get_policy
from hpsjax.decisions._stages import Stages
from hpsjax.decisions._versions import Versions
from hpsjax.wire import InvalidUpdate, PushMeta

__all__ = [
    "Action",
    "Applied",
    "Drop",
    "ForcePull",
    "Joined",
    "PlanChanged",
    "PushAck",
    "Release",
    "SaveCheckpoint",
    "SendParams",
    "ServerCore",
    "StageChanged",
    "StartApply",
    "Wait",
    "WorkerInfo",
]

WorkerId = Hashable
"""A worker's name: a ``str`` or an ``int`` (msgpack-able)."""


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
      checkpoint_every_s: also return a :class:`SaveCheckpoint` every this many
        seconds (of the times the driver passes, counted from the first event)
        when the version changed since the last one asked for by time, from
        the :meth:`tick` at that time (:meth:`next_deadline` includes it);
        ``None`` for never.

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
        checkpoint_every_s: float | None = None,
    ):
        check_int(
            "checkpoint_every_updates", checkpoint_every_updates, low=1, allow_none=True
        )
        self._members = Membership(
            deadline_factor=deadline_factor,
            min_timeout=min_timeout,
            max_timeout=max_timeout,
            initial_timeout=initial_timeout,
            ewma_alpha=ewma_alpha,
            straggler_factor=straggler_factor,
        )
        if policy_kwargs is not None and not isinstance(policy_kwargs, Mapping):
            raise ValueError("policy_kwargs must be a mapping or None.")
        self._policy = get_policy(policy, **dict(policy_kwargs or {}))
        self._view = PolicyView(self)
        self._admission = Admission(
            self._policy,
            self._view,
            self._members,
            expected_workers=expected_workers,
            start_timeout=start_timeout,
            send=self._send,
        )
        self._agg = aggregator(
            params,
            optimizer,
            check_finite=check_finite,
            check_result=check_result,
            keep_stale_params=keep_stale_params,
            max_stale_copies=max_stale_copies,
        )
        self._versions = Versions(
            self._agg,
            keep_stale_params=keep_stale_params,
            checkpoint_every_updates=checkpoint_every_updates,
            checkpoint_every_s=checkpoint_every_s,
            push_weights=push_weights,
        )
        self._stages = Stages(
            self._policy, replanner, replan_from_pushes=replan_from_pushes
        )
        self._now = -math.inf
        self._epoch = 0

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
        return self._versions.version

    @property
    def policy(self) -> Any:
        """The policy object."""
        return self._policy

    @property
    def live(self) -> frozenset:
        """Ids of the live workers."""
        return self._members.live_view

    @property
    def waiting(self) -> tuple:
        """Ids of the workers whose pull is blocked, in the order they blocked."""
        return tuple(self._members.waiting)

    @property
    def started(self) -> bool:
        """Whether the start (held for ``expected_workers``) is over."""
        return self._admission.started

    @property
    def buffered(self) -> int:
        """Number of updates buffered and not yet applied."""
        return len(self._versions.contributors)

    @property
    def buffer_contributors(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        return self._versions.contributor_view

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        return self._members.min_clock

    @property
    def stragglers(self) -> tuple:
        """Live workers whose ``interval`` exceeds ``straggler_factor`` x median."""
        return self._members.stragglers()

    @property
    def epoch(self) -> int:
        """Counts the events handled; policies may key caches on it."""
        return self._epoch

    @property
    def replanner(self) -> Any:
        """The re-planner :meth:`observe_speed` feeds, or ``None``."""
        return self._stages.replanner

    @property
    def stage(self) -> int | None:
        """The staged policy's stage as last announced (:class:`StageChanged`),
        or ``None`` for a policy without stages."""
        return self._stages.stage

    def clock(self, worker_id: WorkerId) -> int:
        """A worker's clock (iterations done); raises for an unknown worker."""
        return self._members.record(worker_id).clock

    def pulled_version(self, worker_id: WorkerId) -> int:
        """The version last sent to a worker; raises for an unknown worker."""
        return self._members.record(worker_id).pulled_version

    def is_waiting(self, worker_id: WorkerId) -> bool:
        """Whether a worker's pull is blocked."""
        return worker_id in self._members.waiting

    def worker(self, worker_id: WorkerId) -> WorkerInfo:
        """A snapshot of a (live or past) worker's bookkeeping.

        Raises:
          UnexpectedMessage: for a worker that never joined.
        """
        return self._members.info(worker_id)

    def workers(self) -> dict:
        """Snapshots of every worker ever seen, by id."""
        return {w: self._members.info(w) for w in self._members.workers}

    @property
    def stale_versions(self) -> tuple[int, ...]:
        """Versions whose parameters are kept for ``stale_params``."""
        return self._agg.stale_versions

    def stale_params(self, version: int) -> Any:
        """The parameters of ``version`` (kept copy, or the current ones).

        Raises:
          KeyError: if that version is not kept.
        """
        return self._agg.params_at(version, self._versions.version)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` should be called next, or ``None`` for never."""
        deadline = self._wait_deadline()
        save_at = self._versions.save_at
        if save_at is None or deadline is None:
            return deadline if save_at is None else save_at
        return min(save_at, deadline)

    def _wait_deadline(self) -> float | None:
        """The earliest deadline of a held start or a live worker, or ``None``."""
        start = self._admission.start_deadline()
        deadline = self._members.next_deadline()
        if start is None or deadline is None:
            return deadline if start is None else start
        return min(start, deadline)

    # Events.

    def handle(self, event: ServerEvent) -> list[Action]:
        """Takes one event, returns the actions it calls for, in order.

        The one way in for a driver: each event (:mod:`hpsjax.decisions._events`)
        goes to the method of its decision (:meth:`join`, :meth:`leave`,
        :meth:`pull`, :meth:`push_begun`, :meth:`push_message`, :meth:`tick`,
        :meth:`set_stage`, :meth:`observe_speed`), whose docstring says what it
        returns and raises; a call that raises changes nothing.

        Raises:
          TypeError: ``event`` is not a server event.
        """
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"not a server event: {event!r}")
        return handler(self, event)

    def _is_live(self, worker_id: WorkerId) -> bool:
        try:
            return worker_id in self._members.live
        except TypeError:  # unhashable: join refuses it
            return False

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
        self._versions.clock(now)

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
        members = self._members
        rec = members.workers.get(worker_id)
        if rec is None:
            rec = members.workers[worker_id] = WorkerRecord(worker_id)
        elif rec.live:
            self._remove(rec, reason=None)
        members.join(rec, now)
        self._admission.joined(now)
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
        rec = self._members.record(worker_id)
        if not rec.live:
            return []
        self._begin(now)
        self._remove(rec, reason=None)
        actions: list[Action] = []
        self._settle(now, actions)
        return actions

    def pull(
        self, worker_id: WorkerId, now: float, *, rejoin: bool = False
    ) -> list[Action]:
        """A worker asks for parameters.

        Args:
          worker_id: a live worker.
          now: the time (s).
          rejoin: a worker that never joined or is no longer live joins
            (:meth:`join`), its answer preceded by a :class:`Joined`.

        Returns:
          ``[SendParams]`` if the policy admits it now, else ``[Wait]`` (and a
          later event returns ``Release`` and ``SendParams`` for it); then any
          releases of others the pull allows (a worker that refreshes its
          parameters may unblock workers waiting on its staleness). A pull from
          a worker already waiting is examined again like a new one.

        Raises:
          UnexpectedMessage: for a worker that never joined (without
            ``rejoin``).
          WorkerDropped: for a worker that left or was dropped (without
            ``rejoin``).
        """
        if rejoin and not self._is_live(worker_id):
            actions = self.join(worker_id, now)
            return [Joined(worker_id, self._versions.version), *actions]
        now = self._check_now(now)
        rec = self._members.live_record(worker_id)
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
        is applied when the policy says so. The fields are checked as the wire
        checks them (:meth:`~hpsjax.wire.PushMeta.from_wire`) and the update
        against the parameters, then it is :meth:`push_message`.

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
          ``[PushAck, ForcePull?, Applied?, ForcePull (stops)...,
          SaveCheckpoint?, StageChanged?, Release/SendParams..., PlanChanged?]``.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped.
          InvalidUpdate: for a version out of range or a bad measurement.
          SpecMismatch: tree structure, shape or dtype differs from the params.
          NonFiniteUpdate: NaN or infinity in the update (``check_finite``).
        """
        self._check_now(now)
        self._members.live_record(worker_id)
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

    def push_begun(
        self, worker_id: WorkerId, version: Any, num_samples: Any, now: float
    ) -> list[Action]:
        """A push's metadata arrived; its leaves are coming.

        Checks and changes nothing (the push is checked once, whole, by
        :meth:`push_message`).

        Returns:
          ``[StartApply]`` where the policy applies this push at once
          (:meth:`~hpsjax.decisions.Policy.completes`) and its metadata is
          plausible now, else ``[]``.
        """
        if (
            type(version) is not int
            or not 0 <= version <= self._versions.version
            or worker_id not in self._members.live
            or self._policy.completes(self._view, worker_id) is not True
        ):
            return []
        return [self._versions.start_apply(worker_id, version, num_samples)]

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
        depends on the server's state is checked here, once: the worker (live),
        ``meta.version`` against the server version, and ``meta.stage``
        against the policy's stages.

        Returns:
          ``[PushAck, ForcePull?, Applied?, ForcePull (stops)...,
          SaveCheckpoint?, StageChanged?, Release/SendParams..., PlanChanged?]``.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped (saying why).
          InvalidUpdate: for a version past the server's, or a stage past the
            policy's last.
        """
        now = self._check_now(now)
        version = meta.version
        versions = self._versions
        rec = self._members.live_record(worker_id)
        if not 0 <= version <= versions.version:
            raise InvalidUpdate(
                f"push version must be an int in [0, {versions.version}] (the "
                f"server version), got {version!r}"
            )
        switch = self._stages.switch(meta)
        stage_before = self._policy.stage
        staleness = versions.version - version
        weight, force_pull, reason, stale, args = versions.judge(
            self._policy, self._view, worker_id, version
        )
        pending = None
        tau = max(versions.staleness, staleness)
        if weight > 0:
            pending = self._agg.candidate(
                update,
                weight,
                meta.num_samples or 1,
                tau,
                version,
                stale,
                completes=self._policy.completes(self._view, worker_id),
                args=args,
            )
        # Nothing raises past this point: the push is taken.
        self._begin(now)
        self._record_push(rec, meta, now)
        if pending is not None:
            self._agg.commit(pending)
            versions.buffer(worker_id, tau)
        else:
            rec.dropped_updates += 1
        tail: list[Action] = []
        status = self._after_push(rec, meta, switch, pending is not None, now, tail)
        stage = self._policy.stage if stage_before is not None else None
        reason = reason if reason or not force_pull else "pull fresh parameters"
        actions: list[Action] = [
            PushAck(
                worker_id=worker_id,
                version=versions.version,
                staleness=staleness,
                status=status,
                weight=float(weight),
                local_steps=self._policy.local_steps(self._view, worker_id),
                reason=reason,
                force_pull=force_pull,
                stage=None if stage == stage_before else stage,
            )
        ]
        if force_pull:
            actions.append(ForcePull(worker_id, reason))
        actions.extend(tail)
        return actions

    def _after_push(
        self,
        rec: WorkerRecord,
        meta: PushMeta,
        switch: bool,
        buffered: bool,
        now: float,
        actions: list[Action],
    ) -> str:
        """What a taken push sets off (applies, releases, a stage, a plan); its
        status: ``"applied"``, ``"buffered"`` or ``"dropped"``."""
        policy, view = self._policy, self._view
        status = "buffered" if buffered else "dropped"
        policy.on_push(view, rec.worker_id, now)
        if policy.stage != self._stages.stage:
            self._stages.note(self._versions.version, actions)
        if self._versions.contributors and policy.ready(view):
            self._apply(now, actions)
            if buffered:
                status = "applied"
        self._release(now, actions)
        if switch:
            # The worker's staged optimizer moved on (ASHL: a flat loss): the
            # server follows, after the push was handled in the stage it was
            # computed in.
            policy.set_stage(view, meta.stage)
            self._stages.note(self._versions.version, actions)
            self._admission.forget_key()
            self._settle(now, actions)
        actions += self._stages.observe_push(
            rec.worker_id, meta, rec.overhead, now, self._versions.version
        )
        return status

    def _record_push(self, rec: WorkerRecord, meta: PushMeta, now: float) -> None:
        """A push in its worker's record, its references and its deadline."""
        self._members.record_push(rec, meta, now)
        if rec.worker_id in self._members.waiting:
            # Its own clock, which admission reads, changes while it is blocked.
            self._admission.forget_key()
        self._versions.pushed(rec, meta.version)
        self._members.progress(rec, now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: ends a held start, drops workers past their deadline.

        Call it at :meth:`next_deadline` (calling it earlier or more often is
        harmless).

        Args:
          now: the time (s).

        Returns:
          ``Drop`` actions, then the applies and releases they allow, then a
          :class:`SaveCheckpoint` due by time.
        """
        now = self._check_now(now)
        self._begin(now)
        actions: list[Action] = []
        self._admission.tick(now)
        for rec in self._members.expired(now):
            reason = (
                f"worker {rec.worker_id!r} made no progress for "
                f"{now - rec.progress_at:.1f} s (deadline {rec.timeout:.1f} s)"
            )
            self._remove(rec, reason=reason)
            actions.append(Drop(rec.worker_id, reason))
        self._settle(now, actions)
        self._versions.timed_save(now, actions)
        return actions

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
        self._admission.forget_key()
        actions: list[Action] = []
        self._stages.note(self._versions.version, actions)
        self._settle(now, actions)
        return actions

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
        return self._stages.observe_speed(
            worker_id, batch_size, time_per_step, now, self._versions.version
        )

    # Who waits.

    def _pull(self, rec: WorkerRecord, now: float, actions: list[Action]) -> None:
        self._admission.pull(
            rec, now, self._versions.version, self._wait_deadline, actions
        )

    def _send(self, rec: WorkerRecord, now: float, actions: list[Action]) -> None:
        self._versions.sent(rec)
        rec.last_start = now
        self._members.progress(rec, now)
        actions.append(
            SendParams(
                rec.worker_id,
                self._versions.version,
                self._policy.local_steps(self._view, rec.worker_id),
            )
        )

    def _remove(self, rec: WorkerRecord, *, reason: str | None) -> None:
        self._members.remove(rec, reason)
        self._admission.forget_key()
        self._versions.forget(rec)

    def _release(self, now: float, actions: list[Action]) -> None:
        self._admission.release(now, self._versions.version, actions)

    def _settle(self, now: float, actions: list[Action]) -> None:
        if self._versions.contributors and self._policy.ready(self._view):
            self._apply(now, actions)
        self._release(now, actions)

    def _apply(self, now: float, actions: list[Action]) -> None:
        self._versions.apply(self._members.workers, actions)
        policy = self._policy
        policy.on_apply(self._view, now)
        actions.extend(
            ForcePull(w, why, stop=True) for w, why in policy.stops(self._view)
        )
        if policy.stage != self._stages.stage:
            self._stages.note(self._versions.version, actions)

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
            "format": STATE_FORMAT,
            "policy": self._policy.name,
            "policy_state": self._policy.state_dict(),
            "version": self._versions.version,
            "max_clock": self._members.max_clock,
            "workers": [rec.saved() for rec in self._members.workers.values()],
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
        records = restore_records(state, self._policy.name)
        new_params, new_opt_state = self._agg.check_restore(params, opt_state)
        # The policy checks its state before changing anything, and nothing
        # after it can fail, so a bad state leaves the core as it was.
        self._policy.load_state_dict(state["policy_state"])
        self._stages.restored()
        self._agg.restore(new_params, new_opt_state)
        self._epoch += 1
        self._versions.reset(int(state["version"]))
        self._members.reset(records, int(state["max_clock"]))
        self._admission.hold_start()


_HANDLERS: dict[type, Callable[[ServerCore, Any], list[Action]]] = {
    WorkerJoined: lambda core, e: core.join(e.worker_id, e.now),
    WorkerLeft: lambda core, e: core.leave(e.worker_id, e.now),
    WorkerPulled: lambda core, e: core.pull(e.worker_id, e.now, rejoin=e.rejoin),
    PushBegun: lambda core, e: core.push_begun(
        e.worker_id, e.version, e.num_samples, e.now
    ),
    WorkerPushed: lambda core, e: core.push_message(
        e.worker_id, e.update, e.meta, now=e.now
    ),
    Tick: lambda core, e: core.tick(e.now),
    StageSet: lambda core, e: core.set_stage(e.index, e.now),
    SpeedMeasured: lambda core, e: core.observe_speed(
        e.worker_id, e.batch_size, e.time_per_step, e.now
    ),
}
