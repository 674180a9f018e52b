"""Staged policies: a sequence of stages, each async, semi-async or sync.

:class:`Hybrid` runs a :class:`HybridStage` at a time (ASHL's AHL then SHL),
moving on at a stage's ``until_version``, when a worker's push says its staged
optimizer moved on, or when told (:meth:`~hpsjax.decisions.ServerCore.set_stage`);
:class:`PlannedHybrid` adds per-stage local steps from a work plan.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from hpsjax._checks import check_choice, check_int, is_int
from hpsjax.decisions._policies_async import ASP, SemiAsync
from hpsjax.decisions._policies_sync import BSP
from hpsjax.decisions._policy import STALE_ACTIONS, Policy

__all__ = ["HYBRID_MODES", "Hybrid", "HybridStage", "PlannedHybrid"]


HYBRID_MODES = ("async", "semi_async", "sync")
"""Modes of a :class:`HybridStage` (those of ``hpsjax.transforms.Stage``)."""


@dataclasses.dataclass(frozen=True)
class HybridStage:
    """Server settings of one stage of :class:`Hybrid`.

    ``hpsjax.transforms.Stage`` objects can be given to :class:`Hybrid` directly:
    their ``mode``, ``local_steps`` and ``max_staleness`` mean the same, and their
    ``until_step`` (updates applied in all) is read as ``until_version``.

    Attributes:
      mode: ``"async"`` (ASP; with ``max_staleness``, stale pushes are damped or
        dropped, nobody waits), ``"semi_async"`` (:class:`SemiAsync`, needs
        ``max_staleness``) or ``"sync"`` (:class:`BSP`).
      local_steps: the local step hint of the stage, an int >= 1.
      max_staleness: the stage's staleness bound (int >= 0) or ``None``.
      until_version: leave the stage once the server reaches this version, or
        ``None`` (only an explicit ``set_stage`` leaves it).
    """

    mode: str = "async"
    local_steps: int = 1
    max_staleness: int | None = None
    until_version: int | None = None

    def __post_init__(self):
        if self.mode not in HYBRID_MODES:
            raise ValueError(
                f"Unknown stage mode {self.mode!r}; valid modes are "
                f"{', '.join(HYBRID_MODES)}."
            )
        check_int("local_steps", self.local_steps, low=1)
        check_int("max_staleness", self.max_staleness, low=0, allow_none=True)
        check_int("until_version", self.until_version, low=1, allow_none=True)
        if self.mode == "semi_async" and self.max_staleness is None:
            raise ValueError("A semi_async stage needs max_staleness (an int >= 0).")
        if self.mode == "sync" and self.max_staleness not in (None, 0):
            raise ValueError(
                "A sync stage has staleness 0; max_staleness must be None or 0, "
                f"got {self.max_staleness!r}."
            )


def _as_hybrid_stage(stage: Any, index: int) -> HybridStage:
    if isinstance(stage, HybridStage):
        return stage
    try:
        mode = stage.mode
        local_steps = stage.local_steps
        max_staleness = stage.max_staleness
    except AttributeError:
        raise ValueError(
            f"stages[{index}] must be a HybridStage or have mode, local_steps and "
            f"max_staleness attributes, got {type(stage).__name__}."
        ) from None
    until = getattr(stage, "until_version", None)
    if until is None:
        until = getattr(stage, "until_step", None)
    return HybridStage(mode, local_steps, max_staleness, until)


class Hybrid(Policy):
    r"""A sequence of stages, each run by the ASP, semi-async or BSP policy.

    ASHL's scheme: a first asynchronous stage with many local steps and a large
    staleness tolerance (AHL), then a semi-asynchronous one with few local steps
    and frequent pushes (SHL). The current stage's policy answers every question;
    its ``local_steps`` is the hint sent to workers. The stage advances when the
    server version reaches its ``until_version``, or when told by
    :meth:`ServerCore.set_stage` (a worker whose staged optimizer switched on a
    flat loss reports it). Blocked workers and buffered updates are re-examined
    under the new stage at once.

    ``hpsjax-server`` takes the stages as JSON objects of :class:`HybridStage`'s
    fields: ``--policy hybrid --policy_arg 'stages=[{"mode": "async",
    "local_steps": 8, "max_staleness": 16, "until_version": 100}, {"mode":
    "semi_async", "max_staleness": 2}]'`` (LAUNCH.md).

    Args:
      stages: a non-empty sequence of :class:`HybridStage` (or
        ``hpsjax.transforms.Stage``); ``until_version`` increases along it.
      on_stale: ``"damp"`` or ``"drop"`` for pushes beyond a stage's bound.

    Examples:
      >>> from hpsjax.decisions._policies import Hybrid, HybridStage
      >>> policy = Hybrid([
      ...     HybridStage("async", local_steps=8, max_staleness=16,
      ...                 until_version=100),
      ...     HybridStage("semi_async", local_steps=1, max_staleness=2),
      ... ])
      >>> policy.stage, policy.current.mode
      (0, 'async')

    References:
      Shen et al., `ASHL: An Adaptive Multi-Stage Distributed Deep Learning
      Training Scheme for Heterogeneous Environments
      <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans. Computers 2024.
    """

    name = "hybrid"

    def __init__(self, stages: Sequence[Any], *, on_stale: str = "damp"):
        check_choice("on_stale", on_stale, STALE_ACTIONS)
        if isinstance(stages, str | bytes) or not isinstance(stages, Sequence):
            raise ValueError(
                f"stages must be a sequence of stages, got {type(stages).__name__}."
            )
        if not stages:
            raise ValueError("Hybrid needs at least one stage.")
        converted = tuple(_as_hybrid_stage(s, i) for i, s in enumerate(stages))
        untils = [s.until_version for s in converted if s.until_version is not None]
        if any(b <= a for a, b in itertools.pairwise(untils)):
            raise ValueError(f"until_version must increase along stages: {untils}.")
        self.stages = converted
        self.on_stale = on_stale
        self._delegates = tuple(self._delegate(s) for s in converted)
        self._stage = 0

    def _delegate(self, stage: HybridStage) -> Policy:
        if stage.mode == "sync":
            return BSP()
        if stage.mode == "semi_async":
            return SemiAsync(max_staleness=stage.max_staleness, on_stale=self.on_stale)
        return ASP(max_staleness=stage.max_staleness, on_stale=self.on_stale)

    @property
    def stage(self) -> int:
        """Index of the current stage."""
        return self._stage

    @property
    def current(self) -> HybridStage:
        """Settings of the current stage."""
        return self.stages[self._stage]

    @property
    def synchronous(self) -> bool:
        """Whether the current stage is synchronous (``"sync"``)."""
        return self._delegates[self._stage].synchronous

    def admit(self, core, worker_id):
        return self._delegates[self._stage].admit(core, worker_id)

    def admit_key(self, core):
        inner = self._delegates[self._stage].admit_key(core)
        return None if inner is None else (self._stage, inner)

    def wait_reason(self, core, worker_id):
        inner = self._delegates[self._stage].wait_reason(core, worker_id)
        return f"hybrid stage {self._stage}: {inner}"

    def judge(self, core, worker_id, staleness):
        return self._delegates[self._stage].judge(core, worker_id, staleness)

    def ready(self, core):
        return self._delegates[self._stage].ready(core)

    def local_steps(self, core, worker_id):
        del core, worker_id
        return self.current.local_steps

    def on_push(self, core, worker_id, now):
        self._delegates[self._stage].on_push(core, worker_id, now)

    def on_apply(self, core, now):
        self._delegates[self._stage].on_apply(core, now)
        last = len(self.stages) - 1
        while self._stage < last:
            until = self.stages[self._stage].until_version
            if until is None or core.version < until:
                break
            self._stage += 1

    def set_stage(self, core, index):
        del core
        if not is_int(index) or not 0 <= index < len(self.stages):
            raise ValueError(
                f"Stage index must be an int in [0, {len(self.stages)}), got {index!r}."
            )
        self._stage = int(index)

    def state_dict(self):
        return {"stage": self._stage}

    def load_state_dict(self, state):
        if not isinstance(state, Mapping) or set(state) != {"stage"}:
            raise ValueError(f"A hybrid state needs exactly the key 'stage': {state!r}")
        index = state["stage"]
        if not is_int(index) or not 0 <= index < len(self.stages):
            raise ValueError(f"Stage index {index!r} out of range.")
        self._stage = int(index)

    def _config(self):
        return {"stages": list(self.stages), "on_stale": self.on_stale}


class PlannedHybrid(Hybrid):
    r"""ASHL's staged policy with each worker's planned local steps.

    :class:`Hybrid` hints the same local step count to every worker of a stage.
    ASHL plans :math:`H_i` per worker so that :math:`H_i t_i + T_i` is equal for
    all (``hpsjax.planning.plan(..., "ashl")``); this policy hints worker
    :math:`i` its planned :math:`H_i` of the current stage (the stage's own count
    for a worker the plan does not name). Everything else is :class:`Hybrid`'s.

    Args:
      stages: the stages, as for :class:`Hybrid`.
      local_steps: per stage, a mapping worker id -> :math:`H_i` (for instance
        ``{w.worker_id: w.local_steps for w in work_plan.workers}``).
      on_stale: as for :class:`Hybrid`.

    Raises:
      ValueError: if ``local_steps`` does not hold one mapping per stage.

    Examples:
      >>> from hpsjax.ps import HybridStage, PlannedHybrid
      >>> policy = PlannedHybrid(
      ...     [HybridStage("async", 8, 32, until_version=10),
      ...      HybridStage("semi_async", 2, 4)],
      ...     [{0: 8, 1: 32}, {0: 2, 1: 8}])
      >>> policy.planned_steps[1][1]
      8

    References:
      Shen, Tang, Zhou, Zhang, Jia, Yu, Zhang, Li, `ASHL: An Adaptive
      Multi-Stage Distributed Deep Learning Training Scheme for Heterogeneous
      Environments <https://doi.org/10.1109/TC.2023.3315847>`_, IEEE Trans.
      Computers 73(1), 2024.
    """

    name = "hybrid"

    def __init__(
        self,
        stages: Sequence[Any],
        local_steps: Sequence[Mapping[Any, int]],
        *,
        on_stale: str = "damp",
    ):
        super().__init__(stages, on_stale=on_stale)
        if len(local_steps) != len(self.stages):
            raise ValueError(
                f"{len(local_steps)} local-step plans for {len(self.stages)} stages"
            )
        self.planned_steps = tuple(dict(p) for p in local_steps)

    def local_steps(self, core, worker_id):
        del core
        return self.planned_steps[self.stage].get(worker_id, self.current.local_steps)

    def _config(self):
        return {**super()._config(), "local_steps": list(self.planned_steps)}
