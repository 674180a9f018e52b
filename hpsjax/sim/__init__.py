"""Virtual-clock simulation of parameter-server training on unequal workers.

:func:`simulate` drives the parameter server's own state machine
(:class:`hpsjax.ps.ServerCore`, with every policy) with a virtual clock and
simulated workers that compute real gradients: a scheme can be studied on 4 or
400 workers of any mix of speeds and links, reproducibly, on one machine.
"""

from hpsjax.sim._halos import HalosCore
from hpsjax.sim._simulate import (
    OVERLAP_MODES,
    ApplyRecord,
    Divergence,
    Interval,
    PushRecord,
    SendRecord,
    SimConfig,
    SimResult,
    simulate,
)
from hpsjax.sim._workers import ComputeModel, WorkerSpec, make_workers

__all__ = [
    "OVERLAP_MODES",
    "ApplyRecord",
    "ComputeModel",
    "Divergence",
    "HalosCore",
    "Interval",
    "PushRecord",
    "SendRecord",
    "SimConfig",
    "SimResult",
    "WorkerSpec",
    "make_workers",
    "simulate",
]
