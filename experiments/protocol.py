r"""The verdict protocol: equal tuning budgets, grids off their edges, a stated test.

A claim that one scheme reaches a target sooner than another is read here the
way a reviewer would accept it:

1. **Tuning** (:func:`tune`): each scheme, method and baseline alike, gets the
   same budget of tuning runs over every knob its paper tunes. Knobs are
   searched one at a time from the middle of their grids (coordinate
   search); a knob whose best value sits on an edge of its grid has its grid
   extended beyond that edge (times or divided by ``factor``) until the best
   is inside or the budget is spent, and the search passes over the knobs
   again until a pass changes nothing. Runs are compared by :func:`rank_key`:
   a diverged run last, then the time to the target, then the best value of
   the target's metric.
2. **Seeds**: the chosen values run on :data:`SEEDS` (5 seeds that took no
   part in the tuning).
3. **The test** (:func:`time_verdict`): the ratio of mean times to the target,
   method over baseline, with a percentile bootstrap confidence interval at
   :data:`LEVEL` (each scheme's seeds resampled on their own); *faster* when
   the whole interval is below 1, *slower* when above, *level* otherwise. A
   run that never reached the target counts as the budget's time
   (:func:`censored_times`): a lower bound on its true time, so a scheme that
   misses the target is never made to look slower than it is.
4. **Bytes** are counted both ways, pushed and pulled (:func:`total_bytes`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpsjax._checks import check_fraction, check_int, check_number

__all__ = [
    "LEVEL",
    "SEEDS",
    "bootstrap_ratio",
    "censored_times",
    "extend_grid",
    "on_edge",
    "rank_key",
    "time_verdict",
    "total_bytes",
    "tune",
]

LEVEL = 0.95
"""The confidence level of the bootstrap interval a verdict is read from."""

SEEDS = (1, 2, 3, 4, 5)
"""The seeds of a verdict's runs (the tuning runs on seed 0)."""


def censored_times(
    summaries: Sequence[Mapping[str, Any]], budget: float
) -> list[float]:
    """Each run's time to the target, the budget for a run that never reached
    it (a lower bound on its time).

    Raises:
      ValueError: ``budget`` is not a number > 0, or no summaries.

    Examples:
      >>> censored_times([{"time_to_target": 12.0}, {"time_to_target": None}], 60)
      [12.0, 60.0]
    """
    budget = check_number("budget", budget, low=0.0, low_inclusive=False)
    if not summaries:
        raise ValueError("a verdict needs at least one run per scheme, got none.")
    return [
        budget if s.get("time_to_target") is None else float(s["time_to_target"])
        for s in summaries
    ]


def total_bytes(summary: Mapping[str, Any]) -> int:
    """The bytes a run moved both ways: pushed and pulled.

    Examples:
      >>> total_bytes({"bytes_sent": 10, "bytes_received": 32})
      42
    """
    return int(summary.get("bytes_sent") or 0) + int(summary.get("bytes_received") or 0)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def bootstrap_ratio(
    method: Sequence[float],
    base: Sequence[float],
    *,
    level: float = LEVEL,
    resamples: int = 10_000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The ratio of mean times, method over baseline, and its percentile
    bootstrap interval at ``level``: ``(ratio, low, high)``.

    Each scheme's times are resampled with replacement on their own
    (``resamples`` times, from ``random.Random(seed)``: the same times give the
    same interval).

    Raises:
      ValueError: an empty or non-positive list of times, or a level outside
        (0, 1].

    Examples:
      >>> r, lo, hi = bootstrap_ratio([10, 11, 9], [20, 22, 18])
      >>> round(r, 2), lo < r < hi, hi < 1
      (0.5, True, True)
    """
    level = check_fraction("level", level)
    resamples = check_int("resamples", resamples, low=1)
    for name, times in (("method", method), ("base", base)):
        if not times or any(not t > 0 for t in times):
            raise ValueError(f"{name} times must be numbers > 0, got {list(times)!r}.")
    rng = random.Random(seed)
    ratios = sorted(
        _mean(rng.choices(method, k=len(method)))
        / _mean(rng.choices(base, k=len(base)))
        for _ in range(resamples)
    )
    tail = (1.0 - level) / 2
    low = ratios[max(0, math.floor(tail * resamples))]
    high = ratios[min(resamples - 1, math.ceil((1.0 - tail) * resamples) - 1)]
    return _mean(method) / _mean(base), low, high


def time_verdict(
    method: Sequence[float], base: Sequence[float], *, level: float = LEVEL
) -> tuple[str, tuple[float, float, float]]:
    """``("faster" | "slower" | "level", (ratio, low, high))``: the method's
    times against the baseline's, read from :func:`bootstrap_ratio`.

    Examples:
      >>> time_verdict([10, 11, 9], [20, 22, 18])[0]
      'faster'
      >>> time_verdict([10, 30, 20], [20, 10, 30])[0]
      'level'
    """
    interval = bootstrap_ratio(method, base, level=level)
    _, low, high = interval
    if high < 1.0:
        return "faster", interval
    if low > 1.0:
        return "slower", interval
    return "level", interval


def best_metric(summary: Mapping[str, Any]) -> float | None:
    """A run's best value of its target's metric (its best accuracy where the
    summary names no metric), or ``None`` where it has none that is finite.

    Examples:
      >>> best_metric({"best_metric": 2.9, "best_accuracy": 0.3})
      2.9
      >>> best_metric({"best_accuracy": 0.8}), best_metric({"best_metric": None})
      (0.8, None)
    """
    best = summary.get("best_metric", summary.get("best_accuracy"))
    return best if best is not None and math.isfinite(best) else None


def rank_key(summary: Mapping[str, Any]) -> tuple:
    """Sorts tuning runs, best first: a diverged run last, then sooner to the
    target, then a better best value of the target's metric (its direction
    from the summary's ``higher_is_better``; accuracy up by default)."""
    diverged = summary.get("diverged_at") is not None
    t = summary.get("time_to_target")
    best = best_metric(summary)
    higher = summary.get("higher_is_better", True)
    best_key = math.inf if best is None else (-best if higher else best)
    return (diverged, t is None, t if t is not None else 0.0, best_key)


def on_edge(grid: Sequence[float], best: float) -> str | None:
    """``"low"`` or ``"high"`` when ``best`` is the grid's lowest or highest
    value (a grid of one value is on both: ``"both"``), else ``None``.

    Examples:
      >>> on_edge([0.1, 0.2, 0.4], 0.4), on_edge([0.1, 0.2, 0.4], 0.2)
      ('high', None)
    """
    if len(set(grid)) == 1:
        return "both"
    if best == min(grid):
        return "low"
    if best == max(grid):
        return "high"
    return None


def extend_grid(grid: Sequence[float], edge: str, factor: float = 2.0) -> float:
    """The next value beyond the grid's ``edge``: its highest times
    ``factor`` or its lowest divided by it; an all-int grid stays int (and
    moves by at least 1; never below 1).

    Raises:
      ValueError: ``edge`` is not low or high, or ``factor`` is not > 1.

    Examples:
      >>> extend_grid([0.1, 0.2, 0.4], "high"), extend_grid([2, 4, 8], "low")
      (0.8, 1)
    """
    factor = check_number("factor", factor, low=1.0, low_inclusive=False)
    if edge not in ("low", "high"):
        raise ValueError(f"edge must be one of low, high, got {edge!r}.")
    integral = all(isinstance(v, int) and not isinstance(v, bool) for v in grid)
    if edge == "high":
        value = max(grid) * factor
        return max(round(value), max(grid) + 1) if integral else value
    value = min(grid) / factor
    return max(1, min(round(value), min(grid) - 1)) if integral else value


def tune(
    evaluate: Callable[[dict[str, Any]], Mapping[str, Any]],
    knobs: Mapping[str, Sequence[Any]],
    *,
    budget: int,
    factor: float = 2.0,
    max_extensions: int = 4,
) -> tuple[dict[str, Any], list[tuple[dict[str, Any], Mapping[str, Any]]]]:
    """A coordinate search over ``knobs`` within ``budget`` runs.

    Args:
      evaluate: runs one point (``{knob: value}``) on the tuning seed and
        returns its summary (``time_to_target``, ``diverged_at``,
        ``best_metric``...). A point already run is not run again.
      knobs: each knob's starting grid (a dotted config path to values).
      budget: the number of runs allowed (the same for every scheme that is
        compared).
      factor: how far an edge is extended (see :func:`extend_grid`).
      max_extensions: extensions of one knob's grid per pass at most.

    Returns:
      ``(chosen, trials)``: the best point found and every ``(point,
      summary)`` run, in order.

    Raises:
      ValueError: no knobs, an empty grid, or a budget < 1.

    Examples:
      >>> def run(p):  # the best step size is 0.8
      ...     return {"time_to_target": abs(math.log2(p["lr"] / 0.8)) + 1}
      >>> chosen, trials = tune(run, {"lr": [0.1, 0.2, 0.4]}, budget=10)
      >>> chosen, len(trials)
      ({'lr': 0.8}, 5)
    """
    budget = check_int("budget", budget, low=1)
    if not knobs or any(len(grid) == 0 for grid in knobs.values()):
        raise ValueError("tune needs at least one knob, each with a non-empty grid.")
    grids = {name: sorted(set(grid)) for name, grid in knobs.items()}
    point = {name: grid[(len(grid) - 1) // 2] for name, grid in grids.items()}
    seen: dict[tuple, Mapping[str, Any]] = {}
    trials: list[tuple[dict[str, Any], Mapping[str, Any]]] = []

    def run(candidate: dict[str, Any]) -> Mapping[str, Any] | None:
        key = tuple(sorted(candidate.items()))
        if key not in seen:
            if len(trials) >= budget:
                return None
            seen[key] = evaluate(dict(candidate))
            trials.append((dict(candidate), seen[key]))
        return seen[key]

    changed = True
    while changed and len(trials) < budget:
        changed = False
        for name, grid in grids.items():
            best = _best_on_grid(run, point, name, grid)
            for _ in range(max_extensions):
                edge = on_edge(grid, best)
                if edge is None or edge == "both":
                    break
                grid.append(extend_grid(grid, edge, factor))
                grid.sort()
                new_best = _best_on_grid(run, point, name, grid)
                if new_best == best:
                    break
                best = new_best
            if best != point[name]:
                point[name] = best
                changed = True
    chosen = min(trials, key=lambda trial: rank_key(trial[1]))[0]
    return chosen, trials


def _best_on_grid(run, point, name, grid) -> Any:
    """The grid's value whose run (``point`` with knob ``name`` at it) ranks
    best, among those the budget let run. The knob's current value runs
    first (at the start, the config's: the middle of its grid), so that a
    budget spent within the grid has run the value the config holds."""
    ranked = []
    current = [v for v in grid if v == point[name]]
    for value in current + [v for v in grid if v != point[name]]:
        summary = run({**point, name: value})
        if summary is not None:
            ranked.append((rank_key(summary), value))
    return min(ranked)[1] if ranked else point[name]
