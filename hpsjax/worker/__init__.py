"""The worker: its decisions, its asyncio runtime, heterogeneity injection.

:class:`WorkerCore` makes a worker's decisions without I/O (it takes events
such as :class:`Pulled` and answers with actions such as :class:`Push`, which
every driver carries out); :class:`Worker`
carries them out against a parameter server in rounds (pull, local steps,
push) with the transfers overlapped with compute, and records per-round
metrics (:class:`JsonLinesSink`, :func:`summarize`); :func:`run_worker` runs
one to the end. :class:`Heterogeneity` and :class:`Injector` make one machine
stand for a mixed cluster (slower compute, narrower links, changing over
time); ``hpsjax-worker`` is the command line.
"""

from hpsjax.worker._command import WorkerCommand
from hpsjax.worker._config import WorkerConfig
from hpsjax.worker._core import (
    NONFINITE_ACTIONS,
    OVERLAP_MODES,
    Acked,
    Compute,
    Computed,
    Discard,
    Dropped,
    ForcePulled,
    Join,
    Joined,
    KeepParams,
    Left,
    PlanChanged,
    Pull,
    Pulled,
    Push,
    Report,
    Reported,
    StepsHinted,
    Stop,
    StopComputing,
    StopRequested,
    WorkerCore,
    WorkerOptions,
    check_overlap,
)
from hpsjax.worker._hetero import Heterogeneity, Injector, parse_schedule
from hpsjax.worker._records import JsonLinesSink, WorkerSummary, summarize
from hpsjax.worker._runtime import Worker, run_worker

__all__ = [
    "NONFINITE_ACTIONS",
    "OVERLAP_MODES",
    "Acked",
    "Compute",
    "Computed",
    "Discard",
    "Dropped",
    "ForcePulled",
    "Heterogeneity",
    "Injector",
    "Join",
    "Joined",
    "JsonLinesSink",
    "KeepParams",
    "Left",
    "PlanChanged",
    "Pull",
    "Pulled",
    "Push",
    "Report",
    "Reported",
    "StepsHinted",
    "Stop",
    "StopComputing",
    "StopRequested",
    "Worker",
    "WorkerCommand",
    "WorkerConfig",
    "WorkerCore",
    "WorkerOptions",
    "WorkerSummary",
    "check_overlap",
    "parse_schedule",
    "run_worker",
    "summarize",
]
