"""What a simulation returns: :class:`SimResult` and the records it is made of.

Pushes, sends and applies as the server saw them, workers' timelines of
compute and transfer (:class:`Interval`), the first divergence, metrics over
virtual time and the run's totals, all plain values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from hpsjax.planning import WorkPlan

__all__ = [
    "ApplyRecord",
    "Divergence",
    "Interval",
    "PushRecord",
    "SendRecord",
    "SimResult",
]


class Interval(NamedTuple):
    """A span of virtual time.

    Attributes:
      start: seconds.
      end: seconds, ``>= start``.
      kind: for worker timelines ``"compute"``, ``"discarded"`` (compute thrown
        away on a force-pull or drop), ``"transfer"`` (blocked on its own
        messages) or ``"wait"`` (blocked by the server: a barrier); for link
        transfers ``"push"`` or ``"pull"``.
    """

    start: float
    end: float
    kind: str


class PushRecord(NamedTuple):
    """One push as the server handled it.

    Attributes:
      time: arrival at the server (s).
      sent: when the worker sent it (s).
      worker_id: the worker.
      version: the version it was computed on.
      staleness: server version at arrival minus ``version``.
      status: ``"applied"``, ``"buffered"``, ``"dropped"`` or ``"rejected"`` (the
        server refused it: an error, see ``SimResult.errors``).
      weight: the policy's damping factor.
      local_steps: local steps behind it.
      batch_size: samples per local step.
      loss: mean training loss of its local steps.
    """

    time: float
    sent: float
    worker_id: Any
    version: int
    staleness: int
    status: str
    weight: float
    local_steps: int
    batch_size: int
    loss: float


class SendRecord(NamedTuple):
    """Parameters sent to a worker (the answer to a pull or join).

    Attributes:
      time: seconds.
      worker_id: the worker.
      version: the version sent.
      clock: the worker's clock (pushes) at that moment.
      min_clock: the smallest clock among live workers at that moment.
    """

    time: float
    worker_id: Any
    version: int
    clock: int
    min_clock: int


class ApplyRecord(NamedTuple):
    """A new server version.

    Attributes:
      time: seconds.
      version: the new version.
      num_updates: updates averaged into it.
      staleness: the staleness passed to the server optimizer.
      contributors: the workers whose updates it holds.
    """

    time: float
    version: int
    num_updates: int
    staleness: int
    contributors: tuple


class Divergence(NamedTuple):
    """Where a simulated run diverged.

    Attributes:
      time: the virtual time (s) it was found at: when the worker's round
        ended (a non-finite loss or update) or when the server refused the
        update.
      worker_id: the worker whose round it was.
      version: the version the round computed on.
      loss: the round's training loss (NaN or infinity where that was it).
      reason: ``"loss"`` (a non-finite training loss), ``"update"`` (a
        non-finite update) or ``"server"`` (the server refused an update that,
        applied, would make the parameters non-finite).
    """

    time: float
    worker_id: Any
    version: int
    loss: float
    reason: str

    def __str__(self) -> str:
        what = {
            "loss": f"loss {self.loss:g}",
            "update": "a non-finite update",
            "server": "an update that would make the parameters non-finite",
        }[self.reason]
        return (
            f"diverged at t = {self.time:.3g} s: worker {self.worker_id!r}, "
            f"{what} on version {self.version}"
        )


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a simulation produced.

    Attributes:
      metrics: columns over virtual time, each a numpy array of one entry per
        evaluation: ``"time"``, ``"version"``, ``"gradients"`` (local steps
        pushed so far), ``"train_loss"`` (mean loss of the pushes since the
        previous entry, NaN if none), and every metric of ``eval_fn``.
      timelines: per worker id, its time from joining to the end (or leaving)
        cut into :class:`Interval` of kind ``"compute"``, ``"discarded"``,
        ``"transfer"`` and ``"wait"``, in order, without gaps or overlaps.
      transfers: per worker id, its link's busy spans (``"push"``, ``"pull"``),
        which may overlap its compute.
      bytes_sent: per worker id, bytes of its pushes.
      bytes_received: per worker id, bytes of the parameters it received.
      pushes: every push handled by the server, in order.
      applies: every new version, in order.
      sends: every parameter send, in order.
      staleness: histogram ``{staleness: pushes}`` of the handled pushes.
      num_updates: server versions made.
      num_gradients: local steps in pushed rounds.
      evaluated_gradients: local steps evaluated (pushed, in flight at the end
        or discarded), without padding.
      padded_gradients: padding rows evaluated to keep shapes fixed.
      drops: times a worker was dropped by a deadline (or refused) and rejoined.
      errors: messages of the errors the server answered pushes or pulls with.
      work_plans: the work plans in force, the initial one first, then each
        revision (empty without a plan).
      params: the server's final parameters.
      end_time: the virtual time the simulation stopped at (s).
      wall_seconds: wall-clock seconds it took.
      diverged: the first :class:`Divergence` of the run, or ``None``; with
        ``SimConfig.stop_on_divergence`` the run stopped there.
    """

    metrics: Mapping[str, np.ndarray]
    timelines: Mapping[Any, tuple[Interval, ...]]
    transfers: Mapping[Any, tuple[Interval, ...]]
    bytes_sent: Mapping[Any, int]
    bytes_received: Mapping[Any, int]
    pushes: tuple[PushRecord, ...]
    applies: tuple[ApplyRecord, ...]
    sends: tuple[SendRecord, ...]
    staleness: Mapping[int, int]
    num_updates: int
    num_gradients: int
    evaluated_gradients: int
    padded_gradients: int
    drops: int
    errors: tuple[str, ...]
    work_plans: tuple[WorkPlan, ...]
    params: Any
    end_time: float
    wall_seconds: float
    diverged: Divergence | None = None

    def time_in(self, worker_id: Any) -> dict[str, float]:
        """Seconds a worker spent in each timeline kind.

        Raises:
          KeyError: for an unknown worker.
        """
        totals = dict.fromkeys(("compute", "discarded", "transfer", "wait"), 0.0)
        for iv in self.timelines[worker_id]:
            totals[iv.kind] += iv.end - iv.start
        return totals

    def idle_fraction(self, worker_id: Any = None) -> float:
        """Share of a worker's time (or all workers' time) not spent on kept work.

        Everything but ``"compute"`` counts as idle: waiting for the server or
        the link, and compute that was thrown away.

        Args:
          worker_id: a worker, or ``None`` for all workers together.

        Returns:
          A number in ``[0, 1]`` (0 for a worker that spent no time).
        """
        ids = list(self.timelines) if worker_id is None else [worker_id]
        total = busy = 0.0
        for w in ids:
            for iv in self.timelines[w]:
                total += iv.end - iv.start
                if iv.kind == "compute":
                    busy += iv.end - iv.start
        return 0.0 if total <= 0 else 1.0 - busy / total
