"""What a launch starts and watches, whichever backend places it.

The job's command lines (:class:`Job`), a child process in its own group with
its output streamed (:class:`Process`), the console
with its progress bar, and the rules on exit statuses (what is a crash to
restart, a diverged run, how a launch ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TextIO

from hpsjax._config_flags import argv_of
from hpsjax.config import get_scheme
from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand, WorkerConfig

if TYPE_CHECKING:
    from hpsjax.launch._monitor import Monitor


PerWorkerArgs = Mapping[int, Sequence[str]] | Sequence[Sequence[str]]

#: Where each local worker process runs, in worker order: the command line's
#: head (what goes before ``-m module``, the interpreter last, e.g. a wrapper
#: that pins the process to its cores) and the environment variables it gets
#: beside the run's (e.g. ``CUDA_VISIBLE_DEVICES``).
WorkerPlaces = Sequence[tuple[Sequence[str], Mapping[str, str]]]

LISTENING = re.compile(r"hpsjax-server listening on (\S+):(\d+)")

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
TRAMPOLINE = """
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


class Process:
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
            [sys.executable, "-c", TRAMPOLINE, str(os.getpid()), *argv],
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


def shutdown(processes: Sequence[Process], timeout: float) -> None:
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


def start_server(
    name: str,
    argv: list[str],
    emit: Callable[[str], None],
    env: Mapping[str, str],
    processes: list[Process],
    start_timeout: float,
) -> int:
    """Starts one server process (appended to ``processes``); returns its port."""
    listening = threading.Event()
    found: list[int] = []

    def on_line(line: str) -> None:
        match = LISTENING.search(line)
        if match and not listening.is_set():
            found.append(int(match.group(2)))
            listening.set()

    server = Process(name, argv, emit, env, on_line)
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


class Console:
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

    def start_bar(self, progress: bool, job: Job) -> None:
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
            if get_scheme(job.policy).policy not in _ROUND_POLICIES:
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
class Job:
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

    def server(
        self, shard: int, head: list[str], init: str, secret_file: str, host: str
    ) -> tuple[str, list[str]]:
        """Server ``shard``'s name and command line."""
        shards = {}
        if self.server_shards > 1:
            shards = dict(
                server_shard=shard,
                server_shards=self.server_shards,
                split_leaves=self.split_leaves,
            )
        given = [*self.server_args, *(self.plan_server_args if shard == 0 else [])]
        # The launcher knows its workers: the run starts once all have joined
        # (a fast worker never trains alone while a slow one still compiles),
        # unless the flags already name them (a pilot, --core_arg).
        hold = {}
        if not any("expected_workers" in a or a == "--pilot" for a in given):
            hold = dict(core_arg={"expected_workers": self.num_workers})
        argv = [
            *head, "-m", "hpsjax.ps._cli",
            *argv_of(ServerOptions, init=init, secret_file=secret_file,
                     policy=self.policy, host=host, **hold),
            *given, *argv_of(ServerOptions, **shards),
        ]  # fmt: skip
        return ("server" if self.server_shards == 1 else f"server {shard}"), argv

    def where(self, addresses: Sequence[tuple[str, int]]) -> list[str]:
        """The workers' flags naming the server(s) at ``addresses``."""
        if self.server_shards > 1:
            return argv_of(
                WorkerCommand, servers=tuple(addresses), split_leaves=self.split_leaves
            )
        host, port = addresses[0]
        return argv_of(WorkerConfig, host=host) + argv_of(WorkerCommand, port=port)

    def worker(
        self,
        i: int,
        head: list[str],
        where: list[str],
        secret_file: str,
        metrics: str | None,
        *,
        module: str = "hpsjax.cli.worker",
    ) -> list[str]:
        """Worker ``i``'s command line (``module`` takes a worker's flags)."""
        command = argv_of(
            WorkerCommand,
            secret_file=secret_file,
            shard_index=i,
            shard_count=self.num_workers,
            metrics=metrics,
        )
        # Every worker names its id, 0 included: its processes tell apart.
        config = argv_of(
            WorkerConfig, always=("worker_id",), worker_id=i, max_steps=self.steps
        )
        return [*head, "-m", module, *where, *command, *config, *self.shared,
                *self.flags[i]]  # fmt: skip


def end_launch(
    reason: str,
    console: Console,
    monitor: Monitor | None,
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
    elif launch_returncode(reason) != DIVERGED:  # said once, in the final line
        console.emit(f"[launch] stopping everything: {reason}")
    stop_all()
    console.close_bar(None if monitor is None else monitor.version)


def final_reason(reason: str, names: Sequence[str], codes: Sequence[int | None]) -> str:
    """``reason``, or, after a run that completed, the first server that did
    not stop cleanly."""
    unclean = [(n, c) for n, c in zip(names, codes, strict=True) if c != 0]
    if reason == "completed" and unclean:
        return f"{unclean[0][0]} did not stop cleanly (status {unclean[0][1]})"
    return reason


def is_crash(code: int | None) -> bool:
    """Whether an exit status is a crash to restart after: a signal or a
    failure, not a clean end, bad flags nor a diverged run."""
    return code is not None and code not in (0, _BAD_FLAGS, DIVERGED)


def worker_ended(i: int, code: int, seconds: float) -> str:
    """Why a run ends when worker ``i`` exited with ``code`` after ``seconds``."""
    if code == DIVERGED:
        return f"worker {i} diverged at t = {seconds:.1f} s"
    return f"worker {i} exited with status {code}"


def launch_returncode(reason: str) -> int:
    """A launch's exit status from why it ended."""
    if reason == "completed":
        return 0
    return DIVERGED if re.fullmatch(r"worker \d+ diverged at .*", reason) else 1
