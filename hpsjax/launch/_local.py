"""The local backend: a launch's processes on this machine (:func:`launch`,
on :class:`LocalRun`)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from hpsjax._config_flags import argv_of, to_argv
from hpsjax.config import RunConfig
from hpsjax.launch._job import (
    Console,
    Job,
    LaunchError,
    LaunchResult,
    PerWorkerArgs,
    Process,
    WorkerPlaces,
    end_launch,
    final_reason,
    is_crash,
    launch_returncode,
    shutdown,
    start_server,
    worker_ended,
)
from hpsjax.launch._monitor import Monitor
from hpsjax.launch._prepare import check_launch, prepare_workdir, run_env
from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand, WorkerConfig

# Seconds between the server's checkpoints when the launcher may restart it
# (``max_restarts``) and the server flags name no interval of their own.
_RESTART_CHECKPOINT_EVERY_S = 1.0


class _Temporary(str):
    """A temporary work directory: removed when the launch ends."""


def launch(
    num_workers: int,
    *,
    policy: str = "bsp",
    steps: int | None = 100,
    worker_args: Sequence[str] = (),
    per_worker_args: PerWorkerArgs | None = None,
    server_args: Sequence[str] = (),
    plan: str | None = None,
    global_batch: int | None = None,
    replan: float | None = None,
    server_shards: int = 1,
    split_leaves: bool = False,
    max_restarts: int = 0,
    workdir: str | os.PathLike | None = None,
    compile_cache: str | os.PathLike | None = None,
    timeout: float | None = None,
    start_timeout: float = 120.0,
    shutdown_timeout: float = 10.0,
    progress: bool = True,
    log: TextIO | None = None,
    python: str = sys.executable,
) -> LaunchResult:
    """Runs a server and ``num_workers`` workers to completion on this machine.

    Model and data flags (``--model``, ``--dataset_arg``, ...) go in
    ``worker_args``; the initial parameters for the server are written from them.

    Args:
      num_workers: how many worker processes, >= 1.
      policy: the server's synchronisation policy.
      steps: rounds per worker (the workers' ``--steps``), ``None`` to leave it to
        ``worker_args``.
      worker_args: flags for every ``hpsjax-worker``.
      per_worker_args: more flags for some workers, by index (a mapping or a
        list of lists).
      server_args: more flags for ``hpsjax-server`` (e.g. ``["--optimizer",
        "adam"]``).
      plan: a :data:`hpsjax.planning.SCHEMES` name to profile the workers
        (in place: all at once, each in its own process, its push and pull
        timed against a throwaway server of the model) and train with the
        resulting work plan, or ``None``.
      global_batch: the plan's global batch; ``--batch_size`` times the
        workers by default.
      replan: with ``plan``, also give the plan to the server, which re-plans
        (H-PS) when a worker's measured speed drifts by more than this
        fraction (``hpsjax-server --work_plan --replan_threshold``); ``None``
        keeps the plan fixed.
      server_shards: how many server processes to split the model over, by
        key range (``hpsjax-server --server_shard I --server_shards N``);
        the work plan (``replan``) goes to shard 0.
      split_leaves: with ``server_shards > 1``, cut arrays by rows between
        shards too (``--split_leaves``), for models with a few huge arrays.
      max_restarts: how often each process is started again after a crash
        (a signal, or a status other than 0 and 2): a worker with the same
        flags (it rejoins under its ``--worker_id``), a server shard on the
        same port from its checkpoints (``--checkpoint_dir``, by default
        ``checkpoints`` in ``workdir``, written every
        ``--checkpoint_every_s`` = 1 s unless ``server_args`` say otherwise).
        Workers that lose their server end and are restarted too, which
        counts against their own restarts. 0: the first crash ends the run.
      workdir: where to keep the secret, initial parameters, plan and metrics;
        by default a temporary directory, removed when the run ends (nothing
        is kept: the result's ``workdir`` is ``None``; ``hpsjax-launch``
        then has the server export its final parameters, see
        :func:`~hpsjax.launch._prepare.with_export`).
      compile_cache: the JAX compilation cache every process of the run
        shares (``JAX_COMPILATION_CACHE_DIR``); by default ``jax_cache`` in
        ``workdir``.
      timeout: seconds the whole run may take, ``None`` for no limit.
      start_timeout: seconds the server has to start listening.
      shutdown_timeout: seconds processes get after SIGTERM before SIGKILL.
      progress: show a tqdm progress bar of the server version (stderr).
      log: where the processes' prefixed output goes (stdout by default).
      python: the Python interpreter for the children.

    Returns:
      A :class:`LaunchResult`; ``returncode`` 0 when every worker exited with
      0, :data:`DIVERGED` when one diverged (``reason`` says which and when).

    Raises:
      LaunchError: bad arguments or worker flags, a model the flags cannot
        build, or a server that failed to start (everything started is stopped
        first).
      KeyboardInterrupt: after a clean shutdown, when interrupted.

    Examples:
      >>> result = launch(2, policy="asp", steps=20, progress=False,
      ...                 worker_args=["--batch_size", "16"])  # doctest: +SKIP
      >>> result.returncode  # doctest: +SKIP
      0
    """
    if workdir is None:
        # The directory holds the secret: it goes when the run ends, failed
        # and interrupted runs included.
        arguments = dict(locals())
        with tempfile.TemporaryDirectory(prefix="hpsjax-launch-") as tmp:
            return launch(**{**arguments, "workdir": _Temporary(tmp)})
    kept = not isinstance(workdir, _Temporary)
    flags, shared = check_launch(
        num_workers, steps=steps, worker_args=worker_args,
        per_worker_args=per_worker_args, server_args=server_args, timeout=timeout,
        plan=plan, replan=replan, server_shards=server_shards,
        split_leaves=split_leaves, max_restarts=max_restarts, policy=policy,
    )  # fmt: skip
    console = Console(log)
    start = time.monotonic()
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = run_env(work, compile_cache)
    job = Job(
        num_workers, policy, steps, [str(a) for a in server_args], shared, flags,
        [], server_shards, split_leaves,
    )  # fmt: skip
    secret, secret_file, init, job, profile_seconds = prepare_workdir(
        work, job, plan, replan, global_batch, console, python=python, env=env,
        start_timeout=start_timeout, shutdown_timeout=shutdown_timeout,
    )  # fmt: skip
    if max_restarts > 0:
        # A restarted server resumes from here: nothing from an earlier
        # launch in the same workdir may be there.
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
    run = LocalRun(job, console, python, max_restarts, start_timeout, env)
    reason = "completed"
    try:
        run.start_servers(str(init), str(secret_file), work / "checkpoints")
        run.start_workers(str(secret_file), work)
        run.monitor = Monitor(run.ports[0], secret)
        console.start_bar(progress, job)
        reason = run.watch(None if timeout is None else start + timeout)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    except BaseException as e:
        reason = f"launcher error: {e}"
        raise
    finally:
        end_launch(
            reason,
            console,
            run.monitor,
            lambda: shutdown(run.servers, shutdown_timeout),
            lambda: run.stop(shutdown_timeout),
        )
    server_codes = tuple(s.poll() for s in run.servers)
    reason = final_reason(reason, [s.name for s in run.servers], server_codes)
    where = f"workdir {work}" if kept else "no --workdir: metrics not kept"
    console.emit(f"[launch] {reason} in {time.monotonic() - start:.1f}s; {where}")
    return LaunchResult(
        returncode=launch_returncode(reason),
        reason=reason,
        server_returncode=server_codes[0] if server_codes else None,
        worker_returncodes=tuple(w.poll() for w in run.workers),
        pids=tuple(p.pid for p in run.processes),
        port=run.ports[0] if run.ports else None,
        workdir=str(work) if kept else None,
        version=None if run.monitor is None else run.monitor.version,
        elapsed=time.monotonic() - start,
        profile_seconds=profile_seconds,
        ports=tuple(run.ports),
        server_returncodes=server_codes,
        worker_restarts=tuple(run.worker_restarts),
        server_restarts=tuple(run.server_restarts),
    )


# What the launcher gives each process itself, by settings class: a run that
# sets any of them is refused (worker i's id and shard are i, checked apart).
_LAUNCHERS_OWN = {
    ServerOptions: ("host", "port", "init_from", "secret_file", "server_shard",
                    "server_shards"),
    WorkerCommand: ("port", "servers", "secret_file", "metrics"),
    WorkerConfig: ("host", "port", "secret"),
}  # fmt: skip
_NOT_WITH_A_RUN = ("num_workers", "policy", "steps", "worker_args",
                   "per_worker_args", "server_args")  # fmt: skip


def launch_run(run: RunConfig, **options: Any) -> LaunchResult:
    """Runs a :class:`hpsjax.config.RunConfig` on this machine: its server's
    settings and each worker's, as they are.

    :func:`launch` starts ``hpsjax-server`` with the run's server settings
    (its defaults where ``run.server`` is ``None``; its policy is the run's
    scheme; its ``init`` is the launcher's, the initial parameters it writes
    from the workers' model) and one ``hpsjax-worker`` per worker with that
    worker's, each a command line written from the settings that parses back
    to exactly them
    (:func:`hpsjax.config.parse_worker`). The launcher gives each process what
    only it knows: worker ``i``'s id and data shard (``i`` of ``n``), the
    servers' addresses, the secret and the initial parameters; a run that
    sets one of these otherwise is refused.

    Args:
      run: the run.
      **options: :func:`launch`'s other arguments (``workdir``, ``plan``,
        ``timeout``, ``max_restarts``, ``progress``, ...); the run gives the
        workers, policy, steps and flags.

    Raises:
      LaunchError: in one line, before anything starts: an option the run
        gives, a launcher's setting in the run, or what :func:`launch`
        refuses.

    Examples:
      >>> from hpsjax.config import parse_worker
      >>> worker = parse_worker(["--batch_size", "16", "--steps", "4"])
      >>> launch_run(RunConfig(workers=(worker,)), workdir="run")  # doctest: +SKIP
    """
    if not isinstance(run, RunConfig):
        raise LaunchError(f"run must be a hpsjax.config.RunConfig, got {run!r}")
    given = sorted(set(options) & set(_NOT_WITH_A_RUN))
    if given:
        raise LaunchError(
            f"launch_run takes {', '.join(given)} from the run, not as an option"
        )
    n = len(run.workers)
    server = ServerOptions(init="init.npz") if run.server is None else run.server
    _refuse_launchers_own("the run's server", server)
    for i, worker in enumerate(run.workers):
        _refuse_launchers_own(f"worker {i}", worker.command, worker.config)
        own = (
            ("worker_id", worker.config.worker_id, i),
            ("shard_index", worker.command.shard_index, i),
        )
        if worker.command.shard_index is not None:
            own += (("shard_count", worker.command.shard_count, n),)
        for name, value, launchers in own:
            if value is not None and value != launchers:
                raise LaunchError(
                    f"worker {i} has {name} {value!r}: the launcher gives "
                    f"worker {i} {name} {launchers}"
                )
    return launch(
        n,
        policy=server.policy,
        steps=None,
        per_worker_args=[worker.argv() for worker in run.workers],
        # The launcher writes the initial parameters from the workers' model.
        server_args=to_argv(server, skip=("init",)),
        **options,
    )


def _refuse_launchers_own(what: str, *settings: Any) -> None:
    for part in settings:
        fields = {f.name: f for f in dataclasses.fields(part)}
        for name in _LAUNCHERS_OWN[type(part)]:
            field = fields[name]
            default = (
                field.default_factory()
                if field.default is dataclasses.MISSING
                else field.default
            )
            if getattr(part, name) != default:
                raise LaunchError(
                    f"{what} sets {name}, which the launcher gives: leave it out"
                )


class LocalRun:
    """A job's processes on this machine: started, restarted, watched.

    :func:`launch` starts its servers and workers with it; a caller that
    serves the model itself (an :class:`hpsjax.ps.Server` in its own process,
    e.g. for an optax chain or a policy object no flag names) starts only the
    workers, against its server's port, and watches them with :meth:`poll`.

    Args:
      job: the command lines (:class:`~hpsjax.launch.Job`).
      console: where the processes' prefixed output goes.
      python: the interpreter of the processes.
      max_restarts: how often each process is started again after a crash.
      start_timeout: seconds a server has to listen.
      env: the processes' environment (:func:`~hpsjax.launch.run_env`).
      places: where each worker runs (:data:`~hpsjax.launch.WorkerPlaces`);
        by default ``python`` in ``env``.
    """

    def __init__(
        self,
        job: Job,
        console: Console,
        python: str,
        max_restarts: int,
        start_timeout: float,
        env: Mapping[str, str],
        places: WorkerPlaces | None = None,
    ):
        if places is not None and len(places) != job.num_workers:
            raise LaunchError(
                f"{len(places)} worker places for {job.num_workers} workers"
            )
        self.job = job
        self.places = places
        self.console = console
        self.python = python
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.env = dict(env)
        self.started = time.monotonic()
        self.processes: list[Process] = []
        self.servers: list[Process] = []
        self.workers: list[Process] = []
        self.monitor: Monitor | None = None
        self.ports: list[int] = []
        self.server_argvs: list[list[str]] = []
        self.worker_argvs: list[list[str]] = []
        self.worker_restarts = [0] * job.num_workers
        self.server_restarts = [0] * job.server_shards

    def _start_server(self, name: str, argv: list[str]) -> int:
        return start_server(
            name, argv, self.console.emit, self.env, self.processes,
            self.start_timeout,
        )  # fmt: skip

    def start_servers(
        self, init: str, secret_file: str, checkpoints: pathlib.Path
    ) -> None:
        job = self.job
        for shard in range(job.server_shards):
            name, argv = job.server(
                shard, [self.python], init, secret_file, "127.0.0.1"
            )
            if self.max_restarts > 0:
                argv += _restart_checkpoint_args(
                    job.server_args, checkpoints, shard, job.server_shards
                )
            if not any(str(a).startswith("--tensorboard_dir") for a in argv):
                # The server's scalars beside the workers' (tensorboard/worker<i>).
                board = checkpoints.parent / "tensorboard"
                if job.server_shards > 1:
                    board = board / f"shard_{shard}"
                argv += argv_of(ServerOptions, tensorboard_dir=str(board))
            self.server_argvs.append(argv)
            self.ports.append(self._start_server(name, argv))
            self.servers.append(self.processes[-1])

    def start_workers(
        self,
        secret_file: str,
        work: pathlib.Path,
        ports: Sequence[int] | None = None,
    ) -> None:
        """Starts every worker, its metrics in ``work/metrics_<i>.jsonl``,
        against the servers this run started or those on ``ports``."""
        job = self.job
        if ports is not None:
            self.ports = list(ports)
        where = job.where([("127.0.0.1", p) for p in self.ports])
        if job.server_shards > 1:
            self.console.emit(
                f"[launch] {job.server_shards} server shards on ports "
                f"{', '.join(map(str, self.ports))}, starting {job.num_workers} "
                "worker(s)"
            )
        else:
            self.console.emit(
                f"[launch] server on port {self.ports[0]}, starting "
                f"{job.num_workers} worker(s)"
            )
        self.started = time.monotonic()
        for i in range(job.num_workers):
            metrics = str(work / f"metrics_{i}.jsonl")
            head = [self.python] if self.places is None else self.places[i][0]
            argv = job.worker(i, list(head), where, secret_file, metrics)
            self.worker_argvs.append(argv)
            self.workers.append(self._process(f"worker {i}", argv, i))

    def _process(
        self, name: str, argv: list[str], worker: int | None = None
    ) -> Process:
        env = self.env
        if worker is not None and self.places is not None:
            env = {**env, **self.places[worker][1]}
        process = Process(name, argv, self.console.emit, env)
        self.processes.append(process)
        return process

    def poll(self) -> str | None:
        """One look at the run, restarting what crashed (``max_restarts``):
        ``None`` while it goes on, else why it ended: ``"completed"`` (every
        worker exited with 0) or what ended it early (:func:`worker_ended`'s
        line for a worker, or a server's)."""
        codes = self._restart_workers()
        failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
        if failed:
            i, code = failed[0]
            return worker_ended(i, code, time.monotonic() - self.started)
        if all(c == 0 for c in codes):
            return "completed"
        reason = self._restart_servers()
        if reason is not None:
            return reason
        exited = [(s.name, s.poll()) for s in self.servers if s.poll() is not None]
        if exited:
            return f"{exited[0][0]} exited early with status {exited[0][1]}"
        return None

    def watch(self, end: float | None) -> str:
        """Polls until the run ends: ``"completed"``, or what ended it early."""
        while True:
            reason = self.poll()
            if reason is not None:
                return reason
            if end is not None and time.monotonic() > end:
                return "timeout"
            self.console.show(self.monitor.version)
            time.sleep(0.1)

    def stop(self, timeout: float) -> None:
        """Stops every process: SIGTERM to each group, ``timeout`` seconds,
        then SIGKILL (:func:`shutdown`)."""
        shutdown(self.processes, timeout)

    def _restart_workers(self) -> list[int | None]:
        """Starts crashed workers again (``max_restarts``); returns each
        worker's exit status, ``None`` for one running or just restarted."""
        codes = [w.poll() for w in self.workers]
        for i, code in enumerate(codes):
            if is_crash(code) and self.worker_restarts[i] < self.max_restarts:
                self.worker_restarts[i] += 1
                self.console.emit(
                    f"[launch] worker {i} crashed (status {code}); restarting "
                    f"it ({self.worker_restarts[i]} of {self.max_restarts})"
                )
                self.workers[i] = self._process(f"worker {i}", self.worker_argvs[i], i)
                codes[i] = None
        return codes

    def _restart_servers(self) -> str | None:
        """Starts crashed server shards again on their ports, from their
        checkpoints; returns why a restart failed, if one did."""
        for shard, server in enumerate(self.servers):
            code = server.poll()
            if not (is_crash(code) and self.server_restarts[shard] < self.max_restarts):
                continue
            self.server_restarts[shard] += 1
            port = self.ports[shard]
            self.console.emit(
                f"[launch] {server.name} crashed (status {code}); restarting "
                f"it on port {port} from its checkpoints "
                f"({self.server_restarts[shard]} of {self.max_restarts})"
            )
            argv = [*self.server_argvs[shard], *argv_of(ServerOptions, port=port)]
            try:
                self._start_server(server.name, argv)
            except LaunchError as e:
                return f"restarting the {server.name} failed: {e}"
            self.servers[shard] = self.processes[-1]
            if shard == 0:
                secret = self.monitor.secret
                self.monitor.close()
                self.monitor = Monitor(self.ports[0], secret)
        return None


def _restart_checkpoint_args(
    server_args: Sequence[str],
    checkpoints: pathlib.Path,
    shard: int,
    server_shards: int,
) -> list[str]:
    """The checkpoint flags a server needs to be restarted, those that
    ``server_args`` leave out."""
    given = {str(a).split("=", 1)[0] for a in server_args}
    extra = {}
    if "--checkpoint_dir" not in given:
        where = checkpoints if server_shards == 1 else checkpoints / f"shard_{shard}"
        extra["checkpoint_dir"] = str(where)
    if not given & {"--checkpoint_every_s", "--checkpoint_every_updates"}:
        extra["checkpoint_every_s"] = _RESTART_CHECKPOINT_EVERY_S
    return argv_of(ServerOptions, **extra)
