"""Chaos run: a real 4-worker training run whose workers and server are
SIGKILLed at random moments, against the same run undisturbed.

The local launcher (:func:`hpsjax.launch.launch` with ``max_restarts``)
restarts what dies: a worker with its ``--worker_id`` (it rejoins), the server
on its port from its checkpoints (one every second). The workers train BSP
until the server's version reaches ``--until_version``, so a run that lost
updates to a server kill redoes them and every run ends on the same number of
updates; the final test accuracy is the workers' evaluation of the last
version on the held-out split. The default 2000 versions is where accuracy has
levelled off (about 0.96 from version 1300 on), so a run that averaged fewer
workers in some rounds is judged by where it ends, not by how far it had
climbed. The server holds its start, and a restarted server's start, until
all 4 workers have joined (``expected_workers``, at most ``--hold`` seconds);
a killed worker is not waited for: BSP rounds go on with the live ones while
it restarts.

A seeded schedule picks the kills: each at a random point of the run's
progress (a server version drawn in [10%, 80%] of the target), on the server
or on a random live worker. Every run has a time limit, so a hang fails it
rather than blocking::

    python -m experiments.chaos --workdir workdirs/chaos --seeds 0,1,2

prints, per seed, the undisturbed and the disturbed accuracy, the kills done,
the restarts and the wall time, then the spread between undisturbed seeds (the
seed noise) and whether every disturbed run ended within it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence

from experiments import _cli
from hpsjax._checks import check_int, check_number
from hpsjax._config_flags import argv_of
from hpsjax.launch import launch
from hpsjax.ps._options import ServerOptions
from hpsjax.worker import WorkerConfig
from hpsjax.worker._command import WorkerCommand

__all__ = ["ChaosRun", "Kill", "final_accuracy", "kill_schedule", "run", "main"]

NUM_WORKERS = 4

# The task: BSP over 4 workers, the MLP on synthetic 8x8 digits, server SGD
# with the step size and momentum chosen for bsp on sim8.
WORKER = dict(batch_size=32)
WORKER_COMMAND = dict(log_level="WARNING")
SERVER = dict(learning_rate=0.2, momentum=0.9, log_level="WARNING")


@dataclasses.dataclass(frozen=True)
class Kill:
    """One planned SIGKILL: at server ``version``, ``target`` ("server" or a
    worker index)."""

    version: int
    target: str | int


@dataclasses.dataclass(frozen=True)
class ChaosRun:
    """How one run ended.

    Attributes:
      seed: the run's seed (initial weights and data order).
      disturbed: whether kills were planned.
      accuracy: held-out accuracy of the last version, ``None`` if no worker
        evaluated one.
      version: that version.
      curve: every evaluation, ``(version, accuracy)`` by version (the last
        one, and one every ``eval_every`` seconds where asked).
      reason: the launch's reason (``"completed"`` when it finished).
      kills: what was SIGKILLed, in order: ``(seconds, target)``.
      worker_restarts: restarts per worker.
      server_restarts: restarts of the server.
      wall_s: seconds the launch took.
    """

    seed: int
    disturbed: bool
    accuracy: float | None
    version: int | None
    reason: str
    curve: tuple[tuple[int, float], ...]
    kills: tuple[tuple[float, str | int], ...]
    worker_restarts: tuple[int, ...]
    server_restarts: int
    wall_s: float


def kill_schedule(
    seed: int, kills: int, until_version: int, server_kills: int = 1
) -> list[Kill]:
    """``kills`` kills at random versions, ``server_kills`` of them on the
    server and the rest on random workers, sorted by version."""
    if not 0 <= server_kills <= kills:
        raise ValueError(f"server_kills must be in 0..{kills}, got {server_kills}")
    rng = random.Random(seed)
    targets: list[str | int] = ["server"] * server_kills
    targets += [rng.randrange(NUM_WORKERS) for _ in range(kills - server_kills)]
    rng.shuffle(targets)
    low, high = max(1, until_version // 10), max(2, until_version * 8 // 10)
    versions = sorted(rng.randint(low, high) for _ in targets)
    return [Kill(v, t) for v, t in zip(versions, targets, strict=True)]


def _records(workdir: pathlib.Path) -> list[dict]:
    found = []
    for path in sorted(workdir.glob("metrics_*.jsonl")):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written
    return found


def _progress(workdir: pathlib.Path) -> int:
    """The newest server version the workers have seen (their metrics)."""
    versions = [
        max(r.get("version") or 0, r.get("pulled_version") or 0)
        for r in _records(workdir)
        if r.get("event") == "round"
    ]
    return max(versions, default=0)


def final_accuracy(workdir: pathlib.Path) -> tuple[float | None, int | None]:
    """``(accuracy, version)`` of the newest version a worker evaluated."""
    evals = [r for r in _records(workdir) if r.get("event") == "eval"]
    if not evals:
        return None, None
    last = max(evals, key=lambda r: r["version"])
    return float(last["accuracy"]), int(last["version"])


def _curve(workdir: pathlib.Path) -> tuple[tuple[int, float], ...]:
    """Every evaluated version's accuracy (one per version), by version."""
    found = {
        int(r["version"]): round(float(r["accuracy"]), 4)
        for r in _records(workdir)
        if r.get("event") == "eval"
    }
    return tuple(sorted(found.items()))


def _children() -> dict[int, str]:
    """This process's live children and their command lines, from /proc."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found[int(entry.name)] = " ".join(a.decode() for a in argv) + " "
    return found


def _find(target: str | int) -> int | None:
    """The pid of the live server (``"server"``) or worker ``target``."""
    for pid, argv in _children().items():
        if target == "server" and "hpsjax.ps._cli" in argv:
            return pid
        if (
            target != "server"
            and "hpsjax.cli.worker" in argv
            and f"--worker_id {target} " in argv
        ):
            return pid
    return None


def _killer(
    workdir: pathlib.Path,
    schedule: Sequence[Kill],
    done: list[tuple[float, str | int]],
    stop: threading.Event,
    start: float,
) -> None:
    for kill in schedule:
        pid = None
        while not stop.is_set():
            if _progress(workdir) >= kill.version:
                pid = _find(kill.target)
                if pid is not None:
                    break
            stop.wait(0.05)
        if stop.is_set():
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        done.append((round(time.monotonic() - start, 1), kill.target))
        # Let the run see past the kill before the next one.
        if kill.target == "server":
            stop.wait(1.0)


def run(
    workdir: str | os.PathLike,
    seed: int,
    *,
    until_version: int = 300,
    kills: int = 0,
    server_kills: int = 1,
    max_restarts: int = 10,
    hold: float = 30.0,
    eval_every: float | None = None,
    timeout: float = 300.0,
    log=None,
) -> ChaosRun:
    """One run of the task, with ``kills`` SIGKILLs (0: undisturbed).

    ``hold`` > 0 has the server hold its start, and a restarted server's start
    from its checkpoint, until all 4 workers have joined or ``hold`` seconds
    have passed (``expected_workers``), so no round runs with the first worker
    to come back alone; 0 starts with whoever joins. ``eval_every`` (seconds)
    adds evaluations during the run to :attr:`ChaosRun.curve`.
    """
    work = pathlib.Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("metrics_*.jsonl"):
        old.unlink()
    schedule = kill_schedule(seed, kills, until_version, min(server_kills, kills))
    done: list[tuple[float, str | int]] = []
    stop = threading.Event()
    start = time.monotonic()
    killer = threading.Thread(
        target=_killer, args=(work, schedule, done, stop, start), daemon=True
    )
    worker_args = argv_of(
        WorkerCommand, **WORKER_COMMAND, model_seed=seed, eval_every=eval_every or 1e9
    ) + argv_of(WorkerConfig, **WORKER, until_version=until_version)
    core = {}
    if hold > 0:
        core = {"expected_workers": NUM_WORKERS, "start_timeout": float(hold)}
    server_args = argv_of(ServerOptions, **SERVER, core_arg=core)
    killer.start()
    try:
        with contextlib.ExitStack() as stack:
            if log is None:
                log = stack.enter_context(open(os.devnull, "w"))
            result = launch(
                NUM_WORKERS,
                policy="bsp",
                steps=None,
                worker_args=worker_args,
                per_worker_args={
                    i: argv_of(WorkerCommand, data_seed=1000 * seed + i)
                    for i in range(NUM_WORKERS)
                },
                server_args=server_args,
                max_restarts=max_restarts if kills else 0,
                workdir=work,
                timeout=timeout,
                progress=False,
                log=log,
            )
    finally:
        stop.set()
        killer.join(5.0)
    accuracy, version = final_accuracy(work)
    return ChaosRun(
        seed=seed,
        disturbed=bool(kills),
        accuracy=accuracy,
        version=version,
        reason=result.reason,
        curve=_curve(work),
        kills=tuple(done),
        worker_restarts=result.worker_restarts,
        server_restarts=sum(result.server_restarts),
        wall_s=round(result.elapsed, 1),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.chaos``; 0 when every disturbed run completed
    within the seed noise of the undisturbed ones."""
    p = _cli.Parser("experiments.chaos", description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--workdir", default="workdirs/chaos", help="where the runs go")
    p.add_argument(
        "--seeds", type=_cli.int_list, default=[0, 1, 2], help="comma-separated seeds"
    )
    p.add_argument("--kills", type=int, default=6, help="SIGKILLs per run")
    p.add_argument("--server_kills", type=int, default=2, help="of them on the server")
    p.add_argument(
        "--until_version", type=int, default=2000,
        help="server version the runs end at (accuracy levels off by ~1500)",
    )  # fmt: skip
    p.add_argument(
        "--hold", type=float, default=30.0,
        help="seconds a (re)started server holds its start for all 4 workers "
        "(0: none)",
    )  # fmt: skip
    p.add_argument(
        "--eval_every", type=float, help="seconds between evaluations (the curve)"
    )
    p.add_argument(
        "--run_timeout", "--timeout", dest="run_timeout", type=float, default=600.0,
        action=_cli.Renamed, metavar="SECONDS",
        help="wall seconds each run may take before it is stopped (the "
        "launcher's --run_timeout); formerly --timeout",
    )  # fmt: skip
    args = p.parse_args(argv)
    with _cli.usage_errors("experiments.chaos"):
        if not args.seeds:
            raise ValueError("--seeds: give at least one seed")
        check_int("--kills", args.kills, low=0)
        check_int("--server_kills", args.server_kills, low=0, high=args.kills)
        check_int("--until_version", args.until_version, low=1)
        check_number("--hold", args.hold, low=0)
        check_number(
            "--eval_every", args.eval_every, low=0, low_inclusive=False,
            allow_none=True,
        )  # fmt: skip
        check_number("--run_timeout", args.run_timeout, low=0, low_inclusive=False)
    seeds = args.seeds
    rows = []
    for seed in seeds:
        for kills in (0, args.kills):
            name = f"seed{seed}_{'chaos' if kills else 'calm'}"
            pathlib.Path(args.workdir).mkdir(parents=True, exist_ok=True)
            with open(pathlib.Path(args.workdir, f"{name}.log"), "w") as log:
                r = run(
                    pathlib.Path(args.workdir, name),
                    seed,
                    until_version=args.until_version,
                    kills=kills,
                    server_kills=args.server_kills,
                    hold=args.hold,
                    eval_every=args.eval_every,
                    timeout=args.run_timeout,
                    log=log,
                )
            rows.append(r)
            print(json.dumps(dataclasses.asdict(r)), flush=True)
    calm = [r.accuracy for r in rows if not r.disturbed and r.accuracy is not None]
    noise = max(calm) - min(calm) if len(calm) > 1 else 0.0
    ok = True
    for seed in seeds:
        a, b = [r for r in rows if r.seed == seed]
        fine = (
            b.reason == "completed"
            and a.accuracy is not None
            and b.accuracy is not None
            and abs(a.accuracy - b.accuracy) <= noise
        )
        ok &= fine
        print(
            f"seed {seed}: undisturbed {a.accuracy} ({a.wall_s}s), disturbed "
            f"{b.accuracy} ({b.wall_s}s, {b.reason}), {len(b.kills)} kills "
            f"{[t for _, t in b.kills]}, worker restarts {list(b.worker_restarts)}, "
            f"server restarts {b.server_restarts}; within noise {noise:.4f}: {fine}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
