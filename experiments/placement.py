"""Worker processes placed on devices and CPU core sets: the real-device setting.

A worker spec names each worker's device, comma-separated: ``gpu:0`` (GPU 0,
its own process with only that GPU visible, ``JAX_PLATFORMS=cuda`` and one host
core) or ``cpu:4`` (the CPU alone, ``JAX_PLATFORMS=cpu``, no GPU visible, pinned
to 4 cores of its own). A CPU worker's XLA thread pool is as wide as its core
set (XLA counts the cores it may run on); a single-core worker also runs XLA's
CPU kernels single-threaded (``--xla_cpu_multi_thread_eigen=false``). The
server takes the first ``server_cores`` cores.

:func:`place` maps a spec onto this machine. Where it has no GPU, each ``gpu:N``
worker runs on the CPU with as many cores as the spec's widest CPU worker (the
same suite on core sets only); where it has fewer cores than asked, core sets
wrap around and share cores. Both are said in the returned notes.

Example::

  >>> ps, server, notes = place("cpu:2, cpu:1", server_cores=1, cpus=[0, 1, 2, 3],
  ...                           gpus=0)
  >>> [p.describe() for p in ps], server
  (['cpu:2 (cores 1,2)', 'cpu:1 (cores 3)'], (0,))
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["Placement", "gpu_count", "parse_spec", "place"]

_ENTRY = re.compile(r"(gpu|cpu):(\d+)")

# Sets this process's CPU affinity, then becomes the given command line.
_PIN = (
    "import os, sys; "
    "os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one worker process runs.

    Attributes:
      spec: its entry of the worker spec, as asked (``"gpu:0"``, ``"cpu:4"``).
      platform: ``"cuda"`` or ``"cpu"``: the JAX platform it runs on.
      gpu: the visible GPU's index, ``None`` on the CPU.
      cores: the CPU cores it may run on (its affinity).
    """

    spec: str
    platform: str
    gpu: int | None
    cores: tuple[int, ...]

    def env(self) -> dict[str, str]:
        """The environment variables that put the process there."""
        env = {
            "JAX_PLATFORMS": self.platform,
            "CUDA_VISIBLE_DEVICES": "" if self.gpu is None else str(self.gpu),
        }
        if self.platform == "cpu" and len(self.cores) == 1:
            flags = os.environ.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
        return env

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """``argv`` (starting with the interpreter) run on this core set."""
        if not self.cores:
            return list(argv)
        cores = ",".join(map(str, self.cores))
        return [sys.executable, "-c", _PIN, cores, *argv]

    def describe(self) -> str:
        where = "cpu" if self.gpu is None else f"gpu:{self.gpu}"
        spec = where if self.gpu is not None else f"cpu:{len(self.cores)}"
        cores = ",".join(map(str, self.cores))
        return f"{spec} (cores {cores})"


def parse_spec(text: str | Sequence[str]) -> list[tuple[str, int]]:
    """``"gpu:0, cpu:4"`` as ``[("gpu", 0), ("cpu", 4)]``.

    Raises:
      ValueError: an entry that is not ``gpu:INDEX`` or ``cpu:CORES`` with
        CORES >= 1 (one line, naming it).
    """
    entries = text.split(",") if isinstance(text, str) else list(text)
    parsed = []
    for entry in entries:
        match = _ENTRY.fullmatch(str(entry).strip().lower())
        if match is None or (match.group(1) == "cpu" and int(match.group(2)) < 1):
            raise ValueError(
                f"bad worker device {str(entry).strip()!r}: expected gpu:INDEX or "
                "cpu:CORES (CORES >= 1), e.g. 'gpu:0, cpu:4, cpu:2, cpu:1'"
            )
        parsed.append((match.group(1), int(match.group(2))))
    if not parsed:
        raise ValueError("the worker spec names no worker")
    return parsed


@functools.cache
def gpu_count() -> int:
    """NVIDIA GPUs on this machine (``nvidia-smi -L``), 0 without any."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def place(
    spec: str | Sequence[str],
    *,
    server_cores: int = 0,
    cpus: Sequence[int] | None = None,
    gpus: int | None = None,
) -> tuple[list[Placement], tuple[int, ...], list[str]]:
    """Maps a worker spec onto this machine's GPUs and cores.

    Args:
      spec: the worker spec (see the module docstring).
      server_cores: cores for the server, taken first; 0 leaves it unpinned.
      cpus: the cores to place on; this process's affinity by default.
      gpus: how many GPUs there are; :func:`gpu_count` by default.

    Returns:
      ``(placements, server_cores, notes)``: each worker's placement, the
      server's cores (``()``: unpinned), and one line for each thing that is
      not as asked (no GPU, fewer cores than asked).
    """
    entries = parse_spec(spec)
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    gpus = gpu_count() if gpus is None else gpus
    if not cpus:
        raise ValueError("no CPU cores to place workers on")
    if isinstance(server_cores, bool) or not isinstance(server_cores, int):
        raise ValueError(f"server_cores must be an int >= 0, got {server_cores!r}")
    if server_cores < 0:
        raise ValueError(f"server_cores must be an int >= 0, got {server_cores}")
    notes = []
    widest = max((n for kind, n in entries if kind == "cpu"), default=1)
    wanted = server_cores + sum(n if kind == "cpu" else 1 for kind, n in entries)
    no_gpu = [i for i, (kind, n) in enumerate(entries) if kind == "gpu" and n >= gpus]
    if no_gpu:
        wanted += (widest - 1) * len(no_gpu)
        notes.append(
            f"{'no GPU' if gpus == 0 else f'only {gpus} GPU(s)'} here: worker(s) "
            f"{', '.join(map(str, no_gpu))} run on the CPU with {widest} core(s)"
        )
    if wanted > len(cpus):
        notes.append(
            f"{wanted} cores asked, {len(cpus)} here: core sets wrap around and "
            "share cores"
        )
    position = 0

    def take(n: int) -> tuple[int, ...]:
        nonlocal position
        n = min(n, len(cpus))
        chosen = [cpus[(position + k) % len(cpus)] for k in range(n)]
        position += n
        return tuple(sorted(set(chosen)))

    server = take(server_cores) if server_cores > 0 else ()
    placements = []
    for i, (kind, n) in enumerate(entries):
        asked = f"{kind}:{n}"
        if kind == "gpu" and i not in no_gpu:
            placements.append(Placement(asked, "cuda", n, take(1)))
        else:
            cores = take(widest if kind == "gpu" else n)
            placements.append(Placement(asked, "cpu", None, cores))
    return placements, server, notes
