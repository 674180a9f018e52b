r"""Compare schemes: ``python -m experiments.compare --suite=NAME --workdir=DIR``.

Runs every scheme of a suite (``experiments/configs/suites.py``) in the suite's
setting, one work directory each (``DIR/<scheme>``, see
:mod:`experiments.train`), then writes

* ``DIR/results.md``: a markdown table with, per scheme, the time to the
  target (``0.9 accuracy``, or a language model's ``val loss 2.1``: the
  target's metric and direction follow the task, see
  :mod:`experiments.target`), the speedup over BSP to that target, the final
  and best value of the target's metric, the megabytes the workers pushed, the
  idle fraction of the workers' time and the server versions made;
* ``DIR/results.json``: the same figures and each scheme's summary;
* ``DIR/<metric>.png`` (``accuracy.png``, ``loss.png``; and ``.pdf``,
  ``.svg``): the target's metric against time and against updates of every
  scheme, the mean and a band over seeds, with the suite's description in
  ``DIR/<metric>.caption.txt``;

and prints the table and the plot's path. ``--schemes=bsp,hps`` runs a subset;
``--seeds=1,2,3`` runs every scheme once per seed and reports the mean (and
standard deviation) of the time to target; ``--render_only`` rebuilds the table
and plot from the work directories of an earlier run. Runs already finished in
``DIR`` are kept, so an interrupted comparison resumes where it stopped
(``--overwrite`` runs them again); ``--jobs=N`` runs N simulated runs at once;
``--set=[SCHEME:]KEY=VALUE`` sets a config field on every run, or on one
scheme's (``--set=hps:plan.pilot=True``: H-PS planned by its pilot).
Example::

  python -m experiments.compare --suite=demo --workdir=/tmp/hpsjax/demo
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import logging
import multiprocessing
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import _cli, plots, registry, train
from experiments.configs.schema import UnknownField
from experiments.configs.suites import Suite
from experiments.target import Target, metric_label
from hpsjax._checks import check_int, check_number
from hpsjax._logs import quiet_backend_probe

__all__ = [
    "aggregate",
    "diverged_at",
    "format_table",
    "load_run",
    "mean_curve",
    "run_finished",
    "parse_settings",
    "run_suite",
]


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values))


def _std(values: Sequence[float]) -> float:
    mean = _mean(values)
    return float((sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5)


def aggregate(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One table row from one scheme's runs (one per seed).

    Returns:
      ``scheme``, ``backend``, ``target`` (the runs'
      :class:`~experiments.target.Target`), ``target_accuracy``, ``runs``,
      ``reached`` (runs that reached the target), ``time_to_target`` (the
      mean over the runs when all reached it, else ``None``),
      ``time_to_target_std``, ``time_to_target_reached`` (the mean over those
      that reached it, or ``None``), ``end_time`` (the longest), the means of
      ``final_metric`` and ``best_metric`` (the target metric's, over the
      runs where it was finite; ``None`` where it never was), of
      ``bytes_sent``, ``idle_fraction`` and ``updates``, and of
      ``final_accuracy`` and ``best_accuracy`` where the runs have them;
      ``diverged_at``, when each run that diverged did
      (:func:`diverged_at`); and where the runs planned on processes, the
      means of the plan's ``predicted_round_s`` and the ``measured_round_s``.

    Raises:
      ValueError: no summaries, or summaries of several schemes.
    """
    if not summaries:
        raise ValueError("aggregate needs at least one summary")
    schemes = {s["scheme"] for s in summaries}
    if len(schemes) != 1:
        raise ValueError(f"aggregate takes one scheme's runs, got {sorted(schemes)}")
    times = [s["time_to_target"] for s in summaries if s["time_to_target"] is not None]
    first = summaries[0]
    target = Target.of_summary(first)
    rounds = {}
    for key in ("predicted_round_s", "measured_round_s"):
        values = [(s.get("info") or {}).get(key) for s in summaries]
        if all(v is not None for v in values):
            rounds[key] = _mean(values)
    return {
        "scheme": first["scheme"],
        "backend": first["backend"],
        "target": target,
        "target_accuracy": first.get("target_accuracy"),
        "runs": len(summaries),
        "reached": len(times),
        "time_to_target": _mean(times) if len(times) == len(summaries) else None,
        "time_to_target_std": _std(times) if times else None,
        "time_to_target_reached": _mean(times) if times else None,
        "end_time": max(s["end_time"] for s in summaries),
        **{
            key: _mean([s[key] for s in summaries])
            for key in ("bytes_sent", "idle_fraction", "updates")
        },
        "other_idle_fraction": _mean_of_finite(
            [s.get("other_idle_fraction") for s in summaries]
        ),
        "final_metric": _mean_of_finite([train._final(s, target) for s in summaries]),
        "best_metric": _mean_of_finite([train._best(s, target) for s in summaries]),
        **{
            key: _mean_of_finite([s.get(key) for s in summaries])
            for key in ("final_accuracy", "best_accuracy")
        },
        "diverged_at": [t for t in map(diverged_at, summaries) if t is not None],
        **rounds,
    }


def _mean_of_finite(values: Sequence[float | None]) -> float | None:
    """The mean of the values that are not ``None`` (a run's metric that was
    not finite), or ``None`` when none is."""
    kept = [v for v in values if v is not None]
    return _mean(kept) if kept else None


def diverged_at(summary: dict[str, Any]) -> float | None:
    """When a run diverged (seconds on its clock), ``None`` if it did not:
    the summary's ``diverged_at``, or its backend's ``info["diverged"]``."""
    if summary.get("diverged_at") is not None:
        return float(summary["diverged_at"])
    diverged = (summary.get("info") or {}).get("diverged")
    return None if not diverged else float(diverged["time"])


def _time_cell(row: dict[str, Any]) -> str:
    runs, reached = row["runs"], row["reached"]
    diverged = row.get("diverged_at") or []
    if diverged:
        when = ", ".join(f"{t:.1f}" for t in diverged)
        cell = f"diverged at t = {when} s"
        return cell if runs == 1 else f"{cell} ({len(diverged)}/{runs} runs)"
    if reached == 0:
        return "not reached" if runs == 1 else f"not reached (0/{runs})"
    if reached < runs:
        return f"{row['time_to_target_reached']:.1f} ({reached}/{runs} runs)"
    if runs == 1:
        return f"{row['time_to_target']:.1f}"
    return f"{row['time_to_target']:.1f} ± {row['time_to_target_std']:.1f}"


def _speedup(base: dict[str, Any] | None, row: dict[str, Any]) -> str:
    ttt = row["time_to_target"]
    if base is None or ttt is None or ttt <= 0:
        return "-"
    if base["time_to_target"] is None:
        if base["reached"] > 0:
            return "-"
        # The baseline never got there within the budget: at least this much.
        return f"> {base['end_time'] / ttt:.2f}x"
    return f"{base['time_to_target'] / ttt:.2f}x"


def format_table(summaries: Sequence[dict[str, Any]], *, baseline: str = "bsp") -> str:
    """The markdown comparison table of some runs' summaries.

    Runs of the same scheme (several seeds) make one row: the time to the
    target is their mean ± standard deviation when every run reached it, and
    the other columns are means. The speedup is the baseline's mean time over
    the scheme's; when the baseline never reached the target within its
    budget, the speedup is at least the budget over the scheme's time.

    Args:
      summaries: :func:`experiments.train.summarize` results; rows follow the
        order in which schemes first appear.
      baseline: the scheme speedups are measured against (its row reads
        ``1.00x``); without it the speedup column shows ``-``.

    Returns:
      The table, ending with a newline.

    Raises:
      ValueError: no summaries, or runs with different targets.
    """
    if not summaries:
        raise ValueError("format_table needs at least one summary")
    targets = {Target.of_summary(s) for s in summaries}
    if len(targets) != 1:
        labels = sorted(t.label for t in targets)
        raise ValueError(f"the runs have different targets: {', '.join(labels)}")
    target = targets.pop()
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        groups.setdefault(s["scheme"], []).append(s)
    rows = [aggregate(g) for g in groups.values()]
    base = next((r for r in rows if r["scheme"] == baseline), None)
    runs = max(r["runs"] for r in rows)
    unit = "virtual s" if all(s["backend"] == "sim" for s in summaries) else "s"
    mean = f", mean of {runs} runs" if runs > 1 else ""
    header = (
        f"| scheme | time to {target.label} ({unit}{mean}) | speedup vs "
        f"{baseline.upper()} | final {target.metric} | best {target.metric} | "
        "MB pushed | idle fraction | idle outside wire and server work | updates |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['scheme']} | {_time_cell(r)} | {_speedup(base, r)} | "
        f"{_metric_cell(r['final_metric'])} | {_metric_cell(r['best_metric'])} | "
        f"{r['bytes_sent'] / 1e6:.1f} | {r['idle_fraction']:.2f} | "
        f"{_metric_cell(r.get('other_idle_fraction'))} | {r['updates']:.0f} |"
        for r in rows
    ]
    return header + "\n".join(lines) + "\n"


def _metric_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def mean_curve(
    runs: Sequence[Sequence[dict[str, Any]]],
    *,
    points: int = 241,
    metric: str = "accuracy",
) -> list[dict[str, float]]:
    """The mean of an evaluation metric of several runs on a common time grid.

    Each run's ``metric`` is interpolated linearly between its evaluations
    (held at its last value after its end); the grid spans the longest run.
    """
    if not runs or any(not r for r in runs):
        raise ValueError("mean_curve needs runs with evaluations")
    end = max(r[-1]["time"] for r in runs)
    grid = np.linspace(0.0, end, points)
    curves = [
        np.interp(grid, [e["time"] for e in r], [e[metric] for e in r]) for r in runs
    ]
    mean = np.mean(curves, axis=0)
    return [
        {"time": float(t), metric: float(a)} for t, a in zip(grid, mean, strict=True)
    ]


def load_run(workdir: str | pathlib.Path) -> tuple[dict[str, Any], list[dict]]:
    """A run's summary and evaluations, read back from its ``metrics.jsonl``.

    Raises:
      FileNotFoundError: no ``metrics.jsonl`` in ``workdir``.
      ValueError: the file holds no summary.
    """
    path = pathlib.Path(workdir) / "metrics.jsonl"
    evals, summary = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["event"] == "eval":
                evals.append(record)
            elif record["event"] == "summary":
                summary = record
    if summary is None:
        raise ValueError(f"{path} holds no summary record; did the run finish?")
    summary.pop("event")
    return summary, evals


def run_finished(workdir: str | pathlib.Path) -> bool:
    """Whether ``workdir`` holds a finished run (a summary in ``metrics.jsonl``)."""
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.is_file():
        return False
    with open(path, encoding="utf-8") as f:
        return any('"event": "summary"' in line for line in f)


def _keep_finished(config, where: pathlib.Path, label: str) -> bool:
    """True: ``where`` already holds this run; False: it must run.

    A finished run of another config is refused rather than replaced.
    """
    if not run_finished(where):
        return False
    saved = where / "config.json"
    if saved.is_file() and config.matches(json.loads(saved.read_text("utf-8"))):
        return True
    raise ValueError(
        f"{where} holds a finished run ({label}) of a different config; pass "
        "--overwrite to replace it, or choose another --workdir"
    )


def _train_quietly(config, where: pathlib.Path, formats: Sequence[str]) -> None:
    # The body of a worker process of --jobs: no progress bars from several
    # processes on one terminal.
    train.train_and_evaluate(config, where, progress=False, formats=formats)


def parse_settings(settings: Sequence[str]) -> list[tuple[str | None, str, Any]]:
    """Reads ``[SCHEME:]KEY=VALUE`` settings into ``(scheme, key, value)``.

    ``KEY`` is a dotted config field (``plan.pilot_tolerance``); ``VALUE`` a
    Python literal (``True``, ``0.05``, ``(1, 2)``) or else a string; a scheme
    limits the setting to that scheme's runs.

    Raises:
      ValueError: a setting without ``=`` or with an empty key, in one line.

    Examples:
      >>> parse_settings(["hps:plan.pilot=True", "budget_seconds=20"])
      [('hps', 'plan.pilot', True), (None, 'budget_seconds', 20)]
    """
    parsed = []
    for setting in settings:
        key, sep, text = setting.partition("=")
        scheme, _, key = key.rpartition(":")
        if not sep or not key.strip():
            raise ValueError(f"a setting is [SCHEME:]KEY=VALUE, got {setting!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        parsed.append((scheme.strip() or None, key.strip(), value))
    return parsed


def _apply_settings(config, scheme: str, settings) -> None:
    """Sets each of ``settings`` (:func:`parse_settings`'s) that applies to
    ``scheme`` on ``config``; an unknown field is a one-line error."""
    for only, key, value in settings:
        if only is not None and only not in registry.SCHEMES:
            raise ValueError(f"--set: unknown scheme {only!r} in {only}:{key}")
        if only is not None and only != scheme:
            continue
        try:
            config.set_path(key, value)
        except UnknownField as e:
            raise ValueError(
                f"--set: {scheme}'s config has no field {key!r} ({e})"
            ) from None
        except ValueError as e:
            raise ValueError(f"--set: {key}={value!r}: {e}") from None


def _progress_label(
    scheme: str, seed: int | None, chosen: Sequence[str], seeds: Sequence[int] | None
) -> str:
    label = f"scheme {chosen.index(scheme) + 1}/{len(chosen)} ({scheme})"
    if seeds is not None:
        label += f", seed {seeds.index(seed) + 1}/{len(seeds)} ({seed})"
    return label


def _check_jobs(jobs: int) -> int:
    jobs = check_int("jobs", jobs, low=1)
    cores = os.cpu_count() or 1
    if jobs > cores:
        logging.info("--jobs=%d lowered to the %d cores of this machine", jobs, cores)
    return min(jobs, cores)


def run_suite(
    suite: str | Suite,
    workdir: str | pathlib.Path,
    *,
    schemes: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    render_only: bool = False,
    progress: bool = True,
    jobs: int = 1,
    overwrite: bool = False,
    budget_seconds: float | None = None,
    devices: str | Sequence[str] | None = None,
    formats: Sequence[str] = plots.FORMATS,
    settings: Sequence[str] = (),
) -> dict[str, Any]:
    """Runs a suite's schemes and writes the comparison.

    Args:
      suite: a name of ``SUITES`` or a :class:`Suite`.
      workdir: the output directory: ``workdir/<scheme>`` per scheme, or
        ``workdir/<scheme>/seed_<s>`` per scheme and seed.
      schemes: a subset of the suite's schemes, or ``None`` for all.
      seeds: run every scheme once per seed (``config.seed`` and
        ``config.model.seed``; the data stay the same) and report means, or
        ``None`` for one run with the configs' seeds.
      render_only: read earlier outputs instead of running.
      progress: show progress bars (with ``jobs=1``).
      jobs: simulated runs to run at once, each in a process of its own (at
        most ``os.cpu_count()``); runs of real processes always run one at a
        time, since they time the wall clock.
      overwrite: run again the runs that ``workdir`` already holds. Without
        it a finished run of the same config is kept (so an interrupted
        comparison resumes where it stopped) and a finished run of another
        config is an error.
      budget_seconds: every run's budget instead of the setting's.
      devices: the workers' devices instead of the setting's, a worker spec
        such as ``"gpu:0, cpu:4, cpu:2, cpu:1"`` (one worker each, see
        :mod:`experiments.placement`; real processes only).
      formats: the figures' file formats (each run's and the comparison's),
        some of :data:`experiments.plots.FORMATS`.
      settings: ``[SCHEME:]KEY=VALUE`` config fields set on every run (of
        that scheme), see :func:`parse_settings`
        (``"hps:plan.pilot=True"``).

    Returns:
      ``{"table": markdown, "table_path", "plot_path", "summaries"}``
      (``plot_path`` in the first format).

    Raises:
      ValueError: an unknown suite or scheme (the message lists valid names),
        a bad seed, ``jobs``, budget or worker spec, or a finished run of
        another config in ``workdir`` without ``overwrite``, before anything
        runs.
    """
    if isinstance(suite, str):
        name = suite
        suite = registry.lookup("suite", suite)
    else:
        name = "custom"
    if not isinstance(suite, Suite):
        raise ValueError(f"suite must be a suite name or a Suite, got {suite!r}")
    chosen = list(suite.schemes if schemes is None else schemes)
    for scheme in chosen:
        registry.lookup("scheme", scheme)
        if scheme not in suite.schemes:
            raise ValueError(
                f"scheme {scheme!r} is not in suite {name!r}; its schemes: "
                f"{', '.join(suite.schemes)}"
            )
    if not chosen:
        raise ValueError("no schemes to run")
    if seeds is not None:
        seeds = [int(s) for s in seeds]
        if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct ints >= 0, got {seeds}")
    jobs = _check_jobs(jobs)
    formats = tuple(formats)
    plots.check_formats(formats)
    if budget_seconds is not None and not (
        isinstance(budget_seconds, int | float) and budget_seconds > 0
    ):
        raise ValueError(f"budget_seconds must be > 0, got {budget_seconds!r}")
    if devices is not None:
        from experiments.placement import parse_spec

        devices = tuple(f"{kind}:{n}" for kind, n in parse_spec(devices))
    settings = parse_settings(settings)
    for only, key, _ in settings:
        if only is not None and only not in chosen:
            raise ValueError(
                f"--set {only}:{key}: {only!r} is not a scheme of this "
                f"comparison ({', '.join(chosen)})"
            )
    workdir = pathlib.Path(workdir)
    planned = []
    for scheme in chosen:
        for seed in [None] if seeds is None else seeds:
            config = registry.load_config(scheme, suite.setting)
            if suite.backend is not None:
                config.backend = suite.backend
            if budget_seconds is not None:
                config.budget_seconds = float(budget_seconds)
            if devices is not None:
                if config.backend != "processes":
                    raise ValueError(
                        f"devices places real worker processes; suite {name!r} "
                        f"runs on the {config.backend!r} backend"
                    )
                config.workers.devices = devices
                config.workers.slowdowns = (1.0,) * len(devices)
            _apply_settings(config, scheme, settings)
            where = workdir / scheme
            if seed is not None:
                config.seed = seed
                config.model.seed = seed
                where = where / f"seed_{seed}"
            registry.check_config(config)
            config.freeze()  # checked: the run reads it as it is
            label = _progress_label(scheme, seed, chosen, seeds)
            planned.append((scheme, config, where, label))
    if not render_only:
        # Seed by seed, every scheme once each: a machine whose speed drifts
        # during the comparison (another tenant, a warming cache) then slows
        # every scheme alike, not the schemes that happen to run last.
        todo = [
            (config, where, label)
            for _, config, where, label in _interleaved(planned, len(chosen))
            if overwrite or not _keep_finished(config, where, label)
        ]
        workdir.mkdir(parents=True, exist_ok=True)
        _run_all(
            todo, total=len(planned), jobs=jobs, progress=progress, formats=formats
        )

    summaries, runs = [], {}
    for scheme, _, where, _ in planned:
        summary, evals = load_run(where)
        summaries.append(summary)
        # Runs written before an evaluation at t = 0 was added get it here.
        runs.setdefault(scheme, []).append(train.with_initial_evaluation(evals))

    first = planned[0][1]
    table = format_table(summaries)
    target = Target.of_summary(summaries[0])
    unit = "virtual s" if first.backend == "sim" else "s"
    plot_path = plots.plot_comparison(
        runs,
        workdir / f"{target.metric}.png",
        target=target.value,
        metric=target.metric,
        title=f"suite {name}"
        + ("" if suite.setting == name else f": {suite.setting}")
        + f" ({first.backend})",
        caption=suite.description or None,
        time_unit=unit,
        formats=formats,
    )
    command = f"python -m experiments.compare --suite={name} --workdir={workdir}"
    if seeds is not None:
        command += f" --seeds={','.join(map(str, seeds))}"
    text = (
        f"# Suite `{name}`\n\n{suite.description}\n\n"
        f"Setting `{suite.setting}`, backend `{first.backend}`, task "
        f"`{first.task}`, budget {first.budget_seconds:g} {unit} per run, "
        f"target {target.label}.\n\n{table}\n"
        f"{metric_label(target.metric).capitalize()} against time and updates: "
        f"`{plot_path.name}`"
        + "".join(f", `{plot_path.with_suffix('.' + f).name}`" for f in formats[1:])
        + "."
        f"\n\nCommand: `{command}`\n"
    )
    table_path = workdir / "results.md"
    table_path.write_text(text)
    (workdir / "results.json").write_text(
        json.dumps(
            {
                "suite": name,
                "seeds": seeds,
                "summaries": summaries,
                "metric": target.metric,
                "curves": _curves(runs, target.metric),
            },
            indent=2,
        )
        + "\n"
    )
    return {
        "table": table,
        "table_path": table_path,
        "plot_path": plot_path,
        "summaries": summaries,
    }


def _curves(
    runs: dict[str, list[list[dict]]], metric: str
) -> dict[str, list[list[list]]]:
    """Per scheme and seed, ``[time, version, value]`` of each evaluation,
    the value the target's ``metric`` (``results.json``'s ``"metric"``).

    What :func:`experiments.plots.plot_comparison` needs to draw the
    comparison again from ``results.json`` alone.
    """
    return {
        scheme: [
            [[e["time"], e["version"], _rounded(e[metric])] for e in evals]
            for evals in seeds
        ]
        for scheme, seeds in runs.items()
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def _interleaved(planned: Sequence[Any], schemes: int) -> list[Any]:
    """``planned`` (each scheme's runs in turn, seed by seed) in the order
    they run: each seed's run of every scheme, then the next seed's.

    Examples:
      >>> _interleaved(["a1", "a2", "b1", "b2"], 2)
      ['a1', 'b1', 'a2', 'b2']
    """
    per_scheme = len(planned) // schemes
    return [
        planned[i * per_scheme + j] for j in range(per_scheme) for i in range(schemes)
    ]


def _run_all(
    todo: Sequence[tuple[Any, pathlib.Path, str]],
    *,
    total: int,
    jobs: int,
    progress: bool,
    formats: Sequence[str],
) -> None:
    """Runs ``(config, where, label)`` runs, logging each start and end."""
    if len(todo) < total:
        logging.info("%d of %d runs already finished: kept", total - len(todo), total)
    for _, where, _ in todo:
        # A stale summary must not pass for this run's should it be interrupted.
        (where / "metrics.jsonl").unlink(missing_ok=True)
    parallel = [t for t in todo if t[0].backend == "sim"] if jobs > 1 else []
    serial = [t for t in todo if not any(t is p for p in parallel)]
    done = 0
    if parallel:
        context = multiprocessing.get_context("spawn")  # jax is not fork-safe
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
            logging.info("%d simulated runs, %d at a time", len(parallel), jobs)
            futures = {
                pool.submit(_train_quietly, config, where, formats): label
                for config, where, label in parallel
            }
            for future in concurrent.futures.as_completed(futures):
                future.result()
                done += 1
                logging.info("%s: done (%d/%d runs)", futures[future], done, len(todo))
    for config, where, label in serial:
        logging.info("%s: running (%s, %s)", label, config.setting, config.backend)
        train.train_and_evaluate(config, where, progress=progress, formats=formats)
        done += 1
        logging.info("%s: done (%d/%d runs)", label, done, len(todo))


def parser() -> _cli.Parser:
    """The command's flags."""
    from experiments.configs.suites import SUITES

    suites = "; ".join(
        f"{name} ({suite.description or suite.setting})"
        for name, suite in SUITES.items()
    )
    p = _cli.Parser(_PROG, description=__doc__.split("\n\n", 1)[0])
    p.add_argument(
        "--suite", required=True, choices=list(SUITES), metavar="SUITE",
        help=f"The suite to run: {suites}.".replace("%", "%%"),
    )  # fmt: skip
    p.add_argument(
        "--workdir", required=True,
        help="Directory for all outputs: <workdir>/<scheme> per run.",
    )  # fmt: skip
    p.add_argument(
        "--schemes", type=_cli.scheme_list, default=None, metavar="A,B",
        help="Run only these schemes of the suite (comma-separated; default: "
        f"all of {', '.join(registry.SCHEMES)}).",
    )  # fmt: skip
    p.add_argument(
        "--seeds", type=_cli.int_list, default=None, metavar="1,2,3",
        help="Run every scheme once per seed (comma-separated ints) and report "
        "means.",
    )  # fmt: skip
    p.add_argument(
        "--render_only", action="store_true",
        help="Rebuild table and plot from existing outputs.",
    )  # fmt: skip
    p.add_argument(
        "--jobs", type=int, default=1,
        help="Simulated runs at once, one process each (at most the cores).",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true",
        help="Run again the runs already finished in --workdir.",
    )  # fmt: skip
    _cli.add_budget_flag(p, "Every run's budget")
    p.add_argument(
        "--devices", default=None,
        help="The workers' devices instead of the setting's (real processes), "
        "e.g. 'gpu:0, cpu:4, cpu:2, cpu:1': a GPU, or a set of CPU cores, per "
        "worker.",
    )  # fmt: skip
    p.add_argument(
        "--formats", type=_cli.comma_list, default=list(plots.FORMATS), metavar="F,G",
        help="The figures' file formats, comma-separated: some of "
        f"{', '.join(plots.FORMATS)} (each run's and the comparison's).",
    )  # fmt: skip
    p.add_argument(
        "--set", action="append", default=[], metavar="[SCHEME:]KEY=VALUE",
        help="Set a config field on every run, or on that scheme's runs "
        "(repeatable), e.g. --set=hps:plan.pilot=True.",
    )  # fmt: skip
    return p


_PROG = "experiments.compare"


def _check_flags(args: argparse.Namespace) -> None:
    """Checks --schemes, --jobs, --devices, --budget, --formats and --set
    against the suite, before anything runs."""
    suite = registry.lookup("suite", args.suite)
    for scheme in args.schemes or ():
        try:
            registry.lookup("scheme", scheme)
        except ValueError as e:
            raise ValueError(f"--schemes: {e}") from None
        if scheme not in suite.schemes:
            raise ValueError(
                f"--schemes: {scheme!r} is not in suite {args.suite!r}; its "
                f"schemes: {', '.join(suite.schemes)}"
            )
    check_int("--jobs", args.jobs, low=1)
    if args.seeds is not None and (
        not args.seeds or min(args.seeds) < 0 or len(set(args.seeds)) != len(args.seeds)
    ):
        raise ValueError(f"--seeds must be distinct ints >= 0, got {args.seeds}")
    if args.devices is not None:
        from experiments.placement import parse_spec

        try:
            parse_spec(args.devices)
        except ValueError as e:
            raise ValueError(f"--devices: {e}") from None
    check_number("--budget", args.budget, low=0, low_inclusive=False, allow_none=True)
    try:
        plots.check_formats(args.formats)
    except ValueError as e:
        raise ValueError(f"--formats: {e}") from None
    settings = parse_settings(args.set)
    for scheme in args.schemes or suite.schemes:
        config = registry.load_config(scheme, suite.setting)
        _apply_settings(config, scheme, settings)
        registry.check_config(config)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse(argv)
    with _cli.usage_errors(_PROG):
        _check_flags(args)
    quiet_backend_probe()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    result = run_suite(
        args.suite,
        args.workdir,
        schemes=args.schemes,
        seeds=args.seeds,
        render_only=args.render_only,
        jobs=args.jobs,
        overwrite=args.overwrite,
        budget_seconds=args.budget,
        devices=args.devices,
        formats=args.formats,
        settings=args.set,
    )
    print(result["table"])
    print(f"table: {result['table_path']}")
    print(f"plot: {result['plot_path']}")


if __name__ == "__main__":
    main()
