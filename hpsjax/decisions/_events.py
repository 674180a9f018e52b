"""The events a server's decisions take, one typed object each.

A driver (the asyncio server, the simulator) turns what happened (a worker
joined, asked for parameters, pushed, left; time passed; the stage was set; a
speed was measured) into one of these and hands it to
:meth:`hpsjax.decisions.ServerCore.handle`, which returns the actions to carry
out, as :meth:`hpsjax.worker.WorkerCore.handle` does for a worker. Every event
carries the driver's time ``now`` (float seconds, never decreasing): the core
reads no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

from hpsjax.wire import PushMeta

__all__ = [
    "PushBegun",
    "ServerEvent",
    "SpeedMeasured",
    "StageSet",
    "Tick",
    "WorkerJoined",
    "WorkerLeft",
    "WorkerPulled",
    "WorkerPushed",
]


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerJoined:
    """A worker joined, or joined again; it is answered like a pull."""

    worker_id: Hashable
    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerLeft:
    """A worker left, or its connection closed."""

    worker_id: Hashable
    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerPulled:
    """A worker asked for parameters.

    Attributes:
      worker_id: the worker.
      now: the driver's time.
      rejoin: a pull of a worker that never joined, or is no longer live,
        joins it (answered with a :class:`~hpsjax.decisions.Joined` first)
        instead of being refused.
    """

    worker_id: Hashable
    now: float
    rejoin: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerPushed:
    """A worker's push, validated where it became an object.

    Attributes:
      worker_id: the pushing worker.
      update: the update, with the parameters' tree structure, shapes and dtypes
        (checked by the wire or the driver, not again).
      meta: what the push says about itself (:class:`~hpsjax.wire.PushMeta`).
      now: the driver's time.
    """

    worker_id: Hashable
    update: Any
    meta: PushMeta
    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class PushBegun:
    """A push's metadata arrived and its leaves are coming (not yet checked).

    The driver may apply the push as its leaves arrive; the core answers with
    a :class:`~hpsjax.decisions.StartApply` where the policy applies that push
    at once, else with nothing. It checks nothing and changes nothing: the
    push is checked once, when it arrives whole (:class:`WorkerPushed`).

    Attributes:
      worker_id: the pushing worker.
      version: the version the push says it was computed on, as received.
      num_samples: the samples it says it holds, as received, or ``None``.
      now: the driver's time.
    """

    worker_id: Hashable
    version: Any
    num_samples: Any
    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class Tick:
    """Time passed: held starts end, workers past their deadline are dropped."""

    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class StageSet:
    """A staged policy is moved to stage ``index`` (by the operator or a test)."""

    index: int
    now: float


@dataclasses.dataclass(frozen=True, slots=True)
class SpeedMeasured:
    """One local step of ``batch_size`` samples took ``time_per_step`` seconds
    of a worker's compute (for the re-planner)."""

    worker_id: Hashable
    batch_size: int
    time_per_step: float
    now: float


ServerEvent = (
    WorkerJoined
    | WorkerLeft
    | WorkerPulled
    | WorkerPushed
    | PushBegun
    | Tick
    | StageSet
    | SpeedMeasured
)
"""Any event :meth:`~hpsjax.decisions.ServerCore.handle` takes."""
