"""The actions a server's decisions return, one frozen dataclass each.

:class:`~hpsjax.decisions.ServerCore` answers every event with a list of these,
in the order a driver (the asyncio server, the simulator) carries them out,
through one :class:`~hpsjax.decisions.ActionInterpreter` that hands each to the
driver's handler for its type: note a worker a pull joined, send parameters,
answer a push (:class:`~hpsjax.wire.PushAck`), hold or release a pull, force
a pull, drop a worker, note a new version, save a checkpoint, start an apply
as a push arrives, announce a stage or a revised plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from hpsjax.wire import PushAck

__all__ = [
    "ACTIONS",
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
    "StageChanged",
    "StartApply",
    "Wait",
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
class Joined:
    """A worker's pull joined it: it never joined, or it is no longer live.

    Returned first, before the :class:`SendParams` or :class:`Wait` that
    answers the pull, by a :class:`~hpsjax.decisions.WorkerPulled` with
    ``rejoin`` (the asyncio server's: a connection's first pull, or the pull
    of a worker that was dropped, joins it), so that the driver can hand the
    worker what it needs before its parameters (its work plan).

    Attributes:
      worker_id: the worker.
      version: the server version after it joined.
    """

    worker_id: WorkerId
    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Wait:
    """The worker's pull is blocked: send nothing until its :class:`Release`.

    Attributes:
      worker_id: the worker.
      until: the earliest deadline now pending of a held start or a live
        worker (``core.next_deadline()`` but a timed checkpoint): when a
        worker that has not made progress by then is dropped and the wait is
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
      stop: the worker is told while it computes, to stop that computation
        (:meth:`~hpsjax.decisions.Policy.stops`), not in answer to its push.
    """

    worker_id: WorkerId
    reason: str
    stop: bool = False


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
    state and :meth:`~hpsjax.decisions.ServerCore.state_dict` as they are now.

    Returned after the :class:`Applied` of every ``checkpoint_every_updates``
    new versions, and by the tick every ``checkpoint_every_s`` seconds when
    the version changed; the driver saves (the asyncio server, on its
    checkpoint thread) and the simulator, which keeps none, never asks for
    it.
    """

    version: int


@dataclasses.dataclass(frozen=True, slots=True)
class StageChanged:
    """A staged policy moved to another stage: tell every worker.

    Returned by the event in which the stage changed, whatever moved it (a
    version reaching the stage's ``until_version``, a pushed ``stage``, the
    policy's own rule, :meth:`~hpsjax.decisions.ServerCore.set_stage`), once
    per change and before the releases the new stage allows. A worker whose
    push moved the stage also learns it from its
    :class:`~hpsjax.ps.PushAck`'s ``stage``.

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


@dataclasses.dataclass(frozen=True, slots=True)
class StartApply:
    """Start the apply of a push as its leaves arrive, before it is whole.

    Returned for a :class:`~hpsjax.decisions.PushBegun` whose push the policy
    applies at once (:meth:`~hpsjax.decisions.Policy.completes`: BSP's last
    push of a round, ASP's push): what an aggregator needs to start that
    apply (``hpsjax.apply.OverlapAggregator.start``). The weight is the one
    known before the policy judges the push (its ``push_weights`` entry); a
    push the policy weighs otherwise is aggregated whole, as is one the core
    then refuses.

    Attributes:
      worker_id: the pushing worker.
      weight: the push's weight.
      samples: the samples behind it (1 when it names none).
      staleness: the staleness the apply is made with (the largest of the
        buffered updates' and this push's).
    """

    worker_id: WorkerId
    weight: float
    samples: int
    staleness: int

    @property
    def plan(self) -> tuple[float, int, int]:
        """``(weight, samples, staleness)``, as an aggregator's ``start`` takes."""
        return self.weight, self.samples, self.staleness


Action = (
    SendParams
    | PushAck
    | Joined
    | Wait
    | Release
    | ForcePull
    | Drop
    | Applied
    | SaveCheckpoint
    | StartApply
    | StageChanged
    | PlanChanged
)
"""Any action returned by a :class:`~hpsjax.decisions.ServerCore` event."""

ACTIONS: tuple[type, ...] = (
    SendParams,
    PushAck,
    Joined,
    Wait,
    Release,
    ForcePull,
    Drop,
    Applied,
    SaveCheckpoint,
    StartApply,
    StageChanged,
    PlanChanged,
)
"""Every action type, for an interpreter to check its handlers against."""
