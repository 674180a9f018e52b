r"""The scheme advisor: which scheme to run on your own cluster.

``python -m experiments.advise`` simulates every scheme (``--schemes``) on a
twin of your cluster fitted from what its workers measured, either a short
pilot run's telemetry (``--telemetry RUN_DIR``: :func:`twin_from_telemetry`)
or the workers' profiles (``--profiles 'profile_*.json'``, as
``hpsjax-worker --profile_out`` writes them: :func:`load_profiles`), tunes
each scheme's step size on the first seed (``--factors``, times its config's
value), runs the chosen one over ``--seeds`` and prints a table ranked by the
predicted time to the setting's target (``--setting``, or ``--model``,
``--dataset``, ``--target``, ``--budget``), the schemes within the winner's
spread marked tied, followed by the ``hpsjax-launch`` command of the winner.
How the twin is made: :func:`cluster_config`. A prediction is a simulation:
the calibration (RESULTS.md) found the simulator's updates/s and idle
fraction within 15% of real processes for BSP, ASP and SSP, H-PS off by 32%
on proc4; read the ranking as a shortlist to try, not as a result. Examples::

  python -m experiments.run --config=experiments/configs/bsp.py:proc4 \
      --config.budget_seconds=8 --workdir=runs/pilot
  python -m experiments.advise --telemetry=runs/pilot --setting=proc4 \
      --schemes=bsp,asp,hps,ssp,ps_plus,adsp --factors=1
  python -m experiments.advise \
      --profiles 'experiments/results/proc4_profiles/profile_*.json' \
      --setting=proc4 --schemes=bsp,asp,hps --factors=1
"""

from __future__ import annotations

import logging
import math
import pathlib
import shlex
import statistics
import tempfile
from collections.abc import Sequence
from typing import Any

from experiments import _cli, build, registry, sweep, train
from experiments.target import Target
from experiments.twin import (
    Twin,
    _step_fit,
    fit_wire,
    link_of,
    load_profiles,
    parse_link,
    twin_from_telemetry,
)
from hpsjax._config_flags import argv_of, flag_fields
from hpsjax.launch._options import LaunchOptions
from hpsjax.ps._options import ServerOptions

__all__ = [
    "Twin",
    "advise",
    "cluster_config",
    "fit_wire",
    "format_advice",
    "launch_command",
    "link_of",
    "load_profiles",
    "parse_link",
    "parse_seeds",
    "spearman",
    "twin_from_telemetry",
]

_PROG = "experiments.advise"


def parse_seeds(text: str | Sequence[str]) -> list[int]:
    """``--seeds``' value, comma-separated ints (two or more, distinct).

    Raises:
      ValueError: anything else (one line).

    Examples:
      >>> parse_seeds("1,2")
      [1, 2]
    """
    parts = text.split(",") if isinstance(text, str) else list(text)
    try:
        seeds = [int(str(p).strip()) for p in parts]
    except ValueError:
        raise ValueError(
            f"--seeds: expected comma-separated integers, got {text!r}"
        ) from None
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(
            f"--seeds: at least two distinct seeds give the spread, got {text!r}"
        )
    return seeds


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long lists, ties averaged.

    Examples:
      >>> spearman([1, 2, 3], [10, 20, 30])
      1.0
      >>> spearman([1, 2, 3], [3, 2, 1])
      -1.0
    """
    import numpy as np

    def ranks(values):
        values = np.asarray(values, dtype=float)
        order = values.argsort(kind="stable")
        r = np.empty(len(values))
        r[order] = np.arange(1, len(values) + 1)
        for v in np.unique(values):
            r[values == v] = r[values == v].mean()
        return r

    if len(a) != len(b) or len(a) < 2:
        raise ValueError("spearman needs two lists of the same length >= 2")
    ra, rb = ranks(a), ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _count(cluster: Any) -> int:
    return len(cluster.workers) if isinstance(cluster, Twin) else len(cluster)


def cluster_config(
    scheme: str,
    cluster: Sequence[Any] | Twin,
    *,
    setting: str = "sim8",
    model: str | None = None,
    dataset: str | None = None,
    data_path: str | None = None,
    target: float | None = None,
    budget: float | None = None,
    jitter: float = 0.1,
    service_time: float | None = None,
    link: tuple[float, float] | None = None,
) -> Any:
    """The scheme's config on the simulated twin of the cluster.

    ``cluster`` is the workers' profiles (:func:`load_profiles`) or a
    :class:`Twin` of a run's telemetry (:func:`twin_from_telemetry`: its own
    jitter, link, server share and start-ups). ``link`` (``(latency,
    bandwidth)``, :func:`parse_link`) replaces the measured link,
    ``service_time`` (seconds per push) the measured server share (0 with
    profiles, which hold none); ``jitter`` applies to profiles only.

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
      push already holds the server's answer; default 0 with profiles, the
      measured share with ``--telemetry``).

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
    if service_time is not None and not (
        service_time >= 0 and math.isfinite(service_time)
    ):
        raise ValueError(f"--service_time must be >= 0, got {service_time}")
    if isinstance(cluster, Twin):
        fits, startup = cluster.fits, cluster.startup
        fit = cluster.link if link is None else LinkFit(*link, "given", 0)
        service = cluster.service_s if service_time is None else service_time
    else:
        b0 = int(config.batch_size)
        fits, startup = {}, None
        for i, p in enumerate(cluster):
            intercept, slope = _step_fit(p, b0)
            fits[i] = ComputeFit(intercept, slope, jitter, b0, 0, "profile")
        latency, bandwidth, _ = link_of(cluster, link)
        fit = LinkFit(latency, bandwidth, "profile" if link is None else "given", 0)
        service = service_time or 0.0
    # The workers' own speeds stand for every slowdown the setting injected.
    sim = simulated_config(config, fits, fit, service, startup)
    registry.check_config(sim)
    return sim


def launch_command(
    config: Any, cluster: Sequence[Any] | Twin
) -> tuple[str, str, list[str]]:
    """How to run ``config`` on the real cluster.

    Returns:
      ``(launch, run, not_carried)``: an ``hpsjax-launch`` command (the server
      and worker flags of the scheme; each host's address, its worker flags and
      the data are the user's), the ``python -m experiments.run`` command that
      runs exactly the simulated config on real processes on this machine, and
      the config fields the ``hpsjax-launch`` command cannot carry.
    """
    n = _count(cluster)
    server = config.server
    not_carried = []
    for path, default in (
        ("server.clip_norm", None),
        ("server.staleness_lr", None),
        ("server.dc_lambda", None),
        ("stages.enabled", False),
    ):
        node = config.get_path(path)
        if node not in (default, None):
            not_carried.append(f"{path}={node}")
    try:
        worker_flags = _shared_worker_flags(config)
    except ValueError as e:
        not_carried.append(str(e).split(":")[0])
        worker_flags = []
    planned = config.plan.scheme != "none"
    launch = [
        "hpsjax-launch",
        *argv_of(
            LaunchOptions,
            workers=n,
            model=config.model.name,
            policy=config.server.policy,
            plan=config.plan.scheme if planned else None,
            global_batch=int(config.batch_size) * n if planned else None,
            workdir=f"runs/{config.scheme}",
        ),
        "--server",
        *argv_of(
            ServerOptions,
            optimizer=server.optimizer,
            learning_rate=float(server.learning_rate),
            momentum=float(server.momentum),
            optimizer_arg=_optimizer_args(config, n),
            policy_arg={
                k: v for k, v in (server.policy_kwargs or {}).items() if v is not None
            },
        ),
        "--",
        *worker_flags,
    ]
    knob = _step_knob(config.scheme)
    run = [
        "python", "-m", "experiments.run",
        f"--config=experiments/configs/{config.scheme}.py:{config.setting}",
        "--config.backend=processes",
    ]  # fmt: skip
    node = config.get_path(knob)
    run.append(f"--config.{knob}={float(node):g}")
    run.append(f"--workdir=runs/{config.scheme}")
    return shlex.join(launch), shlex.join(run), not_carried


# Worker fields each host sets for itself (its id, shard, seed, speed, link)
# or the launcher sets for every worker (the model).
_HOST_OWN = (
    "worker_id", "shard_index", "shard_count", "seed", "slowdown", "bandwidth",
    "latency", "model",
)  # fmt: skip


def _shared_worker_flags(config: Any) -> list[str]:
    """The ``hpsjax-worker`` flags every worker of ``config`` shares (its first
    worker's settings but those of :data:`_HOST_OWN`)."""
    from experiments.backends import run_config

    worker = run_config(config).workers[0]
    argv = []
    for part in (worker.command, worker.config):
        flagged = {field.name for field, _, _ in flag_fields(type(part))}
        fields = {
            name: getattr(part, name) for name in flagged if name not in _HOST_OWN
        }
        argv += argv_of(type(part), **fields)
    return argv


def _optimizer_args(config: Any, workers: int) -> dict[str, Any]:
    """The server optimizer's keyword arguments beyond its step size and
    momentum, as :func:`experiments.build.server_optimizer` passes them."""
    server = config.server
    extra: dict[str, Any] = {}
    if server.optimizer == "delayed_nesterov":
        extra["delay"] = int(server.outer_delay or workers)
    extra.update(server.optimizer_args or {})
    return {k: v for k, v in extra.items() if v is not None}


def _step_knob(scheme: str) -> str:
    from experiments.frontier import KNOBS

    if scheme in KNOBS:
        return KNOBS[scheme][0]  # the first knob the frontier tunes
    config = registry.load_config(scheme)
    if config.worker.local_optimizer != "none":
        return "worker.local_learning_rate"
    return "server.learning_rate"


def advise(
    cluster: Sequence[Any] | Twin,
    *,
    schemes: Sequence[str] | None = None,
    factors: Sequence[float] = (0.5, 1.0, 2.0),
    seeds: Sequence[int] = (0,),
    jobs: int = 1,
    workdir: str | pathlib.Path | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Simulates every scheme on the cluster's twin; rows ranked best first.

    Each scheme's step size is tuned on the first seed (``factors``); the
    chosen one runs on every seed, and the row gives the seeds' mean and
    spread (standard deviation) of the time to the target.

    Args:
      cluster: the workers' profiles (:func:`load_profiles`) or a run's
        :class:`Twin` (:func:`twin_from_telemetry`).
      schemes: scheme names, ``None`` for every scheme.
      factors: step sizes tried, as multiples of each config's value.
      seeds: the seeds of the chosen step size's runs (the first tunes).
      jobs: runs at once.
      workdir: where the runs go (kept: a second call reuses them); a
        temporary directory by default.
      **options: :func:`cluster_config`'s keyword arguments.

    Returns:
      Per scheme: ``scheme``, ``knob``, ``value`` (the step size chosen),
      ``times`` (per seed, ``None``: not reached), ``time_to_target`` (their
      mean over the seeds that reached it, ``None`` if none did), ``spread``
      (their standard deviation), ``reached`` (seeds that reached it),
      ``best_metric`` (the best value of the target's metric, mean over the
      seeds), ``bytes_moved``, ``idle_fraction``, ``updates_per_s`` (means),
      ``diverged``, ``tied`` (within the spread of the first row:
      :func:`experiments.sweep.compare_times` says level) and ``config``;
      ranked by the seeds that reached the target, the mean time to it, and
      the best value of its metric.

    Raises:
      ValueError: an unknown scheme, no schemes, bad factors, seeds or settings.
    """
    chosen = list(registry.SCHEMES if schemes is None else schemes)
    if not chosen:
        raise ValueError("no schemes to simulate")
    for s in chosen:
        registry.lookup("scheme", s)
    factors = [float(f) for f in factors]
    if not factors or min(factors) <= 0 or not all(map(math.isfinite, factors)):
        raise ValueError(f"factors must be positive numbers, got {factors}")
    seeds = [int(s) for s in seeds]
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct integers, got {seeds}")
    if not _count(cluster):
        raise ValueError("no profiles")
    workdir = pathlib.Path(
        workdir if workdir is not None else tempfile.mkdtemp(prefix="hpsjax_advise_")
    )

    def plan(config, knob, value, seed):
        config = config.copy()
        config.set_path(knob, value)
        config.seed = seed
        config.model.seed = seed
        tag = f"lr_{value:g}" + (
            "" if seed == seeds[0] and len(seeds) == 1 else f"_seed_{seed}"
        )
        return config, workdir / config.scheme / tag

    bases = {s: cluster_config(s, cluster, **options) for s in chosen}
    knobs = {s: _step_knob(s) for s in chosen}
    tuning = {}
    for scheme, base in bases.items():
        node = base.get_path(knobs[scheme])
        for f in factors:
            tuning[(scheme, float(node) * f)] = plan(
                base, knobs[scheme], float(node) * f, seeds[0]
            )
    done = sweep.run_many(list(tuning.values()), jobs)
    picked = {}
    for scheme in chosen:
        tried = {
            v: done[w]["summary"] for (s, v), (_, w) in tuning.items() if s == scheme
        }
        picked[scheme] = sweep.choose(tried)
    more = [
        plan(bases[s], knobs[s], picked[s], seed) for s in chosen for seed in seeds[1:]
    ]
    done.update(sweep.run_many(more, jobs))
    rows = []
    for s in chosen:
        runs = [plan(bases[s], knobs[s], picked[s], seed) for seed in seeds]
        summaries = [done[where]["summary"] for _, where in runs]
        rows.append(_row(s, knobs[s], picked[s], summaries, runs[0][0]))
    return _rank(rows)


def _rank(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` best first, each marked ``tied`` where its mean time to the
    target is within the seeds' spread of the first's (level by
    :func:`experiments.sweep.compare_times`)."""

    def key(r):
        t = r["time_to_target"]
        goal = build.target(r["config"])
        return (r["diverged"], -r["reached"], t or 0.0, goal.sort_key(r["best_metric"]))

    ranked = sorted(rows, key=key)
    for r in ranked:
        r["tied"] = r is not ranked[0] and (
            sweep.compare_times(r["stats"], ranked[0]["stats"]) == "level"
        )
    return ranked


def _row(
    scheme: str,
    knob: str,
    value: float,
    summaries: Sequence[dict[str, Any]],
    config: Any,
) -> dict[str, Any]:
    """One scheme's row of :func:`advise` from its seeds' run summaries."""
    stats = sweep.seed_stats(summaries)
    bests = [train._best(s, Target.of_summary(s)) for s in summaries]
    bests = [b for b in bests if b is not None]

    def mean(key):
        return statistics.fmean(float(s.get(key) or 0.0) for s in summaries)

    ends = [max(float(s["end_time"]), 1e-9) for s in summaries]
    return {
        "scheme": scheme,
        "knob": knob,
        "value": value,
        "times": stats["times"],
        "time_to_target": stats["mean"],
        "spread": stats["std"],
        "reached": stats["reached"],
        "best_metric": statistics.fmean(bests) if bests else None,
        "bytes_moved": statistics.fmean(
            s["bytes_sent"] + s.get("bytes_received", 0) for s in summaries
        ),
        "idle_fraction": mean("idle_fraction"),
        "updates_per_s": statistics.fmean(
            float(s.get("pushes") or 0) / e
            for s, e in zip(summaries, ends, strict=True)
        ),
        "diverged": any(s.get("diverged_at") is not None for s in summaries),
        "stats": stats,
        "config": config,
    }


def _describe(first: Any, cluster: Sequence[Any] | Twin, link: Any) -> str:
    """The header: the twin's workers, link, server and task."""
    w = first.workers
    bandwidth = w.bandwidth
    link_text = (
        "none"
        if bandwidth is None and not w.latency
        else f"{w.latency * 1e3:.2f} ms + bytes / "
        + ("inf" if bandwidth is None else f"{bandwidth / 1e6:.3g} MB/s")
    )
    if isinstance(cluster, Twin):
        source = f"telemetry of {cluster.source}"
        notes = list(cluster.notes)
        if link is not None:
            notes.append("the link given by --link replaces the measured one")
    else:
        source = "profiles"
        note = link_of(cluster, link)[2]
        notes = [note] if note else []
    return (
        f"{_count(cluster)} workers ({source}): slowdowns "
        + ", ".join(f"{k:.2f}" for k in w.slowdowns)
        + f" x {w.step_time * 1e3:.2f} ms a step of {first.batch_size}; link "
        + link_text
        + f"; server {first.server.service_time * 1e3:.2f} ms a push"
        + f"; task {first.task}, model {first.model.name}, data {first.data.name}, "
        f"budget {first.budget_seconds:g} s" + "".join(f"\nnote: {n}" for n in notes)
    )


def format_advice(
    rows: Sequence[dict[str, Any]],
    cluster: Sequence[Any] | Twin,
    link: tuple[float, float] | None = None,
) -> str:
    """The ranked table and the winner's commands (``link``: as given to
    :func:`cluster_config`)."""
    first = rows[0]["config"]
    target = build.target(first)
    seeds = len(rows[0]["times"])
    lines = [
        f"| rank | scheme | time to {target.label} (s, predicted, mean ± spread "
        f"of {seeds} seed{'s' if seeds > 1 else ''}) | best {target.metric} | "
        "MB moved | updates/s | idle fraction | step size |",
        "|---:|---|---|---:|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows, 1):
        t = r["time_to_target"]
        if r["diverged"]:
            cell = "diverged"
        elif t is None:
            cell = "not reached"
        else:
            cell = f"{t:.1f} ± {r['spread']:.1f}"
            if r["reached"] < seeds:
                cell += f" ({r['reached']}/{seeds} reached)"
        if r.get("tied"):
            cell += f" (tied with {rows[0]['scheme']})"
        best = "-" if r["best_metric"] is None else f"{r['best_metric']:.3f}"
        lines.append(
            f"| {i} | {r['scheme']} | {cell} | {best} | "
            f"{r['bytes_moved'] / 1e6:.1f} | {r['updates_per_s']:.1f} | "
            f"{r['idle_fraction']:.2f} | {r['knob']}={r['value']:g} |"
        )
    head = _describe(first, cluster, link)
    best = rows[0]
    launch, run, not_carried = launch_command(best["config"], cluster)
    tied = [r["scheme"] for r in rows if r.get("tied")]
    if best["time_to_target"] is None:
        verdict = f"no scheme reached {target.label} within the budget; the closest:"
    else:
        verdict = f"predicted winner: {best['scheme']}" + (
            f" (tied within the seeds' spread with {', '.join(tied)})" if tied else ""
        )
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


def parser() -> _cli.Parser:
    """The command's flags."""
    p = _cli.Parser(_PROG, description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--profiles", type=_cli.comma_list, default=None, metavar="GLOB,GLOB",
        help="Glob(s) of the workers' profile files.",
    )  # fmt: skip
    p.add_argument(
        "--telemetry", type=_cli.comma_list, default=None, metavar="PATH,PATH",
        help="Instead of --profiles: a pilot run's workdir(s) or metrics files "
        "(the workers' round records, the server's version records).",
    )  # fmt: skip
    _cli.add_setting_flag(p, "sim8", "Model, data, target and budget of this setting.")
    p.add_argument("--model", help="The model instead of the setting's.")
    p.add_argument("--dataset", help="The dataset instead of the setting's.")
    p.add_argument("--data_path", help="With --dataset=npz: the file.")
    p.add_argument(
        "--target", type=float, default=None,
        help="The target's value instead of the setting's, on the task's target "
        "metric (a test accuracy, a language model's validation loss).",
    )  # fmt: skip
    _cli.add_budget_flag(p, "Simulated seconds per run")
    p.add_argument(
        "--schemes", type=_cli.scheme_list, default=None, metavar="A,B",
        help="Schemes to simulate (comma-separated; default: all).",
    )  # fmt: skip
    p.add_argument(
        "--factors", type=_cli.float_list, default=[0.5, 1.0, 2.0], metavar="F,F",
        help="Step sizes tried (x config's; default 0.5,1,2).",
    )  # fmt: skip
    p.add_argument(
        "--jitter", type=float, default=0.1,
        help="Lognormal spread of a step's time (with --profiles).",
    )  # fmt: skip
    p.add_argument(
        "--service_time", type=float, default=None,
        help="Server seconds per push (default: 0 with --profiles, the measured "
        "share with --telemetry).",
    )  # fmt: skip
    p.add_argument(
        "--seeds", default="1,2", metavar="1,2",
        help="Seeds of each scheme's prediction (two or more: the spread); the "
        "first tunes the step size.",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="Runs at once.")
    p.add_argument("--workdir", help="Where the runs go (default: a temp dir).")
    p.add_argument(
        "--link", default=None, metavar="MB_PER_S[,LATENCY_MS]",
        help="This link for every worker instead of the measured ones (e.g. 50,1).",
    )  # fmt: skip
    return p


def _cluster(values: Any) -> Sequence[Any] | Twin:
    """The profiles or the telemetry's twin the flags name."""
    if bool(values.profiles) == bool(values.telemetry):
        raise ValueError(
            "give one of --profiles (a glob of profile files) and --telemetry "
            "(a pilot run's workdir or metrics files)"
        )
    if values.profiles:
        return load_profiles(values.profiles)
    return twin_from_telemetry(values.telemetry)


def main(argv: Sequence[str] | None = None) -> None:
    from hpsjax._logs import quiet_backend_probe

    args = parser().parse(argv)
    with _cli.usage_errors(_PROG):
        factors = args.factors
        if not factors or min(factors) <= 0:
            raise ValueError(f"--factors must be numbers > 0, got {factors}")
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        _cli.positive_budget(_PROG, args.budget)
        seeds = parse_seeds(args.seeds)
        link = None if args.link is None else parse_link(args.link)
        cluster = _cluster(args)
        options = {
            "setting": args.setting,
            "model": args.model,
            "dataset": args.dataset,
            "data_path": args.data_path,
            "target": args.target,
            "budget": args.budget,
            "jitter": args.jitter,
            "service_time": args.service_time,
            "link": link,
        }
        # Every config is checked before anything runs.
        for s in args.schemes or registry.SCHEMES:
            cluster_config(s, cluster, **options)
    quiet_backend_probe()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    with _cli.usage_errors(_PROG):
        rows = advise(
            cluster,
            schemes=args.schemes,
            factors=factors,
            seeds=seeds,
            jobs=args.jobs,
            workdir=args.workdir,
            **options,
        )
    print(format_advice(rows, cluster, link), end="")
    logging.info("runs in %s", args.workdir or "a temporary directory")


if __name__ == "__main__":
    main()
