"""One run's configuration: the servers' and the workers' settings, checked once.

A :class:`RunConfig` nests the frozen settings every process of a run is made
from (:class:`~hpsjax.ps.ServerOptions` for the server,
:class:`WorkerSettings` for each worker: the worker command's own flags and
its :class:`~hpsjax.worker.WorkerConfig`), checks what concerns the run as a
whole (workers that cannot be told apart, shards), and writes each process's
command line from the fields (:func:`hpsjax._config_flags.to_argv`);
:func:`parse_server` and :func:`parse_worker` read a command line back with
the commands' own parsers, made from the same fields. :data:`RUN_SCHEMES`
names each scheme once (``hps``, ``ashl``, every policy), with the server
policy and the worker flags it stands for.
"""

from hpsjax.config._run import (
    RUN_SCHEMES,
    RunConfig,
    Scheme,
    WorkerSettings,
    get_scheme,
    parse_server,
    parse_worker,
)

__all__ = [
    "RUN_SCHEMES",
    "RunConfig",
    "Scheme",
    "WorkerSettings",
    "get_scheme",
    "parse_server",
    "parse_worker",
]
