"""Profiling pass and work planning.

:func:`profile` measures a worker's train step on each local device (time per
step against batch size, peak memory) and its transfer time to the server;
:func:`plan` turns the workers' profiles into a :class:`WorkPlan` (per worker and
device: batch size, local steps, step-size scale, and for the schemes that have
them stage steps, data shares, push weights and top-k ratios) under the H-PS,
ASHL (our reading and the reference's), ADSP, DyLU or equal scheme;
:class:`Replanner` revises a plan as measured speeds drift; a :class:`Pilot` makes
the plan from the run's own first rounds, then re-plans as a Replanner.
"""

from hpsjax.profiling._overlap import LINK_SHARE_THRESHOLD, choose_overlap, link_share
from hpsjax.profiling._pilot import Pilot, WorkerFit
from hpsjax.profiling._plan import (
    ASHL_STAGE_MULTIPLIERS,
    LR_SCALINGS,
    MIN_BATCH_SHARE,
    MIN_COMPRESS_RATIO,
    SCHEMES,
    DevicePlan,
    Replanner,
    WorkerPlan,
    WorkPlan,
    plan,
)
from hpsjax.profiling._profile import (
    DeviceProfile,
    LinearFit,
    Link,
    TransferProfile,
    WorkerProfile,
    measure_transfer,
    multi_device_grad,
    profile,
    tree_wire_nbytes,
)

__all__ = [
    "ASHL_STAGE_MULTIPLIERS",
    "LINK_SHARE_THRESHOLD",
    "LR_SCALINGS",
    "MIN_BATCH_SHARE",
    "MIN_COMPRESS_RATIO",
    "SCHEMES",
    "DevicePlan",
    "DeviceProfile",
    "LinearFit",
    "Link",
    "Pilot",
    "Replanner",
    "TransferProfile",
    "WorkPlan",
    "WorkerFit",
    "WorkerPlan",
    "WorkerProfile",
    "choose_overlap",
    "link_share",
    "measure_transfer",
    "multi_device_grad",
    "plan",
    "profile",
    "tree_wire_nbytes",
]
