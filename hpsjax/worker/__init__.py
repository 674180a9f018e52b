"""The worker: its decisions, its asyncio runtime, heterogeneity injection.

:class:`WorkerCore` makes a worker's decisions without I/O (it takes events
such as :class:`Pulled` and answers with actions such as :class:`Push`, which
every driver carries out); :class:`Worker`
carries them out against a parameter server in rounds (pull, local steps,
push) with the transfers overlapped with compute, and records per-round
metrics (:class:`JsonLinesSink`, :func:`summarize`); :func:`run_worker` runs
one to the end. :class:`Heterogeneity` and :class:`Injector` make one machine
stand for a mixed cluster (slower compute, narrower links, changing over
time). A worker's command line is read by :func:`parse_worker_args` (the
flags of :class:`WorkerCommand` and :class:`WorkerConfig`), and its parts are
built from the parsed flags by :func:`build` and the ``make_*`` functions, so a
flag means the same to ``hpsjax-worker`` (:mod:`hpsjax.cli.worker`), the
launcher and the in-place profile.
"""

from hpsjax.worker._build import (
    JoinError,
    build,
    build_worker,
    check_task_fits,
    connect,
    data_shard,
    load_dataset,
    make_client,
    make_heterogeneity,
    make_local_optimizer,
    make_model,
    make_sharded_client,
    make_task,
    server_address,
    task_loss,
    write_init,
)
from hpsjax.worker._cli import Target, worker_target
from hpsjax.worker._cli import parse_args as parse_worker_args
from hpsjax.worker._command import WorkerCommand
from hpsjax.worker._compute import push_compression
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
from hpsjax.worker._worker_id import given_or_assigned_id

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
    "JoinError",
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
    "Target",
    "Worker",
    "WorkerCommand",
    "WorkerConfig",
    "WorkerCore",
    "WorkerOptions",
    "WorkerSummary",
    "build",
    "build_worker",
    "check_overlap",
    "check_task_fits",
    "connect",
    "data_shard",
    "given_or_assigned_id",
    "load_dataset",
    "make_client",
    "make_heterogeneity",
    "make_local_optimizer",
    "make_model",
    "make_sharded_client",
    "make_task",
    "parse_schedule",
    "parse_worker_args",
    "push_compression",
    "run_worker",
    "server_address",
    "summarize",
    "task_loss",
    "worker_target",
    "write_init",
]
