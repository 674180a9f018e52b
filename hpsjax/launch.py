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

With ``--plan SCHEME`` the train step is profiled first (once: the workers share
this machine; each worker's profile is that measurement with its own injected
slowdown and link), :func:`hpsjax.profiling.plan` makes the work plan, and the
workers train with it (``--work_plan``).

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

__all__ = ["LaunchError", "LaunchResult", "launch", "main"]

PerWorkerArgs = Mapping[int, Sequence[str]] | Sequence[Sequence[str]]

_LISTENING = re.compile(r"hpsjax-server listening on (\S+):(\d+)")

# Seconds between the server's checkpoints when the launcher may restart it
# (``max_restarts``) and the server flags name no interval of their own.
_RESTART_CHECKPOINT_EVERY_S = 1.0

# A process exiting with this status is not restarted (bad flags: argparse).
_BAD_FLAGS = 2

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
        self._secret = secret
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
            secret=self._secret,
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
    num_workers: int,
    shared: list[str],
    flags: list[list[str]],
    workdir: pathlib.Path,
    global_batch: int | None,
    emit: Callable[[str], None],
) -> tuple[pathlib.Path, float]:
    """Profiles the train step once and plans; returns the plan file and cost.

    The workers share this machine, so one measurement of the step serves all
    of them; each worker's profile is that one with its own injected slowdown
    and link (see ``hpsjax.worker._cli.with_injection``).
    """
    from hpsjax.profiling import plan
    from hpsjax.worker._cli import measure_step, parse_args, with_injection

    def worker_args(i: int):
        return parse_args(
            [*shared, "--worker_id", str(i), "--shard_index", str(i),
             "--shard_count", str(num_workers), *flags[i]]
        )  # fmt: skip

    measured, spec = measure_step(worker_args(0))
    profiles = []
    for i in range(num_workers):
        profile = with_injection(measured, worker_args(i), spec)
        (workdir / f"profile_{i}.json").write_text(profile.to_json())
        profiles.append(profile)
    emit(
        f"[launch] profiled the step in {measured.profile_seconds:.2f}s: "
        f"{[round(p.devices[0].throughput(64)) for p in profiles]} samples/s "
        "at batch 64"
    )
    if global_batch is None:
        global_batch = parse_args(shared).batch_size * num_workers
    work_plan = plan(profiles, scheme, global_batch=global_batch)
    path = workdir / "plan.json"
    path.write_text(work_plan.to_json())
    emit(
        f"[launch] {scheme} plan: batches "
        f"{[w.batch_size for w in work_plan.workers]}, local steps "
        f"{[w.local_steps for w in work_plan.workers]}, predicted idle "
        f"{work_plan.idle_fraction:.1%}"
    )
    return path, measured.profile_seconds


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
    num_workers: int,
    shared: list[str],
    flags: list[list[str]],
    plan: str | None,
    replan: float | None,
    global_batch: int | None,
    emit: Callable[[str], None],
) -> tuple[bytes, pathlib.Path, pathlib.Path, list[str], list[str], float | None]:
    """Writes a fresh secret, ``init.npz`` and the plan (``plan``) into ``work``.

    Returns the secret, its file, the init file, the workers' shared flags (with
    ``--work_plan``), shard 0's extra flags and the profiling pass's seconds.
    """
    from hpsjax.worker._cli import parse_args, write_init

    secret = secrets.token_urlsafe(32).encode()
    secret_file = work / "secret.txt"
    secret_file.touch(mode=0o600)
    secret_file.write_bytes(secret)
    init = work / "init.npz"
    try:
        write_init(parse_args(shared), init)
    except ValueError as e:
        raise LaunchError(f"cannot build the model from the worker flags: {e}") from e
    profile_seconds = None
    # Flags for shard 0 only: the plan the workers follow comes from it.
    plan_server_args: list[str] = []
    if plan is not None:
        plan_file, profile_seconds = _profile_and_plan(
            plan, num_workers, shared, flags, work, global_batch, emit
        )
        shared = [*shared, "--work_plan", str(plan_file)]
        if replan is not None:
            plan_server_args = [
                "--work_plan",
                str(plan_file),
                "--replan_threshold",
                repr(float(replan)),
            ]
    return secret, secret_file, init, shared, plan_server_args, profile_seconds


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
      plan: a :data:`hpsjax.profiling.SCHEMES` name to profile the workers and
        train with the resulting work plan, or ``None``.
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
      timeout: seconds the whole run may take, ``None`` for no limit.
      start_timeout: seconds the server has to start listening.
      shutdown_timeout: seconds processes get after SIGTERM before SIGKILL.
      progress: show a tqdm progress bar of the server version (stderr).
      log: where the processes' prefixed output goes (stdout by default).
      python: the Python interpreter for the children.

    Returns:
      A :class:`LaunchResult`; ``returncode`` 0 when every worker exited with 0.

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

    out = log if log is not None else sys.stdout
    lock = threading.Lock()
    bar = None

    def emit(line: str) -> None:
        with lock:
            if bar is not None:
                bar.write(line, file=out)
            else:
                print(line, file=out, flush=True)

    start = time.monotonic()
    work = (
        pathlib.Path(workdir)
        if workdir is not None
        else pathlib.Path(tempfile.mkdtemp(prefix="hpsjax-launch-"))
    )
    work.mkdir(parents=True, exist_ok=True)
    secret, secret_file, init, shared, plan_server_args, profile_seconds = (
        _prepare_workdir(
            work, num_workers, shared, flags, plan, replan, global_batch, emit
        )
    )
    shard_args = ["--split_leaves"] if split_leaves else []
    checkpoints = work / "checkpoints"
    if max_restarts > 0:
        # A restarted server resumes from here: nothing from an earlier
        # launch in the same workdir may be there.
        shutil.rmtree(checkpoints, ignore_errors=True)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    processes: list[_Process] = []
    servers: list[_Process] = []
    workers: list[_Process] = []
    monitor: _Monitor | None = None
    ports: list[int] = []
    server_argvs: list[list[str]] = []
    worker_argvs: list[list[str]] = []
    worker_restarts = [0] * num_workers
    server_restarts = [0] * server_shards
    reason = "completed"
    try:
        for shard in range(server_shards):
            server_argv = [
                python, "-m", "hpsjax.ps._cli", "--init", str(init),
                "--secret_file", str(secret_file), "--policy", policy,
                "--host", "127.0.0.1", "--port", "0", *[str(a) for a in server_args],
                *(plan_server_args if shard == 0 else []),
            ]  # fmt: skip
            name = "server"
            if server_shards > 1:
                server_argv += [
                    "--server_shard", str(shard), "--server_shards",
                    str(server_shards), *shard_args,
                ]  # fmt: skip
                name = f"server {shard}"
            if max_restarts > 0:
                server_argv += _restart_checkpoint_args(
                    server_args, checkpoints, shard, server_shards
                )
            server_argvs.append(server_argv)
            ports.append(
                _start_server(name, server_argv, emit, env, processes, start_timeout)
            )
            servers.append(processes[-1])
        port = ports[0]
        if server_shards > 1:
            where = ["--servers", ",".join(f"127.0.0.1:{p}" for p in ports)]
            where += shard_args
            emit(
                f"[launch] {server_shards} server shards on ports "
                f"{', '.join(map(str, ports))}, starting {num_workers} worker(s)"
            )
        else:
            where = ["--host", "127.0.0.1", "--port", str(port)]
            emit(f"[launch] server on port {port}, starting {num_workers} worker(s)")
        for i in range(num_workers):
            argv = [
                python, "-m", "hpsjax.worker._cli", *where,
                "--secret_file", str(secret_file),
                "--worker_id", str(i), "--shard_index", str(i),
                "--shard_count", str(num_workers),
                "--metrics", str(work / f"metrics_{i}.jsonl"),
                *([] if steps is None else ["--max_steps", str(steps)]),
                *shared, *flags[i],
            ]  # fmt: skip
            worker_argvs.append(argv)
            worker = _Process(f"worker {i}", argv, emit, env)
            workers.append(worker)
            processes.append(worker)
        monitor = _Monitor(port, secret)
        tqdm = None
        if progress:
            # tqdm comes with the experiments extra only: no bar without it.
            with contextlib.suppress(ImportError):
                from tqdm import tqdm
        if tqdm is not None:
            total = None
            if steps is not None:
                total = steps if policy in _ROUND_POLICIES else steps * num_workers
            with lock:
                bar = tqdm(total=total, desc="versions", unit="v", file=sys.stderr)
        end = None if timeout is None else start + timeout
        while True:
            codes = [w.poll() for w in workers]
            for i, code in enumerate(codes):
                if _crashed(code) and worker_restarts[i] < max_restarts:
                    worker_restarts[i] += 1
                    emit(
                        f"[launch] worker {i} crashed (status {code}); restarting "
                        f"it ({worker_restarts[i]} of {max_restarts})"
                    )
                    workers[i] = _Process(f"worker {i}", worker_argvs[i], emit, env)
                    processes.append(workers[i])
                    codes[i] = None
            failed = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
            if failed:
                i, code = failed[0]
                reason = f"worker {i} exited with status {code}"
                break
            if all(c == 0 for c in codes):
                break
            for shard, server in enumerate(servers):
                code = server.poll()
                if not (_crashed(code) and server_restarts[shard] < max_restarts):
                    continue
                server_restarts[shard] += 1
                emit(
                    f"[launch] {server.name} crashed (status {code}); restarting "
                    f"it on port {ports[shard]} from its checkpoints "
                    f"({server_restarts[shard]} of {max_restarts})"
                )
                argv = [*server_argvs[shard], "--port", str(ports[shard])]
                try:
                    _start_server(
                        server.name, argv, emit, env, processes, start_timeout
                    )
                except LaunchError as e:
                    reason = f"restarting the {server.name} failed: {e}"
                    break
                servers[shard] = processes[-1]
                if shard == 0:
                    monitor.close()
                    monitor = _Monitor(port, secret)
            if reason != "completed":
                break
            exited = [(s.name, s.poll()) for s in servers if s.poll() is not None]
            if exited:
                reason = f"{exited[0][0]} exited early with status {exited[0][1]}"
                break
            if end is not None and time.monotonic() > end:
                reason = "timeout"
                break
            version = monitor.version
            if bar is not None and version is not None and version > bar.n:
                with lock:
                    bar.update(version - bar.n)
            time.sleep(0.1)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    except BaseException as e:
        reason = f"launcher error: {e}"
        raise
    finally:
        if monitor is not None:
            monitor.close()
        if reason == "completed" and servers:
            # The workers are done; the servers get SIGTERM (a graceful stop
            # with a final checkpoint) before everything is reaped.
            _shutdown(servers, shutdown_timeout)
        if reason != "completed":
            emit(f"[launch] stopping everything: {reason}")
        _shutdown(processes, shutdown_timeout)
        if bar is not None:
            with lock:
                if monitor is not None and (monitor.version or 0) > bar.n:
                    bar.update(monitor.version - bar.n)
                bar.close()
                bar = None
    worker_codes = tuple(w.poll() for w in workers)
    server_codes = tuple(s.poll() for s in servers)
    server_code = server_codes[0] if server_codes else None
    unclean = [
        (s.name, c) for s, c in zip(servers, server_codes, strict=True) if c != 0
    ]
    if reason == "completed" and unclean:
        reason = f"{unclean[0][0]} did not stop cleanly (status {unclean[0][1]})"
    returncode = 0 if reason == "completed" else 1
    where = f"workdir {work}" if kept else "no --workdir: metrics not kept"
    emit(f"[launch] {reason} in {time.monotonic() - start:.1f}s; {where}")
    return LaunchResult(
        returncode=returncode,
        reason=reason,
        server_returncode=server_code,
        worker_returncodes=worker_codes,
        pids=tuple(p.pid for p in processes),
        port=ports[0] if ports else None,
        workdir=str(work) if kept else None,
        version=None if monitor is None else monitor.version,
        elapsed=time.monotonic() - start,
        profile_seconds=profile_seconds,
        ports=tuple(ports),
        server_returncodes=server_codes,
        worker_restarts=tuple(worker_restarts),
        server_restarts=tuple(server_restarts),
    )


def _crashed(code: int | None) -> bool:
    """Whether an exit status is a crash to restart after: a signal or a
    failure, not a clean end nor bad flags."""
    return code is not None and code not in (0, _BAD_FLAGS)


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
    g.add_argument("--plan", help="profile and plan with this scheme (hps, ...)")
    g.add_argument("--global_batch", type=int, help="the plan's global batch")
    g.add_argument(
        "--replan",
        type=float,
        help="with --plan: the server re-plans when a worker's speed drifts by "
        "more than this fraction",
    )
    g = p.add_argument_group("run")
    g.add_argument("--workdir", help="directory for secret, init, plan, metrics")
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
