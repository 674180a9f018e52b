"""Work planning: the plan of a run from its workers' profiles, pure arithmetic.

:func:`plan` turns the workers' :class:`WorkerProfile` objects into a
:class:`WorkPlan` (per worker and device: batch size, local steps, step-size
scale, and for the schemes that have them stage steps, data shares, push weights
and top-k ratios) under the H-PS, ASHL (our reading and the reference's), ADSP,
DyLU or equal scheme; :class:`Replanner` revises a plan as measured speeds drift;
:func:`choose_overlap` picks the overlap mode from a plan's link share;
:func:`batch_grid` and :func:`on_grid` keep batches to a few compiled shapes. No JAX,
no I/O, nothing from the worker or the server: the server's layer plans with
it, and :mod:`hpsjax.profiling` measures the profiles it takes.
"""

from hpsjax.planning._grid import batch_grid, on_grid
from hpsjax.planning._overlap import LINK_SHARE_THRESHOLD, choose_overlap, link_share
from hpsjax.planning._plan import plan
from hpsjax.planning._profiles import (
    PROFILE_FORMAT,
    PROFILE_FORMAT_VERSION,
    DeviceProfile,
    LinearFit,
    Link,
    TransferProfile,
    WorkerProfile,
)
from hpsjax.planning._replan import Replanner, check_report
from hpsjax.planning._solve import lr_scale
from hpsjax.planning._workplan import (
    ASHL_STAGE_MULTIPLIERS,
    LR_SCALINGS,
    MIN_BATCH_SHARE,
    MIN_COMPRESS_RATIO,
    PLAN_FORMAT,
    PLAN_FORMAT_VERSION,
    SCHEMES,
    DevicePlan,
    WorkerPlan,
    WorkPlan,
)

__all__ = [
    "ASHL_STAGE_MULTIPLIERS",
    "LINK_SHARE_THRESHOLD",
    "LR_SCALINGS",
    "MIN_BATCH_SHARE",
    "MIN_COMPRESS_RATIO",
    "PLAN_FORMAT",
    "PLAN_FORMAT_VERSION",
    "PROFILE_FORMAT",
    "PROFILE_FORMAT_VERSION",
    "SCHEMES",
    "DevicePlan",
    "DeviceProfile",
    "LinearFit",
    "Link",
    "Replanner",
    "TransferProfile",
    "WorkPlan",
    "WorkerPlan",
    "WorkerProfile",
    "batch_grid",
    "check_report",
    "choose_overlap",
    "link_share",
    "lr_scale",
    "on_grid",
    "plan",
]
