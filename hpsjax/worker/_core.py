r"""The worker's decisions, without I/O: :class:`WorkerCore`.

:class:`WorkerCore` is to a worker what :class:`hpsjax.ps.ServerCore` is to the
server (and websockets' ``Protocol`` to its front ends): a state machine that
is fed **events** (what happened, with the time it happened at) and answers
with **actions** (what to do next). It reads no clock, does no I/O and runs no
model: the asyncio :class:`hpsjax.worker.Worker` (a compute thread, a
connection) and the simulator's workers (a virtual clock, a batched engine)
only carry its actions out, so the simulator's answer is an answer about the
real worker.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

from hpsjax._checks import check_choice, check_fraction, check_int, check_positive
from hpsjax._ewma import EWMA_ALPHA, ewma
from hpsjax.transforms import STALENESS_POLICIES, staleness_factor
from hpsjax.wire import PushMeta

__all__ = [
    "EWMA_ALPHA",
    "NONFINITE_ACTIONS",
    "OVERLAP_MODES",
    "Acked",
    "Compute",
    "Computed",
    "Discard",
    "Dropped",
    "ForcePulled",
    "Join",
    "Joined",
    "KeepParams",
    "Left",
    "PlanChanged",
    "Pull",
    "Pulled",
    "Push",
    "Report",
    "Reported",
    "StepsHinted",
    "Stop",
    "StopComputing",
    "StopRequested",
    "WorkerCore",
    "WorkerOptions",
    "check_overlap",
    "ewma",
]

OVERLAP_MODES: tuple[str, ...] = ("none", "pipeline", "eager")
"""How a worker overlaps communication with compute: ``"none"`` (compute, then
push and pull in one round trip), ``"pipeline"`` (H-PS, PS+: the previous
round's push and the next pull travel while a round computes) or ``"eager"``
(``"pipeline"`` with up to ``eager_pulls`` pulls a round while compute time is
left, PS+)."""


NONFINITE_ACTIONS: tuple[str, ...] = ("stop", "skip")
"""What a worker does with a round whose loss or update is not finite: end the
run (``"stop"``) or discard the round and go on (``"skip"``)."""


def check_overlap(overlap: Any) -> None:
    """Raises ``ValueError``, naming the valid modes, unless ``overlap`` is one of
    :data:`OVERLAP_MODES`."""
    if overlap not in OVERLAP_MODES:
        raise ValueError(
            f"Unknown overlap {overlap!r}; valid modes are {', '.join(OVERLAP_MODES)}."
        )


# ------------------------------------------------------------------ events


class Joined(NamedTuple):
    """The worker starts (connected): it joins (a pull)."""

    now: float


class Pulled(NamedTuple):
    """Parameters of ``version`` arrived, answering a pull of ``session``, with
    the server's local-steps hint if it sent one."""

    session: int
    version: int
    now: float
    local_steps: int | None = None


class Computed(NamedTuple):
    """Round ``round`` finished computing.

    ``step_time`` is its compute time (s), ``loss`` its mean training loss,
    ``local_steps`` the steps it took, ``stage`` the staged optimizer's stage
    after it; ``None`` where not known yet (the simulator evaluates rounds
    lazily: its driver fills them in at the push). ``batch_size``: the samples
    per step it computed where that is not the round's (the asyncio worker
    keeps its last compiled batch while the step for a newly planned one
    compiles); ``None``: the round's. ``finite``: its loss and update are
    finite (not NaN nor inf).
    """

    round: int
    now: float
    step_time: float
    loss: float | None = None
    local_steps: int | None = None
    stage: int | None = None
    batch_size: int | None = None
    finite: bool = True


class Acked(NamedTuple):
    """A push of ``session`` was acknowledged at server ``version``, with the
    server's local-steps hint and forced pull if it sent them, and the server
    policy's stage as last heard (``None``: not staged, or not known)."""

    session: int
    version: int
    now: float
    local_steps: int | None = None
    force_pull: bool = False
    stage: int | None = None


class PlanChanged(NamedTuple):
    """A plan for this worker; ``None`` fields keep their value. A revision not
    newer than the one followed is ignored (``None``: always newer)."""

    revision: int | None = None
    device_batches: tuple[int, ...] | None = None
    local_steps: int | None = None
    lr_scale: float | None = None


class StepsHinted(NamedTuple):
    """The server's hint of local steps per push (ADSP, hybrid stages)."""

    local_steps: int


class ForcePulled(NamedTuple):
    """The server asks the worker to give up its local work (SaPS)."""

    session: int


class StopComputing(NamedTuple):
    """The server stops the round being computed (Ringmaster ASGD's stopping
    form: its result could only be ignored); fresh parameters are pulled."""

    session: int
    now: float


class Dropped(NamedTuple):
    """The server dropped the worker (a missed deadline)."""

    session: int
    now: float


class Left(NamedTuple):
    """The worker leaves: the round computing is thrown away, nothing follows."""

    now: float


class Reported(NamedTuple):
    """The :class:`Report` was carried out (a replanner, if any, was fed and
    its plan handed over): the round's push and the next round follow."""

    now: float


class StopRequested(NamedTuple):
    """End after the current round (the update computed is still pushed)."""


# ------------------------------------------------------------------ actions


class Pull(NamedTuple):
    """Pull the parameters; ``eager``: a further pull while computing."""

    session: int
    eager: bool = False


class KeepParams(NamedTuple):
    """The parameters of the :class:`Pulled` just handled are the newest held."""

    version: int


class Compute(NamedTuple):
    """Compute round ``round``: local steps on the parameters of ``version``."""

    round: int
    version: int
    device_batches: tuple[int, ...]
    local_steps: int
    lr_scale: float

    @property
    def batch_size(self) -> int:
        return sum(self.device_batches)


class Push(NamedTuple):
    """Push round ``round``'s update scaled by ``lr_factor``; ``meta`` is what
    the push says about it, the :class:`~hpsjax.ps.PushMeta` the client sends
    as it is (``client.push(update, push.meta)``) and the server's core reads.

    ``with_pull``: in one round trip with the next pull (``push_pull``).
    ``final``: the last push of the run. ``compress_ratio``: the share of the
    update's values sent (top-k sparsified), 1 for all of them.
    """

    round: int
    session: int
    meta: PushMeta
    lr_factor: float
    staleness_estimate: int
    with_pull: bool = False
    final: bool = False
    compress_ratio: float = 1.0

    @property
    def version(self) -> int:
        """The version the update was computed on (``meta.version``)."""
        return self.meta.version


class Discard(NamedTuple):
    """Throw round ``round``'s update away (computing or waiting to be pushed)."""

    round: int


class Report(NamedTuple):
    """A kept round's measured speed, for a :class:`~hpsjax.planning.Replanner`."""

    batch_size: int
    time_per_step: float
    now: float


class Join(NamedTuple):
    """Join (a pull) in a new ``session``: on starting, and after a drop."""

    session: int


class Stop(NamedTuple):
    """The run ends: ``"max_steps"``, ``"max_seconds"``, ``"until_version"``,
    ``"stopped"``, ``"left"`` or ``"diverged"``."""

    reason: str


class _State(enum.Enum):
    IDLE = "idle"  # not joined yet
    BLOCKED = "blocked"  # waiting for parameters
    COMPUTING = "computing"
    DONE = "done"


class _Round(NamedTuple):
    round: int
    version: int
    batch_size: int
    step_time: float
    loss: float | None
    local_steps: int
    stage: int | None


def _option(default: Any, help: str | None = None, **flag: Any) -> Any:
    """A field of an options dataclass; with ``help``, a command-line flag
    (``flag``: its other settings, see :mod:`hpsjax._config_flags`)."""
    metadata = {} if help is None else {"help": help, **flag}
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """The options of a worker's decisions (:class:`WorkerCore`), checked once,
    here.

    :class:`hpsjax.worker.WorkerConfig` extends it with the connection, the
    encoding and the run's faults; ``hpsjax-worker``'s flags are made from the
    fields that have a ``help``. The defaults are the core's own; the asyncio
    worker's differ where :class:`~hpsjax.worker.WorkerConfig` says so.

    Args:
      device_batches: samples per local step on each local device (the core
        needs them; a configuration may leave them to its plan or batch).
      local_steps: :math:`H`, local steps per push, before any plan or hint.
      lr_scale: the step-size scale, before any plan.
      overlap: how the transfers overlap compute, one of
        :data:`OVERLAP_MODES`: ``"pipeline"`` and ``"eager"`` push the previous
        update and pull while a round computes, ``"none"`` after it; ``None``
        is left to the driver (the asyncio worker follows the server's policy;
        the core alone takes ``"none"``).
      pull_with_push: with ``"pipeline"`` or ``"eager"``, a round's push carries
        its pull (one ``push_pull``) instead of a pull behind it.
      eager_pulls: pulls a round at most with ``overlap="eager"`` (PS+), >= 1.
      staleness_lr: PS+'s modulation: a
        :data:`hpsjax.transforms.STALENESS_POLICIES` name or a callable
        ``tau -> factor``; ``None`` for none.
      follow_hints: obey the server's plans and local-steps hints.
      max_steps: rounds to compute, ``None`` for no limit.
      max_seconds: no round starts after this time, ``None`` for no limit.
      until_version: stop once the parameters held reach this version.
      compress_ratio: the share of each update's values pushed (top-k), in
        (0, 1]; ``None`` (or 1) sends them all.
      compress_from_stage: pushes are sparsified once the server's stage is at
        least this (0: from the start); ``None`` never sparsifies.
      on_nonfinite: one of :data:`NONFINITE_ACTIONS`: what a round whose loss
        or update is not finite does, ``"stop"`` the run or ``"skip"`` its push.

    Raises:
      ValueError: a bad value, in one line naming it.

    Examples:
      >>> WorkerOptions(local_steps=4).local_steps
      4
      >>> WorkerOptions(eager_pulls=0)
      Traceback (most recent call last):
      ...
      ValueError: eager_pulls must be an int >= 1, got 0.
    """

    device_batches: tuple[int, ...] | None = None
    local_steps: int = _option(1, "local steps per push", group="work")
    lr_scale: float = _option(1.0, "factor on the step size", group="work")
    overlap: str | None = _option(
        "none",
        "transfers during compute: pipeline (the previous push and the next "
        "pull), eager (pipeline, pulling again while compute time is left, up to "
        "--eager_pulls a round) or none (push and pull after compute); default: "
        "the server's policy's, none under a synchronous policy (bsp: every push "
        "has staleness 0), pipeline otherwise (each push at least 1 version stale)",
        choices=OVERLAP_MODES,
        group="work",
    )
    pull_with_push: bool = _option(
        False,
        "with --overlap pipeline or eager, pull in a request of its own "
        "rather than in the push (the PUSH_PULL message)",
        flag="--no_pull_with_push",
        group="work",
    )
    eager_pulls: int = _option(
        1, "with --overlap eager: pulls per round at most", group="work"
    )
    staleness_lr: str | Callable[[int], float] | None = _option(  # noqa: RUF009
        None, "scale updates by f(staleness) on the worker (PS+)", group="work"
    )
    follow_hints: bool = _option(
        True,
        "ignore the server's local-step and plan hints",
        flag="--no_follow_hints",
        aliases=("--ignore_hints",),
        group="work",
    )
    max_steps: int | None = _option(None, "rounds to run", group="work")
    max_seconds: float | None = _option(None, "seconds to run", group="work")
    until_version: int | None = _option(
        None, "stop at this server version", group="work"
    )
    compress_ratio: float | None = None
    compress_from_stage: int | None = _option(
        0,
        "with --work_plan: top-k sparsify pushes at the plan's "
        "compress_ratio once the server's stage is at least this (ASHL's SHL: 1)",
        group="work",
    )
    on_nonfinite: str = _option(
        "stop",
        "a round whose loss or update is not finite (NaN, inf) is never "
        "pushed: stop the run (exit status 3) or skip that push and go on",
        choices=NONFINITE_ACTIONS,
        group="work",
    )

    def __post_init__(self):
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if self.device_batches is not None:
            batches = tuple(self.device_batches)
            if not batches:
                raise ValueError("device_batches is empty")
            put(
                "device_batches",
                tuple(check_int("device_batches entry", b, low=1) for b in batches),
            )
        put("local_steps", check_int("local_steps", self.local_steps, low=1))
        put("lr_scale", check_positive("lr_scale", self.lr_scale))
        if self.overlap is not None:
            check_overlap(self.overlap)
        put("eager_pulls", check_int("eager_pulls", self.eager_pulls, low=1))
        if not (
            self.staleness_lr is None
            or callable(self.staleness_lr)
            or self.staleness_lr in STALENESS_POLICIES
        ):
            raise ValueError(
                f"unknown staleness_lr {self.staleness_lr!r}; valid: "
                f"{', '.join(sorted(STALENESS_POLICIES))}, or a callable"
            )
        check_int("max_steps", self.max_steps, low=1, allow_none=True)
        check_positive("max_seconds", self.max_seconds, allow_none=True)
        check_int("until_version", self.until_version, low=1, allow_none=True)
        check_fraction("compress_ratio", self.compress_ratio, allow_none=True)
        check_int(
            "compress_from_stage", self.compress_from_stage, low=0, allow_none=True
        )
        check_choice("on_nonfinite", self.on_nonfinite, NONFINITE_ACTIONS)

    def core_options(self, **changes: Any) -> WorkerOptions:
        """The :class:`WorkerOptions` part of these options (of a
        :class:`~hpsjax.worker.WorkerConfig` too), with ``changes``."""
        values = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(WorkerOptions)
        }
        return WorkerOptions(**{**values, **changes})


class WorkerCore:
    """The decisions of one worker (see the module docstring).

    Args:
      options: the :class:`WorkerOptions` (``device_batches`` given);
        ``None`` for their defaults.
      pushes_gradients: the worker has no local optimizer: one step a round.
      **changes: :class:`WorkerOptions` fields that replace the ones of
        ``options``.

    Raises:
      ValueError: a bad option, or no ``device_batches``.

    Examples:
      >>> core = WorkerCore(device_batches=(32,))
      >>> core.handle(Joined(0.0))
      [Join(session=1)]
      >>> core.handle(Pulled(1, 0, now=0.1))[1]
      Compute(round=0, version=0, device_batches=(32,), local_steps=1, lr_scale=1.0)
    """

    def __init__(
        self,
        options: WorkerOptions | None = None,
        *,
        pushes_gradients: bool = False,
        **changes: Any,
    ):
        options = WorkerOptions() if options is None else options
        if changes:
            options = dataclasses.replace(options, **changes)
        if options.device_batches is None:
            raise ValueError(
                "device_batches is required: samples per local step on each device"
            )
        overlap = options.overlap or "none"
        self.options = options
        self.device_batches = options.device_batches
        self.plan_steps = options.local_steps
        self.lr_scale = options.lr_scale
        self.pushes_gradients = bool(pushes_gradients)
        self.pipeline = overlap != "none"
        self.eager_pulls = options.eager_pulls if overlap == "eager" else 1
        self.pull_with_push = bool(options.pull_with_push) and self.pipeline
        self.staleness_lr = options.staleness_lr
        self.follow_hints = bool(options.follow_hints)
        self.max_steps = options.max_steps
        self.max_seconds = options.max_seconds
        self.until_version = options.until_version
        self.compress_ratio = (
            1.0 if options.compress_ratio is None else options.compress_ratio
        )
        self.compress_from_stage = options.compress_from_stage
        self.on_nonfinite = options.on_nonfinite
        self.server_stage = 0  # as last heard

        self.state = _State.IDLE
        self.session = 0
        self.joining = False  # a join's answer is awaited
        self.version = -1  # of the parameters held
        self.known_version = 0  # newest heard of
        self.plan_revision: int | None = None
        self.hinted_steps: int | None = None
        self.compute_ewma: float | None = None
        self.pull_ewma: float | None = None
        self.rounds = 0  # rounds started
        self.current: Compute | None = None
        self.round_start = 0.0
        self.discard = False
        self.pending: _Round | None = None
        self.pull_in_flight = False
        self.pull_sent = 0.0
        self.pulls = 0  # in the running round
        self.stop_requested = False
        self.ended_by: str | None = None
        self.drops = 0
        self._factors: dict[int, float] = {}
        self._reporting: _Round | None = None

    # ------------------------------------------------------------ queries

    @property
    def local_steps(self) -> int:
        """Local steps the next round takes."""
        if self.pushes_gradients:
            return 1
        return self.hinted_steps if self.hinted_steps is not None else self.plan_steps

    @property
    def push_ratio(self) -> float:
        """The share of its values the next push sends (the compression rule)."""
        start = self.compress_from_stage
        if start is not None and self.server_stage >= start:
            return self.compress_ratio
        return 1.0

    @property
    def done(self) -> bool:
        """Whether the run ended (a :class:`Stop` was given)."""
        return self.state is _State.DONE

    # ------------------------------------------------------------ events

    def handle(self, event: Any) -> list:
        """Takes one event, returns the actions it calls for, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"not a worker event: {event!r}")
        if self.state is _State.DONE:
            if type(event) is Acked and event.session == self.session:
                # The flush of the last update, acknowledged after the end.
                self.known_version = max(self.known_version, event.version)
            return []
        return handler(self, event)

    def _joined(self, event: Joined) -> list:
        self.state = _State.BLOCKED
        return [self._join(event.now)]

    def _pulled(self, event: Pulled) -> list:
        if event.session != self.session:
            return []
        now = event.now
        self._hint(event.local_steps)
        self.pull_in_flight = False
        self.pull_ewma = ewma(self.pull_ewma, now - self.pull_sent)
        actions: list = []
        if self.joining:
            # A join's answer is the server's state, whatever was held: a
            # server restarted from a checkpoint may be at an older version.
            self.joining = False
            self.version = self.known_version = event.version
            actions.append(KeepParams(event.version))
        elif event.version >= self.version:
            self.version = event.version
            self.known_version = max(self.known_version, event.version)
            actions.append(KeepParams(event.version))
        if self.state is _State.BLOCKED:
            actions += self._start_round(now)
        elif (
            self.state is _State.COMPUTING
            and self.pulls < self.eager_pulls
            and self.compute_ewma is not None
            and self.compute_ewma - (now - self.round_start) >= 2.0 * self.pull_ewma
        ):
            self.pulls += 1
            actions.append(self._pull(now, eager=True))
        return actions

    def _computed(self, event: Computed) -> list:
        current = self.current
        if current is None or event.round != current.round:
            return []
        now = event.now
        self.current = None
        self.compute_ewma = ewma(self.compute_ewma, event.step_time)
        steps = current.local_steps if event.local_steps is None else event.local_steps
        if self.discard:
            # The server asked for fresh parameters (or dropped the worker)
            # while this round computed on old ones.
            self.discard = False
            self.state = _State.BLOCKED
            return [Discard(current.round), *self._proceed(None, now)]
        if not event.finite:
            return self._diverged(current, now)
        batch_size = event.batch_size or current.batch_size
        self._reporting = _Round(
            current.round,
            current.version,
            batch_size,
            event.step_time,
            event.loss,
            steps,
            event.stage,
        )
        self.state = _State.BLOCKED
        return [Report(batch_size, max(event.step_time / steps, 1e-12), now)]

    def _diverged(self, current: Compute, now: float) -> list:
        """A round whose loss or update is not finite: never pushed."""
        actions: list = [Discard(current.round)]
        if self.on_nonfinite == "skip":
            self.state = _State.BLOCKED
            return [*actions, *self._proceed(None, now)]
        if self.pending is not None:
            actions.append(Discard(self.pending.round))
            self.pending = None
        self.session += 1  # answers still in flight are ignored
        return [*actions, self._stop("diverged")]

    def _reported(self, event: Reported) -> list:
        kept, self._reporting = self._reporting, None
        if kept is None:
            return []
        return self._proceed(kept, event.now)

    def _proceed(self, kept: _Round | None, now: float) -> list:
        """After a round: push it (or not), then the next round if it can start."""
        if not self.pipeline:
            if kept is not None:
                return [self._push(kept, now, with_pull=True)]
            if not self.pull_in_flight:
                # Discarded on a drop, and the rejoin's parameters are in.
                return self._start_round(now)
            return []
        self.pending = kept
        if not self.pull_in_flight:
            return self._start_round(now)
        return []

    def _acked(self, event: Acked) -> list:
        if event.session != self.session:
            return []
        self.known_version = max(self.known_version, event.version)
        self._hint(event.local_steps)
        if event.stage is not None:
            self.server_stage = int(event.stage)
        if event.force_pull:
            return self._discard_current()
        return []

    def _plan_changed(self, event: PlanChanged) -> list:
        if not self.follow_hints:
            return []
        if (
            event.revision is not None
            and self.plan_revision is not None
            and event.revision <= self.plan_revision
        ):
            return []
        if event.device_batches is not None:
            self.device_batches = tuple(event.device_batches)
        if event.local_steps is not None:
            self.plan_steps = int(event.local_steps)
        if event.lr_scale is not None:
            self.lr_scale = float(event.lr_scale)
        if event.revision is not None:
            self.plan_revision = event.revision
        return []

    def _steps_hinted(self, event: StepsHinted) -> list:
        self._hint(event.local_steps)
        return []

    def _hint(self, local_steps: int | None) -> None:
        if local_steps is not None and self.follow_hints:
            self.hinted_steps = int(local_steps)

    def _force_pulled(self, event: ForcePulled) -> list:
        if event.session != self.session:
            return []
        return self._discard_current()

    def _stop_computing(self, event: StopComputing) -> list:
        if event.session != self.session or self.state is not _State.COMPUTING:
            return []  # pushed meanwhile: the pull that follows is fresh
        if self.pipeline:
            return self._drop_current()
        round_, self.current = self.current.round, None
        self.discard = False
        self.state = _State.BLOCKED
        return [Discard(round_), self._pull(event.now)]

    def _dropped(self, event: Dropped) -> list:
        if event.session != self.session:
            return []
        self.drops += 1
        actions = self._drop_current()
        self.hinted_steps = None
        return [*actions, self._join(event.now)]

    def _left(self, event: Left) -> list:
        del event
        actions: list = []
        if self.current is not None:
            actions.append(Discard(self.current.round))
            self.current = None
        if self.pending is not None:
            actions.append(Discard(self.pending.round))
            self.pending = None
        self.session += 1
        return [*actions, self._stop("left")]

    def _stop_requested(self, event: StopRequested) -> list:
        del event
        self.stop_requested = True
        return []

    _handlers: ClassVar[dict] = {
        Joined: _joined,
        Pulled: _pulled,
        Computed: _computed,
        Acked: _acked,
        PlanChanged: _plan_changed,
        StepsHinted: _steps_hinted,
        ForcePulled: _force_pulled,
        StopComputing: _stop_computing,
        Dropped: _dropped,
        Left: _left,
        Reported: _reported,
        StopRequested: _stop_requested,
    }

    # ------------------------------------------------------------ rules

    def _join(self, now: float) -> Join:
        self.session += 1
        self.joining = True
        self.pull_in_flight = True
        self.pull_sent = now
        return Join(self.session)

    def _pull(self, now: float, *, eager: bool = False) -> Pull:
        self.pull_in_flight = True
        self.pull_sent = now
        return Pull(self.session, eager)

    def _ended(self, now: float) -> str | None:
        if self.stop_requested:
            return "stopped"
        if self.max_steps is not None and self.rounds >= self.max_steps:
            return "max_steps"
        if self.max_seconds is not None and now >= self.max_seconds:
            return "max_seconds"
        if self.until_version is not None and self.version >= self.until_version:
            return "until_version"
        return None

    def _start_round(self, now: float) -> list:
        reason = self._ended(now)
        if reason is not None:
            actions = []
            if self.pending is not None:
                actions.append(self._push(self.pending, now, final=True))
                self.pending = None
            return [*actions, self._stop(reason)]
        actions = []
        if self.pipeline:
            self.pulls = 1
            if self.pending is not None and self.pull_with_push:
                actions.append(self._push(self.pending, now, with_pull=True))
                self.pending = None
            else:
                if self.pending is not None:
                    actions.append(self._push(self.pending, now))
                    self.pending = None
                actions.append(self._pull(now))
        self.current = Compute(
            self.rounds,
            self.version,
            self.device_batches,
            self.local_steps,
            self.lr_scale,
        )
        self.rounds += 1
        self.round_start = now
        self.discard = False
        self.state = _State.COMPUTING
        return [*actions, self.current]

    def _factor(self, tau: int) -> float:
        if self.staleness_lr is None:
            return 1.0
        factor = self._factors.get(tau)
        if factor is None:
            if callable(self.staleness_lr):
                factor = float(self.staleness_lr(tau))
            else:
                factor = float(staleness_factor(self.staleness_lr, tau))
            self._factors[tau] = factor
        return factor

    def _push(
        self, r: _Round, now: float, *, with_pull: bool = False, final: bool = False
    ) -> Push:
        tau = max(0, self.known_version - r.version)
        if with_pull:
            self.pull_in_flight = True
            self.pull_sent = now
        return Push(
            round=r.round,
            session=self.session,
            meta=PushMeta(
                version=r.version,
                step_time=r.step_time,
                num_samples=r.batch_size * r.local_steps,
                local_steps=r.local_steps,
                # The wire carries finite floats only (a diverged round is
                # never pushed; this keeps a stray one from failing the push).
                loss=r.loss if r.loss is None or math.isfinite(r.loss) else None,
                stage=r.stage,
            ),
            lr_factor=self._factor(tau),
            staleness_estimate=tau,
            with_pull=with_pull,
            final=final,
            compress_ratio=self.push_ratio,
        )

    def _discard_current(self) -> list:
        if not self.pipeline:
            # The pull that follows each push brings fresh parameters, and
            # nothing was computed meanwhile.
            return []
        return self._drop_current()

    def _drop_current(self) -> list:
        """Throws away the round computing, or the one waiting to be pushed."""
        if self.state is _State.COMPUTING:
            self.discard = True
            return []
        if self.pending is not None:
            round_ = self.pending.round
            self.pending = None
            return [Discard(round_)]
        return []

    def _stop(self, reason: str) -> Stop:
        self.state = _State.DONE
        self.ended_by = reason
        return Stop(reason)
