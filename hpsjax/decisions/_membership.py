r"""Membership and deadlines: who is live, their clocks, times and deadlines.

:class:`Membership` is the part of :class:`~hpsjax.decisions.ServerCore` that
keeps every worker's bookkeeping (a :class:`WorkerRecord` each, a
:class:`WorkerInfo` snapshot for readers), the live set and its clocks, whose
pull is blocked since when, and the deadlines by which live workers must make
progress while a pull is blocked:

.. math::

   T = \operatorname{clip}\big(k \cdot \max_{j\ \text{live}} \bar t_j,\
       T_{\min},\ T_{\max}\big)

of a worker's last progress (a push, or getting parameters), :math:`\bar t_j`
the EWMA of worker :math:`j`'s measured ``interval`` (``initial_timeout`` for
a worker that has not pushed since it joined: its first round may compile).
It decides nothing about versions or policies; the core asks it and tells it.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import numpy as np

from hpsjax._checks import (
    check_fraction,
    check_positive,
    check_worker_id,
    is_int,
    is_number,
)
from hpsjax._ewma import ewma
from hpsjax.wire import PushMeta, UnexpectedMessage, WorkerDropped

__all__ = ["Membership", "WorkerInfo", "WorkerRecord", "free_worker_id"]

WorkerId = Hashable

# Fields of a worker record that a checkpoint keeps; times are the driver's clock
# and do not survive a restart, so they are left out.
SAVED_FIELDS = (
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


class WorkerRecord:
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

    def saved(self) -> dict:
        """The fields a checkpoint keeps, with the worker's id."""
        return {"worker_id": self.worker_id} | {
            name: getattr(self, name) for name in SAVED_FIELDS
        }


def free_worker_id(*taken: Iterable[WorkerId]) -> int:
    """The id a server assigns to a worker that asks for one: the lowest int
    >= 0 in none of ``taken`` (the ids of every worker it has seen, of its
    connections, and those it assigned before: an id is never handed out twice,
    so a worker that asked can connect again under it).

    Examples:
      >>> free_worker_id({0: "seen", "gpu0": "seen"}, [2], {1})
      3
      >>> free_worker_id()
      0
    """
    used = set().union(*taken)
    worker_id = 0
    while worker_id in used:
        worker_id += 1
    return worker_id


STATE_FORMAT = 1
_STATE_KEYS = frozenset(
    {"format", "policy", "policy_state", "version", "max_clock", "workers"}
)


def restore_records(state: Any, policy: str) -> dict[WorkerId, WorkerRecord]:
    """The worker records of a core's checked state, saved under ``policy``.

    Raises:
      ValueError: for a malformed state or another policy.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a mapping, got {type(state).__name__}.")
    if set(state) != _STATE_KEYS:
        raise ValueError(
            f"state needs exactly the keys {sorted(_STATE_KEYS)}, got {sorted(state)}."
        )
    if state["format"] != STATE_FORMAT:
        raise ValueError(f"Unknown state format {state['format']!r}.")
    if state["policy"] != policy:
        raise ValueError(
            f"state was saved with policy {state['policy']!r}, this core runs "
            f"{policy!r}."
        )
    for key in ("version", "max_clock"):
        if not is_int(state[key]) or state[key] < 0:
            raise ValueError(f"state[{key!r}] must be an int >= 0.")
    records = {}
    for entry in state["workers"]:
        if not isinstance(entry, Mapping) or set(entry) != {
            "worker_id",
            *SAVED_FIELDS,
        }:
            raise ValueError(f"Malformed worker entry in state: {entry!r}.")
        worker_id = entry["worker_id"]
        check_worker_id("worker_id", worker_id)
        rec = WorkerRecord(worker_id)
        try:
            for name in SAVED_FIELDS:
                setattr(rec, name, _restore_field(name, entry[name]))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"Malformed worker entry for {worker_id!r}: {err}"
            ) from None
        records[worker_id] = rec
    return records


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


class Membership:
    """The workers' bookkeeping, the live set, the blocked pulls, the deadlines.

    Args:
      deadline_factor: :math:`k`, > 0.
      min_timeout: :math:`T_{\\min}` (s), > 0.
      max_timeout: :math:`T_{\\max}` (s), or ``None``.
      initial_timeout: timeout (s) of a worker that has not pushed since it
        (re)joined.
      ewma_alpha: weight of a new sample in every moving average.
      straggler_factor: a live worker whose ``interval`` exceeds this many
        times the live workers' median is a straggler.

    Raises:
      ValueError: for a bad argument.

    Attributes:
      workers: every worker ever seen, by id.
      live: ids of the live workers (a set; :attr:`live_view` is frozen).
      waiting: the workers whose pull is blocked, with when it blocked, in the
        order they blocked.
      max_clock: the largest clock any worker reached.
    """

    def __init__(
        self,
        *,
        deadline_factor: float,
        min_timeout: float,
        max_timeout: float | None,
        initial_timeout: float,
        ewma_alpha: float,
        straggler_factor: float,
    ):
        for name, value in (
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
        self._deadline_factor = float(deadline_factor)
        self._min_timeout = float(min_timeout)
        self._max_timeout = None if max_timeout is None else float(max_timeout)
        self._initial_timeout = float(initial_timeout)
        self._alpha = float(ewma_alpha)
        self._straggler_factor = float(straggler_factor)
        self.reset({}, 0)

    def reset(self, records: dict[WorkerId, WorkerRecord], max_clock: int) -> None:
        """These workers, none live, none waiting, no deadlines."""
        self.workers = records
        self.max_clock = max_clock
        self.live: set[WorkerId] = set()
        self.waiting: dict[WorkerId, float] = {}
        # How many live workers are at each clock.
        self._clock_counts: dict[int, int] = {}
        self._min_clock_cache: int | None = None
        self._max_interval_cache: float | None = None
        self._heap: list[tuple[float, int, WorkerId]] = []
        self._heap_seq = 0
        self._live_changed()

    # Reads.

    @property
    def live_view(self) -> frozenset:
        """Ids of the live workers."""
        return self._live_view

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        if not self._min_clock_valid:
            self._min_clock_cache = min(self._clock_counts, default=None)
            self._min_clock_valid = True
        return self._min_clock_cache

    @property
    def heap_size(self) -> int:
        """Entries in the deadline heap (stale ones included)."""
        return len(self._heap)

    def stragglers(self) -> tuple:
        """Live workers whose ``interval`` exceeds ``straggler_factor`` x median."""
        timed = [
            (w, self.workers[w].interval)
            for w in self.live
            if self.workers[w].interval is not None
        ]
        if len(timed) < 2:
            return ()
        median = float(np.median([t for _, t in timed]))
        return tuple(
            sorted(
                (w for w, t in timed if t > self._straggler_factor * median), key=str
            )
        )

    def record(self, worker_id: WorkerId) -> WorkerRecord:
        """A worker's record.

        Raises:
          UnexpectedMessage: for a worker that never joined.
        """
        try:
            return self.workers[worker_id]
        except (KeyError, TypeError):
            raise UnexpectedMessage(
                f"worker {worker_id!r} has not joined; join first"
            ) from None

    def live_record(self, worker_id: WorkerId) -> WorkerRecord:
        """A live worker's record.

        Raises:
          UnexpectedMessage: for a worker that never joined.
          WorkerDropped: for a worker that left or was dropped (saying why).
        """
        rec = self.record(worker_id)
        if not rec.live:
            how = rec.dropped_reason or "left"
            raise WorkerDropped(f"worker {worker_id!r} is not live ({how}); join again")
        return rec

    def clock(self, worker_id: WorkerId) -> int:
        """A worker's clock (iterations done); raises for an unknown worker."""
        return self.record(worker_id).clock

    def pulled_version(self, worker_id: WorkerId) -> int:
        """The version last sent to a worker; raises for an unknown worker."""
        return self.record(worker_id).pulled_version

    def is_waiting(self, worker_id: WorkerId) -> bool:
        """Whether a worker's pull is blocked."""
        return worker_id in self.waiting

    def info(self, worker_id: WorkerId) -> WorkerInfo:
        """A snapshot of a (live or past) worker's bookkeeping.

        Raises:
          UnexpectedMessage: for a worker that never joined.
        """
        rec = self.record(worker_id)
        return WorkerInfo(
            worker_id=rec.worker_id,
            live=rec.live,
            waiting=rec.worker_id in self.waiting,
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

    # Changes.

    def join(self, rec: WorkerRecord, now: float) -> None:
        """A (not live) worker joins at the smallest clock among the live ones,
        so it never holds the others back more than the slowest already does."""
        others = self.min_clock
        rec.clock = self.max_clock if others is None else others
        rec.live = True
        rec.joins += 1
        rec.dropped_reason = None
        rec.pushed_version = None
        rec.last_start = now
        rec.deadline = None
        rec.rounds = 0
        self.live.add(rec.worker_id)
        self._clock_counts[rec.clock] = self._clock_counts.get(rec.clock, 0) + 1
        self._live_changed()

    def remove(self, rec: WorkerRecord, reason: str | None) -> None:
        """A worker leaves the live set (its blocked pull with it)."""
        rec.live = False
        rec.dropped_reason = reason
        rec.deadline = None
        self.waiting.pop(rec.worker_id, None)
        self.live.discard(rec.worker_id)
        count = self._clock_counts.pop(rec.clock) - 1
        if count:
            self._clock_counts[rec.clock] = count
        self._live_changed()

    def record_push(self, rec: WorkerRecord, meta: PushMeta, now: float) -> None:
        """A push's measurements and clock in its worker's record."""
        step_time, local_steps, loss = meta.step_time, meta.local_steps, meta.loss
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
        self.max_clock = max(self.max_clock, clock)
        rec.pushes += 1
        rec.rounds += 1
        rec.pushed_version = meta.version
        rec.last_loss = None if loss is None else float(loss)
        rec.last_start = now

    # Deadlines.

    def progress(self, rec: WorkerRecord, now: float) -> None:
        """A worker made progress: its deadline moves to ``now`` plus its timeout."""
        rec.timeout = self._timeout(rec)
        rec.progress_at = now
        rec.deadline = now + rec.timeout
        self._heap_seq += 1
        heapq.heappush(self._heap, (rec.deadline, self._heap_seq, rec.worker_id))
        if len(self._heap) > 4 * len(self.live) + 64:
            # Entries go stale as workers progress; rebuild rather than grow.
            heap = []
            for w in self.live:
                r = self.workers[w]
                if r.deadline is not None and w not in self.waiting:
                    self._heap_seq += 1
                    heap.append((r.deadline, self._heap_seq, w))
            heapq.heapify(heap)
            self._heap = heap

    def expired(self, now: float) -> list[WorkerRecord]:
        """The live workers past their deadline at ``now`` while a pull is
        blocked, in deadline order (their heap entries taken off)."""
        if not self.waiting:
            return []
        expired = {}
        while self._heap and self._heap[0][0] <= now:
            deadline, _, w = heapq.heappop(self._heap)
            rec = self.workers[w]
            if self._deadline_valid(rec, deadline):
                expired[w] = rec
        return list(expired.values())

    def next_deadline(self) -> float | None:
        """The earliest deadline now in force, or ``None``: none while no pull
        is blocked."""
        if not self.waiting:
            return None
        heap = self._heap
        while heap and not self._deadline_valid(self.workers[heap[0][2]], heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _deadline_valid(self, rec: WorkerRecord, deadline: float) -> bool:
        return (
            rec.live and rec.deadline == deadline and rec.worker_id not in self.waiting
        )

    def _timeout(self, rec: WorkerRecord) -> float:
        if rec.interval is None or not rec.rounds:
            # Nothing measured since it joined: its first round may compile,
            # and what was measured before (another process, before a
            # restart) says nothing of this one.
            return self._initial_timeout
        if not self._max_interval_valid:
            workers = self.workers
            self._max_interval_cache = max(
                (
                    workers[w].interval
                    for w in self.live
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

    def _live_changed(self) -> None:
        self._live_view = frozenset(self.live)
        self._min_clock_valid = False
        self._max_interval_valid = False
