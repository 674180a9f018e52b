r"""Train one scheme from its config and write what happened to a work directory.

:func:`train_and_evaluate` is what ``python -m experiments.run`` calls, and what
tests and notebooks call directly. It checks the config, runs it on its backend
(``config.backend``: ``"sim"`` or ``"processes"``), and writes to ``workdir``:

=================  ==========================================================
``config.json``    the config used
``metrics.jsonl``  one JSON object per line: ``{"event": "eval", ...}`` (the
                   task's metrics on the test set over time), ``"push"``
                   and ``"replan"`` (sim) or ``"round"`` (processes)
                   records, one ``"worker"`` record per worker (compute,
                   transfer, wait and idle time, bytes sent and received)
                   and a final ``"summary"``
``timeline.json``  every worker's time cut into compute, transfer, wait,
                   discarded and profiling spans, and the ``marks``
                   (``[time, label]``) of :func:`timeline_marks`
``summary.json``   the summary alone (see :func:`summarize`)
``tensorboard/``   the same records as TensorBoard event files, one run per
                   scheme and seed (``<scheme>_seed<seed>``, its workers'
                   records under ``worker<id>``)
``<metric>.png``   the target's metric against time (``accuracy.png``: test
                   accuracy; ``loss.png``: validation loss), the target as
                   a line (and as ``.pdf`` and ``.svg``)
``timeline.png``   per-worker timeline of compute, transfer and idle time, the
                   stage switch and re-plans marked (see
                   :func:`timeline_marks`; also ``.pdf`` and ``.svg``)
=================  ==========================================================

The figures are written in every format of :data:`experiments.plots.FORMATS`
unless ``formats=`` names fewer (``("png",)``, or ``()`` for no figure: a
study of many runs that draws its own comparison).

Time is virtual seconds in the simulator and wall seconds after every worker
joined for real processes; profiling, where a scheme profiles, is part of it.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

from experiments import backends, build, plots, registry
from experiments.configs.schema import ExperimentConfig
from experiments.target import Target, with_initial_evaluation
from hpsjax.metrics import MetricsWriter

__all__ = [
    "describe",
    "summarize",
    "with_initial_evaluation",
    "tensorboard_dir",
    "time_to_target",
    "timeline_marks",
    "train_and_evaluate",
]

logger = logging.getLogger("experiments")


def time_to_target(evals: list[dict[str, Any]], target: float | Target) -> float | None:
    """The first evaluation time at which the run reached ``target``.

    Args:
      evals: the run's evaluation records, in time order.
      target: a :class:`~experiments.target.Target`, or a number: a test
        accuracy.

    Returns:
      Seconds, or ``None`` when the run never reached it.
    """
    if not isinstance(target, Target):
        target = Target("accuracy", float(target), higher_is_better=True)
    return target.time_to(evals)


def summarize(config: ExperimentConfig, output: backends.RunOutput) -> dict[str, Any]:
    r"""The figures a comparison table shows, from a backend's output.

    ``idle_fraction`` is the share of all workers' time not spent on compute
    that was kept (waiting for the server or the link, discarded work and
    profiling):

    .. math::

      \text{idle} = 1 - \frac{\sum_i \text{compute}_i}{\sum_i \text{time}_i}.

    Returns:
      A JSON-serialisable dict: ``scheme``, ``setting``, ``backend``,
      ``task``, the target (``target_metric``, ``target_value``,
      ``higher_is_better``, and ``target_accuracy``: the value of an accuracy
      target, else ``None``), ``time_to_target`` (``None`` if not reached),
      ``final_metric`` and ``best_metric`` (the target metric's last and best
      value), ``final_accuracy`` and ``best_accuracy`` (``None`` for a task
      without accuracy), ``final_loss``, ``end_time``, ``bytes_sent``,
      ``bytes_received``, ``idle_fraction``, ``pushes``, ``updates``,
      ``diverged_at`` (when the run diverged, its backend's
      ``info["diverged"]["time"]``, else ``None``) and the backend's ``info``.
    """
    evals = output.evals
    if not evals:
        raise ValueError("the run made no evaluation; is the budget too short?")
    target = build.target(config)
    accuracy = Target("accuracy", 1.0, higher_is_better=True)
    compute = sum(w["compute_s"] for w in output.workers.values())
    total = 0.0
    for w in output.workers.values():
        total += sum(
            w.get(k, 0.0)
            for k in (
                "compute_s",
                "compile_s",
                "transfer_s",
                "wait_s",
                "discarded_s",
                "profile_s",
            )
        )
    return {
        "scheme": config.scheme,
        "setting": config.setting,
        "backend": config.backend,
        "num_workers": len(config.workers.slowdowns),
        "task": str(config.task),
        **target.fields(),
        "time_to_target": target.time_to(evals),
        "final_metric": build.finite_or_none(evals[-1][target.metric]),
        "best_metric": target.best([e[target.metric] for e in evals]),
        "final_accuracy": evals[-1].get("accuracy"),
        "best_accuracy": accuracy.best([e.get("accuracy") for e in evals]),
        "final_loss": build.finite_or_none(evals[-1]["loss"]),
        "end_time": evals[-1]["time"],
        "bytes_sent": int(sum(w["bytes_sent"] for w in output.workers.values())),
        "bytes_received": int(
            sum(w["bytes_received"] for w in output.workers.values())
        ),
        "idle_fraction": 0.0 if total <= 0 else 1.0 - compute / total,
        "other_idle_fraction": _other_idle(output.workers),
        "pushes": int(sum(w["pushes"] for w in output.workers.values())),
        "updates": int(evals[-1]["version"]),
        "diverged_at": (output.info.get("diverged") or {}).get("time"),
        "info": output.info,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return _jsonable(value.item())
    return value


def _dump(record: dict[str, Any]) -> str:
    return json.dumps(_jsonable(record), allow_nan=False)


def tensorboard_dir(config: ExperimentConfig, workdir: pathlib.Path) -> pathlib.Path:
    """The TensorBoard run of ``config`` under ``workdir``: one per scheme and
    seed, so ``tensorboard --logdir`` over several work directories overlays
    them."""
    return pathlib.Path(workdir) / "tensorboard" / f"{config.scheme}_seed{config.seed}"


def _round_times(output: backends.RunOutput) -> list[tuple[float, dict[str, Any]]]:
    """Real workers' round records with their start on the timelines' clock.

    Each worker's records count from its own start; its timeline is shifted so
    that its first round starts at the end of profiling (see
    ``backends._worker_timeline``), and so are the times here.
    """
    offset = float(output.info.get("profile_seconds") or 0.0)
    first: dict[Any, float] = {}
    rounds = []
    for r in output.records:
        if r.get("event") == "round":
            shift = offset - first.setdefault(r["worker"], float(r["time"]))
            rounds.append((shift, r))
    return rounds


def _version_time(output: backends.RunOutput, version: int) -> float | None:
    """When the server reached ``version``, as the records tell, or ``None``."""
    times = []
    for r in output.records:
        if r.get("event") == "push" and r["status"] != "rejected":
            # The server's version after this push: one more if it applied it.
            after = r["version"] + r["staleness"] + (r["status"] == "applied")
            if after >= version:
                times.append(float(r["time"]))
    for shift, r in _round_times(output):
        if r.get("pull_end") is not None and (r.get("pulled_version") or 0) >= version:
            times.append(shift + float(r["pull_end"]))
    if not times:  # no record tells: the first evaluation at that version
        times = [e["time"] for e in output.evals if e["version"] >= version][:1]
    return min(times, default=None)


def timeline_marks(
    config: ExperimentConfig, output: backends.RunOutput
) -> list[tuple[float, str]]:
    """The stage switch and the re-plans of a run, as ``(time, label)`` marks.

    Re-plans come from the simulator's ``"replan"`` records, or from the
    ``plan_revision`` of real workers' rounds (a revision's first round). The
    stage switch is where the server reached the version it switched at: the
    config's ``stages.switch_version``, or the version the loss switch
    happened at (``info["switched_at"]``); a switch of the workers' own
    optimizers on a plateau is not recorded, and not marked.
    """
    marks = [
        (float(r["time"]), f"re-plan {r['revision']}")
        for r in output.records
        if r.get("event") == "replan"
    ]
    first: dict[int, float] = {}
    for shift, r in _round_times(output):
        revision = r.get("plan_revision")
        if revision:
            first[revision] = min(first.get(revision, math.inf), shift + r["time"])
    marks += [(t, f"re-plan {revision}") for revision, t in first.items()]
    stages = config.stages
    if stages.enabled and (output.info.get("final_stage") or 0) > 0:
        version = output.info.get("switched_at")
        if version is None and stages.switch == "version":
            version = int(stages.switch_version)
        at = None if version is None else _version_time(output, version)
        if at is not None:
            marks.append((at, "stage switch"))
    return sorted(marks)


def write_outputs(
    config: ExperimentConfig,
    output: backends.RunOutput,
    summary: dict[str, Any],
    workdir: pathlib.Path,
    *,
    formats: Sequence[str] = plots.FORMATS,
) -> dict[str, pathlib.Path]:
    """Writes metrics, timelines, summary and plots; returns their paths.

    The plots are written in ``formats`` (some of
    :data:`experiments.plots.FORMATS`; the paths returned are the first
    format's), none where ``formats`` is empty.
    """
    formats = _check_formats(formats)
    paths = {
        "metrics": workdir / "metrics.jsonl",
        "timeline": workdir / "timeline.json",
        "summary": workdir / "summary.json",
    }
    paths["tensorboard"] = tensorboard_dir(config, workdir)
    paths["metrics"].unlink(missing_ok=True)
    shutil.rmtree(paths["tensorboard"], ignore_errors=True)
    with MetricsWriter(paths["metrics"], tensorboard_dir=paths["tensorboard"]) as f:
        for record in output.evals:
            f({"event": "eval", **record})
        for record in output.records:
            f(record)
        for worker, totals in output.workers.items():
            f({"event": "worker", "worker": worker, **totals})
        f({"event": "summary", **summary})
    marks = timeline_marks(config, output)
    paths["timeline"].write_text(
        _dump(
            {
                "kinds": list(backends.TIMELINE_KINDS),
                "marks": [list(mark) for mark in marks],
                "workers": {
                    str(w): [list(span) for span in spans]
                    for w, spans in output.timelines.items()
                },
            }
        )
    )
    paths["summary"].write_text(json.dumps(_jsonable(summary), indent=2) + "\n")
    if not formats:
        return paths
    time_unit = "virtual s" if config.backend == "sim" else "s"
    target = build.target(config)
    paths["metric_plot"] = plots.plot_accuracy(
        {config.scheme: output.evals},
        workdir / f"{target.metric}.png",
        target=target.value,
        metric=target.metric,
        title=f"{plots.display_name(config.scheme)} ({config.setting}, "
        f"{config.backend})",
        time_unit=time_unit,
        formats=formats,
    )
    paths["timeline_plot"] = plots.plot_timeline(
        output.timelines,
        workdir / "timeline.png",
        title=f"{plots.display_name(config.scheme)}: worker timelines "
        f"({config.setting})",
        time_unit=time_unit,
        marks=marks,
        formats=formats,
    )
    return paths


def _check_formats(formats: Sequence[str]) -> tuple[str, ...]:
    """``formats`` as a tuple, checked: some of :data:`experiments.plots.FORMATS`
    (none: no figure)."""
    if isinstance(formats, str) or not all(isinstance(f, str) for f in formats):
        raise ValueError(
            f"formats must be a sequence of some of {plots.FORMATS}, got {formats!r}"
        )
    formats = tuple(formats)
    if formats:
        plots.check_formats(formats)
    return formats


def train_and_evaluate(
    config: ExperimentConfig,
    workdir: str | pathlib.Path,
    *,
    progress: bool = True,
    formats: Sequence[str] = plots.FORMATS,
) -> dict[str, Any]:
    """Runs one scheme's config and writes its outputs to ``workdir``.

    Args:
      config: a scheme's config (``experiments/configs/<scheme>.py``).
      workdir: the output directory (created if missing; files in it are
        overwritten).
      progress: show a tqdm progress bar while it runs.
      formats: the figures' file formats, some of
        :data:`experiments.plots.FORMATS`; ``()`` draws no figure.

    Returns:
      The summary (see :func:`summarize`).

    Raises:
      ValueError: an unknown registry name, an impossible setting or an
        unknown format (nothing is written), or a run that failed.
      FileNotFoundError: ``data.name="npz"`` and no file at ``data.path``.
    """
    registry.check_config(config)
    formats = _check_formats(formats)
    setup = build.setup(config)
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
    backend = backends.BACKENDS[config.backend]
    output = backend(config, setup, workdir=workdir, progress=progress)
    output = output._replace(evals=with_initial_evaluation(output.evals))
    summary = summarize(config, output)
    write_outputs(config, output, summary, workdir, formats=formats)
    return summary


def describe(summary: dict[str, Any]) -> str:
    """One line of a run's result: time to the target and the target metric's
    final value, or when it diverged and its best value."""
    target = Target.of_summary(summary)
    reached = summary["time_to_target"]
    time = (
        f"time to {target.label} "
        f"{'not reached' if reached is None else f'{reached:.2f}s'}"
    )
    diverged = summary.get("diverged_at")
    if diverged is not None:
        where = (summary.get("info") or {}).get("diverged") or {}
        worker = f" (worker {where['worker']})" if "worker" in where else ""
        return (
            f"{summary['scheme']}: diverged at t = {diverged:.1f} s{worker}; "
            f"{time}; best {target.metric} {_value(_best(summary, target))}"
        )
    return (
        f"{summary['scheme']}: {time}; final {target.metric} "
        f"{_value(_final(summary, target))}"
    )


def _final(summary: dict[str, Any], target: Target) -> float | None:
    """The target metric's last value (``final_accuracy`` in a summary of
    before targets had a metric)."""
    return summary.get("final_metric", summary.get(f"final_{target.metric}"))


def _best(summary: dict[str, Any], target: Target) -> float | None:
    """The target metric's best value (``best_accuracy`` in a summary of
    before targets had a metric)."""
    return summary.get("best_metric", summary.get(f"best_{target.metric}"))


def _value(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def _other_idle(workers: Mapping[Any, Mapping[str, Any]]) -> float | None:
    """The workers' mean share of their rounds idle for neither the wire nor
    the server (``hpsjax.telemetry.idle_fraction``), or ``None`` without round
    telemetry."""
    shares = [
        w["other_idle_fraction"]
        for w in workers.values()
        if w.get("other_idle_fraction") is not None
    ]
    return sum(shares) / len(shares) if shares else None
