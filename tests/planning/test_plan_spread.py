"""The plan counts how much steps vary: a barrier round waits for the slowest
worker of that round, not for the slowest median.

Synthetic profiles for the arithmetic (checked against an independent draw
and a closed form), one real profile for the measurement, and the field's
way through JSON, a slowdown and a re-plan.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from hpsjax.planning._solve import _expected_slowest
from hpsjax.profiling import (
    DeviceProfile,
    Replanner,
    WorkerProfile,
    WorkPlan,
    plan,
    profile,
)
from hpsjax.profiling._profile import _filled_spread

SPEEDS = [100.0, 100.0, 200.0, 400.0]  # samples per second


def _workers(spread=None, speeds=SPEEDS, transfer=0.01):
    out = []
    for i, s in enumerate(speeds):
        w = WorkerProfile.synthetic(i, s, transfer_seconds=transfer)
        if spread is not None:
            d = w.devices[0]
            w = dataclasses.replace(
                w,
                devices=(
                    dataclasses.replace(d, step_spread=(spread,) * len(d.batch_sizes)),
                ),
            )
        out.append(w)
    return out


def _independent_expected_max(compute, spreads, transfers, draws=400_000):
    # Another seed and far more draws than the planner's.
    rng = np.random.default_rng(12345)
    c, t, s = (np.asarray(x, np.float64) for x in (compute, transfers, spreads))
    sigma = np.sqrt(np.log1p(s**2))
    x = np.exp(sigma * rng.standard_normal((draws, len(c))))
    return float(np.mean(np.max(c * x + t, axis=1)))


def test_one_worker_waits_for_its_own_mean():
    # One lognormal step of median c and variation s has the mean
    # c * sqrt(1 + s^2): the round of a lone worker.
    for s in (0.1, 0.3, 0.6):
        got = _expected_slowest([0.1], [s], [0.02])
        assert got == pytest.approx(0.1 * math.sqrt(1 + s**2) + 0.02, rel=0.02)


@pytest.mark.parametrize(
    "compute, spreads",
    [
        ([0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3]),
        ([0.1, 0.1, 0.05, 0.02], [0.5, 0.1, 0.3, 0.0]),
        ([0.2, 0.1], [0.05, 0.6]),
    ],
)
def test_expected_slowest_matches_an_independent_draw(compute, spreads):
    transfers = [0.01] * len(compute)
    got = _expected_slowest(compute, spreads, transfers)
    assert got == pytest.approx(
        _independent_expected_max(compute, spreads, transfers), rel=0.02
    )
    # Above the slowest median, and no spread gives exactly that.
    slowest = max(c + t for c, t in zip(compute, transfers, strict=True))
    assert got > slowest
    assert _expected_slowest(compute, [0.0] * len(compute), transfers) == slowest


def test_spread_lengthens_a_barrier_round_and_its_idle():
    still = plan(_workers(), "hps", global_batch=256)
    varied = plan(_workers(spread=0.4), "hps", global_batch=256)
    # The batches balance the medians either way.
    assert [w.batch_size for w in varied.workers] == [
        w.batch_size for w in still.workers
    ]
    assert varied.round_time > 1.1 * still.round_time
    assert varied.idle_fraction > still.idle_fraction + 0.05
    compute = [w.local_steps * w.step_time for w in still.workers]
    assert varied.round_time == pytest.approx(
        _independent_expected_max(compute, [0.4] * 4, [0.01] * 4), rel=0.02
    )
    # A function of the profiles: the same plan every time.
    assert plan(_workers(spread=0.4), "hps", global_batch=256) == varied
    # Each device's spread at its batch is in the plan.
    assert all(w.devices[0].step_spread == pytest.approx(0.4) for w in varied.workers)


def test_local_steps_average_the_spread_out():
    one = plan(_workers(spread=0.4), "equal", global_batch=256)
    many = plan(_workers(spread=0.4), "equal", global_batch=256, local_steps=16)
    calm_one = plan(_workers(), "equal", global_batch=256)
    calm_many = plan(_workers(), "equal", global_batch=256, local_steps=16)
    # Relative to the round without spread, 16 steps add a quarter as much.
    extra_one = one.round_time / calm_one.round_time - 1
    extra_many = many.round_time / calm_many.round_time - 1
    assert extra_many < 0.4 * extra_one


def test_schemes_without_a_barrier_are_not_changed_by_spread():
    for scheme in ("adsp", "dylu"):
        assert (
            plan(_workers(spread=0.5), scheme, global_batch=256).round_time
            == plan(_workers(), scheme, global_batch=256).round_time
        )


def test_spread_travels_through_json_slowdown_and_replan():
    w = _workers(spread=0.3)[0]
    assert WorkerProfile.from_json(w.to_json()) == w
    slowed = w.with_slowdown(4.0)
    # The injected sleep follows the typical step: longer, not more varied.
    assert slowed.devices[0].step_spread == pytest.approx((0.075, 0.075))
    assert slowed.devices[0].step_times == pytest.approx(
        tuple(4 * t for t in w.devices[0].step_times)
    )
    # A profile written before the field existed reads as unmeasured.
    old = json.loads(w.to_json())
    del old["devices"][0]["step_spread"]
    assert WorkerProfile.from_json(json.dumps(old)).devices[0].step_spread is None

    p = plan(_workers(spread=0.4), "hps", global_batch=256)
    assert WorkPlan.from_json(p.to_json()) == p
    replanner = Replanner(p, cooldown=0.0, min_observations=2)
    new = None
    for k in range(4):
        # Worker 3 runs at half its planned speed.
        w3 = p.worker(3)
        new = replanner.observe(3, w3.batch_size, 2 * w3.step_time, now=float(k)) or new
    assert new is not None and new.revision == 1
    compute = [x.local_steps * x.step_time for x in new.workers]
    spreads = [x.devices[0].step_spread for x in new.workers]
    assert all(s == pytest.approx(0.4) for s in spreads)
    assert new.round_time == pytest.approx(
        _independent_expected_max(compute, spreads, [0.01] * 4), rel=0.02
    )


@pytest.mark.parametrize(
    "spread, message",
    [
        ((0.1,), "1 step spreads for 2 batch sizes"),
        ((0.1, -0.2), "step spread"),
        ((0.1, float("nan")), "step spread"),
    ],
)
def test_a_bad_spread_is_one_line(spread, message):
    with pytest.raises(ValueError, match=message) as e:
        DeviceProfile(0, "cpu", "cpu", (8, 16), (0.1, 0.2), step_spread=spread)
    assert "\n" not in str(e.value)


def test_a_real_profile_measures_the_spread_from_enough_steps():
    def step(w, batch):
        return w - 0.01 * jnp.mean(batch @ w)

    params = jnp.ones((64,), jnp.float32)

    def make_batch(b):
        return jnp.ones((b, 64), jnp.float32)

    measured = profile(step, params, make_batch, batch_sizes=(8, 32), repeats=6)
    for d in measured.devices:
        assert d.step_spread is not None and len(d.step_spread) == 2
        assert all(math.isfinite(x) and x >= 0 for x in d.step_spread)
    # Too few steps for a spread: none is claimed.
    few = profile(step, params, make_batch, batch_sizes=(8, 32), repeats=2)
    assert all(d.step_spread is None for d in few.devices)


def test_a_size_with_too_few_steps_takes_the_nearest_measured_spread():
    assert _filled_spread((8, 16, 64), (0.2, None, 0.1)) == (0.2, 0.2, 0.1)
    assert _filled_spread((8, 16, 64), (None, None, 0.1)) == (0.1, 0.1, 0.1)
    assert _filled_spread((8, 16), (None, None)) is None


def test_the_measured_round_as_median_or_mean():
    from experiments.backends import measured_round

    def rounds(starts):
        return [{"event": "round", "time": t} for t in starts]

    # After the first 3 rounds: gaps 1, 1, 4 and 2, 2.
    records = [rounds([0, 5, 6, 7, 8, 9, 13]), rounds([0, 1, 2, 3, 5, 7])]
    assert measured_round(records) == 2.0
    assert measured_round(records, statistic="mean") == pytest.approx(10 / 5)
    # Gaps 1, 1, 7: one long round moves the mean, not the median.
    skewed = [rounds([0, 1, 2, 3, 4, 5, 12])]
    assert measured_round(skewed) == 1.0
    assert measured_round(skewed, statistic="mean") == 3.0
    assert measured_round([rounds([0, 1])]) is None
    with pytest.raises(ValueError, match="statistic must be"):
        measured_round(records, statistic="max")
