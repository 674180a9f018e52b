"""The ``processes`` backend: a real server in this process, one
``hpsjax-worker`` process per worker on loopback.

The workers are started and watched by :mod:`hpsjax.launch` (wall time); the
output is a :class:`~experiments.run_output.RunOutput`, as the simulator's, with
per-worker timelines read from the workers' round records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from experiments import build, registry
from experiments.configs.schema import ExperimentConfig
from experiments.run_output import (
    RunOutput,
    _advance,
    _evaluate,
    _progress_bar,
    _replanner,
)
from experiments.worker_flags import _job, _placements, _run_env, _worker_places
from hpsjax import telemetry
from hpsjax._config_flags import argv_of
from hpsjax.launch import DIVERGED
from hpsjax.worker import WorkerConfig
from hpsjax.worker._command import WorkerCommand

__all__ = ["measured_round", "run_processes"]


def _server(
    config: ExperimentConfig,
    setup: build.Setup,
    secret: bytes,
    policy: Any = "asp",
    core_kwargs: Mapping[str, Any] | None = None,
    policy_kwargs: Mapping[str, Any] | None = None,
    replanner: Any = None,
) -> Any:
    """A server of the run in this process, on loopback: the config's
    optimizer, holding the first pull until every worker joined."""
    from hpsjax.ps import Server

    return Server(
        setup.params,
        build.server_optimizer(config),
        policy,
        host="127.0.0.1",
        port=0,
        secret=secret,
        core_kwargs={
            **(core_kwargs or {}),
            "expected_workers": len(config.workers.slowdowns),
        },
        replanner=replanner,
        **(policy_kwargs or {}),
    )


@contextlib.contextmanager
def _serving_on_a_thread(make: Callable[[], Any], timeout: float) -> Any:
    """The server ``make()`` builds, serving on an event loop of a thread of
    its own while the block runs (for a pass of :mod:`hpsjax.launch` that
    watches its processes from this thread); yields it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="server", daemon=True)
    thread.start()

    async def start() -> Any:
        server = make()
        await server.start()
        return server

    try:
        server = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout)
        try:
            yield server
        finally:
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(timeout)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def _profile_in_place(
    config: ExperimentConfig,
    setup: build.Setup,
    workdir: pathlib.Path,
    env: Mapping[str, str],
    secret: bytes,
    secret_file: pathlib.Path,
) -> tuple[list[Any], float]:
    """The profiling pass in place, one profile per worker.

    :func:`hpsjax.launch.profile_in_place`: every worker is profiled in its
    own process with its own flags (slowdown, link, codec) and placement, all
    at once: its step is timed beside the others, under the run's contention,
    and its push and pull against a throwaway server of the model in this
    process, as the run's will be (the run's optimizer; ASP, holding the
    first pull until all joined), its injected link added. The
    pass is charged at what the slowest worker spends in it: its warm-up and
    timed steps, slowed, plus one round trip. Compiling is not charged, as no
    scheme's compiling is (the workers compile before the clock starts).
    The processes' output is in ``workers/profile.log``.
    """
    from hpsjax.launch import Console, LaunchError, profile_in_place

    logs = workdir / "workers"
    timeout = float(config.processes.start_timeout)
    sizes = sorted({int(b) for b in config.plan.profile_batch_sizes})
    repeats = int(config.plan.profile_repeats)
    log_path = logs / "profile.log"
    with (
        open(log_path, "w", encoding="utf-8") as log,
        _serving_on_a_thread(lambda: _server(config, setup, secret), timeout) as server,
    ):
        try:
            profiles = profile_in_place(
                _job(config, plan_file=None), logs, secret_file, None, Console(log),
                python=sys.executable, env=env, start_timeout=timeout,
                shutdown_timeout=float(config.processes.shutdown_timeout),
                places=_worker_places(config),
                profile_args=argv_of(
                    WorkerCommand,
                    profile_batch_sizes=",".join(map(str, sizes)),
                    profile_repeats=repeats,
                ),
                ports=[server.port],
            )  # fmt: skip
        except LaunchError as e:
            raise RuntimeError(f"{e}; see {log_path}") from None
    cost = max(
        sum((1 + repeats) * t for d in p.devices for t in d.step_times)
        + p.transfer_seconds
        for p in profiles
    )
    return profiles, cost


async def _watch(run: Any, end: float, done: Callable[[], bool] = lambda: False) -> str:
    """:meth:`hpsjax.launch.LocalRun.poll` until the workers end (why), ``done()``
    holds (``"done"``) or the monotonic time ``end`` passes (``"timeout"``),
    serving meanwhile."""
    while (reason := run.poll()) is None:
        if done():
            return "done"
        if time.monotonic() > end:
            return "timeout"
        await asyncio.sleep(0.02)
    return reason


async def _ended(workers: Sequence[Any], timeout: float) -> bool:
    """Waits up to ``timeout`` for every worker to exit; ``False`` if some
    are still running."""
    deadline = time.monotonic() + timeout
    while any(w.poll() is None for w in workers):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _serve_and_train(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    policy: Any,
    policy_kwargs: dict[str, Any],
    core_kwargs: dict[str, Any],
    plan_file: pathlib.Path | None,
    replan: bool,
    duration: float,
    offset: float,
    workdir: pathlib.Path,
    secret: bytes,
    secret_file: pathlib.Path,
    progress: bool,
) -> tuple[list[tuple[float, int, Any]], dict[str, Any]]:
    """Runs the server and the workers; returns parameter snapshots over time.

    The server is this process's, the workers a
    :class:`hpsjax.launch.LocalRun` against its port (their output in
    ``workers/run.log``). With ``replan``, the server re-plans from
    ``plan_file``'s plan; the revisions are in ``info["replans"]`` (run time
    since the workers started, without the profiling ``offset``).
    """
    from hpsjax.launch import Console, LocalRun

    logs = workdir / "workers"
    for stale in logs.glob("metrics_*.jsonl"):
        stale.unlink()
    env = _run_env(workdir)
    start_timeout = float(config.processes.start_timeout)
    if config.processes.warmup:
        await _warm_up(
            config,
            setup,
            plan_file,
            secret,
            secret_file,
            logs,
            env,
            server_args=(policy, core_kwargs, policy_kwargs),
        )
    replanned: list[tuple[float, Any]] = []
    replanner = None
    if replan:
        from hpsjax.profiling import WorkPlan

        replanner = _replanner(
            config,
            None if plan_file is None else WorkPlan.from_json(plan_file.read_text()),
            lambda now, revised: replanned.append((time.monotonic(), revised)),
        )
    server = _server(
        config, setup, secret, policy, core_kwargs, policy_kwargs, replanner
    )
    await server.start()
    log_path = logs / "run.log"
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115
    run = None
    info: dict[str, Any] = {}
    snapshots: list[tuple[float, int, Any]] = []
    bar = None
    try:
        shared = argv_of(WorkerConfig, max_seconds=start_timeout + duration)
        run = LocalRun(
            _job(config, plan_file=plan_file, shared=shared),
            Console(log), sys.executable, 0, start_timeout, env,
            _worker_places(config),
        )  # fmt: skip
        # The evaluation at t = 0 is of the parameters before any push: a fast
        # worker's first push can be applied before the loop below sees the
        # run start (ASP once evaluated version 1 there).
        initial = (server.core.version, server.core.params)
        run.start_workers(str(secret_file), logs, ports=[server.port])
        start_deadline = time.monotonic() + start_timeout
        while not server.core.started:
            reason = run.poll()
            if reason is not None:
                raise RuntimeError(f"{reason} before all joined; see {log_path}")
            if time.monotonic() > start_deadline:
                raise RuntimeError(
                    f"the workers did not all join within "
                    f"{config.processes.start_timeout}s; see {log_path}"
                )
            await asyncio.sleep(0.02)
        t0 = time.monotonic()
        bar = _progress_bar(progress, offset + duration, "s")
        every = float(config.eval.every_seconds)
        max_updates = config.max_updates
        snapshots.append((0.0, *initial))
        next_eval = every
        while True:
            elapsed = time.monotonic() - t0
            end = elapsed >= duration or (
                max_updates is not None and server.core.version >= max_updates
            )
            if elapsed >= next_eval or end:
                # Parameters are immutable arrays replaced at each update, so a
                # reference is a snapshot; evaluation waits until the end.
                snapshots.append(
                    (min(elapsed, duration), server.core.version, server.core.params)
                )
                next_eval += every
                if bar is not None:
                    _advance(bar, offset + min(elapsed, duration))
                    bar.set_postfix(v=server.core.version)
            if end:
                break
            reason = run.poll()
            if reason is not None:
                diverged = [
                    i for i, w in enumerate(run.workers) if w.poll() == DIVERGED
                ]
                if not diverged:
                    raise RuntimeError(f"{reason} before the end; see {log_path}")
                # The run ends here: the table says when, not a traceback.
                info["diverged"] = {"worker": diverged[0], "time": offset + elapsed}
                snapshots.append((elapsed, server.core.version, server.core.params))
                break
            await asyncio.sleep(min(0.02, max(0.0, next_eval - elapsed)))
        for worker in run.workers:
            if worker.poll() is None:
                worker.signal(signal.SIGTERM)
        if not await _ended(run.workers, float(config.processes.shutdown_timeout)):
            # Workers blocked on a barrier end when the server says goodbye.
            await server.close()
            await _ended(run.workers, 5.0)
        info["worker_returncodes"] = [w.poll() for w in run.workers]
        info["final_version"] = server.core.version
        info["replans"] = [
            {
                "time": max(0.0, at - t0),
                "revision": revised.revision,
                "predicted_round_s": revised.round_time,
                "workers": [
                    {
                        "worker": w.worker_id,
                        "batch_size": w.batch_size,
                        "step_time": w.step_time,
                        "transfer_seconds": w.transfer_seconds,
                    }
                    for w in revised.workers
                ],
            }
            for at, revised in replanned
        ]
    finally:
        if bar is not None:
            bar.close()
        if run is not None:
            run.stop(0.0)
        log.close()
        await server.close()
    failed = [
        (i, code)
        for i, code in enumerate(info["worker_returncodes"])
        if code not in (0, -signal.SIGTERM, DIVERGED)
    ]
    if failed:
        raise RuntimeError(
            f"worker {failed[0][0]} exited with status {failed[0][1]}; see "
            f"{log_path} (its lines are [worker {failed[0][0]}])"
        )
    return snapshots, info


async def _warm_up(
    config: ExperimentConfig,
    setup: build.Setup,
    plan_file: pathlib.Path | None,
    secret: bytes,
    secret_file: pathlib.Path,
    logs: pathlib.Path,
    env: Mapping[str, str],
    server_args: tuple[Any, dict[str, Any], dict[str, Any]],
) -> None:
    """Runs every worker for two rounds against a throwaway server.

    The workers compile their train step in the first round; with the
    persistent compilation cache in ``env``, the timed run then loads it instead
    of compiling while the clock runs. The throwaway server has the timed
    one's optimizer, policy (a name; an ASP stand-in for a stateful policy
    object) and core settings, and this process uses the same cache, so the
    timed server loads its compiled steps too (compiled on its first apply
    they held every worker's first round by 4 to 5 s on proc4). It ends when
    every worker has left the throwaway server; a process still tearing down
    its JAX runtime then is stopped rather than awaited. The workers'
    output is in ``workers/warmup.log``, their metrics in ``workers/warmup/``.
    """
    from hpsjax._compile_cache import CACHE_ENV, use_compile_cache
    from hpsjax.launch import Console, LocalRun

    policy, core_kwargs, policy_kwargs = server_args
    if not isinstance(policy, str):
        policy, policy_kwargs = "asp", {}
    before = os.environ.get(CACHE_ENV)
    use_compile_cache(env[CACHE_ENV])
    # The children have the cache in their own environment; this process's
    # later children (another run's) get theirs.
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before
    server = _server(config, setup, secret, policy, core_kwargs, policy_kwargs)
    await server.start()
    timeout = float(config.processes.start_timeout)
    log_path = logs / "warmup.log"
    (logs / "warmup").mkdir(exist_ok=True)
    run = None
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            run = LocalRun(
                _job(config, plan_file=plan_file, steps=2), Console(log),
                sys.executable, 0, timeout, env, _worker_places(config),
            )  # fmt: skip
            run.start_workers(str(secret_file), logs / "warmup", ports=[server.port])
            # Done when every worker has joined and left again: its rounds
            # are over and what it compiled is in the cache. A process that
            # used JAX then takes about a second to tear its runtime down,
            # which the timed run need not wait for: it is stopped below.
            reason = await _watch(
                run,
                time.monotonic() + timeout,
                lambda: server.core.started and not server.core.live,
            )
            reason = run.poll() or reason
            codes = [w.poll() for w in run.workers]
        finally:
            if run is not None:
                run.stop(0.0)
            await server.close()
    if reason == "timeout":
        raise RuntimeError(
            f"the warm-up workers did not finish within {timeout}s; see {log_path}"
        )
    # A warm-up only compiles: a run that diverges within its two rounds (a
    # step size far too large) says so in the timed run instead.
    if any(code not in (None, 0, DIVERGED) for code in codes):
        raise RuntimeError(f"a warm-up worker failed: {reason}; see {log_path}")


def _read_worker_records(path: pathlib.Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _worker_timeline(
    records: list[dict[str, Any]], offset: float
) -> tuple[dict[str, Any], list[tuple[float, float, str]]]:
    """Totals and a timeline from one worker's round records.

    A round computes from ``time`` to ``compute_end`` (compile, compute and the
    injected slowdown), then the worker is idle for ``wait_s`` until the
    parameters of the next round are there: the first ``link_delay_s`` of that
    is its link (transfer), the rest waiting for the server. Times are shifted so
    that the worker's first round starts at ``offset``: every worker is released
    at once when the last one joins, a few milliseconds before its first round.
    """
    rounds = [r for r in records if r.get("event") == "round"]
    totals = dict.fromkeys(
        ("compute_s", "compile_s", "transfer_s", "wait_s", "discarded_s"), 0.0
    )
    totals.update(bytes_sent=0, bytes_received=0, pushes=0, local_steps=0)
    spans: list[tuple[float, float, str]] = []
    if not rounds:
        return totals, spans
    shift = offset - float(rounds[0]["time"])
    for r in rounds:
        start = float(r["time"]) + shift
        busy = float(r["compute_end"]) + shift - start
        compile_s = min(max(float(r.get("compile_s") or 0.0), 0.0), busy)
        if compile_s > 0:
            spans.append((start, start + compile_s, "compile"))
            totals["compile_s"] += compile_s
        kind = "discarded" if r.get("discarded") else "compute"
        totals["discarded_s" if kind == "discarded" else "compute_s"] += (
            busy - compile_s
        )
        spans.append((start + compile_s, start + busy, kind))
        start += busy
        idle = max(float(r["wait_s"]), 0.0)
        link = min(idle, max(float(r.get("link_delay_s") or 0.0), 0.0))
        if link > 0:
            spans.append((start, start + link, "transfer"))
        if idle > link:
            spans.append((start + link, start + idle, "wait"))
        totals["transfer_s"] += link
        totals["wait_s"] += idle - link
        totals["local_steps"] += int(r.get("local_steps") or 0)
    for r in records:
        totals["bytes_sent"] += int(r.get("bytes_sent") or 0)
        totals["bytes_received"] += int(r.get("bytes_received") or 0)
        if r.get("status") is not None:
            totals["pushes"] += 1
    return totals, spans


def run_processes(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    workdir: pathlib.Path,
    progress: bool = True,
) -> RunOutput:
    """Runs ``config`` with a real server and one worker process per worker.

    The server (:class:`hpsjax.ps.Server`, so that any optax chain and policy
    object can be served) runs in this process on loopback; each worker is an
    ``hpsjax-worker`` process (``python -m hpsjax.cli.worker``) with its
    slowdown and link cap injected. The server holds every pull until all
    workers joined; time 0 is that moment. The parameters are snapshot every
    ``eval.every_seconds`` and evaluated on the test set after the run, so
    evaluation takes no time from training. After ``budget_seconds``, or once
    the server made ``max_updates`` versions (checked every 20 ms), the workers
    get SIGTERM, finish their round and push it.

    Schemes with a work plan are profiled first, in place (see
    :func:`_profile_in_place`); its cost is charged as in the simulator, and
    the plan's predicted round is reported beside the measured one
    (``info["predicted_round_s"]``, ``info["measured_round_s"]``). A worker
    that exits with the diverged status (:data:`hpsjax.launch.DIVERGED`)
    ends the run there (``info["diverged"]``: which worker, and when). With
    ``plan.replan`` the server re-plans as the workers' measured step times
    drift from the profile (a :class:`~hpsjax.profiling.Replanner` fed by every
    push, as ``hpsjax-server --work_plan`` does) and sends each worker its new
    batch; ASHL's stage switch is the server version.

    The workers are :mod:`hpsjax.launch`'s (:class:`~hpsjax.launch.LocalRun`,
    :func:`~hpsjax.launch.profile_in_place`): their command lines, process
    groups, exit-status rules and shutdown are a launch's; the server stays
    here for what no ``hpsjax-server`` flag carries (any optax chain, a
    policy object read after the run, parameter snapshots at the evaluation
    times).

    Outputs besides the returned ones, in ``workdir``: ``workers/run.log``
    (the workers' output, ``[worker i]`` lines; ``profile.log`` and
    ``warmup.log`` beside it for the passes before) and
    ``workers/metrics_<i>.jsonl`` (the workers' own round records).

    Returns:
      The :class:`RunOutput`; times are wall seconds.

    Raises:
      ValueError: a setting the processes backend cannot run.
      RuntimeError: a worker failed or did not join in time (its log is named).
    """
    if config.stages.enabled and config.stages.switch == "plateau":
        raise ValueError(
            "the processes backend switches ASHL's stages at a server version "
            "or on the server's training loss only; stages.switch='plateau' "
            "runs in the simulator"
        )
    info: dict[str, Any] = {"backend": "processes"}
    placements, server_cores, notes = _placements(config)
    if placements is not None:
        info["placement"] = [p.describe() for p in placements]
        info["server_cores"] = list(server_cores)
        info["placement_notes"] = notes
        for note in notes:
            logging.warning("workers.devices: %s", note)
    affinity = os.sched_getaffinity(0)
    if server_cores:
        # The server runs on this process's main thread.
        os.sched_setaffinity(0, server_cores)
    try:
        return _run_processes(
            config, setup, workdir=workdir, progress=progress, info=info
        )
    finally:
        if server_cores:
            os.sched_setaffinity(0, affinity)


def _run_processes(
    config: ExperimentConfig,
    setup: build.Setup,
    *,
    workdir: pathlib.Path,
    progress: bool,
    info: dict[str, Any],
) -> RunOutput:
    """:func:`run_processes` once the server's cores are set."""
    from hpsjax.launch import write_secret

    plan_scheme = registry.lookup("plan scheme", config.plan.scheme)
    offset = 0.0
    plan_file = None
    stage_plans: list[Any] = []
    plans: list[Any] = []
    (workdir / "workers").mkdir(parents=True, exist_ok=True)
    secret, secret_file = write_secret(workdir)
    pilot = plan_scheme != "none" and bool(config.plan.pilot)
    if pilot:
        info["pilot"] = True
    elif plan_scheme != "none":
        profiles, offset = _profile_in_place(
            config, setup, workdir, _run_env(workdir), secret, secret_file
        )
        info["profile_seconds"] = offset
        first, stage_plans = build.plans(config, profiles)
        plans = [first]
        plan_file = workdir / "plan.json"
        plan_file.write_text(plans[0].to_json())
        info["plans"] = [build.plan_to_dict(p) for p in plans]
        if stage_plans:
            info["stage_plans"] = [build.plan_to_dict(p) for p in stage_plans]
    duration = float(config.budget_seconds) - offset
    if duration <= 0:
        raise ValueError(
            f"the profiling pass takes {offset:.3g}s of the "
            f"{config.budget_seconds}s budget; raise budget_seconds"
        )
    policy, policy_kwargs = build.policy(config, stage_plans)
    wall = time.perf_counter()
    coroutine = _serve_and_train(
        config,
        setup,
        policy=policy,
        policy_kwargs=policy_kwargs,
        core_kwargs=build.core_kwargs(config, plans[0] if plans else None),
        plan_file=plan_file,
        replan=pilot or (bool(plans) and bool(config.plan.replan)),
        duration=duration,
        offset=offset,
        workdir=workdir,
        secret=secret,
        secret_file=secret_file,
        progress=progress,
    )
    try:
        import uvloop

        snapshots, run_info = uvloop.run(coroutine)
    except ImportError:
        snapshots, run_info = asyncio.run(coroutine)
    info.update(run_info)
    info["wall_seconds"] = time.perf_counter() - wall
    if config.stages.enabled:
        info["final_stage"] = int(policy.stage)
        info["switched_at"] = getattr(policy, "switched_at", None)

    evals, seen = [], {}
    for t, version, params in snapshots:
        if version not in seen:
            seen[version] = _evaluate(setup, params, int(config.eval.batch_size))
        evals.append({"time": offset + t, "version": version, **seen[version]})

    workers, timelines, records = {}, {}, []
    for i in range(len(config.workers.slowdowns)):
        own = _read_worker_records(workdir / "workers" / f"metrics_{i}.jsonl")
        totals, spans = _worker_timeline(own, offset)
        total = offset + sum(
            totals[k]
            for k in ("compute_s", "compile_s", "transfer_s", "wait_s", "discarded_s")
        )
        totals["profile_s"] = offset
        totals["idle_fraction"] = 0.0 if total <= 0 else 1 - totals["compute_s"] / total
        # Idle for neither the wire nor the server, from the round telemetry.
        totals["other_idle_fraction"] = telemetry.idle_fraction(
            [{**r, "worker": i} for r in own if r.get("event") == "round"]
        ).get(str(i))
        workers[i] = totals
        timelines[i] = ([(0.0, offset, "profile")] if offset > 0 else []) + spans
        records.extend({**r, "worker": i} for r in own)
    records.extend(
        {"event": "replan", **r, "time": offset + r["time"]}
        for r in info.pop("replans", [])
    )
    info["num_updates"] = run_info["final_version"]
    if pilot:
        _pilot_rounds(info, records)
    if plans:
        info["predicted_round_s"] = plans[0].round_time
        own = [
            _read_worker_records(workdir / "workers" / f"metrics_{i}.jsonl")
            for i in range(len(config.workers.slowdowns))
        ]
        info["measured_round_s"] = measured_round(own)
        # The plan predicts the expected round (a barrier's expected slowest
        # worker), which the mean, not the median, measures.
        info["measured_mean_round_s"] = measured_round(own, statistic="mean")
    return RunOutput(evals, workers, timelines, records, info)


def _pilot_rounds(info: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """A piloted run's plan against its rounds: the last revision's predicted
    round, and the mean measured round of the rounds that started after it at
    each worker's batch of the plan (its last; before it, the new batch's
    step compiles beside rounds at the old one), each worker's first two there
    left out, as the pilot does."""
    revisions = [r for r in records if r.get("event") == "replan"]
    if not revisions:
        return
    last = revisions[-1]
    info["predicted_round_s"] = last["predicted_round_s"]
    info["pilot_seconds"] = last["time"]
    after: dict[Any, list[tuple[Any, float]]] = {}
    for r in records:
        if r.get("event") == "round" and float(r.get("time", 0.0)) >= last["time"]:
            batch = (r.get("batch_size"), float(r["round_s"]))
            after.setdefault(r["worker"], []).append(batch)
    kept = [
        t
        for rounds in after.values()
        for t in [t for b, t in rounds if b == rounds[-1][0]][2:]
    ]
    if kept:
        info["measured_mean_round_s"] = sum(kept) / len(kept)


def measured_round(
    records: list[list[dict[str, Any]]], skip: int = 3, statistic: str = "median"
) -> float | None:
    """The median (or ``statistic="mean"``) seconds from one round's start to
    the next, over every worker's rounds after its first ``skip`` (compiles,
    joining), or ``None`` when there are none."""
    if statistic not in ("median", "mean"):
        raise ValueError(f"statistic must be 'median' or 'mean', got {statistic!r}")
    gaps = []
    for own in records:
        starts = [float(r["time"]) for r in own if r.get("event") == "round"]
        gaps += np.diff(starts[skip:]).tolist()
    if not gaps:
        return None
    return float(np.median(gaps) if statistic == "median" else np.mean(gaps))
