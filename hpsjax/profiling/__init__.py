"""Measurement: the profiling pass, the in-place profile of a worker, the pilot.

:func:`profile` measures a worker's train step on each local device (time per
step against batch size, peak memory) and :func:`measure_transfer` its transfer
time to the server; :mod:`hpsjax.profiling.in_place` profiles a worker as it
will run; a :class:`Pilot` makes the plan from the run's own first rounds, then
re-plans as a Replanner. The plan itself is pure arithmetic in
:mod:`hpsjax.planning`, whose names this package also offers.
"""

from hpsjax._devices import multi_device_grad
from hpsjax.planning import (  # noqa: F401
    ASHL_STAGE_MULTIPLIERS,
    LINK_SHARE_THRESHOLD,
    LR_SCALINGS,
    MIN_BATCH_SHARE,
    MIN_COMPRESS_RATIO,
    SCHEMES,
    DevicePlan,
    DeviceProfile,
    LinearFit,
    Link,
    Replanner,
    TransferProfile,
    WorkerPlan,
    WorkerProfile,
    WorkPlan,
    choose_overlap,
    link_share,
    plan,
)
from hpsjax.profiling._pilot import Pilot, WorkerFit
from hpsjax.profiling._profile import (
    measure_transfer,
    profile,
    tree_wire_nbytes,
)

# The planning names above stay importable from here; their documentation is
# hpsjax.planning's.
__all__ = [
    "Pilot",
    "WorkerFit",
    "measure_transfer",
    "multi_device_grad",
    "profile",
    "tree_wire_nbytes",
]
