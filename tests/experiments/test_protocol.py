"""The verdict protocol: tuning with grid extension, the bootstrap test, bytes."""

import doctest
import math

import pytest

from experiments import protocol
from experiments.protocol import (
    bootstrap_ratio,
    censored_times,
    extend_grid,
    on_edge,
    rank_key,
    time_verdict,
    total_bytes,
    tune,
)


def test_module_doctests():
    assert doctest.testmod(protocol).failed == 0


def test_the_interval_holds_the_ratio_and_is_reproducible():
    method, base = [9.0, 10.0, 11.0, 10.5, 9.5], [19.0, 20.0, 21.0, 20.5, 19.5]
    ratio, low, high = bootstrap_ratio(method, base)
    assert ratio == pytest.approx(0.5)
    assert low < ratio < high < 0.6
    assert bootstrap_ratio(method, base) == (ratio, low, high)
    # A wider level gives a wider interval.
    _, low99, high99 = bootstrap_ratio(method, base, level=0.99)
    assert low99 <= low and high99 >= high


def test_verdicts_read_the_interval():
    assert time_verdict([10, 11, 9, 10, 10], [20, 22, 18, 20, 20])[0] == "faster"
    assert time_verdict([20, 22, 18, 20, 20], [10, 11, 9, 10, 10])[0] == "slower"
    # Means 5% apart with 30% spreads: level.
    verdict, (_, low, high) = time_verdict([7, 13, 10, 14, 6.5], [10, 14, 7, 12, 9])
    assert verdict == "level" and low < 1 < high


def test_the_interval_covers_the_true_ratio_about_as_often_as_stated():
    # Two schemes whose times are drawn with a true ratio of 0.8: over many
    # repeats of 5 seeds each, the 95% interval holds 0.8 in most of them
    # (a percentile bootstrap of 5 samples runs somewhat narrow).
    import random

    rng = random.Random(1)
    covered = 0
    repeats = 200
    for i in range(repeats):
        a = [rng.gauss(8.0, 1.0) for _ in range(5)]
        b = [rng.gauss(10.0, 1.0) for _ in range(5)]
        _, low, high = bootstrap_ratio(a, b, resamples=2000, seed=i)
        covered += low <= 0.8 <= high
    assert 0.8 <= covered / repeats <= 1.0


def test_a_run_that_misses_the_target_counts_as_the_budget():
    runs = [{"time_to_target": 5.0}, {"time_to_target": None}]
    assert censored_times(runs, 60) == [5.0, 60.0]
    with pytest.raises(ValueError, match=r"budget must be > 0\.0, got 0\.0"):
        censored_times(runs, 0)
    with pytest.raises(ValueError, match="at least one run"):
        censored_times([], 60)


def test_bytes_count_both_ways():
    assert total_bytes({"bytes_sent": 3, "bytes_received": 4}) == 7
    assert total_bytes({"bytes_sent": 3}) == 3


def test_rank_key_puts_diverged_then_unreached_last_and_follows_the_metric():
    fast = {"time_to_target": 5.0}
    slow = {"time_to_target": 9.0}
    unreached_good = {"time_to_target": None, "best_metric": 0.8}
    unreached_bad = {"time_to_target": None, "best_metric": 0.6}
    diverged = {"time_to_target": 1.0, "diverged_at": 2.0}
    ranked = sorted([diverged, unreached_bad, slow, unreached_good, fast], key=rank_key)
    assert ranked == [fast, slow, unreached_good, unreached_bad, diverged]
    # A loss target: lower is better.
    low = {"time_to_target": None, "best_metric": 2.5, "higher_is_better": False}
    high = {"time_to_target": None, "best_metric": 2.9, "higher_is_better": False}
    assert sorted([high, low], key=rank_key) == [low, high]
    nan = {"time_to_target": None, "best_metric": math.nan}
    assert sorted([nan, unreached_bad], key=rank_key) == [unreached_bad, nan]


def test_edges_and_their_extension():
    assert on_edge([0.1, 0.2], 0.1) == "low"
    assert on_edge([0.5], 0.5) == "both"
    assert extend_grid([0.1, 0.2], "low") == pytest.approx(0.05)
    assert extend_grid([1, 2], "low") == 1
    assert extend_grid([2, 3], "high", factor=1.2) == 4  # ints move by >= 1
    with pytest.raises(ValueError, match="edge must be one of low, high"):
        extend_grid([1.0], "both")
    with pytest.raises(ValueError, match=r"factor must be > 1\.0"):
        extend_grid([1.0], "high", factor=1)


def _bowl(best):
    """A tuning run whose time to target grows with the log-distance from
    ``best`` in every knob (the budget of 30 s is never exceeded)."""

    def run(point):
        t = 5 + sum(abs(math.log2(point[k] / v)) for k, v in best.items())
        return {"time_to_target": t if t < 30 else None, "best_metric": -t}

    return run


def test_tuning_extends_a_grid_until_the_best_is_inside():
    chosen, trials = tune(_bowl({"lr": 1.6}), {"lr": [0.1, 0.2, 0.4]}, budget=20)
    assert chosen == {"lr": 1.6}
    values = sorted(p["lr"] for p, _ in trials)
    assert values == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 3.2])


def test_tuning_searches_every_knob_within_the_budget():
    best = {"lr": 0.05, "momentum_steps": 8}
    chosen, trials = tune(
        _bowl(best), {"lr": [0.1, 0.2, 0.4], "momentum_steps": [2, 4, 8]}, budget=40
    )
    assert chosen == best
    assert len(trials) <= 40
    # A point is never run twice.
    points = [tuple(sorted(p.items())) for p, _ in trials]
    assert len(points) == len(set(points))
    # A small budget is a hard cap, and the best of what ran is chosen.
    chosen, trials = tune(_bowl({"lr": 0.05}), {"lr": [0.1, 0.2, 0.4]}, budget=2)
    assert len(trials) == 2 and chosen == {"lr": 0.1}


def test_tuning_refuses_bad_input():
    with pytest.raises(ValueError, match="budget must be an int >= 1"):
        tune(_bowl({"lr": 1}), {"lr": [1]}, budget=0)
    with pytest.raises(ValueError, match="at least one knob"):
        tune(_bowl({"lr": 1}), {}, budget=3)
    with pytest.raises(ValueError, match="method times must be numbers > 0"):
        bootstrap_ratio([], [1.0])
    with pytest.raises(ValueError, match="level must be in"):
        bootstrap_ratio([1.0], [1.0], level=1.5)
