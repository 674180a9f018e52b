"""What the server's decisions need of a re-planner, as a protocol.

H-PS's dynamic scheduling revises the work plan when the workers' measured speeds
drift. The arithmetic of that revision lives in :mod:`hpsjax.planning` (and the
pilot that plans a run from its own first rounds in :mod:`hpsjax.profiling`),
above or beside the server; the server's decisions and the asyncio server only
call it through :class:`ReplannerProtocol`, so neither imports planning.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ReplannerProtocol"]


@runtime_checkable
class ReplannerProtocol(Protocol):
    """A re-planner: a work plan in force, revised from measured speeds.

    :class:`hpsjax.planning.Replanner` and :class:`hpsjax.profiling.Pilot` are
    the two in the library. ``plan`` is a :class:`hpsjax.planning.WorkPlan`
    (``workers``, each with ``worker_id``; ``revision``). Two members are
    optional and read with ``getattr``: ``reason`` (why the last revision was
    made, a string; a pilot's phase) and ``observe_link(worker_id, seconds)``
    (a push's measured link time, for a re-planner that plans with it).
    """

    @property
    def plan(self) -> Any:
        """The work plan in force."""
        ...

    def observe(
        self, worker_id: Any, batch_size: float, time_per_step: float, now: float
    ) -> Any | None:
        """Takes one measured local step of a worker; returns the revised plan
        when the speeds drifted enough to revise it, else ``None``."""
        ...
