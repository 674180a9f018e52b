"""Who waits: the start held for the expected workers, and blocked pulls.

:class:`Admission` is the part of :class:`~hpsjax.decisions.ServerCore` that
answers a pull (send now, or hold it with a :class:`~hpsjax.decisions.Wait`)
and releases held pulls when the policy admits them, re-examining them only
when the policy's admission key says something changed; it holds every pull
until ``expected_workers`` are live or ``start_timeout`` passed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpsjax._checks import check_int, check_positive
from hpsjax.decisions._actions import Action, Release, Wait
from hpsjax.decisions._membership import Membership, WorkerRecord

__all__ = ["Admission"]

# Equal to no admission key: blocked workers must be examined again.
_UNKNOWN_KEY = object()


class Admission:
    """The start and the blocked pulls.

    Args:
      policy: the core's policy.
      view: the policy's view of the core.
      members: the core's membership (its ``waiting`` are the blocked pulls).
      expected_workers: hold every pull until this many workers are live, or
        ``None``.
      start_timeout: seconds after the first join when a held start begins.
      send: ``send(record, now, actions)``, the core's answer to an admitted
        pull.

    Raises:
      ValueError: for a bad ``expected_workers`` or ``start_timeout``.
    """

    def __init__(
        self,
        policy: Any,
        view: Any,
        members: Membership,
        *,
        expected_workers: int | None,
        start_timeout: float,
        send: Callable[[WorkerRecord, float, list[Action]], None],
    ):
        check_int("expected_workers", expected_workers, low=1, allow_none=True)
        check_positive("start_timeout", start_timeout)
        self._policy = policy
        self._view = view
        self._members = members
        self._expected = expected_workers
        self._start_timeout = float(start_timeout)
        self._send = send
        self.hold_start()

    def hold_start(self) -> None:
        """The start held again (``expected_workers``), no admission key known."""
        # The policy's admission key at which every blocked worker was last
        # refused; while it holds, re-examining them cannot release anyone.
        self._key: Any = _UNKNOWN_KEY
        self.started = self._expected is None
        self._start_deadline: float | None = None

    def forget_key(self) -> None:
        """Something the policy's admission reads changed: examine again."""
        self._key = _UNKNOWN_KEY

    def joined(self, now: float) -> None:
        """A worker joined: the held start's timeout runs from the first join."""
        if not self.started:
            if self._start_deadline is None:
                self._start_deadline = now + self._start_timeout
            if len(self._members.live) >= self._expected:
                self.started = True

    def tick(self, now: float) -> None:
        """Time passed: a held start past its timeout begins."""
        if (
            not self.started
            and self._start_deadline is not None
            and now >= self._start_deadline
        ):
            self.started = True

    def start_deadline(self) -> float | None:
        """When a held start begins anyway, or ``None``."""
        return None if self.started else self._start_deadline

    def pull(
        self,
        rec: WorkerRecord,
        now: float,
        version: int,
        until: Callable[[], float | None],
        actions: list[Action],
    ) -> None:
        """A pull: answered now (``send``), or held with a :class:`Wait`
        (``until()`` its earliest deadline)."""
        worker_id = rec.worker_id
        waiting = self._members.waiting
        since = waiting.get(worker_id)
        if since is None:
            # A worker counts as waiting while the policy judges its pull, so
            # "the workers not waiting" never includes the one asking.
            waiting[worker_id] = now
        if self.started and self._policy.admit(self._view, worker_id):
            del waiting[worker_id]
            if since is not None:
                actions.append(Release(worker_id, version, now - since))
            self._send(rec, now, actions)
            return
        if not self.started:
            self._key = _UNKNOWN_KEY
        else:
            key = self._policy.admit_key(self._view)
            if key is None or (len(waiting) > 1 and key != self._key):
                self._key = _UNKNOWN_KEY
            else:
                self._key = key
        actions.append(Wait(worker_id, until=until(), reason=self._wait_reason(rec)))

    def _wait_reason(self, rec: WorkerRecord) -> str:
        if not self.started:
            return (
                f"start: {len(self._members.live)} of {self._expected} "
                "expected workers live"
            )
        return self._policy.wait_reason(self._view, rec.worker_id)

    def release(self, now: float, version: int, actions: list[Action]) -> None:
        """Releases the blocked pulls the policy admits now, in the order they
        blocked."""
        waiting = self._members.waiting
        if not waiting or not self.started:
            return
        policy = self._policy
        view = self._view
        key = policy.admit_key(view)
        if key is not None and key == self._key:
            return
        workers = self._members.workers
        for worker_id, since in list(waiting.items()):
            if policy.admit(view, worker_id):
                del waiting[worker_id]
                actions.append(Release(worker_id, version, now - since))
                self._send(workers[worker_id], now, actions)
        # Releases may have moved the key; then the refusals say nothing.
        if key is not None and policy.admit_key(view) == key:
            self._key = key
        else:
            self._key = _UNKNOWN_KEY
