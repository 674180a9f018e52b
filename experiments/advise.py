r"""The scheme advisor: which scheme to run on your own cluster.

``python -m experiments.advise --profiles 'profile_*.json'`` reads the
profiles of your workers (the files ``hpsjax-worker --profile_out`` or
``python -m hpsjax.profiling.in_place --profile_out`` write, one per worker,
each with the worker's measured step times and, where it reached a server,
its measured push and pull), builds the calibrated simulator's twin of that
cluster, runs every scheme on it (``--schemes``, all by default) with a short
tuning of each scheme's step size (``--factors``: 0.5, 1 and 2 times its
config's value, one seed each), and prints a table ranked by the predicted
time to the target (the setting's task's: test accuracy, a language model's
validation loss), with the bytes moved (pushed and pulled) and the
workers' idle fraction, followed by the command that launches the winner.

The twin is :func:`experiments.calibrate.simulated_config`, the mapping the
calibration measured against real processes, fed from the profiles instead
of a run's round records:

* **compute**, per worker: the profile's fitted step time
  :math:`t_i(b) = a_i + c_i b` (its first device; a worker with several
  devices splits its batch evenly over them) at the config's batch size; the
  fastest worker sets the simulator's step time, the others their slowdowns,
  :math:`a_i / t_i` the fixed share; the jitter is ``--jitter`` (a profile
  keeps medians only);
* **link**: one push and one pull of the profile, ``latency + bytes /
  bandwidth``; two messages of different sizes give both terms, two of the
  same size cannot tell them apart and are charged by the byte (latency 0).
  The simulator has one link model for all workers: the workers' median is
  used, and the table says so when their links differ by more than 2x.
  ``--link=MB_PER_S[,LATENCY_MS]`` replaces every profile's link by that one
  (a profile's link measured on a loaded machine can be off by 10x: see
  RESULTS.md), e.g. ``--link=50,1`` for 50 MB/s and 1 ms;
* **server**: ``--service_time`` seconds per push at one server (a measured
  push already holds the server's answer; default 0).

The task, model, data, target and budget come from ``--setting`` (a name of
``experiments.configs.common.SETTINGS``; the simulated workers replace its
own; ``lm_sim8`` trains the language model), or from ``--model``,
``--dataset`` (``--data_path`` for ``npz``), ``--target`` (a value of the
task's target metric) and ``--budget``. Schemes that plan (H-PS, ADSP, ASHL) plan in
the simulator from the twin's workers, as on the real cluster they would from
these profiles.

A prediction is a simulation: the calibration (RESULTS.md) found the
simulator's updates/s and idle fraction within 15% of real processes for BSP,
ASP and SSP, H-PS off by 32% on proc4, and the time to the target of one seed
within the noise of a second evaluation. Read the ranking as a shortlist to
try, not as a result. Example::

  python -m experiments.advise \
      --profiles 'experiments/results/proc4_profiles/profile_*.json' \
      --setting=proc4 --schemes=bsp,asp,hps --factors=1
"""

from __future__ import annotations

import glob
import math
import pathlib
import shlex
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from experiments import _cli, build, registry, train
from experiments.target import Target

__all__ = [
    "advise",
    "cluster_config",
    "format_advice",
    "launch_command",
    "link_of",
    "load_profiles",
    "parse_link",
]

_PROG = "advise"


def load_profiles(pattern: str | Sequence[str]) -> list[Any]:
    """The profiles that ``pattern`` (a glob, or several) matches, by worker id.

    Raises:
      ValueError: no file matches, a file is not a profile (the message names
        it), or two profiles have the same worker id.
    """
    from hpsjax.profiling import WorkerProfile

    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths = sorted({p for pat in patterns for p in glob.glob(pat)})
    if not paths:
        raise ValueError(f"no profile files match {' '.join(patterns)!r}")
    profiles = []
    for path in paths:
        try:
            text = pathlib.Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        try:
            profiles.append(WorkerProfile.from_json(text))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    ids = [str(p.worker_id) for p in profiles]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"several profiles of worker {', '.join(dup)}")

    def order(p):
        w = p.worker_id
        return (0, int(w), "") if isinstance(w, int) else (1, 0, str(w))

    return sorted(profiles, key=order)


def _link(transfer: Any) -> tuple[float, float] | None:
    """``(latency, bandwidth)`` of one worker's measured push and pull."""
    if transfer is None:
        return None
    points = [
        (transfer.push_bytes, transfer.push_seconds),
        (transfer.pull_bytes, transfer.pull_seconds),
    ]
    points = [(n, s) for n, s in points if s is not None and n > 0]
    if not points:
        # Only a round trip, without its bytes: all of it latency.
        return transfer.round_trip_seconds / 2, math.inf
    (n1, s1), (n2, s2) = points[0], points[-1]
    if n1 != n2:
        slope = (s2 - s1) / (n2 - n1)
        if slope > 0:
            latency = max(s1 - slope * n1, 0.0)
            return latency, 1.0 / slope
    seconds = (s1 + s2) / 2
    nbytes = (n1 + n2) / 2
    return 0.0, (nbytes / seconds if seconds > 0 else math.inf)


def parse_link(text: str) -> tuple[float, float]:
    """``--link``'s value, ``MB_PER_S[,LATENCY_MS]``, as ``(latency_s, bytes_per_s)``.

    Raises:
      ValueError: anything else, or a bandwidth that is not a finite number
        > 0 or a latency that is not a finite number >= 0 (one line).

    Examples:
      >>> parse_link("50,1")
      (0.001, 50000000.0)
      >>> parse_link("4.5")
      (0.0, 4500000.0)
    """
    parts = str(text).split(",")
    try:
        if len(parts) > 2:
            raise ValueError
        mbps = float(parts[0])
        latency_ms = float(parts[1]) if len(parts) == 2 else 0.0
    except ValueError:
        mbps = latency_ms = math.nan
    if not (math.isfinite(mbps) and mbps > 0):
        raise ValueError(
            f"--link: expected MB_PER_S[,LATENCY_MS] with MB_PER_S > 0, got {text!r}"
        )
    if not (math.isfinite(latency_ms) and latency_ms >= 0):
        raise ValueError(f"--link: the latency must be >= 0 ms, got {text!r}")
    return latency_ms / 1e3, mbps * 1e6


def link_of(
    profiles: Sequence[Any], link: tuple[float, float] | None = None
) -> tuple[float, float, str]:
    """One link for the simulator: the workers' median latency and bandwidth,
    or ``link`` (``(latency, bandwidth)``, :func:`parse_link`) in their place.

    Returns:
      ``(latency, bandwidth, note)``: bandwidth ``inf`` for no link; the note
      says where the workers' links differ by more than 2x, or that ``link``
      replaced them, else ``""``.
    """
    if link is not None:
        return link[0], link[1], "the link given by --link replaces the profiled ones"
    links = [link for link in map(_link, (p.transfer for p in profiles)) if link]
    if not links:
        return 0.0, math.inf, "no profile measured a link: transfers cost nothing"
    latency = statistics.median(lat for lat, _ in links)
    bandwidth = statistics.median(b for _, b in links)
    finite = [b for _, b in links if math.isfinite(b)]
    note = ""
    if finite and max(finite) > 2 * min(finite):
        note = (
            f"the workers' links differ ({min(finite) / 1e6:.3g} to "
            f"{max(finite) / 1e6:.3g} MB/s): simulated with their median"
        )
    if len(links) < len(profiles):
        note = (note + "; " if note else "") + (
            f"{len(profiles) - len(links)} profile(s) without a link take the median"
        )
    return latency, bandwidth, note


def _step_fit(profile: Any, batch_size: int) -> tuple[float, float]:
    """``(intercept, slope)`` of the worker's step time in its whole batch."""
    devices = profile.devices
    share = batch_size / len(devices)
    slowest = max(devices, key=lambda d: d.step_time(share))
    fit = slowest.time_fit
    # The devices split the batch: per sample of the worker's batch, the
    # slowest device's slope over the devices.
    return float(fit.intercept), float(fit.slope) / len(devices)


def cluster_config(
    scheme: str,
    profiles: Sequence[Any],
    *,
    setting: str = "sim8",
    model: str | None = None,
    dataset: str | None = None,
    data_path: str | None = None,
    target: float | None = None,
    budget: float | None = None,
    jitter: float = 0.1,
    service_time: float = 0.0,
    link: tuple[float, float] | None = None,
) -> Any:
    """The scheme's config on the simulated twin of the profiled cluster.

    ``link`` (``(latency, bandwidth)``, :func:`parse_link`) replaces the
    profiles' measured link.

    Raises:
      ValueError: an unknown scheme or setting (the message lists valid
        names), or a bad value.
    """
    from experiments.calibrate import ComputeFit, LinkFit, simulated_config

    registry.lookup("scheme", scheme)
    config = registry.load_config(scheme, setting)
    if model is not None:
        config.model.name = model
    if dataset is not None:
        config.data.name = dataset
    if data_path is not None:
        config.data.path = data_path
    if target is not None:
        config.eval.target_value = float(target)
    if budget is not None:
        if not budget > 0:
            raise ValueError(f"--budget must be > 0, got {budget}")
        config.budget_seconds = float(budget)
    if not (jitter >= 0 and math.isfinite(jitter)):
        raise ValueError(f"--jitter must be >= 0, got {jitter}")
    if not (service_time >= 0 and math.isfinite(service_time)):
        raise ValueError(f"--service_time must be >= 0, got {service_time}")
    b0 = int(config.batch_size)
    fits = {}
    for i, p in enumerate(profiles):
        intercept, slope = _step_fit(p, b0)
        fits[i] = ComputeFit(intercept, slope, jitter, b0, 0, "profile")
    latency, bandwidth, _ = link_of(profiles, link)
    fit = LinkFit(latency, bandwidth, "profile" if link is None else "given", 0)
    sim = simulated_config(config, fits, fit, service_time)
    # The workers' own speeds stand for every slowdown the setting injected.
    sim.workers.startup_times = ()
    registry.check_config(sim)
    return sim


def launch_command(config: Any, profiles: Sequence[Any]) -> tuple[str, str, list[str]]:
    """How to run ``config`` on the real cluster.

    Returns:
      ``(launch, run, not_carried)``: an ``hpsjax-launch`` command (the server
      and worker flags of the scheme; each host's address, its worker flags and
      the data are the user's), the ``python -m experiments.run`` command that
      runs exactly the simulated config on real processes on this machine, and
      the config fields the ``hpsjax-launch`` command cannot carry.
    """
    from experiments.backends import _worker_flags

    n = len(profiles)
    server = config.server
    not_carried = []
    for path, default in (
        ("server.clip_norm", None),
        ("server.staleness_lr", None),
        ("server.dc_lambda", None),
        ("server.outer_delay", None),
        ("stages.enabled", False),
    ):
        node = config
        for key in path.split("."):
            node = node.get(key) if hasattr(node, "get") else None
        if node not in (default, None):
            not_carried.append(f"{path}={node}")
    worker_flags: list[str] = []
    try:
        flags_ = _worker_flags(config, 0, plan_file=None)
    except ValueError as e:
        not_carried.append(str(e).split(":")[0])
        flags_ = []
    skip = {
        "--worker_id", "--shard_index", "--shard_count", "--seed", "--slowdown",
        "--bandwidth", "--latency", "--model",
    }  # fmt: skip
    i = 0
    while i < len(flags_):
        flag = flags_[i]
        takes_value = i + 1 < len(flags_) and not flags_[i + 1].startswith("--")
        if flag not in skip:
            worker_flags += flags_[i : i + 1 + takes_value]
        i += 1 + takes_value
    launch = ["hpsjax-launch", "--workers", str(n), "--model", config.model.name]
    launch += ["--policy", config.server.policy]
    if config.plan.scheme != "none":
        launch += ["--plan", config.plan.scheme]
        launch += ["--global_batch", str(int(config.batch_size) * n)]
    launch += ["--workdir", f"runs/{config.scheme}", "--server"]
    launch += ["--optimizer", server.optimizer]
    launch += ["--learning_rate", f"{float(server.learning_rate):g}"]
    if float(server.momentum):
        launch += ["--momentum", f"{float(server.momentum):g}"]
    for key, value in (server.policy_kwargs or {}).items():
        if value is not None:
            launch += ["--policy_arg", f"{key}={value}"]
    launch += ["--", *worker_flags]
    knob = _step_knob(config.scheme)
    run = [
        "python", "-m", "experiments.run",
        f"--config=experiments/configs/{config.scheme}.py:{config.setting}",
        "--config.backend=processes",
    ]  # fmt: skip
    node = config
    for key in knob.split("."):
        node = node[key]
    run.append(f"--config.{knob}={float(node):g}")
    run.append(f"--workdir=runs/{config.scheme}")
    return shlex.join(launch), shlex.join(run), not_carried


def _step_knob(scheme: str) -> str:
    from experiments.frontier import KNOBS

    if scheme in KNOBS:
        return KNOBS[scheme]
    config = registry.load_config(scheme)
    if config.worker.local_optimizer != "none":
        return "worker.local_learning_rate"
    return "server.learning_rate"


def advise(
    profiles: Sequence[Any],
    *,
    schemes: Sequence[str] | None = None,
    factors: Sequence[float] = (0.5, 1.0, 2.0),
    seed: int = 0,
    jobs: int = 1,
    workdir: str | pathlib.Path | None = None,
    **cluster: Any,
) -> list[dict[str, Any]]:
    """Simulates every scheme on the profiled cluster; rows ranked best first.

    Args:
      profiles: the workers' profiles (:func:`load_profiles`).
      schemes: scheme names, ``None`` for every scheme.
      factors: step sizes tried, as multiples of each config's value.
      seed: the seed of every run.
      jobs: runs at once.
      workdir: where the runs go (kept: a second call reuses them); a
        temporary directory by default.
      **cluster: :func:`cluster_config`'s keyword arguments.

    Returns:
      Per scheme: ``scheme``, ``knob``, ``value`` (the step size chosen),
      ``time_to_target`` (``None``: not reached), ``best_metric`` (the best
      value of the target's metric), ``bytes_moved``, ``idle_fraction``,
      ``diverged``, ``config``, ranked by the time to the target (those that
      never reach it last, by their best value of its metric).

    Raises:
      ValueError: an unknown scheme, no schemes, bad factors or settings.
    """
    from experiments.frontier import _run_many, _set, choose

    chosen = list(registry.SCHEMES if schemes is None else schemes)
    if not chosen:
        raise ValueError("no schemes to simulate")
    for s in chosen:
        registry.lookup("scheme", s)
    factors = [float(f) for f in factors]
    if not factors or min(factors) <= 0 or not all(map(math.isfinite, factors)):
        raise ValueError(f"factors must be positive numbers, got {factors}")
    if not profiles:
        raise ValueError("no profiles")
    workdir = pathlib.Path(
        workdir if workdir is not None else tempfile.mkdtemp(prefix="hpsjax_advise_")
    )
    todo, index = [], {}
    for scheme in chosen:
        base = cluster_config(scheme, profiles, **cluster)
        knob = _step_knob(scheme)
        node = base
        for key in knob.split("."):
            node = node[key]
        for f in factors:
            value = float(node) * f
            config = base.copy_and_resolve_references()
            _set(config, knob, value)
            config.seed = seed
            config.model.seed = seed
            where = workdir / scheme / f"lr_{value:g}"
            todo.append((config, where))
            index[(scheme, value)] = (config, where, knob)
    done = _run_many(todo, jobs)
    rows = []
    for scheme in chosen:
        tried = {
            v: done[where]["summary"]
            for (s, v), (_, where, _) in index.items()
            if s == scheme
        }
        value = choose(tried)
        config, _, knob = index[(scheme, value)]
        s = tried[value]
        rows.append(
            {
                "scheme": scheme,
                "knob": knob,
                "value": value,
                "time_to_target": s["time_to_target"],
                "best_metric": train._best(s, Target.of_summary(s)),
                "bytes_moved": s["bytes_sent"] + s.get("bytes_received", 0),
                "idle_fraction": s["idle_fraction"],
                "diverged": s.get("diverged_at") is not None,
                "config": config,
            }
        )

    def key(r):
        t = r["time_to_target"]
        goal = build.target(r["config"])
        return (r["diverged"], t is None, t or 0.0, goal.sort_key(r["best_metric"]))

    return sorted(rows, key=key)


def format_advice(
    rows: Sequence[dict[str, Any]],
    profiles: Sequence[Any],
    link: tuple[float, float] | None = None,
) -> str:
    """The ranked table and the winner's commands (``link``: as given to
    :func:`cluster_config`)."""
    first = rows[0]["config"]
    target = build.target(first)
    unit = "s, predicted"
    lines = [
        f"| rank | scheme | time to {target.label} ({unit}) | best {target.metric} | "
        "MB moved | idle fraction | step size |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        t = r["time_to_target"]
        cell = (
            "diverged" if r["diverged"] else "not reached" if t is None else f"{t:.1f}"
        )
        best = "-" if r["best_metric"] is None else f"{r['best_metric']:.3f}"
        lines.append(
            f"| {i} | {r['scheme']} | {cell} | {best} | "
            f"{r['bytes_moved'] / 1e6:.1f} | {r['idle_fraction']:.2f} | "
            f"{r['knob']}={r['value']:g} |"
        )
    latency, bandwidth, note = link_of(profiles, link)
    w = first.workers
    head = (
        f"{len(profiles)} workers: slowdowns "
        + ", ".join(f"{k:.2f}" for k in w.slowdowns)
        + f" x {w.step_time * 1e3:.2f} ms a step of {first.batch_size}; link "
        + (
            "none"
            if not math.isfinite(bandwidth)
            else f"{latency * 1e3:.2f} ms + bytes / {bandwidth / 1e6:.3g} MB/s"
        )
        + f"; task {first.task}, model {first.model.name}, data {first.data.name}, "
        f"budget {first.budget_seconds:g} s" + (f"\nnote: {note}" if note else "")
    )
    best = rows[0]
    launch, run, not_carried = launch_command(best["config"], profiles)
    if best["time_to_target"] is None:
        verdict = f"no scheme reached {target.label} within the budget; the closest:"
    else:
        verdict = f"predicted winner: {best['scheme']}"
    tail = f"{verdict}\n  {launch}\n"
    if not_carried:
        tail += (
            "  (hpsjax-launch does not carry "
            + ", ".join(not_carried)
            + "; the exact config on processes:)\n"
        )
    else:
        tail += "  or, the exact config on processes on this machine:\n"
    tail += f"  {run}\n"
    return head + "\n\n" + "\n".join(lines) + "\n\n" + tail


def _define_flags() -> None:
    flags.DEFINE_list("profiles", None, "Glob(s) of the workers' profile files.")
    flags.DEFINE_string(
        "setting", "sim8", "Model, data, target and budget of this setting."
    )
    flags.DEFINE_string("model", None, "The model instead of the setting's.")
    flags.DEFINE_string("dataset", None, "The dataset instead of the setting's.")
    flags.DEFINE_string("data_path", None, "With --dataset=npz: the file.")
    flags.DEFINE_float(
        "target",
        None,
        "The target's value instead of the setting's, on the task's target "
        "metric (a test accuracy, a language model's validation loss).",
    )
    flags.DEFINE_float("budget", None, "Simulated seconds per run.")
    flags.DEFINE_list("schemes", None, "Schemes to simulate (default: all).")
    flags.DEFINE_list("factors", ["0.5", "1", "2"], "Step sizes tried (x config's).")
    flags.DEFINE_float("jitter", 0.1, "Lognormal spread of a step's time.")
    flags.DEFINE_float("service_time", 0.0, "Server seconds per push.")
    flags.DEFINE_integer("seed", 0, "Seed of every run.")
    flags.DEFINE_integer("jobs", 1, "Runs at once.")
    flags.DEFINE_string("workdir", None, "Where the runs go (default: a temp dir).")
    flags.DEFINE_string(
        "link",
        None,
        "MB_PER_S[,LATENCY_MS]: this link for every worker instead of the "
        "profiled ones (e.g. 50,1).",
    )


def main(argv):
    if len(argv) > 1:
        _cli.fail(_PROG, f"unexpected arguments: {' '.join(argv[1:])}")
    from hpsjax._logs import quiet_backend_probe

    quiet_backend_probe()
    values = flags.FLAGS
    with _cli.usage_errors(_PROG):
        if not values.profiles:
            raise ValueError("--profiles is required (a glob of profile files)")
        try:
            factors = [float(f) for f in values.factors]
        except ValueError:
            raise ValueError(
                f"--factors: expected numbers, got {values.factors}"
            ) from None
        if values.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {values.jobs}")
        link = None if values.link is None else parse_link(values.link)
        profiles = load_profiles(values.profiles)
        cluster = {
            "setting": values.setting,
            "model": values.model,
            "dataset": values.dataset,
            "data_path": values.data_path,
            "target": values.target,
            "budget": values.budget,
            "jitter": values.jitter,
            "service_time": values.service_time,
            "link": link,
        }
        # Every config is checked before anything runs.
        for s in values.schemes or registry.SCHEMES:
            cluster_config(s, profiles, **cluster)
        rows = advise(
            profiles,
            schemes=values.schemes,
            factors=factors,
            seed=values.seed,
            jobs=values.jobs,
            workdir=values.workdir,
            **cluster,
        )
    print(format_advice(rows, profiles, link), end="")
    logging.info("runs in %s", values.workdir or "a temporary directory")


if __name__ == "__main__":
    _define_flags()
    app.run(main, flags_parser=_cli.flags_parser(_PROG))
