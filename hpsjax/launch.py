"""Local launcher: one parameter server and N workers as processes on this machine.

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

With ``--plan SCHEME`` the workers are profiled first, in place: a throwaway
server of the run's model is started and every worker, in its own process and
all at once (``python -m hpsjax.profiling.in_place``), times its train step
beside the others and its push and pull against that server (its injected
slowdown and link added); :func:`hpsjax.profiling.plan` makes the work plan from
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

For several hosts, see LAUNCH.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from hpsjax._logs import quiet_backend_probe

__all__ = ["DIVERGED", "LaunchError", "LaunchResult", "launch", "main"]

PerWorkerArgs = Mapping[int, Sequence[str]] | Sequence[Sequence[str]]

_LISTENING = re.compile(r"hpsjax-server listening on (\S+):(\d+)")

# Seconds between the server's checkpoints when the launcher may restart it
# (``max_restarts``) and the server flags name no interval of their own.
_RESTART_CHECKPOINT_EVERY_S = 1.0

# A process exiting with this status is not restarted (bad flags: argparse).
_BAD_FLAGS = 2

#: A worker's exit status when its run diverged (a non-finite loss or update):
#: the run ends, nothing is restarted.
DIVERGED = 3

# Versions the progress bar expects per worker round: one per round for a
# barrier policy, one per push otherwise.
_ROUND_POLICIES = ("bsp",)


class LaunchError(RuntimeError):
    """The launch could not start (bad arguments, the server did not come up)."""


class _Temporary(str):
    """A temporary work directory: removed when the launch ends."""


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How a launch ended.

    Attributes:
      returncode: 0 when every worker finished with 0; otherwise non-zero.
      reason: ``"completed"``, or what ended the run early (the first process
        that failed, ``"timeout"``, ``"interrupted"``).
      server_returncode: the server's exit status (``None`` if never started).
      worker_returncodes: each worker's exit status, in worker order.
      pids: process ids of everything started (server first), for checks.
      port: the server's port (shard 0's with several shards).
      workdir: directory holding ``secret.txt``, ``init.npz``, the plan and the
        workers' ``metrics_<i>.jsonl``; ``None`` when the launch ran without
        one (nothing was kept).
      version: the last server version seen, or ``None``.
      elapsed: seconds from start to the end of shutdown.
      profile_seconds: seconds the profiling pass took (``plan``; the workers
        share this machine, so the step is measured once for all), else
        ``None``.
      ports: every server shard's port, in shard order.
      server_returncodes: every server shard's exit status, in shard order.
      worker_restarts: how often each worker was restarted after a crash
        (``max_restarts``), in worker order.
      server_restarts: how often each server shard was restarted after a
        crash, in shard order.
    """

    returncode: int
    reason: str
    server_returncode: int | None
    worker_returncodes: tuple[int | None, ...]
    pids: tuple[int, ...]
    port: int | None
    workdir: str | None
    version: int | None
    elapsed: float
    profile_seconds: float | None = None
    ports: tuple[int, ...] = ()
    server_returncodes: tuple[int | None, ...] = ()
    worker_restarts: tuple[int, ...] = ()
    server_restarts: tuple[int, ...] = ()


# Started in front of every child: on Linux it asks the kernel to send the child
# SIGTERM when the launcher dies (PR_SET_PDEATHSIG survives exec), then execs the
# real command line. Setting it here rather than in a preexec_fn keeps Popen off
# fork() (JAX refuses to be forked once it has started threads).
_TRAMPOLINE = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
if os.getppid() != parent:
    sys.exit(143)
os.execvp(sys.argv[2], sys.argv[2:])
"""


class _Process:
    """One child in its own process group, with its output streamed."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        emit: Callable[[str], None],
        env: Mapping[str, str],
        on_line: Callable[[str], None] | None = None,
    ):
        self.name = name
        self.argv = argv
        self.popen = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            text=True,
            bufsize=1,
        )
        self._on_line = on_line
        self._reader = threading.Thread(
            target=self._read, args=(emit,), name=f"log-{name}", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self, emit: Callable[[str], None]) -> None:
        with self.popen.stdout:
            for line in self.popen.stdout:
                line = line.rstrip("\n")
                if self._on_line is not None:
                    self._on_line(line)
                emit(f"[{self.name}] {line}")

    def poll(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        # The whole group: a child's own children go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def join_output(self, timeout: float) -> None:
        self._reader.join(timeout)


def _shutdown(processes: Sequence[_Process], timeout: float) -> None:
    """SIGTERM every group, wait up to ``timeout``, then SIGKILL what is left."""
    for p in processes:
        p.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(max(0.0, deadline - time.monotonic()))
    for p in processes:
        # Also reaches members that outlived a group leader that exited.
        p.signal(signal.SIGKILL)
        p.popen.wait()
        p.join_output(2.0)


class _Monitor:
    """Polls the server's version from a background thread (for the bar)."""

    def __init__(
        self, port: int, secret: bytes, interval: float = 0.5, host: str = "127.0.0.1"
    ):
        self._host = host
        self._port = port
        self.secret = secret
        self._interval = interval
        self._stop = threading.Event()
        self.version: int | None = None
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        from hpsjax.ps import Client, HpsError

        client = Client(
            self._host,
            self._port,
            worker_id="hpsjax-launch-monitor",
            secret=self.secret,
            timeout=5.0,
        )
        with contextlib.suppress(HpsError, OSError, TimeoutError):
            info = await client.connect()
            self.version = info.version
            while not self._stop.is_set():
                self.version = (await client.refresh_info()).version
                await asyncio.sleep(self._interval)
        with contextlib.suppress(HpsError, OSError, TimeoutError):
            await client.close(timeout=1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 6.0)


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


def _profile_and_plan(
    scheme: str,
    job: _Job,
    workdir: pathlib.Path,
    secret_file: pathlib.Path,
    init: pathlib.Path,
    global_batch: int | None,
    console: _Console,
    *,
    python: str,
    env: Mapping[str, str],
    start_timeout: float,
    shutdown_timeout: float,
) -> tuple[pathlib.Path, float]:
    """Profiles every worker in place and plans; returns the plan file and cost.

    A throwaway server of the run's model (ASP, so that no push waits for
    another; it holds the first pull until every worker joined) and one
    profiling process per worker, all at once, each with its worker's command
    line: the step times are taken beside the other workers and the push and
    pull against a real server, as the run will see them.
    """
    from hpsjax.profiling import WorkerProfile, plan
    from hpsjax.worker._cli import parse_args

    emit = console.emit
    start = time.monotonic()
    n = job.num_workers
    probe = dataclasses.replace(
        job,
        policy="asp",
        steps=None,
        # Its joins and leaves would read as the run's: warnings only.
        server_args=[
            "--core_arg",
            f"expected_workers={n}",
            "--log_level",
            "WARNING",
        ],
        plan_server_args=[],
    )
    processes: list[_Process] = []
    try:
        ports = []
        for shard in range(job.server_shards):
            name, argv = probe.server(
                shard, [python], str(init), str(secret_file), "127.0.0.1"
            )
            ports.append(
                _start_server(
                    f"profile {name}", argv, emit, env, processes, start_timeout
                )
            )
        where = probe.where([("127.0.0.1", p) for p in ports])
        outs = [workdir / f"profile_{i}.json" for i in range(n)]
        profilers = []
        for i, out in enumerate(outs):
            out.unlink(missing_ok=True)
            argv = [
                *probe.worker(
                    i, [python], where, str(secret_file), None,
                    module="hpsjax.profiling.in_place",
                ),
                "--profile_out", str(out),
            ]  # fmt: skip
            profilers.append(_Process(f"profile {i}", argv, emit, env))
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
        _shutdown(processes, shutdown_timeout)
    profiles = [WorkerProfile.from_json(out.read_text()) for out in outs]
    seconds = time.monotonic() - start
    batch = parse_args(job.shared).batch_size
    emit(
        f"[launch] profiled {n} worker(s) in place in {seconds:.1f}s: "
        f"{[round(p.devices[0].step_time(batch) * 1e3, 1) for p in profiles]} ms "
        f"a step of {batch}, "
        f"{[round(p.transfer_seconds * 1e3, 1) for p in profiles]} ms push+pull"
    )
    if global_batch is None:
        global_batch = batch * n
    work_plan = plan(profiles, scheme, global_batch=global_batch)
    path = workdir / "plan.json"
    path.write_text(work_plan.to_json())
    emit(
        f"[launch] {scheme} plan: batches "
        f"{[w.batch_size for w in work_plan.workers]}, local steps "
        f"{[w.local_steps for w in work_plan.workers]}, predicted round "
        f"{work_plan.round_time * 1e3:.1f} ms, idle {work_plan.idle_fraction:.1%}"
    )
    return path, seconds


def _start_server(
    name: str,
    argv: list[str],
    emit: Callable[[str], None],
    env: Mapping[str, str],
    processes: list[_Process],
    start_timeout: float,
) -> int:
    """Starts one server process (appended to ``processes``); returns its port."""
    listening = threading.Event()
    found: list[int] = []

    def on_line(line: str) -> None:
        match = _LISTENING.search(line)
        if match and not listening.is_set():
            found.append(int(match.group(2)))
            listening.set()

    server = _Process(name, argv, emit, env, on_line)
    processes.append(server)
    deadline = time.monotonic() + start_timeout
    while not listening.wait(0.1):
        if server.poll() is not None or time.monotonic() > deadline:
            what = (
                f"exited with status {server.poll()}"
                if server.poll() is not None
                else f"did not listen within {start_timeout}s"
            )
            raise LaunchError(f"the {name} {what}")
    return found[0]


def _check_launch(
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
) -> tuple[list[list[str]], list[str]]:
    """Checks a launch's arguments; returns each worker's and the shared flags."""
    if (
        isinstance(num_workers, bool)
        or not isinstance(num_workers, int)
        or num_workers < 1
    ):
        raise LaunchError(f"num_workers must be an int >= 1, got {num_workers!r}")
    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or steps < 1
    ):
        raise LaunchError(f"steps must be an int >= 1 or None, got {steps!r}")
    for name, value in (("worker_args", worker_args), ("server_args", server_args)):
        if isinstance(value, str):
            raise LaunchError(f"{name} must be a list of arguments, not a string")
    if timeout is not None and not timeout > 0:
        raise LaunchError(f"timeout must be > 0 or None, got {timeout!r}")
    if plan is not None:
        from hpsjax.profiling import SCHEMES

        if plan not in SCHEMES:
            raise LaunchError(f"unknown plan scheme {plan!r}; valid: {SCHEMES}")
    if replan is not None and (plan is None or not replan > 0):
        raise LaunchError(f"replan needs a plan and a threshold > 0, got {replan!r}")
    if (
        isinstance(server_shards, bool)
        or not isinstance(server_shards, int)
        or server_shards < 1
    ):
        raise LaunchError(f"server_shards must be an int >= 1, got {server_shards!r}")
    if split_leaves and server_shards == 1:
        raise LaunchError("split_leaves needs server_shards > 1")
    if isinstance(max_restarts, bool) or not (
        isinstance(max_restarts, int) and max_restarts >= 0
    ):
        raise LaunchError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    flags = _worker_flags(per_worker_args, num_workers)
    shared = [str(a) for a in worker_args]
    from hpsjax.worker._cli import _heterogeneity, parse_args

    try:
        parse_args(shared)
        for extra in flags:
            _heterogeneity(parse_args([*shared, *extra]))
    except SystemExit:
        raise LaunchError("bad worker flags (see the message above)") from None
    except ValueError as e:
        raise LaunchError(f"bad worker flags: {e}") from None
    return flags, shared


def _prepare_workdir(
    work: pathlib.Path,
    job: _Job,
    plan: str | None,
    replan: float | None,
    global_batch: int | None,
    console: _Console,
    *,
    python: str,
    env: Mapping[str, str],
    start_timeout: float,
    shutdown_timeout: float,
) -> tuple[bytes, pathlib.Path, pathlib.Path, _Job, float | None]:
    """Writes a fresh secret, ``init.npz`` and the plan (``plan``) into ``work``.

    Returns the secret, its file, the init file, the job (its workers' shared
    flags with ``--work_plan``, shard 0's with the plan when it re-plans) and
    the profiling pass's seconds.
    """
    from hpsjax.worker._cli import parse_args, write_init

    secret = secrets.token_urlsafe(32).encode()
    secret_file = work / "secret.txt"
    secret_file.touch(mode=0o600)
    secret_file.write_bytes(secret)
    init = work / "init.npz"
    try:
        write_init(parse_args(job.shared), init)
    except ValueError as e:
        raise LaunchError(f"cannot build the model from the worker flags: {e}") from e
    profile_seconds = None
    if plan is not None:
        plan_file, profile_seconds = _profile_and_plan(
            plan, job, work, secret_file, init, global_batch, console,
            python=python, env=env, start_timeout=start_timeout,
            shutdown_timeout=shutdown_timeout,
        )  # fmt: skip
        # Flags for shard 0 only: the plan the workers follow comes from it.
        plan_server_args: list[str] = []
        if replan is not None:
            plan_server_args = [
                "--work_plan",
                str(plan_file),
                "--replan_threshold",
                repr(float(replan)),
            ]
        job = dataclasses.replace(
            job,
            shared=[*job.shared, "--work_plan", str(plan_file)],
            plan_server_args=plan_server_args,
        )
    return secret, secret_file, init, job, profile_seconds


def run_cache_env(
    work: pathlib.Path, compile_cache: str | os.PathLike | None
) -> dict[str, str]:
    """The environment variables that give a run's processes its compilation
    cache: ``compile_cache``, by default the work directory's."""
    from hpsjax._compile_cache import cache_dir_for, cache_env

    return cache_env(cache_dir_for(work) if compile_cache is None else compile_cache)


def run_env(
    work: pathlib.Path, compile_cache: str | os.PathLike | None
) -> dict[str, str]:
    """The environment of a run's local processes: this one's, unbuffered,
    with the run's compilation cache (:func:`run_cache_env`)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", **run_cache_env(work, compile_cache))


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
      steps: rounds per worker (``--max_steps``), ``None`` to leave it to
        ``worker_args``.
      worker_args: flags for every ``hpsjax-worker``.
      per_worker_args: more flags for some workers, by index (a mapping or a
        list of lists).
      server_args: more flags for ``hpsjax-server`` (e.g. ``["--optimizer",
        "adam"]``).
      plan: a :data:`hpsjax.profiling.SCHEMES` name to profile the workers
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
        is kept: the result's ``workdir`` is ``None``).
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
    flags, shared = _check_launch(
        num_workers,
        steps=steps,
        worker_args=worker_args,
        per_worker_args=per_worker_args,
        server_args=server_args,
        timeout=timeout,
        plan=plan,
        replan=replan,
        server_shards=server_shards,
        split_leaves=split_leaves,
        max_restarts=max_restarts,
    )
    console = _Console(log)
    start = time.monotonic()
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    env = run_env(work, compile_cache)
    job = _Job(
        num_workers, policy, steps, [str(a) for a in server_args], shared, flags,
        [], server_shards, split_leaves,
    )  # fmt: skip
    secret, secret_file, init, job, profile_seconds = _prepare_workdir(
        work, job, plan, replan, global_batch, console, python=python, env=env,
        start_timeout=start_timeout, shutdown_timeout=shutdown_timeout,
    )  # fmt: skip
    if max_restarts > 0:
        # A restarted server resumes from here: nothing from an earlier
        # launch in the same workdir may be there.
        shutil.rmtree(work / "checkpoints", ignore_errors=True)
    run = _LocalRun(job, console, python, max_restarts, start_timeout, env)
    reason = "completed"
    try:
        run.start_servers(str(init), str(secret_file), work / "checkpoints")
        run.start_workers(str(secret_file), work)
        run.monitor = _Monitor(run.ports[0], secret)
        console.start_bar(progress, job)
        reason = run.watch(None if timeout is None else start + timeout)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    except BaseException as e:
        reason = f"launcher error: {e}"
        raise
    finally:
        _stop(
            reason,
            console,
            run.monitor,
            lambda: _shutdown(run.servers, shutdown_timeout),
            lambda: _shutdown(run.processes, shutdown_timeout),
        )
    server_codes = tuple(s.poll() for s in run.servers)
    reason = _final_reason(reason, [s.name for s in run.servers], server_codes)
    where = f"workdir {work}" if kept else "no --workdir: metrics not kept"
    console.emit(f"[launch] {reason} in {time.monotonic() - start:.1f}s; {where}")
    return LaunchResult(
        returncode=_returncode(reason),
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


class _Console:
    """A launch's output: lines to ``log``, above the progress bar of the
    server version while there is one."""

    def __init__(self, log: TextIO | None):
        self._out = log if log is not None else sys.stdout
        self._lock = threading.Lock()
        self._bar = None

    def emit(self, line: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.write(line, file=self._out)
            else:
                print(line, file=self._out, flush=True)

    def start_bar(self, progress: bool, job: _Job) -> None:
        """A tqdm bar of the server version, unless not asked or no tqdm."""
        if not progress:
            return
        try:
            # tqdm comes with the experiments extra only: no bar without it.
            from tqdm import tqdm
        except ImportError:
            return
        total = None
        if job.steps is not None:
            total = job.steps
            if job.policy not in _ROUND_POLICIES:
                total *= job.num_workers
        with self._lock:
            self._bar = tqdm(total=total, desc="versions", unit="v", file=sys.stderr)

    def show(self, version: int | None) -> None:
        bar = self._bar
        if bar is not None and version is not None and version > bar.n:
            with self._lock:
                bar.update(version - bar.n)

    def close_bar(self, version: int | None) -> None:
        if self._bar is None:
            return
        with self._lock:
            if (version or 0) > self._bar.n:
                self._bar.update(version - self._bar.n)
            self._bar.close()
            self._bar = None


@dataclasses.dataclass(frozen=True)
class _Job:
    """What either backend starts: the servers' and workers' command lines.

    ``head`` is what goes before ``-m module`` (the interpreter, or nothing
    where the process's owner adds it).
    """

    num_workers: int
    policy: str
    steps: int | None
    server_args: list[str]
    shared: list[str]  # every worker's flags (``--work_plan`` included)
    flags: list[list[str]]  # each worker's own
    plan_server_args: list[str]  # shard 0's only
    server_shards: int
    split_leaves: bool

    @property
    def shard_args(self) -> list[str]:
        return ["--split_leaves"] if self.split_leaves else []

    def server(
        self, shard: int, head: list[str], init: str, secret_file: str, host: str
    ) -> tuple[str, list[str]]:
        """Server ``shard``'s name and command line."""
        argv = [
            *head, "-m", "hpsjax.ps._cli", "--init", init,
            "--secret_file", secret_file, "--policy", self.policy,
            "--host", host, "--port", "0", *self.server_args,
            *(self.plan_server_args if shard == 0 else []),
        ]  # fmt: skip
        if self.server_shards == 1:
            return "server", argv
        argv += [
            "--server_shard", str(shard), "--server_shards",
            str(self.server_shards), *self.shard_args,
        ]  # fmt: skip
        return f"server {shard}", argv

    def where(self, addresses: Sequence[tuple[str, int]]) -> list[str]:
        """The workers' flags naming the server(s) at ``addresses``."""
        if self.server_shards > 1:
            servers = ",".join(f"{host}:{port}" for host, port in addresses)
            return ["--servers", servers, *self.shard_args]
        host, port = addresses[0]
        return ["--host", host, "--port", str(port)]

    def worker(
        self,
        i: int,
        head: list[str],
        where: list[str],
        secret_file: str,
        metrics: str | None,
        *,
        module: str = "hpsjax.worker._cli",
    ) -> list[str]:
        """Worker ``i``'s command line (``module`` takes a worker's flags)."""
        return [
            *head, "-m", module, *where,
            "--secret_file", secret_file,
            "--worker_id", str(i), "--shard_index", str(i),
            "--shard_count", str(self.num_workers),
            *([] if metrics is None else ["--metrics", metrics]),
            *([] if self.steps is None else ["--max_steps", str(self.steps)]),
            *self.shared, *self.flags[i],
        ]  # fmt: skip


def _stop(
    reason: str,
    console: _Console,
    monitor: _Monitor | None,
    stop_servers: Callable[[], None],
    stop_all: Callable[[], None],
) -> None:
    """Ends a launch, either backend's: after a run that completed the
    servers get SIGTERM first (a graceful stop with a final checkpoint), then
    everything is stopped."""
    if monitor is not None:
        monitor.close()
    if reason == "completed":
        stop_servers()
    elif _returncode(reason) != DIVERGED:  # said once, in the final line
        console.emit(f"[launch] stopping everything: {reason}")
    stop_all()
    console.close_bar(None if monitor is None else monitor.version)


def _final_reason(
    reason: str, names: Sequence[str], codes: Sequence[int | None]
) -> str:
    """``reason``, or, after a run that completed, the first server that did
    not stop cleanly."""
    unclean = [(n, c) for n, c in zip(names, codes, strict=True) if c != 0]
    if reason == "completed" and unclean:
        return f"{unclean[0][0]} did not stop cleanly (status {unclean[0][1]})"
    return reason


class _LocalRun:
    """The local backend's processes: started, restarted, watched."""

    def __init__(
        self,
        job: _Job,
        console: _Console,
        python: str,
        max_restarts: int,
        start_timeout: float,
        env: Mapping[str, str],
    ):
        self.job = job
        self.console = console
        self.python = python
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.env = dict(env)
        self.started = time.monotonic()
        self.processes: list[_Process] = []
        self.servers: list[_Process] = []
        self.workers: list[_Process] = []
        self.monitor: _Monitor | None = None
        self.ports: list[int] = []
        self.server_argvs: list[list[str]] = []
        self.worker_argvs: list[list[str]] = []
        self.worker_restarts = [0] * job.num_workers
        self.server_restarts = [0] * job.server_shards

    def _start_server(self, name: str, argv: list[str]) -> int:
        return _start_server(
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
                argv += ["--tensorboard_dir", str(board)]
            self.server_argvs.append(argv)
            self.ports.append(self._start_server(name, argv))
            self.servers.append(self.processes[-1])

    def start_workers(self, secret_file: str, work: pathlib.Path) -> None:
        job = self.job
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
            argv = job.worker(i, [self.python], where, secret_file, metrics)
            self.worker_argvs.append(argv)
            self.workers.append(self._process(f"worker {i}", argv))

    def _process(self, name: str, argv: list[str]) -> _Process:
        process = _Process(name, argv, self.console.emit, self.env)
        self.processes.append(process)
        return process

    def watch(self, end: float | None) -> str:
        """Polls until the run ends: ``"completed"``, or what ended it early."""
        while True:
            codes = self._restart_workers()
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                i, code = failed[0]
                return _worker_ended(i, code, time.monotonic() - self.started)
            if all(c == 0 for c in codes):
                return "completed"
            reason = self._restart_servers()
            if reason is not None:
                return reason
            exited = [(s.name, s.poll()) for s in self.servers if s.poll() is not None]
            if exited:
                return f"{exited[0][0]} exited early with status {exited[0][1]}"
            if end is not None and time.monotonic() > end:
                return "timeout"
            self.console.show(self.monitor.version)
            time.sleep(0.1)

    def _restart_workers(self) -> list[int | None]:
        """Starts crashed workers again (``max_restarts``); returns each
        worker's exit status, ``None`` for one running or just restarted."""
        codes = [w.poll() for w in self.workers]
        for i, code in enumerate(codes):
            if _crashed(code) and self.worker_restarts[i] < self.max_restarts:
                self.worker_restarts[i] += 1
                self.console.emit(
                    f"[launch] worker {i} crashed (status {code}); restarting "
                    f"it ({self.worker_restarts[i]} of {self.max_restarts})"
                )
                self.workers[i] = self._process(f"worker {i}", self.worker_argvs[i])
                codes[i] = None
        return codes

    def _restart_servers(self) -> str | None:
        """Starts crashed server shards again on their ports, from their
        checkpoints; returns why a restart failed, if one did."""
        for shard, server in enumerate(self.servers):
            code = server.poll()
            if not (_crashed(code) and self.server_restarts[shard] < self.max_restarts):
                continue
            self.server_restarts[shard] += 1
            port = self.ports[shard]
            self.console.emit(
                f"[launch] {server.name} crashed (status {code}); restarting "
                f"it on port {port} from its checkpoints "
                f"({self.server_restarts[shard]} of {self.max_restarts})"
            )
            argv = [*self.server_argvs[shard], "--port", str(port)]
            try:
                self._start_server(server.name, argv)
            except LaunchError as e:
                return f"restarting the {server.name} failed: {e}"
            self.servers[shard] = self.processes[-1]
            if shard == 0:
                secret = self.monitor.secret
                self.monitor.close()
                self.monitor = _Monitor(self.ports[0], secret)
        return None


def _crashed(code: int | None) -> bool:
    """Whether an exit status is a crash to restart after: a signal or a
    failure, not a clean end, bad flags nor a diverged run."""
    return code is not None and code not in (0, _BAD_FLAGS, DIVERGED)


def _worker_ended(i: int, code: int, seconds: float) -> str:
    """Why a run ends when worker ``i`` exited with ``code`` after ``seconds``."""
    if code == DIVERGED:
        return f"worker {i} diverged at t = {seconds:.1f} s"
    return f"worker {i} exited with status {code}"


def _returncode(reason: str) -> int:
    """A launch's exit status from why it ended."""
    if reason == "completed":
        return 0
    return DIVERGED if re.fullmatch(r"worker \d+ diverged at .*", reason) else 1


def _restart_checkpoint_args(
    server_args: Sequence[str],
    checkpoints: pathlib.Path,
    shard: int,
    server_shards: int,
) -> list[str]:
    """The checkpoint flags a server needs to be restarted, those that
    ``server_args`` leave out."""
    given = {str(a).split("=", 1)[0] for a in server_args}
    extra: list[str] = []
    if "--checkpoint_dir" not in given:
        where = checkpoints if server_shards == 1 else checkpoints / f"shard_{shard}"
        extra += ["--checkpoint_dir", str(where)]
    if not given & {"--checkpoint_every_s", "--checkpoint_every_updates"}:
        extra += ["--checkpoint_every_s", repr(_RESTART_CHECKPOINT_EVERY_S)]
    return extra


def __getattr__(name: str):
    # The Ray backend imports this module, so it is loaded on first use.
    if name == "launch_ray":
        from hpsjax._ray_launch import launch_ray

        return launch_ray
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _split_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Splits ``[own] [--server ...] [-- worker...]`` style command lines."""
    own, server, worker = [], [], []
    target = own
    for arg in argv:
        if arg == "--" and target is not worker:
            target = worker
        elif arg == "--server" and target is own:
            target = server
        else:
            target.append(arg)
    return own, server, worker


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hpsjax.launch``; returns the exit status.

    Usage: ``python -m hpsjax.launch [launcher flags] [--server SERVER FLAGS]
    [-- WORKER FLAGS]``.
    """
    quiet_backend_probe()
    argv = list(sys.argv[1:] if argv is None else argv)
    own, server_args, worker_args = _split_argv(argv)
    from hpsjax import _ray_launch
    from hpsjax.profiling import SCHEMES
    from hpsjax.ps import POLICIES

    p = argparse.ArgumentParser(
        prog="hpsjax-launch",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run a parameter server and N workers on this machine.",
        epilog="Flags after --server go to hpsjax-server, flags after -- to every "
        "hpsjax-worker.",
    )
    g = p.add_argument_group("workers and model")
    g.add_argument("--workers", type=int, required=True, help="number of workers")
    g.add_argument(
        "--model",
        help="the workers' model (sets their --model): a built-in name or "
        "package.module:factory, importable from here or PYTHONPATH",
    )
    g.add_argument("--steps", type=int, default=100, help="rounds per worker")
    g.add_argument(
        "--worker_flags",
        nargs=2,
        action="append",
        default=[],
        metavar=("INDEX", "FLAGS"),
        help="extra flags (one quoted string) for worker INDEX, repeatable",
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--policy",
        default="bsp",
        help=f"server synchronisation policy: {', '.join(sorted(POLICIES))}",
    )
    g.add_argument(
        "--server_shards",
        type=int,
        default=1,
        help="split the model by key range over this many server processes",
    )
    g.add_argument(
        "--split_leaves",
        action="store_true",
        help="with --server_shards: cut arrays by rows between shards too",
    )
    g = p.add_argument_group("work plan")
    g.add_argument(
        "--plan",
        choices=SCHEMES,
        metavar="SCHEME",
        help="profile the workers in place and plan with this scheme: "
        f"{', '.join(SCHEMES)}",
    )
    g.add_argument("--global_batch", type=int, help="the plan's global batch")
    g.add_argument(
        "--replan",
        type=float,
        help="with --plan: the server re-plans when a worker's speed drifts by "
        "more than this fraction",
    )
    g = p.add_argument_group("run")
    g.add_argument("--workdir", help="directory for secret, init, plan, metrics")
    g.add_argument(
        "--compile_cache",
        metavar="DIR",
        help="the JAX compilation cache every process of the run shares "
        "(default: jax_cache in the work directory)",
    )
    g.add_argument("--timeout", type=float, help="seconds the run may take")
    g.add_argument("--no_progress", action="store_true", help="no progress bar")
    _ray_launch.add_ray_flags(p)
    args = p.parse_args(own)

    def terminate(signum, frame):
        del signum, frame
        raise KeyboardInterrupt

    # SIGTERM (a scheduler stopping the job) shuts down like Ctrl-C.
    signal.signal(signal.SIGTERM, terminate)
    per_worker: dict[int, list[str]] = {}
    try:
        if args.model is not None:
            worker_args = ["--model", args.model, *worker_args]
        for index, text in args.worker_flags:
            per_worker.setdefault(int(index), []).extend(shlex.split(text))
        backend = _ray_launch.backend_from_flags(args) or functools.partial(
            launch, max_restarts=args.max_restarts or 0
        )
        result = backend(
            args.workers,
            policy=args.policy,
            steps=args.steps,
            worker_args=worker_args,
            per_worker_args=per_worker,
            server_args=server_args,
            plan=args.plan,
            global_batch=args.global_batch,
            replan=args.replan,
            server_shards=args.server_shards,
            split_leaves=args.split_leaves,
            workdir=args.workdir,
            compile_cache=args.compile_cache,
            timeout=args.timeout,
            progress=not args.no_progress,
        )
    except (LaunchError, ValueError) as e:
        print(f"hpsjax.launch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
