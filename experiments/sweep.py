"""Many short runs of configs, kept on disk, and what their seeds say together.

:func:`run_many` runs ``(config, where)`` pairs not yet finished (each
``where/run.json`` holds its config, summary and evaluations), several at a
time in processes of their own; :func:`choose` picks a tuned value from one
run per candidate; :func:`seed_stats` sums one scheme's runs over seeds and
:func:`compare_times` tells two schemes apart beyond their seeds' spread. The
advisor (:mod:`experiments.advise`) tunes and ranks every scheme with them.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from experiments import registry
from experiments.target import Target

__all__ = ["choose", "compare_times", "finished", "run_many", "run_one", "seed_stats"]


def run_one(config: Any, where: str) -> dict[str, Any]:
    """One run: its summary and evaluations in ``where/run.json``.

    The body of a worker process; only what a ranking or a table needs is
    written.
    """
    from experiments import backends, build, train

    registry.check_config(config)
    setup = build.setup(config)
    out = pathlib.Path(where)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    output = backends.BACKENDS[config.backend](
        config, setup, workdir=out, progress=False
    )
    output = output._replace(evals=train.with_initial_evaluation(output.evals))
    summary = train.summarize(config, output)
    record = {
        "config": config.to_json(indent=2),
        "summary": train._jsonable(summary),
        "evals": [[e["time"], e[setup.target.metric]] for e in output.evals],
        "compute_s": time.perf_counter() - start,
    }
    (out / "run.json").write_text(json.dumps(record) + "\n")
    return record


def finished(config: Any, where: pathlib.Path) -> dict[str, Any] | None:
    """The record of ``where``'s finished run of ``config``, or ``None``."""
    path = where / "run.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        saved = json.loads(record.get("config") or "null")
    except json.JSONDecodeError:
        return None
    return record if isinstance(saved, dict) and config.matches(saved) else None


def run_many(
    todo: Sequence[tuple[Any, pathlib.Path]], jobs: int
) -> dict[pathlib.Path, dict[str, Any]]:
    """Runs the ``(config, where)`` pairs not yet finished, ``jobs`` at a time
    (each in a process of its own when ``jobs > 1``).

    Returns:
      Each ``where``'s record: ``config`` (JSON), ``summary``, ``evals``
      (``[time, value of the target's metric]``) and ``compute_s``.
    """
    done, missing = {}, []
    for config, where in todo:
        record = finished(config, where)
        if record is None:
            missing.append((config, where))
        else:
            done[where] = record
    if not missing:
        return done
    logging.info("%d runs (%d kept), %d at a time", len(missing), len(done), jobs)
    if jobs == 1:
        for config, where in missing:
            done[where] = run_one(config, str(where))
        return done
    context = multiprocessing.get_context("spawn")  # jax is not fork-safe
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=context) as pool:
        futures = {pool.submit(run_one, c, str(w)): w for c, w in missing}
        for future in concurrent.futures.as_completed(futures):
            where = futures[future]
            done[where] = future.result()
            s = done[where]["summary"]
            logging.info(
                "%s: time to target %s, %.0f s of compute",
                where,
                s["time_to_target"],
                done[where]["compute_s"],
            )
    return done


def choose(summaries: dict[float, dict[str, Any]]) -> float:
    """The tuned value: soonest to the target, else the best value of the
    target's metric (its direction: :class:`experiments.target.Target`).

    Args:
      summaries: one tuning run's summary per candidate value.

    Returns:
      The chosen value; a run that diverged is chosen only if all did.
    """

    def key(item):
        _, s = item
        diverged = s.get("diverged_at") is not None
        t = s["time_to_target"]
        return (diverged, t is None, t if t is not None else 0.0, _best_key(s))

    return min(summaries.items(), key=key)[0]


def _best_key(summary: dict[str, Any]) -> float:
    """Sorts a run's best value of its target's metric, better first (a
    summary of before targets had a metric: its best accuracy)."""
    if summary.get("target_metric") is None:
        return -summary["best_accuracy"]
    return Target.of_summary(summary).sort_key(summary.get("best_metric"))


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5


def seed_stats(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One scheme's runs over seeds: ``runs``, ``reached`` (the target),
    ``times``, their ``mean`` and ``std`` (over the runs that reached it),
    ``mb`` pushed per run and ``mb_to_target``, ``bytes_per_push``,
    ``best_accuracy`` and its ``best_accuracy_std``, and ``diverged`` runs."""
    times = [s["time_to_target"] for s in summaries]
    reached = [t for t in times if t is not None]
    n = len(summaries)
    mean = sum(reached) / len(reached) if reached else None
    pushes = [s.get("pushes") or 0 for s in summaries]
    bytes_sent = [s["bytes_sent"] for s in summaries]
    # Bytes pushed until the target, pro rata of the run's time.
    to_target = [
        s["bytes_sent"] * s["time_to_target"] / s["end_time"]
        for s in summaries
        if s["time_to_target"] is not None and s["end_time"] > 0
    ]
    return {
        "runs": n,
        "reached": len(reached),
        "times": times,
        "mean": mean,
        "std": _std(reached) if reached else None,
        "mb": sum(bytes_sent) / n / 1e6,
        "mb_to_target": sum(to_target) / len(to_target) / 1e6 if to_target else None,
        "bytes_per_push": sum(bytes_sent) / max(sum(pushes), 1),
        "best_accuracy": sum(s["best_accuracy"] for s in summaries) / n,
        "best_accuracy_std": _std([s["best_accuracy"] for s in summaries]),
        "diverged": sum(s.get("diverged_at") is not None for s in summaries),
    }


def compare_times(method: dict[str, Any], base: dict[str, Any]) -> str:
    """``"faster"``, ``"slower"`` or ``"level"``: the method's time to the
    target against the baseline's (:func:`seed_stats` each), beyond the larger
    standard deviation.

    A scheme that reached the target in fewer runs than the other is the
    slower; where neither ever reached it, the best accuracy decides (higher
    beyond the larger standard deviation is faster), level without it.

    Examples:
      >>> fast = {"reached": 2, "mean": 10.0, "std": 1.0}
      >>> slow = {"reached": 2, "mean": 14.0, "std": 2.0}
      >>> compare_times(fast, slow), compare_times(slow, fast)
      ('faster', 'slower')
      >>> compare_times(fast, {"reached": 2, "mean": 11.5, "std": 2.0})
      'level'
    """
    if method["reached"] != base["reached"]:
        return "faster" if method["reached"] > base["reached"] else "slower"
    if method["reached"] == 0:
        mine, theirs = method.get("best_accuracy"), base.get("best_accuracy")
        if mine is None or theirs is None:
            return "level"
        noise = max(
            method.get("best_accuracy_std", 0.0), base.get("best_accuracy_std", 0.0)
        )
        if mine > theirs + noise:
            return "faster"
        if mine < theirs - noise:
            return "slower"
        return "level"
    noise = max(method["std"], base["std"])
    if method["mean"] < base["mean"] - noise:
        return "faster"
    if method["mean"] > base["mean"] + noise:
        return "slower"
    return "level"
