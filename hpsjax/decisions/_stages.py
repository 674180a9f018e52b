"""Stages and re-planning: what a server announces to every worker.

:class:`Stages` is the part of :class:`~hpsjax.decisions.ServerCore` that
follows a staged policy's stage (announcing each change once, as a
:class:`~hpsjax.decisions.StageChanged`) and feeds measured speeds to a
re-planner (:class:`~hpsjax.decisions.ReplannerProtocol`), whose revised plan
it announces as a :class:`~hpsjax.decisions.PlanChanged`.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hpsjax.decisions._actions import Action, PlanChanged, StageChanged
from hpsjax.wire import InvalidUpdate, PushMeta

__all__ = ["Stages"]

WorkerId = Hashable


class Stages:
    """The stage last announced, and the re-planner.

    Args:
      policy: the core's policy (its ``stage`` is ``None`` without stages).
      replanner: the re-planner, or ``None``.
      replan_from_pushes: feed it every push's measured speed.

    Attributes:
      stage: the stage last announced, or ``None`` for a policy without stages.
      replanner: the re-planner, or ``None``.
    """

    def __init__(self, policy: Any, replanner: Any, *, replan_from_pushes: bool):
        self._policy = policy
        self.replanner = replanner
        self._from_pushes = bool(replan_from_pushes)
        self.stage = policy.stage

    def restored(self) -> None:
        """The policy's restored stage is in force; workers learn it as they
        join again."""
        self.stage = self._policy.stage

    def note(self, version: int, actions: list[Action]) -> None:
        """Announces a change of the policy's stage (once)."""
        stage = self._policy.stage
        if stage != self.stage:
            self.stage = stage
            actions.append(StageChanged(stage, version))

    def switch(self, meta: PushMeta) -> bool:
        """Whether a push's ``stage`` moves the server to it.

        Raises:
          InvalidUpdate: for a stage past the policy's last.
        """
        policy = self._policy
        current = policy.stage
        if meta.stage is None or current is None or meta.stage <= current:
            return False
        if meta.stage >= len(policy.stages):
            raise InvalidUpdate(
                f"push stage {meta.stage} is past the policy's last stage "
                f"{len(policy.stages) - 1}"
            )
        return True

    def observe_speed(
        self,
        worker_id: WorkerId,
        batch_size: int,
        time_per_step: float,
        now: float,
        version: int,
    ) -> list[Action]:
        """Feeds a worker's measured speed to the re-planner: ``[PlanChanged]``
        when the plan was revised, else ``[]``."""
        replanner = self.replanner
        if replanner is None or worker_id not in {
            entry.worker_id for entry in replanner.plan.workers
        }:
            return []
        revised = replanner.observe(worker_id, batch_size, time_per_step, now)
        if revised is None:
            return []
        reason = getattr(replanner, "reason", None)  # a Pilot's phase
        reason = reason or f"worker {worker_id}'s speed drifted"
        return [PlanChanged(revised, version, reason)]

    def observe_push(
        self,
        worker_id: WorkerId,
        meta: PushMeta,
        overhead: float | None,
        now: float,
        version: int,
    ) -> list[Action]:
        """Feeds one push's measured speed (and its link time, ``overhead``)
        to the re-planner, where it takes pushes'."""
        if self.replanner is None or not self._from_pushes:
            return []
        step_time, samples = meta.step_time, meta.num_samples
        if not step_time or not samples:
            return []
        steps = meta.local_steps or 1
        # A pilot (hpsjax.profiling.Pilot) plans with the link's seconds too.
        observe_link = getattr(self.replanner, "observe_link", None)
        if observe_link is not None and overhead is not None:
            observe_link(worker_id, overhead)
        return self.observe_speed(
            worker_id, max(1, samples // steps), step_time / steps, now, version
        )
