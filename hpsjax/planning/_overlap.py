r"""Whether a plan's workers should overlap their transfers with compute.

A worker that pipelines (``overlap="pipeline"``) pushes a round's update and
pulls while the next round computes: its round takes about
:math:`\max(c, T)` instead of :math:`c + T` (compute :math:`c`, transfer
:math:`T`), at the price of every gradient being applied one version late.
The plan predicts both terms, so it can say when the link's share of a round,
:math:`s = \max_i T_i / R` (:math:`R` the plan's predicted round), is large
enough for that trade: above :data:`LINK_SHARE_THRESHOLD` (or a threshold of
the caller's), :func:`choose_overlap` picks ``"pipeline"`` (the docs' planning
notes say when that pays).
"""

from __future__ import annotations

import math
from typing import Any

from hpsjax._checks import check_fraction
from hpsjax.planning._workplan import WorkPlan

__all__ = ["LINK_SHARE_THRESHOLD", "choose_overlap", "link_share"]

LINK_SHARE_THRESHOLD = 0.25
"""The link share of a predicted round above which :func:`choose_overlap`
pipelines by default: the round then shrinks by more than a quarter."""


def _check_plan(work_plan: Any) -> None:
    if not isinstance(work_plan, WorkPlan):
        raise ValueError(
            f"work_plan must be a hpsjax.planning.WorkPlan, got "
            f"{type(work_plan).__name__}"
        )


def link_share(work_plan: WorkPlan) -> float:
    r"""The largest share of the plan's predicted round a worker's link takes.

    .. math::

      s = \min\left(1, \max_i T_i / R\right)

    with :math:`T_i` the worker's round-trip ``transfer_seconds`` and :math:`R`
    the plan's ``round_time``; 0 for a plan whose predicted round is 0.

    Args:
      work_plan: a plan of :func:`hpsjax.planning.plan`.

    Returns:
      :math:`s`, in [0, 1].

    Raises:
      ValueError: ``work_plan`` is not a ``WorkPlan``.

    Examples:
      >>> from hpsjax.planning import WorkerProfile, link_share, plan
      >>> profiles = [WorkerProfile.synthetic(i, 1000.0, transfer_seconds=0.03)
      ...             for i in range(2)]
      >>> round(link_share(plan(profiles, "hps", global_batch=64)), 3)
      0.484
    """
    _check_plan(work_plan)
    if not work_plan.round_time > 0:
        return 0.0
    transfer = max(w.transfer_seconds for w in work_plan.workers)
    return min(1.0, transfer / work_plan.round_time)


def choose_overlap(work_plan: WorkPlan, threshold: float = LINK_SHARE_THRESHOLD) -> str:
    """``"pipeline"`` where the plan's link share exceeds ``threshold``, else
    ``"none"``: the workers' ``overlap`` for this plan.

    Args:
      work_plan: a plan of :func:`hpsjax.planning.plan`.
      threshold: the link share (:func:`link_share`) above which the transfers
        are worth hiding behind compute, in (0, 1].

    Returns:
      ``"pipeline"`` or ``"none"`` (values of ``hpsjax.worker.OVERLAP_MODES``).

    Raises:
      ValueError: ``work_plan`` is not a ``WorkPlan``, or ``threshold`` is not a
        number in (0, 1].

    Examples:
      >>> from hpsjax.planning import WorkerProfile, choose_overlap, plan
      >>> profiles = [WorkerProfile.synthetic(i, 1000.0, transfer_seconds=0.03)
      ...             for i in range(2)]
      >>> choose_overlap(plan(profiles, "hps", global_batch=64))
      'pipeline'
      >>> choose_overlap(plan(profiles, "hps", global_batch=64), threshold=0.9)
      'none'
    """
    check_fraction("threshold", threshold)
    _check_plan(work_plan)
    share = link_share(work_plan)
    return "pipeline" if math.isfinite(share) and share > threshold else "none"
