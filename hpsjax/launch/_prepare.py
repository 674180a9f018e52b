"""Before a launch starts its job: the checks of its arguments, the work
directory (secret, initial parameters) and the profiling pass with its plan."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pathlib
import secrets
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from hpsjax import profiling
from hpsjax._checks import check_int, check_positive
from hpsjax._compile_cache import cache_dir_for, cache_env
from hpsjax._config_flags import argv_of, flag_message
from hpsjax.config import RunConfig, get_scheme, parse_server, parse_worker
from hpsjax.decisions import DEFAULT_POLICY
from hpsjax.launch._job import (
    Console,
    Job,
    LaunchError,
    PerWorkerArgs,
    Process,
    WorkerPlaces,
    shutdown,
    start_server,
)
from hpsjax.ps import ServerOptions
from hpsjax.tasks import get_task
from hpsjax.worker import (
    WorkerCommand,
    WorkerConfig,
    make_heterogeneity,
    worker_target,
    write_init,
)
from hpsjax.worker import parse_worker_args as parse_args


def check_launch(
    num_workers: int,
    *,
    steps: int | None,
    worker_args: Sequence[str],
    per_worker_args: PerWorkerArgs | None,
    server_args: Sequence[str],
    timeout: float | None,
    plan: str | None,
    replan: float | None,
    server_shards: int,
    split_leaves: bool,
    max_restarts: int = 0,
    policy: str = DEFAULT_POLICY,
) -> tuple[list[list[str]], list[str]]:
    """Checks a launch's arguments; returns each worker's and the shared flags
    (``policy``'s scheme's worker flags first)."""
    for name, value in (("worker_args", worker_args), ("server_args", server_args)):
        if isinstance(value, str):
            raise LaunchError(f"{name} must be a list of arguments, not a string")
    if plan is not None and plan not in profiling.SCHEMES:
        raise LaunchError(f"unknown plan scheme {plan!r}; valid: {profiling.SCHEMES}")
    if replan is not None and (plan is None or not replan > 0):
        raise LaunchError(f"replan needs --plan and a value > 0, got {replan!r}")
    if split_leaves and server_shards == 1:
        raise LaunchError("split_leaves needs server_shards > 1")
    try:
        check_int("num_workers", num_workers, low=1)
        check_int("steps", steps, low=1, allow_none=True)
        check_positive("timeout", timeout, allow_none=True)
        check_int("server_shards", server_shards, low=1)
        check_int("max_restarts", max_restarts, low=0)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    flags = _worker_flags(per_worker_args, num_workers)
    try:
        scheme = get_scheme(policy)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    shared = [*scheme.worker_flags, *map(str, worker_args)]
    server_args = [*argv_of(ServerOptions, policy=policy), *map(str, server_args)]
    _check_flags(num_workers, shared, flags, server_args, server_shards, split_leaves)
    return flags, shared


def with_export(
    server_args: Sequence[str], kept: bool, server_shards: int
) -> tuple[list[str], pathlib.Path | None]:
    """Without a work directory that is kept, the server exports its final
    parameters (``--export_params``) to a file of the system's temporary
    directory, unless its flags name one (or it is sharded); returns the
    server's flags and that file (or ``None``)."""
    server_args = [str(a) for a in server_args]
    named = any(a.startswith("--export_params") for a in server_args)
    if kept or server_shards > 1 or named:
        return server_args, None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = (
        pathlib.Path(tempfile.gettempdir()) / f"hpsjax-params-{stamp}-{os.getpid()}.npz"
    )
    return [*server_args, *argv_of(ServerOptions, export_params=str(path))], path


def kept_params(params: pathlib.Path) -> str:
    """Where a launch without a work directory kept its final parameters
    (:func:`with_export`), for its last line."""
    if params.is_file():
        return f"final parameters in {params} (hpsjax.export.load_params reads them)"
    return f"no final parameters at {params}: the server did not write them"


def _check_flags(
    num_workers: int,
    shared: list[str],
    flags: list[list[str]],
    server_args: Sequence[str],
    server_shards: int,
    split_leaves: bool,
) -> None:
    """Reads the workers' and the server's flags as the processes will, the
    launcher's own added, so that a bad one stops the launch before anything
    starts."""
    said = io.StringIO()  # the parsers' lines: a refusal, deprecated names
    try:
        with contextlib.redirect_stderr(said):
            _parse_flags(
                num_workers, shared, flags, server_args, server_shards, split_leaves
            )
    except SystemExit:
        refusal = "".join(said.getvalue().strip().splitlines()[-1:])
        what = "server" if refusal.startswith("hpsjax-server") else "worker"
        raise LaunchError(f"bad {what} flags: {refusal}") from None
    sys.stderr.write(said.getvalue())


def _parse_flags(
    num_workers: int,
    shared: list[str],
    flags: list[list[str]],
    server_args: Sequence[str],
    server_shards: int,
    split_leaves: bool,
) -> None:
    """Parses every process's flags (see :func:`_check_flags`).

    Raises:
      LaunchError: a bad setting, in one line naming its flag.
      SystemExit: a flag a command does not take (the parser said which).
    """
    workers = []
    what = "worker"
    try:
        get_task(parse_args(shared).task)
        for i, extra in enumerate(flags):
            own = [
                *argv_of(WorkerConfig, worker_id=i),
                *argv_of(WorkerCommand, shard_index=i, shard_count=num_workers),
            ]
            parsed = parse_args([*own, *shared, *extra])
            worker_target(parsed, get_task(parsed.task))
            make_heterogeneity(parsed)
            workers.append(parse_worker([*own, *shared, *extra]))
        what = "server"
        shards = {}
        if server_shards > 1:
            shards = dict(
                server_shard=0, server_shards=server_shards, split_leaves=split_leaves
            )
        server = parse_server(
            argv_of(ServerOptions, init="init.npz", secret_file="secret.txt", **shards)
            + [str(a) for a in server_args]
        )
        what = "worker"
        RunConfig(workers=tuple(workers), server=server)
    except ValueError as e:
        classes = (
            (ServerOptions,) if what == "server" else (WorkerCommand, WorkerConfig)
        )
        raise LaunchError(
            f"bad {what} flags: {flag_message(str(e), *classes)}"
        ) from None


def _worker_flags(
    per_worker_args: PerWorkerArgs | None,
    num_workers: int,
) -> list[list[str]]:
    flags: list[list[str]] = [[] for _ in range(num_workers)]
    if per_worker_args is None:
        return flags
    items = (
        per_worker_args.items()
        if isinstance(per_worker_args, Mapping)
        else enumerate(per_worker_args)
    )
    for index, extra in items:
        if not (isinstance(index, int) and 0 <= index < num_workers):
            raise LaunchError(
                f"per-worker flags for worker {index!r}, not in 0..{num_workers - 1}"
            )
        if isinstance(extra, str):
            raise LaunchError(
                f"per-worker flags for worker {index} must be a list of arguments, "
                f"got the string {extra!r} (split it with shlex.split)"
            )
        flags[index] = [str(a) for a in extra]
    return flags


def prepare_workdir(
    work: pathlib.Path,
    job: Job,
    plan: str | None,
    replan: float | None,
    global_batch: int | None,
    console: Console,
    *,
    python: str,
    env: Mapping[str, str],
    start_timeout: float,
    shutdown_timeout: float,
) -> tuple[bytes, pathlib.Path, pathlib.Path, Job, float | None]:
    """Writes a fresh secret, ``init.npz`` and the plan (``plan``) into ``work``.

    Returns the secret, its file, the init file, the job (its workers' shared
    flags with ``--work_plan``, shard 0's with the plan when it re-plans) and
    the profiling pass's seconds.
    """
    secret, secret_file = write_secret(work)
    init = work / "init.npz"
    try:
        # Worker 0's model (the workers check theirs against it as they join).
        write_init(parse_args([*job.shared, *job.flags[0]]), init)
    except ValueError as e:
        raise LaunchError(f"cannot build the model from the worker flags: {e}") from e
    profile_seconds = None
    if plan is not None:
        plan_file, profile_seconds = _profile_and_plan(
            plan, job, work, secret_file, init, global_batch, console,
            python=python, env=env, start_timeout=start_timeout,
            shutdown_timeout=shutdown_timeout,
        )  # fmt: skip
        job = with_plan(job, plan_file, replan)
    return secret, secret_file, init, job, profile_seconds


def with_plan(job: Job, plan_file: pathlib.Path, replan: float | None) -> Job:
    """``job`` with its workers following ``plan_file`` (``--work_plan``) and,
    when it re-plans (``replan``), server shard 0 re-planning from it."""
    # Flags for shard 0 only: the plan the workers follow comes from it.
    plan_server_args: list[str] = []
    if replan is not None:
        plan_server_args = argv_of(
            ServerOptions, work_plan=str(plan_file), replan_threshold=float(replan)
        )
    return dataclasses.replace(
        job,
        shared=[*job.shared, *argv_of(WorkerCommand, work_plan=str(plan_file))],
        plan_server_args=plan_server_args,
    )


def write_secret(work: pathlib.Path) -> tuple[bytes, pathlib.Path]:
    """A fresh secret in ``work/secret.txt``, readable by its owner only;
    returns it and its file."""
    secret = secrets.token_urlsafe(32).encode()
    secret_file = work / "secret.txt"
    secret_file.touch(mode=0o600)
    secret_file.write_bytes(secret)
    return secret, secret_file


def _profile_and_plan(
    scheme: str,
    job: Job,
    workdir: pathlib.Path,
    secret_file: pathlib.Path,
    init: pathlib.Path,
    global_batch: int | None,
    console: Console,
    *,
    python: str,
    env: Mapping[str, str],
    start_timeout: float,
    shutdown_timeout: float,
) -> tuple[pathlib.Path, float]:
    """Profiles every worker in place and plans; returns the plan file and cost
    (the pass's seconds, :func:`profile_in_place`)."""
    start = time.monotonic()
    profiles = profile_in_place(
        job, workdir, secret_file, init, console, python=python, env=env,
        start_timeout=start_timeout, shutdown_timeout=shutdown_timeout,
    )  # fmt: skip
    seconds = time.monotonic() - start
    path = write_plan(scheme, profiles, job, workdir, global_batch, console, seconds)
    return path, seconds


def write_plan(
    scheme: str,
    profiles: Sequence[profiling.WorkerProfile],
    job: Job,
    workdir: pathlib.Path,
    global_batch: int | None,
    console: Console,
    seconds: float,
    where: str = "in place",
) -> pathlib.Path:
    """Plans ``scheme`` from the workers' ``profiles`` (taken ``where``, in
    ``seconds``) into ``workdir/plan.json``; returns that file."""
    emit = console.emit
    n = job.num_workers
    batch = parse_args(job.shared).batch_size
    emit(
        f"[launch] profiled {n} worker(s) {where} in {seconds:.1f}s: "
        f"{[round(p.devices[0].step_time(batch) * 1e3, 1) for p in profiles]} ms "
        f"a step of {batch}, "
        f"{[round(p.transfer_seconds * 1e3, 1) for p in profiles]} ms push+pull"
    )
    if global_batch is None:
        global_batch = batch * n
    work_plan = profiling.plan(profiles, scheme, global_batch=global_batch)
    path = workdir / "plan.json"
    path.write_text(work_plan.to_json())
    emit(
        f"[launch] {scheme} plan: batches "
        f"{[w.batch_size for w in work_plan.workers]}, local steps "
        f"{[w.local_steps for w in work_plan.workers]}, predicted round "
        f"{work_plan.round_time * 1e3:.1f} ms, idle {work_plan.idle_fraction:.1%}"
    )
    return path


def profiling_job(job: Job) -> Job:
    """The profiling pass's job: ``job``'s workers against a throwaway server
    (ASP, so that no push waits for another; it holds the first pull until
    every worker joined)."""
    return dataclasses.replace(
        job,
        policy="asp",
        steps=None,
        # Its joins and leaves would read as the run's: warnings only.
        server_args=argv_of(
            ServerOptions,
            core_arg={"expected_workers": job.num_workers},
            log_level="WARNING",
        ),
        plan_server_args=[],
    )


def profile_in_place(
    job: Job,
    workdir: pathlib.Path,
    secret_file: pathlib.Path,
    init: pathlib.Path | None,
    console: Console,
    *,
    python: str,
    env: Mapping[str, str],
    start_timeout: float,
    shutdown_timeout: float,
    places: WorkerPlaces | None = None,
    profile_args: Sequence[str] = (),
    ports: Sequence[int] | None = None,
) -> list[profiling.WorkerProfile]:
    """Profiles every worker of ``job`` in place; returns their profiles.

    A throwaway server of the run's model (ASP, so that no push waits for
    another; it holds the first pull until every worker joined; or the
    caller's, on ``ports``) and one
    profiling process per worker, all at once, each with its worker's command
    line: the step times are taken beside the other workers and the push and
    pull against a real server, as the run will see them. Worker ``i``'s
    profile is also in ``workdir/profile_<i>.json``.

    Args:
      job: the run's job; its workers' flags are profiled.
      workdir: where the profiles go.
      secret_file: the run's secret (:func:`write_secret`).
      init: the model's initial parameters, ``hpsjax-server --init``'s file
        (``None`` with ``ports``).
      console: where the processes' prefixed output goes.
      python: the interpreter of the processes.
      env: their environment.
      start_timeout: seconds the server has to listen, and the pass to end.
      shutdown_timeout: seconds each process gets after SIGTERM.
      places: where each worker's profiling process runs, as its worker
        would (:data:`WorkerPlaces`); by default ``python`` in ``env``.
      profile_args: more flags for every profiling process
        (``python -m hpsjax.profiling.in_place --help``: batch sizes, repeats).
      ports: the ports of a throwaway server the caller runs on loopback
        (one per shard), e.g. in its own process with the run's optimizer, to
        profile against instead of an ``hpsjax-server`` of ``init``.

    Raises:
      LaunchError: a profiling process failed, or the pass did not end within
        ``start_timeout`` (everything it started is stopped first).
    """
    emit = console.emit
    start = time.monotonic()
    n = job.num_workers
    if places is not None and len(places) != n:
        raise LaunchError(f"{len(places)} worker places for {n} workers")
    if ports is not None and len(ports) != job.server_shards:
        raise LaunchError(f"{len(ports)} ports for {job.server_shards} server shards")
    if ports is None and init is None:
        raise LaunchError("profile_in_place needs the model's init file or ports")
    probe = profiling_job(job)
    processes: list[Process] = []
    try:
        if ports is None:
            ports = []
            for shard in range(job.server_shards):
                name, argv = probe.server(
                    shard, [python], str(init), str(secret_file), "127.0.0.1"
                )
                ports.append(
                    start_server(
                        f"profile {name}", argv, emit, env, processes, start_timeout
                    )
                )
        where = probe.where([("127.0.0.1", p) for p in ports])
        outs = [workdir / f"profile_{i}.json" for i in range(n)]
        profilers = []
        for i, out in enumerate(outs):
            out.unlink(missing_ok=True)
            head, own_env = [python], env
            if places is not None:
                head, own_env = list(places[i][0]), {**env, **places[i][1]}
            argv = [
                *probe.worker(
                    i, head, where, str(secret_file), None,
                    module="hpsjax.profiling.in_place",
                ),
                *argv_of(WorkerCommand, profile_out=str(out)), *profile_args,
            ]  # fmt: skip
            profilers.append(Process(f"profile {i}", argv, emit, own_env))
            processes.append(profilers[-1])
        deadline = start + start_timeout
        while any(p.poll() is None for p in profilers):
            failed = [(i, p.poll()) for i, p in enumerate(profilers) if p.poll()]
            if failed:
                i, code = failed[0]
                raise LaunchError(
                    f"profiling worker {i} failed (status {code}; its lines are above)"
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the profiling pass did not end within {start_timeout}s"
                )
            time.sleep(0.05)
        failed = [(i, p.poll()) for i, p in enumerate(profilers) if p.poll()]
        if failed:
            i, code = failed[0]
            raise LaunchError(
                f"profiling worker {i} failed (status {code}; its lines are above)"
            )
    finally:
        shutdown(processes, shutdown_timeout)
    return [profiling.WorkerProfile.from_json(out.read_text()) for out in outs]


def run_cache_env(
    work: pathlib.Path, compile_cache: str | os.PathLike | None
) -> dict[str, str]:
    """The environment variables that give a run's processes its compilation
    cache: ``compile_cache``, by default the work directory's."""
    return cache_env(cache_dir_for(work) if compile_cache is None else compile_cache)


def run_env(
    work: pathlib.Path, compile_cache: str | os.PathLike | None
) -> dict[str, str]:
    """The environment of a run's local processes: this one's, unbuffered,
    with the run's compilation cache (:func:`run_cache_env`)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **run_cache_env(work, compile_cache))
