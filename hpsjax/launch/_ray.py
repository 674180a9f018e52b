"""Ray launch backend: the server shard(s) and the workers as Ray actors.

``hpsjax-launch --backend ray`` (or :func:`launch_ray`) runs the same job as the
local launcher (:func:`hpsjax.launch.launch`: the same flags, plans and server
shards), but Ray places every process: each server shard and each worker is an
actor with its own resource request (CPUs, GPUs, memory, custom resources such
as ``accelerator_type:A100``), on a local cluster or on one started with
``ray start``. Each actor owns one ``hpsjax-server`` or ``hpsjax-worker``
process, in its own process group, and relays its output to the launcher, which
prints it with the usual ``[server]`` / ``[worker i]`` prefix.

- **The secret** travels through Ray's object store as an actor argument and is
  written to a 0600 file in the actor's own 0700 directory: it is never on a
  command line (``ps``) nor in a log.
- **A crashed worker** (its process killed or failed) ends its actor, which Ray
  restarts (``max_restarts``) on whatever node has the resources; the new
  process starts with the same ``--worker_id`` and rejoins the server. Bad flags
  (exit status 2) are not retried.
- **Stopping**: when every worker finished, the servers get SIGTERM (a final
  checkpoint), then everything is stopped; when a server exits, a worker fails
  for good, the time limit passes, or on Ctrl-C (SIGTERM), every process group
  gets SIGTERM, then SIGKILL, and every actor is killed. Each process is also
  tied to its actor's life (``PR_SET_PDEATHSIG``), and Ray ends a launcher's
  actors when the launcher ends, so no process outlives the launch. A cluster
  the launcher started is shut down.

The work plan (``plan``) is profiled where the workers run: each worker's
profiling process is an actor with that worker's resource request, timed
against a throwaway server actor placed as the run's server is, so a plan for
unequal nodes sees each node's own devices and link (never the launcher's
host). Workers' metrics are streamed back into ``workdir`` as
``metrics_<i>.jsonl``, whatever node the worker ran on (a restarted worker's
rounds are appended), and the server's final parameters (its
``--export_params FILE``, which ``hpsjax-launch`` adds without ``--workdir``
as the local backend does) come back into ``FILE`` on the launcher's host when
the server stops. A resource request that no node of the cluster could ever
hold (more GPUs or CPUs than any node has, a custom resource none offers) is
refused at once, before anything is placed or prepared.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

from hpsjax import profiling
from hpsjax._checks import check_number
from hpsjax._config_flags import argv_of
from hpsjax.launch._actor import ACTOR_DIR, NODE_IP, ProcessActor
from hpsjax.launch._job import (
    Console,
    Job,
    LaunchError,
    LaunchResult,
    PerWorkerArgs,
    end_launch,
    final_reason,
    launch_returncode,
    worker_ended,
)
from hpsjax.launch._monitor import Monitor
from hpsjax.launch._prepare import (
    check_launch,
    prepare_workdir,
    profiling_job,
    run_cache_env,
    run_env,
    with_plan,
    write_plan,
)
from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand

__all__ = ["launch_ray", "parse_resources", "worker_resources_from_flags"]

Resources = Mapping[str, float]
PerWorkerResources = Mapping[int, Resources] | Sequence[Resources]

# Resource names that are Ray actor options; every other name is a custom
# resource (``accelerator_type:A100``, ``TPU``, a label of the cluster's own).
_OPTION_RESOURCES = ("num_cpus", "num_gpus", "memory")
_DEFAULT_RESOURCES = {"num_cpus": 1.0}
# The names Ray's nodes give the actor options' resources.
_NODE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
# The server's final parameters (--export_params), in its actor's directory.
_EXPORTED = "params.npz"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:\-/]*")


def parse_resources(text: str) -> dict[str, float]:
    """Parses ``"num_gpus=1,accelerator_type:A100=0.5"`` into a resource dict.

    Names are ``num_cpus``, ``num_gpus``, ``memory`` (bytes) or any custom
    resource of the cluster; amounts are numbers >= 0.

    Raises:
      ValueError: a one-line message naming the bad entry.

    Examples:
      >>> parse_resources("num_cpus=2,accelerator_type:A100=1")
      {'num_cpus': 2.0, 'accelerator_type:A100': 1.0}
    """
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, amount = item.strip().rpartition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise ValueError(f"expected NAME=AMOUNT in resources, got {item!r}")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"resource {name} needs an amount >= 0, got {amount!r}")
        if name in out:
            raise ValueError(f"resource {name} given twice in {text!r}")
        out[name] = value
    return out


def worker_resources_from_flags(
    entries: Sequence[tuple[str, str]], num_workers: int
) -> list[dict[str, float]]:
    """Per-worker resources from ``--worker_resources INDEX RESOURCES`` flags.

    ``INDEX`` is a worker index or ``all``; entries for one worker are merged
    over those for ``all``, later ones over earlier ones.

    Raises:
      ValueError: a one-line message naming the bad entry.

    Examples:
      >>> worker_resources_from_flags(
      ...     [("all", "num_cpus=2"), ("1", "num_gpus=1")], 2)
      [{'num_cpus': 2.0}, {'num_cpus': 2.0, 'num_gpus': 1.0}]
    """
    everyone: dict[str, float] = {}
    own: list[dict[str, float]] = [{} for _ in range(num_workers)]
    for index, text in entries:
        resources = parse_resources(text)
        if index == "all":
            everyone.update(resources)
        elif index.isdigit() and int(index) < num_workers:
            own[int(index)].update(resources)
        else:
            raise ValueError(
                f"--worker_resources index must be 'all' or 0..{num_workers - 1}, "
                f"got {index!r}"
            )
    return [{**everyone, **mine} for mine in own]


def _checked(resources: Resources, what: str) -> dict[str, float]:
    if not isinstance(resources, Mapping):
        raise LaunchError(
            f"{what} must be a mapping of resource names to amounts, got {resources!r}"
        )
    out = {}
    for name, amount in resources.items():
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise LaunchError(f"{what}: bad resource name {name!r}")
        try:
            out[name] = check_number(f"{what}: {name}", amount, low=0)
        except ValueError as e:
            raise LaunchError(str(e)) from None
    return {**_DEFAULT_RESOURCES, **out}


def _per_worker_resources(
    resources: PerWorkerResources | None, num_workers: int
) -> list[dict[str, float]]:
    out = [dict(_DEFAULT_RESOURCES) for _ in range(num_workers)]
    if resources is None:
        return out
    items = (
        resources.items() if isinstance(resources, Mapping) else enumerate(resources)
    )
    for index, entry in items:
        if not (isinstance(index, int) and 0 <= index < num_workers):
            raise LaunchError(
                f"resources for worker {index!r}, not in 0..{num_workers - 1}"
            )
        out[index] = _checked(entry, f"worker {index}'s resources")
    return out


def _actor_options(resources: Mapping[str, float]) -> dict[str, Any]:
    options: dict[str, Any] = {
        k: v for k, v in resources.items() if k in _OPTION_RESOURCES
    }
    if "memory" in options:
        options["memory"] = int(options["memory"])
    custom = {k: v for k, v in resources.items() if k not in _OPTION_RESOURCES}
    if custom:
        options["resources"] = custom
    return options


@dataclasses.dataclass
class _Member:
    """The launcher's view of one actor and the process it owns."""

    name: str
    actor: Any
    emit: Callable[[str], None]
    metrics: pathlib.Path | None = None
    pending: Any = None
    pids: list[int] = dataclasses.field(default_factory=list)
    returncode: int | None = None
    crashed: bool = False
    port: int | None = None
    host: str | None = None
    restarts: int = 0
    died: str | None = None
    # Files the process wrote that its actor's last answer brought back.
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def take(self, state: Mapping[str, Any]) -> None:
        for file_name, data in state.get("files", {}).items():
            if data is not None:
                self.files[file_name] = data
        for line in state["lines"]:
            self.emit(f"[{self.name}] {line}")
        if state["metrics"] and self.metrics is not None:
            with self.metrics.open("ab") as f:
                f.write(state["metrics"])
        if state["pid"] not in self.pids:
            if self.pids:
                self.restarts += 1
                self.emit(
                    f"[launch] {self.name} restarted by Ray "
                    f"(restart {self.restarts}, pid {state['pid']})"
                )
            self.pids.append(state["pid"])
        self.crashed = state["crashed"]
        self.returncode = state["returncode"]
        self.host, self.port = state["host"], state["port"]


def _poll_all(members: Sequence[_Member], wait: float) -> None:
    """Collects every member's state that arrives within ``wait`` seconds."""
    import ray

    for m in members:
        if m.pending is None and m.died is None:
            m.pending = m.actor.poll.remote()
    pending = [m.pending for m in members if m.pending is not None]
    if not pending:
        return
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=wait)
    ready_set = set(ready)
    for m in members:
        if m.pending is None or m.pending not in ready_set:
            continue
        ref, m.pending = m.pending, None
        try:
            m.take(ray.get(ref))
        except ray.exceptions.RayActorError as e:
            m.died = str(e).splitlines()[0] if str(e) else type(e).__name__


def _stop_all(members: Sequence[_Member], timeout: float) -> None:
    """Stops every member's process (in parallel), then kills the actors.

    A member whose first poll has not come back yet may still own a process
    (its actor was placed late): it is asked to stop too, and given a few
    seconds to answer; one never placed cannot answer, and killing its actor
    is enough.
    """
    import ray

    known, unknown = {}, {}
    for m in members:
        if m.died is None:
            (known if m.pids else unknown)[
                m.actor.stop.remote(timeout, (_EXPORTED,))
            ] = m
    refs = {**known, **unknown}
    ready = []
    if known:
        ready, _ = ray.wait(
            list(known), num_returns=len(known), timeout=2 * timeout + 5
        )
    if unknown:
        more, _ = ray.wait(list(unknown), num_returns=len(unknown), timeout=3.0)
        ready += more
    for ref in ready:
        with contextlib.suppress(ray.exceptions.RayError):
            refs[ref].take(ray.get(ref))
    for m in members:
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(m.actor, no_restart=True)


def _connect(
    ray_address: str | None, cpus_needed: float, runtime_env: Mapping | None
) -> bool:
    """Joins (or starts) a Ray cluster; returns whether this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    if ray_address is None:
        # A local cluster, as the local launcher: oversubscribe this machine's
        # cores rather than leave a worker unplaced.
        ray.init(
            num_cpus=max(os.cpu_count() or 1, int(cpus_needed + 0.999)),
            include_dashboard=False,
            runtime_env=runtime_env,
        )
    else:
        ray.init(address=ray_address, runtime_env=runtime_env)
    return True


def _infeasible(
    requests: Mapping[str, Mapping[str, float]], nodes: Sequence[Mapping[str, Any]]
) -> str | None:
    """Why the first of ``requests`` (by what asks) can never be placed on
    ``nodes`` (``ray.nodes()``): no live node has all it asks for, even idle;
    ``None`` when every request fits some node."""
    totals = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    for what, request in requests.items():
        wanted = {_NODE_NAMES.get(k, k): v for k, v in request.items() if v > 0}
        if any(all(t.get(k, 0) >= v for k, v in wanted.items()) for t in totals):
            continue
        most = {
            name: max([t.get(_NODE_NAMES.get(name, name), 0) for t in totals] or [0])
            for name in request
        }
        return (
            f"{what} asks for {dict(request)}, more than any node of the Ray "
            f"cluster has (the most one node has: {most})"
        )
    return None


def _refuse_infeasible(
    server_request: dict[str, float],
    server_shards: int,
    resources: Sequence[dict[str, float]],
) -> None:
    """Raises :class:`LaunchError` (:func:`_infeasible`'s line) for a server
    shard's or a worker's request that no node of the cluster could hold."""
    import ray

    requests = {
        **{f"server shard {i}": server_request for i in range(server_shards)},
        **{f"worker {i}": r for i, r in enumerate(resources)},
    }
    refusal = _infeasible(requests, ray.nodes())
    if refusal is not None:
        raise LaunchError(refusal)


def _export_in_actor(job: Job) -> tuple[Job, pathlib.Path | None]:
    """``job`` with the server's ``--export_params FILE`` (a file on the
    launcher's host, as with the local backend) written into its actor's
    directory instead, and that ``FILE`` (``None`` where there is none)."""
    args, path = list(job.server_args), None
    for i, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name != "--export_params":
            continue
        if not equals:
            value = args[i + 1] if i + 1 < len(args) else ""
            del args[i + 1 : i + 2]
        inside = argv_of(ServerOptions, export_params=f"{ACTOR_DIR}/{_EXPORTED}")
        args[i : i + 1] = inside
        path = pathlib.Path(value)
        break
    return dataclasses.replace(job, server_args=args), path


def _bring_back(server: Any, path: pathlib.Path | None) -> None:
    """Writes the final parameters the server's actor brought back to
    ``path`` (whole or not at all); nothing when it wrote none."""
    data = None if server is None else server.files.get(_EXPORTED)
    if path is None or data is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def launch_ray(
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
    workdir: str | os.PathLike | None = None,
    compile_cache: str | os.PathLike | None = None,
    timeout: float | None = None,
    start_timeout: float = 120.0,
    shutdown_timeout: float = 10.0,
    progress: bool = True,
    log: TextIO | None = None,
    ray_address: str | None = None,
    worker_resources: PerWorkerResources | None = None,
    server_resources: Resources | None = None,
    max_restarts: int = 3,
    runtime_env: Mapping[str, Any] | None = None,
) -> LaunchResult:
    """Runs a server and ``num_workers`` workers to completion as Ray actors.

    Takes every argument of :func:`hpsjax.launch.launch` (but ``python``: each
    node runs its own interpreter, where hpsjax must be installed), and:
    the profiling pass (``plan``) runs on Ray, each worker's profiling process
    placed with that worker's resources and all at once against a throwaway
    server placed with ``server_resources``; every actor's process gets the run's
    compilation cache (``compile_cache``, by default ``jax_cache`` in
    ``workdir``: a path each node creates for itself where it has no shared
    file system).

    Args:
      ray_address: the cluster to join (``"auto"``, ``"ray://host:10001"``,
        ``"host:6379"``); ``None`` starts a local one, shut down at the end.
        When Ray is already initialised in this process, that cluster is used
        and left running.
      worker_resources: each worker's resource request, by index (a mapping or
        a list of dicts), e.g. ``{0: {"num_gpus": 1}, 1:
        {"accelerator_type:A100": 0.5}}``; ``num_cpus`` is 1 unless given.
      server_resources: each server shard's resource request (``num_cpus`` 1
        unless given).
      max_restarts: how often Ray restarts a worker whose process crashed;
        0 ends the run at the first crash, as the local launcher does.
      runtime_env: Ray's runtime environment for the actors (``env_vars``,
        ``pip``, ...), ``None`` for the cluster's.

    Returns:
      A :class:`hpsjax.launch.LaunchResult` (``pids`` are every process started,
      restarted ones included, on whatever node they ran).

    Raises:
      LaunchError: bad arguments or resources, or a server that was not placed
        or did not listen within ``start_timeout`` (everything started is
        stopped first).
      KeyboardInterrupt: after a clean shutdown, when interrupted.
    """
    if workdir is None:
        arguments = dict(locals())
        with tempfile.TemporaryDirectory(prefix="hpsjax-launch-") as tmp:
            return launch_ray(**{**arguments, "workdir": tmp})
    flags, shared = check_launch(
        num_workers, steps=steps, worker_args=worker_args,
        per_worker_args=per_worker_args, server_args=server_args, timeout=timeout,
        plan=plan, replan=replan, server_shards=server_shards,
        split_leaves=split_leaves, max_restarts=max_restarts, policy=policy,
    )  # fmt: skip
    resources = _per_worker_resources(worker_resources, num_workers)
    server_request = _checked(server_resources or {}, "server_resources")
    try:
        import ray
    except ImportError:
        raise LaunchError(
            "the Ray backend needs ray: pip install 'hpsjax[ray]'"
        ) from None

    console = Console(log)
    start = time.monotonic()
    work = pathlib.Path(workdir)
    cpus = server_request.get("num_cpus", 0) * server_shards + sum(
        r.get("num_cpus", 0) for r in resources
    )
    started_ray = _connect_keeping_sigterm(ray_address, cpus, runtime_env)
    try:
        _refuse_infeasible(server_request, server_shards, resources)
        work.mkdir(parents=True, exist_ok=True)
        env = run_env(work, compile_cache)
        job, exported = _export_in_actor(Job(
            num_workers, policy, steps, [str(a) for a in server_args], shared,
            flags, [], server_shards, split_leaves,
        ))  # fmt: skip
        secret, _, init, job, _ = prepare_workdir(
            work, job, None, None, global_batch, console, python=sys.executable,
            env=env, start_timeout=start_timeout, shutdown_timeout=shutdown_timeout,
        )  # fmt: skip
    except BaseException:
        if started_ray:
            ray.shutdown()
        raise
    actor_env = run_cache_env(work, compile_cache)
    run = _RayRun(job, console, {}, max_restarts, start_timeout, actor_env)
    profile_seconds = None
    reason = "completed"
    try:
        if plan is not None:
            profiles, profile_seconds = _profile_on_ray(
                profiling_job(job), _actor_files(work, secret, init, False)[0],
                console, resources, server_request, start_timeout,
                shutdown_timeout, actor_env, work,
            )  # fmt: skip
            plan_file = write_plan(
                plan, profiles, job, work, global_batch, console,
                profile_seconds, where="on their Ray nodes",
            )  # fmt: skip
            job = with_plan(job, plan_file, replan)
        files, local = _actor_files(work, secret, init, plan is not None)
        run.files = files
        run.job = job = dataclasses.replace(
            job,
            shared=local(job.shared),
            flags=[local(f) for f in job.flags],
            plan_server_args=local(job.plan_server_args),
        )
        run.start_servers(server_request)
        run.start_workers(resources, work)
        run.monitor = Monitor(run.servers[0].port, secret, host=run.servers[0].host)
        console.start_bar(progress, job)
        reason = run.watch(resources, None if timeout is None else start + timeout)
    except KeyboardInterrupt:
        reason = "interrupted"
        raise
    except BaseException as e:
        reason = f"launcher error: {e}"
        raise
    finally:

        def stop_all() -> None:
            _stop_all(run.members, shutdown_timeout)
            if started_ray:
                ray.shutdown()

        end_launch(
            reason,
            console,
            run.monitor,
            lambda: _stop_all(run.servers, shutdown_timeout),
            stop_all,
        )
    servers, workers = run.servers, run.workers
    _bring_back(servers[0] if servers else None, exported)
    server_codes = tuple(s.returncode for s in servers)
    reason = final_reason(reason, [s.name for s in servers], server_codes)
    console.emit(
        f"[launch] {reason} in {time.monotonic() - start:.1f}s; workdir {work}"
    )
    return LaunchResult(
        returncode=launch_returncode(reason),
        reason=reason,
        server_returncode=server_codes[0] if server_codes else None,
        worker_returncodes=tuple(w.returncode for w in workers),
        pids=tuple(pid for m in run.members for pid in m.pids),
        port=servers[0].port if servers else None,
        workdir=str(work),
        version=None if run.monitor is None else run.monitor.version,
        elapsed=time.monotonic() - start,
        profile_seconds=profile_seconds,
        ports=tuple(s.port for s in servers),
        server_returncodes=server_codes,
    )


def _actor_files(
    work: pathlib.Path, secret: bytes, init: pathlib.Path, planned: bool
) -> tuple[dict[str, bytes], Callable[[Sequence[str]], list[str]]]:
    """The files every actor writes into its own directory, and what turns
    paths into the work directory into paths into that one."""
    files = {"secret.txt": secret, "init.npz": init.read_bytes()}
    plan_file = work / "plan.json"
    if planned:
        files["plan.json"] = plan_file.read_bytes()

    def local(args: Sequence[str]) -> list[str]:
        return [
            f"{ACTOR_DIR}/plan.json" if a == str(plan_file) else str(a) for a in args
        ]

    return files, local


def _profile_on_ray(
    probe: Job,
    files: dict[str, bytes],
    console: Console,
    resources: Sequence[dict[str, float]],
    server_request: dict[str, float],
    start_timeout: float,
    shutdown_timeout: float,
    env: Mapping[str, str],
    work: pathlib.Path,
) -> tuple[list[profiling.WorkerProfile], float]:
    """Profiles every worker of ``probe`` (:func:`profiling_job`) where it runs.

    A throwaway server actor (``server_request``) and one profiling actor per
    worker (its own ``resources``), all at once; worker ``i``'s profile comes
    back from its actor into ``work/profile_<i>.json``. Returns the profiles
    and the pass's seconds.

    Raises:
      LaunchError: a profiling process failed or was not placed, or the pass
        did not end within ``start_timeout`` (everything it started is stopped).
    """
    import ray

    start = time.monotonic()
    prober = _RayRun(probe, console, files, 0, start_timeout, env, prefix="profile ")
    try:
        prober.start_servers(server_request)
        where = probe.where([(s.host, s.port) for s in prober.servers])
        for i in range(probe.num_workers):
            argv = [
                *probe.worker(
                    i, [], where, f"{ACTOR_DIR}/secret.txt", None,
                    module="hpsjax.profiling.in_place",
                ),
                *argv_of(WorkerCommand, profile_out=f"{ACTOR_DIR}/profile.json"),
            ]  # fmt: skip
            name = f"profile {i}"
            actor = prober.actor_class.options(
                **_actor_options(resources[i]), max_restarts=0
            ).remote(name, argv, files, False, prober.cwd, env)
            prober.workers.append(_Member(name, actor, console.emit))
        prober.members.extend(prober.workers)
        _wait_for_profilers(prober.workers, resources, start + start_timeout)
        blobs = ray.get([w.actor.read.remote("profile.json") for w in prober.workers])
    finally:
        _stop_all(prober.members, shutdown_timeout)
    profiles = []
    for i, blob in enumerate(blobs):
        if blob is None:
            raise LaunchError(f"profiling worker {i} wrote no profile")
        (work / f"profile_{i}.json").write_bytes(blob)
        profiles.append(profiling.WorkerProfile.from_json(blob.decode()))
    return profiles, time.monotonic() - start


def _wait_for_profilers(
    profilers: Sequence[_Member], resources: Sequence[dict[str, float]], end: float
) -> None:
    """Waits until every profiling process ended well.

    Raises:
      LaunchError: one failed, died, or had not ended (or been placed) by ``end``.
    """
    import ray

    while not all(p.returncode == 0 for p in profilers):
        _poll_all(profilers, 0.2)
        for i, p in enumerate(profilers):
            if p.died is not None or p.returncode not in (None, 0):
                what = p.died or f"status {p.returncode}"
                raise LaunchError(
                    f"profiling worker {i} failed ({what}; its lines are above)"
                )
        if time.monotonic() > end:
            unplaced = [i for i, p in enumerate(profilers) if not p.pids]
            if unplaced:
                i = unplaced[0]
                raise LaunchError(
                    f"profiling worker {i} was not placed (it asks for "
                    f"{resources[i]}; the cluster has {ray.available_resources()})"
                )
            raise LaunchError("the profiling pass did not end within its start_timeout")


def _connect_keeping_sigterm(
    ray_address: str | None, cpus_needed: float, runtime_env: Mapping | None
) -> bool:
    """:func:`_connect`, keeping the caller's SIGTERM handler."""
    on_sigterm = signal.getsignal(signal.SIGTERM)
    started_ray = _connect(ray_address, cpus_needed, runtime_env)
    if callable(on_sigterm) and threading.current_thread() is threading.main_thread():
        # ray.init replaces the caller's SIGTERM handler (hpsjax-launch's
        # stops the run like Ctrl-C): it is put back.
        signal.signal(signal.SIGTERM, on_sigterm)
    return started_ray


class _RayRun:
    """The Ray backend's actors: placed, watched."""

    def __init__(
        self,
        job: Job,
        console: Console,
        files: dict[str, bytes],
        max_restarts: int,
        start_timeout: float,
        env: Mapping[str, str] | None = None,
        prefix: str = "",
    ):
        import ray

        self.prefix = prefix
        self.env = dict(env or {})
        self.started: float | None = None
        self.job = job
        self.console = console
        self.files = files
        self.max_restarts = max_restarts
        self.start_timeout = start_timeout
        self.actor_class = ray.remote(ProcessActor)
        self.cwd = os.getcwd()
        self.members: list[_Member] = []
        self.servers: list[_Member] = []
        self.workers: list[_Member] = []
        self.monitor: Monitor | None = None

    def start_servers(self, request: dict[str, float]) -> None:
        """Starts the server shards and waits until they listen.

        Raises:
          LaunchError: a shard ended, or was not placed or did not listen
            within ``start_timeout``.
        """
        import ray

        for shard in range(self.job.server_shards):
            name, argv = self.job.server(
                shard,
                [],
                f"{ACTOR_DIR}/init.npz",
                f"{ACTOR_DIR}/secret.txt",
                NODE_IP,
            )
            name = self.prefix + name
            actor = self.actor_class.options(
                **_actor_options(request), max_restarts=0
            ).remote(name, argv, self.files, False, self.cwd, self.env)
            self.servers.append(_Member(name, actor, self.console.emit))
        self.members.extend(self.servers)
        servers = self.servers
        deadline = time.monotonic() + self.start_timeout
        while not all(s.port is not None for s in servers):
            _poll_all(servers, 0.2)
            failed = [s for s in servers if s.died or s.returncode is not None]
            if failed:
                s = failed[0]
                what = s.died or f"exited with status {s.returncode}"
                raise LaunchError(f"the {s.name} {what}")
            if time.monotonic() > deadline:
                unplaced = [s.name for s in servers if not s.pids]
                where = (
                    f"was not placed (it asks for {request}; the cluster "
                    f"has {ray.available_resources()})"
                    if unplaced
                    else "did not listen"
                )
                raise LaunchError(
                    f"the {(unplaced or [servers[0].name])[0]} {where} "
                    f"within {self.start_timeout}s"
                )

    def start_workers(
        self, resources: Sequence[dict[str, float]], work: pathlib.Path
    ) -> None:
        job = self.job
        addresses = [(s.host, s.port) for s in self.servers]
        where = job.where(addresses)
        self.started = time.monotonic()
        self.console.emit(
            f"[launch] server{'s' if job.server_shards > 1 else ''} on "
            f"{', '.join(f'{h}:{p}' for h, p in addresses)}, starting "
            f"{job.num_workers} worker(s) on Ray"
        )
        for i in range(job.num_workers):
            argv = job.worker(
                i,
                [],
                where,
                f"{ACTOR_DIR}/secret.txt",
                f"{ACTOR_DIR}/metrics.jsonl",
            )
            actor = self.actor_class.options(
                **_actor_options(resources[i]),
                max_restarts=self.max_restarts,
                max_task_retries=-1,
            ).remote(
                f"worker {i}", argv, self.files, self.max_restarts > 0, self.cwd,
                self.env,
            )  # fmt: skip
            metrics = work / f"metrics_{i}.jsonl"
            metrics.unlink(missing_ok=True)
            self.workers.append(
                _Member(f"worker {i}", actor, self.console.emit, metrics)
            )
        self.members.extend(self.workers)

    def watch(self, resources: Sequence[dict[str, float]], end: float | None) -> str:
        """Polls until the run ends: ``"completed"``, or what ended it early."""
        import ray

        workers_placed_by = time.monotonic() + self.start_timeout
        while True:
            _poll_all(self.members, 0.2)
            reason = _run_state(
                self.servers, self.workers, self.max_restarts, self.started
            )
            if reason != "running":
                return reason
            if time.monotonic() > workers_placed_by:
                unplaced = [(i, w) for i, w in enumerate(self.workers) if not w.pids]
                if unplaced:
                    i, w = unplaced[0]
                    return (
                        f"{w.name} was not placed within {self.start_timeout}s (it "
                        f"asks for {resources[i]}; the cluster has "
                        f"{ray.available_resources()})"
                    )
            if end is not None and time.monotonic() > end:
                return "timeout"
            self.console.show(self.monitor.version)


def _run_state(
    servers: Sequence[_Member],
    workers: Sequence[_Member],
    max_restarts: int,
    started: float | None = None,
) -> str:
    """``"running"``, ``"completed"``, or what ends the run early (``started``:
    when the workers started, on the monotonic clock)."""
    for i, w in enumerate(workers):
        if w.died is not None:
            return (
                f"worker {i} crashed and Ray's {max_restarts} restart(s) are used "
                f"up ({w.died})"
            )
        if w.returncode not in (None, 0) and not w.crashed:
            since = 0.0 if started is None else time.monotonic() - started
            return worker_ended(i, w.returncode, since)
    if all(w.returncode == 0 for w in workers):
        return "completed"
    for s in servers:
        if s.died is not None:
            return f"{s.name} died ({s.died})"
        if s.returncode is not None:
            return f"{s.name} exited early with status {s.returncode}"
    return "running"


def backend_from_flags(
    args: argparse.Namespace,
) -> Callable[..., LaunchResult] | None:
    """The Ray launcher with its flags bound, ``None`` for the local backend.

    Raises:
      ValueError: Ray flags without ``--backend ray``, or bad resources.
    """
    if args.backend == "local":
        given = [
            flag
            for flag, value in (
                ("--ray_address", args.ray_address),
                ("--worker_resources", args.worker_resources),
                ("--server_resources", args.server_resources),
            )
            if value
        ]
        if given:
            raise ValueError(f"{given[0]} needs --backend ray")
        return None
    worker_resources = worker_resources_from_flags(args.worker_resources, args.workers)
    server_resources = (
        parse_resources(args.server_resources) if args.server_resources else None
    )

    def run(*a, **kw) -> LaunchResult:
        return launch_ray(
            *a,
            **kw,
            ray_address=args.ray_address,
            worker_resources=worker_resources,
            server_resources=server_resources,
            max_restarts=3 if args.max_restarts is None else args.max_restarts,
        )

    return run
