r"""What a synchronisation policy is: its hooks, its view of the core, its verdicts.

A policy answers five questions for :class:`~hpsjax.ps.ServerCore`, which keeps
all the bookkeeping and asks them at the right moments:

* :meth:`Policy.admit`: may this worker's pull proceed now, or must it wait?
* :meth:`Policy.judge`: how much of a push of staleness :math:`\tau` is used
  (a weight; 0 drops it), and must the worker pull fresh parameters?
* :meth:`Policy.ready`: apply the buffered updates now (averaged)?
* :meth:`Policy.completes`: would one more push of this worker make it ready
  (asked before the push is recorded; ``None`` where it cannot tell)?
* :meth:`Policy.local_steps`: how many local steps should a worker take before its
  next push (a hint sent with each answer)?

and may keep state of its own through :meth:`Policy.on_push` and
:meth:`Policy.on_apply`, and stop running computations after a new version
(:meth:`Policy.stops`). Notation: worker :math:`i` pushes an update computed on
parameters of version :math:`v_i` while the server is at version :math:`V`; its
staleness is :math:`\tau = V - v_i`; its clock :math:`c_i` counts its pushes.

Writing your own: subclass :class:`Policy` and override only what differs; the
defaults are those of ASP (never wait, use every push fully, apply at once)::

    class EveryOther(Policy):
        name = "every_other"

        def ready(self, core):
            return core.buffered >= 2

        def judge(self, core, worker_id, staleness):
            if staleness > 8:
                return Verdict(weight=0.0, force_pull=True, reason="too stale")
            return Verdict()

    core = ServerCore(params, optax.sgd(0.1), EveryOther())

Policies read the core through a :class:`PolicyView`, the few read-only
members they need (``core.version``, ``core.live``, ``core.clock(i)``,
``core.min_clock``, ``core.worker(i)``, ...), and never change it. A stateful
policy object belongs to one core.

A damped push (``on_stale="damp"``) beyond a staleness bound :math:`s` is scaled by

.. math::

   f(\tau) = \frac{1 + s}{1 + \tau}, \qquad \tau > s,

which is 1 at the bound and falls like :math:`1/\tau` beyond it, as the staleness-
aware rule of Zhang et al. (2016) does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["STALE_ACTIONS", "Policy", "PolicyView", "Verdict", "stale_verdict"]

STALE_ACTIONS = ("damp", "drop")
"""What to do with a push beyond a staleness bound."""


class Verdict(NamedTuple):
    """What the server does with one push.

    Attributes:
      weight: factor the update is scaled by before averaging, in [0, 1]; 0 drops
        it.
      force_pull: tell the worker to discard its local work and pull.
      reason: why it was damped, dropped or force-pulled (reported to the worker).
      args: int keyword arguments the server optimizer's update takes when
        the buffer with this push is applied (the last push's, for a buffer
        of several: a policy that gives them applies each push alone), or
        ``None``; Ringleader ASGD's table slot and operation.
    """

    weight: float = 1.0
    force_pull: bool = False
    reason: str | None = None
    args: Mapping[str, int] | None = None


_ACCEPT = Verdict()


class PolicyView:
    """What a policy reads of its :class:`~hpsjax.ps.ServerCore`, read only.

    The core hands every policy hook one view of itself; the view's members
    are the core's of the same names.

    Args:
      core: the server core.

    Attributes:
      clock: ``clock(worker_id)``, a worker's clock :math:`c_i` (pushes done).
      pulled_version: ``pulled_version(worker_id)``, the version last sent to
        a worker.
      is_waiting: ``is_waiting(worker_id)``, whether a worker's pull is blocked.
      worker: ``worker(worker_id)``, a snapshot of a worker's bookkeeping
        (:class:`~hpsjax.ps.WorkerInfo`: its measured times, its loss).
    """

    __slots__ = ("_core", "clock", "is_waiting", "pulled_version", "worker")

    def __init__(self, core: Any):
        self._core = core
        # The core's own methods, so that a policy's reads of every worker
        # (SemiAsync's) cost no more through the view.
        self.clock = core.clock
        self.pulled_version = core.pulled_version
        self.is_waiting = core.is_waiting
        self.worker = core.worker

    @property
    def version(self) -> int:
        """The server version :math:`V`."""
        return self._core.version

    @property
    def epoch(self) -> int:
        """Counts the core's events; a policy may key a cache on it."""
        return self._core.epoch

    @property
    def live(self) -> frozenset:
        """Ids of the live workers."""
        return self._core.live

    @property
    def min_clock(self) -> int | None:
        """The smallest clock among live workers, or ``None`` with none live."""
        return self._core.min_clock

    @property
    def buffered(self) -> int:
        """Number of updates buffered and not yet applied."""
        return self._core.buffered

    @property
    def buffer_contributors(self) -> frozenset:
        """Ids of the workers with an update in the buffer."""
        return self._core.buffer_contributors


def stale_verdict(
    staleness: int, bound: int | None, on_stale: str, *, force_pull: bool, who: str
) -> Verdict:
    """Damps or drops a push beyond ``bound`` (see the module docstring)."""
    if bound is None or staleness <= bound:
        return _ACCEPT
    if on_stale == "drop":
        return Verdict(
            0.0, force_pull, f"{who}: staleness {staleness} > {bound}, dropped"
        )
    return Verdict(
        (1.0 + bound) / (1.0 + staleness),
        force_pull,
        f"{who}: staleness {staleness} > {bound}, damped",
    )


class Policy:
    """Base class of synchronisation policies; its defaults behave as ASP.

    Override any of the hooks below. Each receives the
    :class:`~hpsjax.ps.ServerCore` (read it, never change it) and must be cheap:
    the core calls ``admit`` for every blocked worker after every event (after
    every event that changes :meth:`admit_key`, for a policy that defines it).

    Attributes:
      name: the policy's name, used in reasons, reprs and checkpoints.
      synchronous: every round waits for every live worker (a barrier), so a
        worker computes on the newest version and pushes with staleness 0
        unless it pipelines its transfers; told to workers when they connect
        (the INFO map's ``synchronous``), whose overlap follows it by default.
      stages: a staged policy's stages (:meth:`set_stage`), else empty.
      stage: a staged policy's current stage index, else ``None``.
    """

    name: str = "custom"
    synchronous: bool = False
    stages: tuple = ()
    stage: int | None = None

    def admit(self, core: PolicyView, worker_id: Any) -> bool:
        """Whether ``worker_id``'s pull may proceed now.

        Called when the worker pulls (it already counts as waiting, so it is
        excluded from "the workers that are not waiting") and, while it waits,
        after every later event (every one that changes :meth:`admit_key`, or
        the worker's own record), in the order the workers began to wait.

        Args:
          core: the server core.
          worker_id: a live worker.

        Returns:
          ``True`` to send it parameters now, ``False`` to make it wait.
        """
        del core, worker_id
        return True

    def admit_key(self, core: PolicyView) -> Any:
        """What :meth:`admit` depends on, beyond the asking worker's own record.

        A hashable value such that, as long as it stays equal and a blocked
        worker's own record (its clock, its membership) is unchanged,
        :meth:`admit` gives that worker the same answer. The core then re-examines
        blocked workers only when the key changes, which keeps an event O(1) in
        the number of blocked workers instead of O(n). ``None`` (the default)
        means unknown: every blocked worker is re-examined after every event.

        Args:
          core: the server core.

        Returns:
          A hashable value, or ``None``.
        """
        del core
        return None

    def wait_reason(self, core: PolicyView, worker_id: Any) -> str:
        """A short text saying what a blocked worker waits for."""
        del core, worker_id
        return f"{self.name}: waiting"

    def judge(self, core: PolicyView, worker_id: Any, staleness: int) -> Verdict:
        """Decides the weight of a push and whether its worker must pull.

        Called once per valid push, before any bookkeeping changes (``core``
        shows the state before the push).

        Args:
          core: the server core.
          worker_id: the pushing worker.
          staleness: :math:`\\tau = V - v_i` of the push, an int >= 0.

        Returns:
          A :class:`Verdict`.
        """
        del core, worker_id, staleness
        return _ACCEPT

    def ready(self, core: PolicyView) -> bool:
        """Whether the buffered updates (``core.buffered`` > 0) are applied now."""
        return core.buffered >= 1

    def completes(self, core: PolicyView, worker_id: Any) -> bool | None:
        """Whether a buffered push of ``worker_id`` would make :meth:`ready` true.

        Asked before the push is judged and recorded (``core`` shows the state
        before it), so only a policy whose readiness depends on the buffer and
        the live workers alone can answer; ``None`` (the default) means it
        cannot tell. The answer changes where the arithmetic happens, never a
        decision: a push said to complete a version has its apply worked out
        (and checked) with it, and may have it started before it is whole;
        others have only the buffer checked. A subclass that changes
        :meth:`ready` or :meth:`on_push` says so here too.
        """
        del core, worker_id
        return None

    def local_steps(self, core: PolicyView, worker_id: Any) -> int | None:
        """Hint: local steps ``worker_id`` should take before its next push."""
        del core, worker_id
        return None

    def on_push(self, core: PolicyView, worker_id: Any, now: float) -> None:
        """Sees every valid push after the core recorded it (before any apply)."""
        del core, worker_id, now

    def on_apply(self, core: PolicyView, now: float) -> None:
        """Sees every new version right after it was applied."""
        del core, now

    def stops(self, core: PolicyView) -> tuple:
        """Workers whose running computation is stopped, asked after every new
        version (after :meth:`on_apply`).

        Each named worker gets a :class:`~hpsjax.ps.ForcePull`: it drops the
        round it computes and pulls the new version (Ringmaster ASGD's
        stopping form). The default stops nobody.

        Returns:
          ``(worker_id, reason)`` pairs, in a fixed order.
        """
        del core
        return ()

    def set_stage(self, core: PolicyView, index: int) -> None:
        """Moves to stage ``index``; only staged policies have stages."""
        del core
        raise ValueError(
            f"Policy {self.name!r} has no stages (asked for stage {index!r}); "
            "use the 'hybrid' policy."
        )

    def state_dict(self) -> dict:
        """The policy's own state as plain Python values (msgpack-able)."""
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        """Restores :meth:`state_dict`; raises ``ValueError`` on a bad state."""
        if state:
            raise ValueError(
                f"Policy {self.name!r} keeps no state, got keys {sorted(state)}."
            )

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({fields})"

    def _config(self) -> dict:
        return {}
