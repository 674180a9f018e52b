r"""Versions and stale copies: the version, the buffer of updates, kept copies.

:class:`Versions` is the part of :class:`~hpsjax.decisions.ServerCore` that
counts versions, keeps the buffer of accepted updates until the policy says
apply, asks its aggregator (:mod:`hpsjax.apply`) for the arithmetic, keeps the
stale copies live workers may still push against, and says when to save a
checkpoint. Updates accepted by the policy are buffered with a weight
:math:`n_j d_j` (:math:`n_j` the ``num_samples`` of the push, :math:`d_j` the
policy's damping times the worker's ``push_weights`` entry); an apply gives
the optimizer their weighted average
:math:`\bar u = \sum_j n_j d_j u_j / \sum_j n_j` with the largest staleness of
the buffered updates, and the version increases by one: the one place where
batches are weighted.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any

from hpsjax._checks import check_positive, is_number
from hpsjax.decisions._actions import Action, Applied, SaveCheckpoint, StartApply
from hpsjax.decisions._membership import WorkerRecord
from hpsjax.decisions._policy import Verdict

__all__ = ["Versions"]

WorkerId = Hashable


class Versions:
    """The version, the buffered updates, the stale copies kept.

    Args:
      aggregator: the arithmetic (parameters, optimizer state, the buffered
        mean, stale copies).
      keep_stale_params: keep a copy of every version a live worker may push
        against.
      checkpoint_every_updates: ask for a checkpoint every this many new
        versions, or ``None``.
      checkpoint_every_s: ask for a checkpoint of a version not yet saved
        every this many seconds of the driver's clock, or ``None``.
      push_weights: a factor per worker id on every push of that worker, or
        ``None``.

    Raises:
      ValueError: for bad ``push_weights``.

    Attributes:
      version: the current version.
      contributors: the workers with an update in the buffer, in push order.
      staleness: the largest staleness among the buffered updates.
    """

    def __init__(
        self,
        aggregator: Any,
        *,
        keep_stale_params: bool,
        checkpoint_every_updates: int | None,
        checkpoint_every_s: float | None = None,
        push_weights: Mapping[Any, float] | None = None,
    ):
        check_positive("checkpoint_every_s", checkpoint_every_s, allow_none=True)
        self._checkpoint_every_s = checkpoint_every_s
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
        self._push_weights = None if push_weights is None else dict(push_weights)
        self.agg = aggregator
        self.keep_stale = bool(keep_stale_params)
        self._checkpoint_every = checkpoint_every_updates
        self.reset(0)

    def reset(self, version: int) -> None:
        """At ``version`` (the last checkpointed), no buffer, no copies referred to."""
        self.version = self._checkpointed_version = self._timed_version = version
        # When the next timed checkpoint is due (set by the first event).
        self.save_at: float | None = None
        # Live references to each version kept for stale_params.
        self._refcount: dict[int, int] = {}
        self.reset_buffer()

    def reset_buffer(self) -> None:
        """An empty buffer."""
        self.contributors: list[WorkerId] = []
        self._contributor_view: frozenset | None = None
        self.staleness = 0

    @property
    def contributor_view(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        if self._contributor_view is None:
            self._contributor_view = frozenset(self.contributors)
        return self._contributor_view

    def buffer(self, worker_id: WorkerId, staleness: int) -> None:
        """An update of ``worker_id`` went into the buffer (its arithmetic is
        the aggregator's); ``staleness`` the buffer's largest."""
        self.contributors.append(worker_id)
        self._contributor_view = None
        self.staleness = staleness

    def _weight(self, worker_id: WorkerId) -> float:
        if self._push_weights is None:
            return 1.0
        return float(self._push_weights.get(worker_id, 1.0))

    def judge(
        self, policy: Any, view: Any, worker_id: WorkerId, version: int
    ) -> tuple[float, bool, str | None, Any, Any]:
        """The verdict on a push on ``version``: ``(weight, force_pull, reason,
        stale, args)`` (``args``: the verdict's optimizer arguments).

        ``weight`` is the policy's times the worker's ``push_weights`` entry;
        ``stale`` is the kept copy of ``version`` (``keep_stale_params``), and
        a push on a version no copy is kept of gets weight 0 and a forced pull.

        Raises:
          ValueError: the policy returned no :class:`Verdict`, or a bad weight.
        """
        stale = None
        if self.keep_stale:
            stale = self.agg.copy_of(version, self.version)
            if stale is None:
                reason = f"no stale copy of version {version} is kept"
                return 0.0, True, reason, None, None
        verdict = policy.judge(view, worker_id, self.version - version)
        if not isinstance(verdict, Verdict):
            raise ValueError(
                f"Policy {policy.name!r}.judge returned "
                f"{type(verdict).__name__}, not a Verdict."
            )
        weight = verdict.weight
        if not is_number(weight) or not (math.isfinite(weight) and weight >= 0):
            raise ValueError(
                f"Policy {policy.name!r} returned weight "
                f"{weight!r}; weights are finite and >= 0."
            )
        if self._push_weights is not None:
            weight *= self._weight(worker_id)
        return weight, bool(verdict.force_pull), verdict.reason, stale, verdict.args

    def start_apply(
        self, worker_id: WorkerId, version: int, num_samples: Any
    ) -> StartApply:
        """How a push on ``version`` that completes a version is aggregated,
        for an apply started as it arrives."""
        samples = num_samples if type(num_samples) is int and num_samples > 0 else 1
        staleness = max(self.staleness, self.version - version)
        return StartApply(worker_id, self._weight(worker_id), samples, staleness)

    def sent(self, rec: WorkerRecord) -> None:
        """The current version was sent to a worker: keep its copy while the
        worker may push against it."""
        version = self.version
        rec.pulled_version = version
        if self.keep_stale and (not rec.refs or rec.refs[-1] != version):
            rec.refs.append(version)
            self._refcount[version] = self._refcount.get(version, 0) + 1
            self.agg.keep_copy(version)

    def pushed(self, rec: WorkerRecord, version: int) -> None:
        """A worker pushed against ``version``: it never pushes against an
        older one again."""
        refs = rec.refs
        while refs and refs[0] < version:
            self._unref(refs.pop(0))

    def forget(self, rec: WorkerRecord) -> None:
        """A worker left: the copies it referred to may go."""
        for version in rec.refs:
            self._unref(version)
        rec.refs = []

    def _unref(self, version: int) -> None:
        count = self._refcount.get(version, 0) - 1
        if count > 0:
            self._refcount[version] = count
        else:
            self._refcount.pop(version, None)
            self.agg.drop_copy(version)

    def clock(self, now: float) -> None:
        """The driver's time: the timed checkpoints start from the first event."""
        if self.save_at is None and self._checkpoint_every_s is not None:
            self.save_at = now + self._checkpoint_every_s

    def timed_save(self, now: float, actions: list[Action]) -> None:
        """A :class:`SaveCheckpoint` where one is due by time and the version
        changed since the last one due by time."""
        if self.save_at is None or now < self.save_at:
            return
        self.save_at = now + self._checkpoint_every_s
        if self.version != self._timed_version:
            self._timed_version = self.version
            actions.append(SaveCheckpoint(self.version))

    def apply(
        self, workers: dict[WorkerId, WorkerRecord], actions: list[Action]
    ) -> None:
        """Applies the buffer as a new version: :class:`Applied`, and a
        :class:`SaveCheckpoint` where one is due."""
        self.version += 1
        self.agg.apply(self.version, self.staleness)
        contributors = tuple(self.contributors)
        for worker_id in contributors:
            workers[worker_id].applied += 1
        actions.append(
            Applied(
                version=self.version,
                contributors=contributors,
                staleness=self.staleness,
                num_updates=len(contributors),
            )
        )
        self.reset_buffer()
        every = self._checkpoint_every
        if every and self.version - self._checkpointed_version >= every:
            self._checkpointed_version = self.version
            actions.append(SaveCheckpoint(self.version))
