"""The Ray backend's actor: one server or worker process on a Ray node.

Kept apart from the launcher's modules, with only the standard library and
:mod:`hpsjax.launch._job` beneath it, because every actor imports it on its
node: an actor starts within the launch's ``start_timeout``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from hpsjax.launch._job import LISTENING, TRAMPOLINE, is_crash

# In an actor's command line, replaced by the actor's own directory and by the
# address of the node it runs on.
ACTOR_DIR = "<hpsjax-actor-dir>"
NODE_IP = "<hpsjax-node-ip>"
# How long a crashed process's actor waits for the launcher to collect its last
# output before it ends itself (and Ray restarts it).
_DRAIN_SECONDS = 2.0


def _end_actor() -> None:
    """Ends the actor's process at once, for Ray to restart it."""
    os._exit(1)


class ProcessActor:
    """One hpsjax process on a Ray node, in its own process group.

    The process's files (secret, ``init.npz``, plan) are written, 0600, into a
    0700 directory of the actor's own; its metrics file is there too. With
    ``restart``, a process that ends unexpectedly (a signal, a failure other
    than bad flags) ends the actor, for Ray to restart it.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        files: dict[str, bytes],
        restart: bool,
        cwd: str,
        env: Mapping[str, str] | None = None,
    ):
        import ray

        self._restart = restart
        self._node_ip = ray.util.get_node_ip_address()
        self._dir = tempfile.mkdtemp(prefix=f"hpsjax-{name.replace(' ', '-')}-")
        for file_name, data in files.items():
            fd = os.open(
                os.path.join(self._dir, file_name),
                os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                0o600,
            )
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        argv = [
            a.replace(ACTOR_DIR, self._dir).replace(NODE_IP, self._node_ip)
            for a in argv
        ]
        self._lock = threading.Lock()
        self._lines: deque[str] = deque(maxlen=10_000)
        self._metrics_offset = 0
        self._stopping = False
        self._crashed = False
        # Set by the reader with ``_crashed``, under the lock: a poll never
        # sees the exit status before it is known whether Ray restarts it.
        self._returncode: int | None = None
        self._drained = threading.Event()
        self._port: int | None = None
        # The trampoline ties the process to this actor's life (see _job.py).
        self._popen = subprocess.Popen(
            [sys.executable, "-c", TRAMPOLINE, str(os.getpid()),
             sys.executable, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            cwd=cwd if os.path.isdir(cwd) else self._dir,
            text=True,
            bufsize=1,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self._popen.stdout:
            for line in self._popen.stdout:
                line = line.rstrip("\n")
                match = LISTENING.search(line)
                with self._lock:
                    if match and self._port is None:
                        self._port = int(match.group(2))
                    self._lines.append(line)
        code = self._popen.wait()
        crashed = is_crash(code) and self._restart
        with self._lock:
            self._crashed = crashed and not self._stopping
            self._returncode = code
            if not self._crashed:
                return
        # Give the launcher its last lines and metrics, then end the actor:
        # Ray restarts it and the process starts again.
        if self._drained.wait(_DRAIN_SECONDS):
            time.sleep(0.5)  # for the answer to leave
        with self._lock:
            if self._stopping:
                return
        shutil.rmtree(self._dir, ignore_errors=True)
        _end_actor()

    def _new_metrics(self) -> bytes:
        path = os.path.join(self._dir, "metrics.jsonl")
        try:
            with open(path, "rb") as f:
                f.seek(self._metrics_offset)
                data = f.read()
        except FileNotFoundError:
            return b""
        # Whole lines only: the rest comes with the next poll.
        data = data[: data.rfind(b"\n") + 1]
        self._metrics_offset += len(data)
        return data

    def poll(self) -> dict[str, Any]:
        """New output lines and metrics, the exit status, the port (servers)."""
        with self._lock:
            lines = list(self._lines)
            self._lines.clear()
            crashed = self._crashed
            state = {
                "lines": lines,
                "metrics": self._new_metrics(),
                "returncode": self._returncode,
                "pid": self._popen.pid,
                "crashed": crashed,
                "host": self._node_ip,
                "port": self._port,
            }
        if crashed:
            # The process's output ended before it was marked crashed: all of
            # it is in this answer.
            self._drained.set()
        return state

    def read(self, file_name: str) -> bytes | None:
        """A file the process wrote into the actor's directory (a profile),
        ``None`` when there is none."""
        try:
            with open(os.path.join(self._dir, file_name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def stop(self, timeout: float, fetch: tuple[str, ...] = ()) -> dict[str, Any]:
        """SIGTERM to the process group, SIGKILL after ``timeout``; final poll,
        with ``files``: the bytes of each file named in ``fetch`` that the
        process wrote into the actor's directory (a server's final parameters),
        ``None`` for one it did not, read before the directory goes."""
        with self._lock:
            self._stopping = True
        self._drained.set()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._popen.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout)
        self._reader.join(2.0)
        with self._lock:
            if self._returncode is None:
                self._returncode = self._popen.poll()
        state = self.poll()
        state["files"] = {name: self.read(name) for name in fetch}
        shutil.rmtree(self._dir, ignore_errors=True)
        return state
