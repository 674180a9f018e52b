"""Launcher: one parameter server and N workers as processes on this machine, or
placed by Ray (``--backend ray``, :func:`launch_ray`).

``python -m hpsjax.launch --workers 4 --policy bsp --steps 200`` writes the
model's initial parameters and a fresh secret into a work directory, starts
``hpsjax-server`` and N ``hpsjax-worker`` processes (each in its own process
group), streams their output with a ``[server]`` / ``[worker i]`` prefix, shows
the server's version on a progress bar, and stops the server once every worker
has finished. Arguments after ``--server`` go to the server's command line, those
after ``--`` to every worker's, and ``--worker_flags i "..."`` to worker ``i``
only::

    python -m hpsjax.launch --workers 4 --policy bsp --steps 300 --plan hps \\
        --worker_flags 0 "--slowdown 4" --worker_flags 1 "--slowdown 4" \\
        --worker_flags 2 "--slowdown 2" -- --batch_size 64

``--task lm`` (or ``regression``, or a user's ``my_pkg.my_module:make_task``)
sets every worker's ``--task``, as ``--model`` sets their model; a task that
does not exist is refused before anything starts.

With ``--plan SCHEME`` the workers are profiled first, in place: a throwaway
server of the run's model is started and every worker, in its own process and
all at once (``python -m hpsjax.profiling.in_place``), times its train step
beside the others and its push and pull against that server (its injected
slowdown and link added); :func:`hpsjax.planning.plan` makes the work plan from
these profiles, link included, and the workers train with it (``--work_plan``).

Every process of a run (the profiling pass, the server, the workers) shares one
JAX compilation cache, ``jax_cache`` in the work directory unless
``--compile_cache`` names another (``JAX_COMPILATION_CACHE_DIR`` in their
environment): a step compiled by the profiling pass is loaded, not compiled
again, by the worker that runs it.

A worker that exits with the status of a diverged run (:data:`DIVERGED`, a
non-finite loss or update) ends the run with one line, ``worker N diverged at
t = ... s``, and is never restarted.

Shutdown is clean whatever happens: when a worker fails, the server exits early,
the time limit passes, or Ctrl-C (or SIGTERM) arrives, every process group is
sent SIGTERM, given ``shutdown_timeout`` seconds, then SIGKILL; no process
outlives the launcher (on Linux the children are also tied to the launcher's
life with ``PR_SET_PDEATHSIG``, so they get SIGTERM even if it is killed).

With ``--server_shards N`` the model is split by key range over N server
processes (:class:`hpsjax.ps.KeyRangePartition`), each holding its own share of
the parameters, and the workers talk to all of them
(:class:`hpsjax.ps.ShardedClient`); a work plan goes to shard 0, whose plan the
workers follow.

With ``--max_restarts N`` a process that crashes (killed by a signal, or
failed with a status other than 2, bad flags) is started again, up to N times
each: a worker with the same command line (its ``--worker_id``; it rejoins),
a server on the same port from its checkpoint directory (the launcher gives
it ``--checkpoint_dir`` and ``--checkpoint_every_s`` unless ``--server``
flags do). The Ray backend's flag of the same name restarts workers only.

:func:`launch_run` launches a :class:`hpsjax.config.RunConfig` as it is:
its server's settings and each worker's, each process's command line written
from them.

For several hosts, see LAUNCH.md.

The package, one layer per module: ``_job`` (what a launch starts and watches,
whichever backend: the job's command lines, its processes, the console, the
exit-status rules), ``_monitor`` (the server's version, polled), ``_prepare``
(checks, the work directory, the profiling pass and its plan), ``_local``
(:func:`launch`), ``_ray`` (:func:`launch_ray`), ``_actor`` (the process a Ray
actor runs) and ``_cli`` (``hpsjax-launch``).

Beneath :func:`launch`, for a caller that serves the model itself (an
:class:`hpsjax.ps.Server` in its own process: any optax chain, a policy
object, its parameters read while it runs; ``experiments``' processes
backend): :class:`Job` (the command lines), :func:`write_secret`,
:func:`profile_in_place` (the profiling pass, each worker where it will run:
:data:`WorkerPlaces`) and :class:`LocalRun` (the workers started against the
caller's port, watched by :func:`launch`'s rules, stopped for sure).
"""

from hpsjax.launch._job import (
    DIVERGED,
    Console,
    Job,
    LaunchError,
    LaunchResult,
    PerWorkerArgs,
    WorkerPlaces,
)

__all__ = [
    "DIVERGED",
    "Console",
    "Job",
    "LaunchError",
    "LaunchResult",
    "LocalRun",
    "PerWorkerArgs",
    "WorkerPlaces",
    "launch",
    "launch_ray",
    "launch_run",
    "main",
    "profile_in_place",
    "run_cache_env",
    "run_env",
    "write_secret",
]


def __getattr__(name: str):
    # The launchers are loaded on first use, for start-up time only (no circle):
    # every Ray actor imports this package on its node for ``_actor`` alone, and
    # the launchers would add the server package, profiling and the worker's
    # command line (seconds) to each actor's start, within ``start_timeout``.
    if name in ("launch", "launch_run", "LocalRun"):
        from hpsjax.launch import _local

        return getattr(_local, name)
    if name == "launch_ray":
        from hpsjax.launch._ray import launch_ray

        return launch_ray
    if name == "main":
        from hpsjax.launch._cli import main

        return main
    if name in ("run_env", "run_cache_env", "profile_in_place", "write_secret"):
        from hpsjax.launch import _prepare

        return getattr(_prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
