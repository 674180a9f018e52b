"""The worker runtime, heterogeneity injection and the ``hpsjax-worker`` command.

:class:`Worker` trains against a parameter server in rounds (pull, local steps,
push) with the transfers overlapped with compute, follows the server's hints, and
records per-round metrics; :func:`run_worker` runs one to the end.
:class:`Heterogeneity` and :class:`Injector` make one machine stand for a mixed
cluster (slower compute, narrower links, changing over time).
"""

from hpsjax.worker._core import (
    NONFINITE_ACTIONS,
    OVERLAP_MODES,
    WorkerCore,
    WorkerOptions,
)
from hpsjax.worker._hetero import Heterogeneity, Injector, parse_schedule
from hpsjax.worker._runtime import (
    JsonLinesSink,
    Worker,
    WorkerConfig,
    WorkerSummary,
    run_worker,
    summarize,
)

__all__ = [
    "NONFINITE_ACTIONS",
    "OVERLAP_MODES",
    "Heterogeneity",
    "Injector",
    "JsonLinesSink",
    "Worker",
    "WorkerConfig",
    "WorkerCore",
    "WorkerOptions",
    "WorkerSummary",
    "parse_schedule",
    "run_worker",
    "summarize",
]
