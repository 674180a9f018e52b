"""Tests of work planning (H-PS, ASHL, ADSP, equal) and re-planning."""

import dataclasses
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from hpsjax.profiling import (
    LR_SCALINGS,
    SCHEMES,
    DeviceProfile,
    LinearFit,
    Replanner,
    TransferProfile,
    WorkerProfile,
    WorkPlan,
    plan,
)

W = WorkerProfile.synthetic


def _speeds(*speeds, **kwargs):
    return [W(i, s, **kwargs) for i, s in enumerate(speeds)]


def _fixed_cost_workers():
    """Steps of 50 or 100 ms fixed cost and 0.1 ms per sample, alternating."""
    return [W(i, 1e4, overhead=0.1 if i % 2 == 0 else 0.05) for i in range(4)]


def _batches(work_plan):
    return [w.batch_size for w in work_plan.workers]


def _steps(work_plan):
    return [w.local_steps for w in work_plan.workers]


# --- hps -------------------------------------------------------------------------


def test_hps_batches_follow_throughput():
    p = plan(_speeds(1, 1, 2, 4), "hps", global_batch=256)
    assert _batches(p) == [32, 32, 64, 128]
    assert _steps(p) == [1, 1, 1, 1]
    assert [w.lr_scale for w in p.workers] == [1.0] * 4
    assert p.round_time == pytest.approx(32.0)
    assert p.idle_fraction == pytest.approx(0.0, abs=1e-12)
    assert p.reference_batch == 64.0


def test_equal_baseline_idles_where_hps_does_not():
    p = plan(_speeds(1, 1, 2, 4), "equal", global_batch=256)
    assert _batches(p) == [64, 64, 64, 64]
    assert _steps(p) == [1, 1, 1, 1]
    assert [w.lr_scale for w in p.workers] == [1.0] * 4
    assert p.round_time == pytest.approx(64.0)
    # busy 64 + 64 + 32 + 16 of 4 * 64 device-seconds
    assert p.idle_fraction == pytest.approx(1 - 176 / 256)


def test_hps_counts_transfer_and_overhead():
    workers = [
        W("fast-link", 10.0, transfer_seconds=0.0),
        W("slow-link", 10.0, transfer_seconds=1.0),
    ]
    p = plan(workers, global_batch=40)
    # 10 tau + 10 (tau - 1) = 40  ->  tau = 2.5
    assert _batches(p) == [25, 15]
    assert p.round_time == pytest.approx(2.5)
    workers = [W(0, 10.0, overhead=0.5), W(1, 10.0)]
    assert _batches(plan(workers, global_batch=40)) == [18, 22]
    # H local steps per round scale the compute but not the transfer.
    workers = [W(0, 10.0, transfer_seconds=2.0), W(1, 10.0)]
    p = plan(workers, global_batch=40, local_steps=2)
    # 2 b0 / 10 + 2 = 2 b1 / 10, b0 + b1 = 40  ->  b0 = 15
    assert _batches(p) == [15, 25]
    assert _steps(p) == [2, 2]
    assert p.round_time == pytest.approx(5.0)


def test_hps_memory_cap_redistributes_the_rest():
    workers = _speeds(1, 1, 2)
    workers.append(W(3, 4, bytes_per_sample=10, memory_capacity=1000))
    p = plan(workers, global_batch=256, memory_fraction=1.0)
    # worker 3 holds at most 100; the other 156 go 1:1:2
    assert _batches(p) == [39, 39, 78, 100]
    assert p.workers[3].devices[0].max_batch == 100
    p = plan(workers, global_batch=256)
    # 90% of the capacity: 90 samples; 166 over 1:1:2 = 41.5, 41.5, 83
    assert _batches(p) == [42, 41, 83, 90]
    assert p.idle_fraction > 0


def test_hps_fixed_memory_counts_against_the_cap():
    w = W(0, 1.0, bytes_per_sample=10, base_bytes=500, memory_capacity=1000)
    assert w.devices[0].max_batch(memory_fraction=1.0) == 50
    p = plan([w, W(1, 1.0)], global_batch=200, memory_fraction=1.0)
    assert _batches(p) == [50, 150]


def test_memory_cap_is_exact_for_memory_on_a_line():
    # Whole bytes on a line fit to the exact line, so the cap is the exact
    # quotient on any machine: a least-squares solve that rounds to 268.99...
    # would take a sample off.
    for base, per_sample, capacity in [
        (500, 10, 1000),
        (1998, 19, 7109),
        (37, 7, 1000),
        (0, 3, 3 * 4096),
        (1110, 58, 1110 + 58 * 269 + 57),
    ]:
        w = W(0, 1.0, bytes_per_sample=per_sample, base_bytes=base)
        device = dataclasses.replace(w.devices[0], memory_capacity=capacity)
        assert device.memory_fit == LinearFit(base, per_sample)
        want = (capacity - base) // per_sample
        assert device.max_batch(memory_fraction=1.0) == want, (base, per_sample)


def test_batch_over_total_memory_is_an_error():
    workers = [W(i, 1.0, bytes_per_sample=1, memory_capacity=100) for i in range(2)]
    with pytest.raises(ValueError, match="does not fit the devices' memory"):
        plan(workers, global_batch=181)
    assert _batches(plan(workers, global_batch=180)) == [90, 90]
    tiny = W(0, 1.0, bytes_per_sample=1, base_bytes=200, memory_capacity=100)
    with pytest.raises(ValueError, match="not even 1 sample"):
        plan([tiny, W(1, 1.0)], global_batch=10)


def test_hps_splits_a_worker_over_its_devices():
    workers = [W("a", [100.0, 300.0]), W("b", 200.0)]
    p = plan(workers, global_batch=600)
    assert [d.batch_size for d in p.workers[0].devices] == [100, 300]
    assert [d.batch_size for d in p.workers[1].devices] == [200]
    assert _batches(p) == [400, 200]
    assert p.workers[0].step_time == pytest.approx(1.0)


def test_hps_minimum_batch_per_device():
    p = plan(_speeds(1, 1000), global_batch=100, min_device_batch=8)
    assert _batches(p) == [8, 92]
    with pytest.raises(ValueError, match="smaller than the 2 devices"):
        plan(_speeds(1, 1000), global_batch=15, min_device_batch=8)


def test_fixed_cost_plan_keeps_a_minimum_batch_and_warns(caplog):
    # Finishing together alone gives the slow-overhead workers one sample each.
    assert _batches(plan(_fixed_cost_workers(), global_batch=256, min_batch=1)) == [
        1,
        127,
        1,
        127,
    ]
    with caplog.at_level("WARNING", logger="hpsjax.profiling"):
        p = plan(_fixed_cost_workers(), global_batch=256)
    assert p.min_batch == 8 and min(_batches(p)) >= 8
    assert _batches(p) == [8, 120, 8, 120]
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert "[1, 127, 1, 127]" in record.getMessage()
    assert "workers [0, 2] get min_batch=8" in record.getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="hpsjax.profiling"):
        p = plan(_fixed_cost_workers(), global_batch=256, min_batch=40)
    assert _batches(p) == [40, 88, 40, 88] and len(caplog.records) == 1
    # A balanced plan above the minimum logs nothing.
    caplog.clear()
    with caplog.at_level("WARNING", logger="hpsjax.profiling"):
        plan(_speeds(1, 1, 2, 4), global_batch=256)
    assert caplog.records == []
    # The minimum of a worker is spread over its devices.
    two = [W(0, [1e4, 1e4], overhead=0.1), W(1, 1e4, overhead=0.01)]
    p = plan(two, global_batch=256, min_batch=30)
    assert [d.batch_size for d in p.workers[0].devices] == [15, 15]
    with pytest.raises(ValueError, match="smaller than the 4 workers times min_batch"):
        plan(_fixed_cost_workers(), global_batch=256, min_batch=65)


def test_rounding_keeps_the_global_batch():
    assert _batches(plan(_speeds(1, 1, 1), global_batch=100)) == [34, 33, 33]
    rng = random.Random(0)
    for _ in range(50):
        speeds = [rng.uniform(0.1, 10.0) for _ in range(rng.randint(1, 9))]
        batch = rng.randint(len(speeds), 5000)
        p = plan(_speeds(*speeds), global_batch=batch, min_batch=1)
        assert sum(_batches(p)) == batch
        assert min(_batches(p)) >= 1
        # largest remainder: no worker is more than one sample from its share
        exact = [batch * s / sum(speeds) for s in speeds]
        assert all(abs(b - x) < 1 for b, x in zip(_batches(p), exact, strict=True))


# --- ashl / adsp -----------------------------------------------------------------


def _ashl_workers(transfer=0.5):
    # one sample each: t_i = 1, 0.5, 0.25 seconds per step
    return _speeds(1.0, 2.0, 4.0, transfer_seconds=transfer)


def test_ashl_local_steps_equalise_rounds():
    p = plan(_ashl_workers(), "ashl", global_batch=3, local_steps=2)
    assert _batches(p) == [1, 1, 1]
    assert [w.step_time for w in p.workers] == pytest.approx([1.0, 0.5, 0.25])
    # L = 2 * 1 + 0.5 = 2.5; H_i = (2.5 - 0.5) / t_i
    assert _steps(p) == [2, 4, 8]
    assert [w.round_time for w in p.workers] == pytest.approx([2.5] * 3)
    assert p.idle_fraction == pytest.approx(0.0, abs=1e-12)
    assert [w.lr_scale for w in p.workers] == [1.0, 1.0, 1.0]


def test_ashl_slowest_gets_h_min_and_rounds_to_nearest():
    p = plan(_ashl_workers(), "ashl", global_batch=3, local_steps=1)
    # L = 1.5: H = 1, 1 / 0.5, 1 / 0.25
    assert _steps(p) == [1, 2, 4]
    p = plan(_speeds(1.0, 3.0, transfer_seconds=0.0), "ashl", global_batch=2)
    assert _steps(p) == [1, 3]
    # (1 - 0.2) / 0.3 = 2.67 -> 3
    workers = [W(0, 1.0, transfer_seconds=0.0), W(1, 1 / 0.3, transfer_seconds=0.2)]
    assert _steps(plan(workers, "ashl", global_batch=2)) == [1, 3]
    p = plan(_ashl_workers(), "ashl", global_batch=3, local_steps=2, max_local_steps=6)
    assert _steps(p) == [2, 4, 6]


def test_ashl_slowest_includes_its_transfer():
    workers = [W(0, 1.0, transfer_seconds=0.0), W(1, 2.0, transfer_seconds=1.7)]
    p = plan(workers, "ashl", global_batch=2)
    # worker 1's round, 0.5 + 1.7, is the longest: it gets H_min; 2.2 / 1 -> 2
    assert _steps(p) == [2, 1]


def test_adsp_commit_intervals():
    workers = _ashl_workers(transfer=0.1)
    p = plan(workers, "adsp", global_batch=3, check_period=8.0, commits_per_period=4)
    assert _steps(p) == [2, 4, 8]
    assert p.commit_interval == pytest.approx(2.0)
    assert p.check_period == pytest.approx(8.0)
    assert [w.round_time for w in p.workers] == pytest.approx([2.0] * 3)
    p = plan(workers, "adsp", global_batch=3, check_period=8.0)
    assert p.commits_per_period == 8
    assert _steps(p) == [1, 2, 4]
    p = plan(workers, "adsp", global_batch=3, commits_per_period=5, local_steps=3)
    assert p.commit_interval == pytest.approx(3.0)
    assert p.check_period == pytest.approx(15.0)
    assert _steps(p) == [3, 6, 12]
    p = plan(workers, "adsp", global_batch=3)
    assert (p.commits_per_period, _steps(p)) == (1, [1, 2, 4])


def test_adsp_slow_link_stretches_the_interval():
    workers = [W(0, 1.0, transfer_seconds=0.1), W(1, 2.0, transfer_seconds=3.0)]
    p = plan(workers, "adsp", global_batch=2, check_period=8.0, commits_per_period=4)
    assert _steps(p) == [2, 4]
    assert [w.round_time for w in p.workers] == pytest.approx([2.0, 3.0])
    assert p.idle_fraction == pytest.approx(1 - 5 / 6)


def test_equal_share_must_fit_memory():
    workers = [W(0, 1.0, bytes_per_sample=1, memory_capacity=10), W(1, 1.0)]
    with pytest.raises(ValueError, match="equal share of 50"):
        plan(workers, "equal", global_batch=100, memory_fraction=1.0)
    assert _batches(plan(workers, "hps", global_batch=100, memory_fraction=1.0)) == [
        10,
        90,
    ]


# --- step-size scale -------------------------------------------------------------


def test_lr_scaling_rules():
    workers = _speeds(1, 1, 2, 4)
    # One factor for all workers, from the global batch and the reference.
    p = plan(workers, global_batch=256, lr_scaling="sqrt")
    assert [w.lr_scale for w in p.workers] == pytest.approx([2.0] * 4)
    p = plan(workers, global_batch=256)
    assert p.lr_scaling == "none" and [w.lr_scale for w in p.workers] == [1.0] * 4
    p = plan(workers, global_batch=256, lr_scaling="linear", reference_batch=128)
    assert [w.lr_scale for w in p.workers] == [2.0] * 4
    p = plan(workers, global_batch=256, lr_scaling="linear")
    assert [w.lr_scale for w in p.workers] == [4.0] * 4


def _bsp_step(work_plan, gradient=1.0):
    """The step of one BSP round of sgd(1.0) on equal gradients under a plan.

    Each worker pushes ``lr_scale * gradient`` with its samples, as the worker
    runtime and the simulator do; the server weighs the pushes by the samples.
    """
    import jax.numpy as jnp
    import optax

    from hpsjax.ps import ServerCore

    core = ServerCore({"w": jnp.zeros(())}, optax.sgd(1.0), "bsp")
    for w in work_plan.workers:
        core.join(w.worker_id, now=0.0)
    for w in work_plan.workers:
        update = {"w": jnp.asarray(w.lr_scale * gradient, jnp.float32)}
        core.push(
            w.worker_id,
            update,
            version=0,
            now=1.0,
            num_samples=w.batch_size * w.local_steps,
        )
    assert core.version == 1
    return -float(core.params["w"])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_plan_changes_the_step_for_equal_gradients(scheme):
    # Unequal speeds, and a fixed-cost-dominated pair, give unequal batches.
    for workers, batch in [
        (_speeds(1, 3.34), 256),
        (_speeds(1, 1, 2, 4), 256),
        (_fixed_cost_workers(), 256),
    ]:
        p = plan(workers, scheme, global_batch=batch)
        assert _bsp_step(p) == pytest.approx(1.0, rel=1e-6)
        p = plan(workers, scheme, global_batch=batch, lr_scaling="linear")
        assert _bsp_step(p) == pytest.approx(len(workers), rel=1e-6)


# --- JSON and bad input ----------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_plan_json_round_trip(scheme):
    workers = [
        W("a", [100.0, 300.0], transfer_seconds=0.3, overhead=0.01),
        W("b", 200.0, bytes_per_sample=4, memory_capacity=4000),
        W(7, 50.0, transfer_seconds=0.1),
    ]
    p = plan(workers, scheme, global_batch=600, local_steps=2)
    text = p.to_json()
    assert json.loads(text)["version"] == 1
    again = WorkPlan.from_json(text)
    assert again == p
    assert again.worker(7).worker_id == 7
    assert again.worker("a").devices[1].batch_size == p.workers[0].devices[1].batch_size


def test_plan_json_rejects_bad_text():
    text = plan(_speeds(1, 2), global_batch=10).to_json()
    data = json.loads(text)
    with pytest.raises(ValueError, match="version 2 is not supported"):
        WorkPlan.from_json(json.dumps({**data, "version": 2}))
    with pytest.raises(ValueError, match="not a JSON WorkPlan"):
        WorkPlan.from_json("{")
    with pytest.raises(ValueError, match="format key"):
        WorkPlan.from_json("[1, 2]")
    with pytest.raises(ValueError, match="do not sum to global_batch"):
        WorkPlan.from_json(json.dumps({**data, "global_batch": 11}))
    broken = json.loads(text)
    del broken["workers"][0]["local_steps"]
    with pytest.raises(ValueError, match="malformed"):
        WorkPlan.from_json(json.dumps(broken))
    with pytest.raises(ValueError, match="unknown scheme"):
        WorkPlan.from_json(json.dumps({**data, "scheme": "bsp"}))
    # A plan that scales workers by their batches would weight them twice.
    twice = json.loads(text)
    twice["workers"][0]["lr_scale"] = 0.5
    with pytest.raises(ValueError, match="would weight batches twice"):
        WorkPlan.from_json(json.dumps(twice))


def test_profile_json_round_trip():
    w = W("w", [10.0, 20.0], bytes_per_sample=8, base_bytes=100, memory_capacity=900)
    w = dataclasses.replace(
        w,
        transfer=TransferProfile(
            round_trip_seconds=0.25,
            push_seconds=0.05,
            pull_seconds=0.2,
            push_bytes=100,
            pull_bytes=400,
            method="measured",
        ),
        param_count=100,
        param_bytes=400,
        profile_seconds=1.5,
        compile_seconds=0.5,
    )
    again = WorkerProfile.from_json(w.to_json())
    assert again == w
    data = json.loads(w.to_json())
    with pytest.raises(ValueError, match="version 9 is not supported"):
        WorkerProfile.from_json(json.dumps({**data, "version": 9}))
    data["devices"][0]["step_times"] = [1.0, -1.0]
    with pytest.raises(ValueError, match="step time must be a finite number > 0"):
        WorkerProfile.from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scheme": "bsp"}, r"unknown scheme 'bsp'; valid schemes: \('hps', "),
        ({"lr_scaling": "cubic"}, "unknown lr_scaling 'cubic'; valid values"),
        ({"global_batch": 3}, "global batch 3 is smaller than the 4 devices"),
        ({"global_batch": 0}, "global_batch must be an int >= 1"),
        ({"global_batch": 8.0}, "global_batch must be an int"),
        ({"local_steps": 0}, "local_steps must be an int >= 1"),
        ({"min_device_batch": 0}, "min_device_batch must be an int >= 1"),
        ({"min_batch": 0}, "min_batch must be an int >= 1"),
        ({"max_local_steps": 0}, "max_local_steps must be an int >= 1"),
        ({"reference_batch": -1.0}, "reference_batch must be a finite number > 0"),
        ({"memory_fraction": 0.0}, r"memory_fraction must be in \(0, 1\]"),
        ({"memory_fraction": 1.5}, r"memory_fraction must be in \(0, 1\]"),
        ({"check_period": 1.0}, "apply to 'adsp' only"),
        (
            {"scheme": "adsp", "check_period": 0.0},
            "check_period must be a finite number > 0",
        ),
        ({"scheme": "adsp", "commits_per_period": 0}, "commits_per_period must"),
    ],
)
def test_plan_bad_arguments(kwargs, message):
    kwargs = {"scheme": "hps", "global_batch": 256, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan(_speeds(1, 1, 2, 4), **kwargs)


def test_plan_bad_profiles():
    with pytest.raises(ValueError, match="profiles is empty"):
        plan([], global_batch=8)
    with pytest.raises(ValueError, match="worker ids repeat"):
        plan([W(0, 1.0), W(0, 2.0)], global_batch=8)
    with pytest.raises(ValueError, match="WorkerProfile objects"):
        plan([{"worker_id": 0}], global_batch=8)
    with pytest.raises(
        ValueError, match="samples_per_second must be a finite number > 0"
    ):
        plan([W(0, 1.0), W(1, 0.0)], global_batch=8)
    with pytest.raises(
        ValueError, match="samples_per_second must be a finite number > 0"
    ):
        W(1, [1.0, -2.0])
    with pytest.raises(ValueError, match="step time must be a finite number > 0"):
        DeviceProfile(0, "cpu", "cpu", (8, 16), (0.1, 0.0))
    with pytest.raises(ValueError, match="step time must be a finite number > 0"):
        DeviceProfile(0, "cpu", "cpu", (8, 16), (0.1, math.inf))
    with pytest.raises(ValueError, match="batch_sizes must be increasing"):
        DeviceProfile(0, "cpu", "cpu", (16, 8), (0.1, 0.2))
    with pytest.raises(ValueError, match="2 step times for 3 batch sizes"):
        DeviceProfile(0, "cpu", "cpu", (8, 16, 32), (0.1, 0.2))
    with pytest.raises(ValueError, match="device ids repeat"):
        WorkerProfile(0, (W(0, 1.0).devices[0],) * 2)


def test_flat_timings_plan_through_the_largest_measurement():
    flat = DeviceProfile(0, "cpu", "cpu", (8, 64), (0.5, 0.5))
    assert flat.time_fit == LinearFit(0.5, 0.0)
    p = plan([WorkerProfile(0, (flat,)), W(1, 128.0)], global_batch=300)
    # flat device planned as 64 samples per 0.5 s = 128 samples/s
    assert _batches(p) == [150, 150]


def test_linear_fit():
    fit = LinearFit.fit([1, 2, 4], [3.0, 5.0, 9.0])
    assert fit.intercept == pytest.approx(1.0)
    assert fit.slope == pytest.approx(2.0)
    # a negative intercept is not physical: the best line through the origin
    fit = LinearFit.fit([1, 2, 3], [0.5, 2.5, 4.5])
    assert fit.intercept == 0.0
    assert fit.slope == pytest.approx((0.5 + 5 + 13.5) / 14)
    # falling times: the best constant
    assert LinearFit.fit([1, 2], [2.0, 1.0]) == LinearFit(1.5, 0.0)
    assert LinearFit.fit([4, 4], [2.0, 2.0]) == LinearFit(0.0, 0.5)
    with pytest.raises(ValueError, match="positive xs"):
        LinearFit.fit([0, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="equally long"):
        LinearFit.fit([1, 2], [1.0])


# --- re-planning -----------------------------------------------------------------


def _feed(replanner, speeds, rng, now, *, noise):
    """One step from every worker at the batch of the plan in force.

    ``speeds`` are the workers' true samples per second; measured times carry
    uniform relative noise. Returns the revised plans.
    """
    revised = []
    for w in replanner.plan.workers:
        t = w.batch_size / speeds[w.worker_id] * (1 + rng.uniform(-noise, noise))
        new = replanner.observe(w.worker_id, w.batch_size, t, now)
        if new is not None:
            revised.append(new)
    return revised


def test_replanner_ignores_noise_below_threshold():
    speeds = [1.0, 1.0, 2.0, 4.0]
    p = plan(_speeds(*speeds), global_batch=256)
    replanner = Replanner(p, threshold=0.2, window=10, cooldown=0.0)
    rng = random.Random(1)
    for k in range(200):
        assert _feed(replanner, speeds, rng, float(k), noise=0.15) == []
    assert replanner.plan is p
    assert all(abs(replanner.speed_ratio(i) - 1) < 0.1 for i in range(4))


def test_replanner_gives_a_slowed_worker_less_work():
    speeds = [1.0, 1.0, 2.0, 4.0]
    p = plan(_speeds(*speeds), global_batch=256)
    replanner = Replanner(p, threshold=0.2, window=4, cooldown=10.0)
    rng = random.Random(2)
    for k in range(20):
        assert _feed(replanner, speeds, rng, float(k), noise=0.05) == []
    # The fastest worker slows to a quarter of its speed, as fast as worker 0.
    speeds[3] = 1.0
    revisions = []
    for k in range(20, 100):
        revisions += _feed(replanner, speeds, rng, float(k), noise=0.05)
    first = revisions[0]
    assert first.revision == 1
    assert _batches(first)[3] < 128
    assert all(b > a for a, b in zip(_batches(p)[:3], _batches(first)[:3], strict=True))
    # The moving average lags, so a second revision finishes the job; then the
    # plan matches the speeds and stays.
    assert 1 <= len(revisions) <= 3
    final = replanner.plan
    assert final is revisions[-1] and final.revision == len(revisions)
    assert sum(_batches(final)) == 256
    assert _batches(final) == pytest.approx([51.2, 51.2, 102.4, 51.2], abs=4)
    assert final.idle_fraction < 0.05


def test_replanner_fits_intercept_and_slope():
    # Planned as 0.1 s + 0.1 ms per sample; in fact 20 ms + 0.3 ms per sample.
    p = plan(_fixed_cost_workers()[:2], global_batch=128)
    replanner = Replanner(p, window=8, cooldown=0.0, min_observations=8, warmup=0)
    rng = random.Random(3)
    revised = None
    for k, batch in enumerate([4, 8, 16, 24, 32, 48, 64, 96]):
        t = (0.02 + 3e-4 * batch) * (1 + rng.uniform(-0.01, 0.01))
        revised = replanner.observe(0, batch, t, now=float(k))
    assert revised is not None
    (device,) = revised.worker(0).devices
    assert device.time_intercept == pytest.approx(0.02, rel=0.1)
    assert device.time_slope == pytest.approx(3e-4, rel=0.05)
    # The unobserved worker keeps its model.
    assert revised.worker(1).devices[0].time_intercept == pytest.approx(0.05)


def test_replanner_keeps_a_batch_one_worker_from_the_biggest_batch():
    # Worker 0's fixed cost was profiled at 0.1 s; it is 0.05 s like workers 1
    # and 3, with the same cost per sample. Its reports all come at batch 1.
    p = plan(_fixed_cost_workers(), global_batch=256, min_batch=1)
    assert _batches(p) == [1, 127, 1, 127]
    # Worker 2's fixed cost sets the round with either batches: min_gain 0
    # lets the revision show the refit's reading.
    replanner = Replanner(p, cooldown=0.0, min_observations=3, warmup=0, min_gain=0.0)
    revised = None
    for k in range(3):
        revised = replanner.observe(0, 1, 0.05 + 1e-4, now=float(k))
    assert revised is not None
    (device,) = revised.worker(0).devices
    assert device.time_intercept == pytest.approx(0.05)
    assert device.time_slope == pytest.approx(1e-4)
    # Now as fast as workers 1 and 3, not twice as fast per sample.
    b = _batches(revised)
    assert b[2] == 1 and max(b) - min(b[0], b[1], b[3]) <= 1


def test_replanner_keeps_batches_that_new_ones_would_not_beat():
    # As on one H200 beside CPU workers: rounds of 10-14 ms of push and pull,
    # steps of a millisecond. Worker 0's steps read 4x the profile's; new
    # batches would save under 5% of the round, so the batches stay and only
    # the predicted times are refitted (min_gain 0: the batches move).
    profiles = [
        W(0, 1.2e5, transfer_seconds=0.010),
        W(1, 2.5e4, overhead=3e-4, transfer_seconds=0.013),
        W(2, 5e4, overhead=1.4e-3, transfer_seconds=0.014),
        W(3, 6e3, transfer_seconds=0.011),
    ]
    p = plan(profiles, global_batch=128, min_batch=4)
    moved = {}
    for gain in (0.05, 0.0):
        replanner = Replanner(
            p, cooldown=0.0, min_observations=3, warmup=0, min_gain=gain
        )
        revised = None
        for k in range(3):
            for w in p.workers:
                t = w.step_time * (4.0 if w.worker_id == 0 else 1.0)
                revised = (
                    replanner.observe(w.worker_id, w.batch_size, t, float(k)) or revised
                )
        assert revised is not None and revised.revision == 1
        slope = revised.worker(0).devices[0].time_slope
        assert slope == pytest.approx(4 * p.worker(0).devices[0].time_slope)
        moved[gain] = _batches(revised) != _batches(p)
        kept = max(w.step_time + w.transfer_seconds for w in revised.workers)
        if not moved[gain]:
            # The batches in force, their round predicted from the refit.
            assert revised.round_time == pytest.approx(kept, rel=0.01)
    assert moved == {0.05: False, 0.0: True}
    with pytest.raises(ValueError, match="min_gain must be a number in"):
        Replanner(p, min_gain=1.0)


def _proc4_like(run_factor=1.0):
    """proc4's workers (slowdowns 8, 8, 4, 1): 1.5 ms + 0.31 ms per sample,
    slowed; ``run_factor`` times the profile's step in the run."""
    slowdowns = (8, 8, 4, 1)

    def step(i, b):
        return run_factor * slowdowns[i] * (1.5e-3 + 3.1e-4 * b)

    profiles = [
        WorkerProfile(
            i,
            (
                DeviceProfile(
                    0,
                    "cpu",
                    "cpu",
                    (8, 32),
                    tuple(step(i, b) / run_factor for b in (8, 32)),
                ),
            ),
        )
        for i in range(4)
    ]
    return profiles, step


@pytest.mark.parametrize("warmup", [0, 2])
def test_replanner_leaves_out_the_first_rounds(warmup):
    # As measured on proc4's real processes: every step in the run is 1.8x the
    # profile's, and a worker's first two rounds take 10x and 4x its steady
    # step (first executions, the others still starting). Fitted with them, the
    # revised plan predicted rounds 3-5x too long.
    profiles, step = _proc4_like(run_factor=1.8)
    p = plan(profiles, global_batch=128)
    replanner = Replanner(p, cooldown=1e9, warmup=warmup)
    revised, now = None, 0.0
    for k in range(8):
        for w in p.workers:
            now += 0.1
            t = step(w.worker_id, w.batch_size) * (10.0, 4.0, 1.0, 1.0)[min(k, 3)]
            revised = replanner.observe(w.worker_id, w.batch_size, t, now) or revised
    assert revised is not None
    true_round = max(step(w.worker_id, w.batch_size) for w in revised.workers)
    if warmup:
        assert revised.round_time == pytest.approx(true_round, rel=0.05)
    else:
        assert revised.round_time > 3 * true_round


def test_replanner_warms_up_again_at_a_new_batch():
    p = plan(_speeds(1, 1), global_batch=64)
    replanner = Replanner(p, window=1, cooldown=0.0, min_observations=1, warmup=1)
    # Each worker's first report at a batch is left out, however slow.
    assert replanner.observe(0, 32, 640.0, now=0.0) is None
    assert replanner.speed_ratio(0) == 1.0
    assert replanner.observe(0, 16, 640.0, now=1.0) is None
    assert replanner.speed_ratio(0) == 1.0
    revised = replanner.observe(0, 16, 32.0, now=2.0)
    assert revised is not None and _batches(revised) == [21, 43]


def test_replanner_cooldown():
    p = plan(_speeds(1, 1), global_batch=64)
    replanner = Replanner(
        p, threshold=0.2, window=1, cooldown=10.0, min_observations=1, warmup=0
    )
    first = replanner.observe(0, 32, 64.0, now=0.0)
    assert first is not None and _batches(first) == [21, 43]
    # worker 1 slows too, but within the cooldown nothing changes
    assert replanner.observe(1, 43, 86.0, now=5.0) is None
    second = replanner.observe(1, 43, 86.0, now=10.0)
    assert second is not None and second.revision == 2
    assert _batches(second) == [32, 32]


def test_replanner_waits_until_every_reporting_worker_has_settled():
    # The whole machine runs 10x faster than planned; worker 0's reports come
    # in first. Re-planning on them alone would keep worker 1's planned speed
    # and hand worker 0 nearly all the work.
    p = plan(_speeds(1, 1), global_batch=64)
    replanner = Replanner(
        p, threshold=0.2, window=2, cooldown=0.0, min_observations=3, warmup=0
    )
    assert replanner.observe(1, 32, 3.2, now=0.0) is None
    for k in range(3):
        assert replanner.observe(0, 32, 3.2, now=1.0 + k) is None
    assert replanner.observe(1, 32, 3.2, now=4.0) is None
    revised = replanner.observe(1, 32, 3.2, now=5.0)
    assert revised is not None and _batches(revised) == [32, 32]
    # A worker never heard from does not hold a revision back.
    q = plan(_speeds(1, 1), global_batch=64)
    alone = Replanner(
        q, threshold=0.2, window=1, cooldown=0.0, min_observations=2, warmup=0
    )
    assert alone.observe(0, 32, 64.0, now=0.0) is None
    assert _batches(alone.observe(0, 32, 64.0, now=1.0)) == [21, 43]


def test_replanner_keeps_scheme_and_settings():
    workers = _ashl_workers()
    p = plan(workers, "ashl", global_batch=3, local_steps=2)
    replanner = Replanner(p, cooldown=0.0, min_observations=1, window=1, warmup=0)
    # the fastest worker runs at half speed: 0.5 s per step
    new = replanner.observe(2, 1, 0.5, now=0.0)
    assert new.scheme == "ashl" and new.local_steps == 2
    assert _steps(new) == [2, 4, 4]


def test_replanner_bad_input_changes_nothing():
    p = plan(_speeds(1, 2), global_batch=30)
    replanner = Replanner(p, min_observations=1, window=1, cooldown=0.0)
    for args, message in [
        (("nobody", 10, 1.0, 0.0), "no worker 'nobody'"),
        ((0, 0, 1.0, 0.0), "batch_size must be an int >= 1"),
        ((0, 10, 0.0, 0.0), "step_time must be a finite number > 0"),
        ((0, 10, math.nan, 0.0), "step_time must be a finite number > 0"),
        ((0, 10, 1.0, math.inf), "now must be finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            replanner.observe(*args)
        assert replanner.speed_ratio(0) == 1.0
        assert replanner.plan is p
    for kwargs, message in [
        ({"threshold": 0.0}, "threshold"),
        ({"window": 0}, "window"),
        ({"cooldown": -1.0}, "cooldown"),
        ({"min_observations": 0}, "min_observations"),
        ({"warmup": -1}, "warmup"),
    ]:
        with pytest.raises(ValueError, match=message):
            Replanner(p, **kwargs)
    with pytest.raises(ValueError, match="must be a WorkPlan"):
        Replanner("plan")


def test_numpy_numbers_are_accepted():
    p = plan(
        [W(0, np.float32(1.0)), W(1, np.float64(3.0))],
        global_batch=np.int64(64),
        local_steps=np.int32(2),
    )
    assert _batches(p) == [16, 48] and _steps(p) == [2, 2]
    assert type(p.global_batch) is int
    assert WorkPlan.from_json(p.to_json()) == p


def test_public_names():
    assert SCHEMES == ("hps", "ashl", "adsp", "equal", "ashl_reference", "dylu")
    assert LR_SCALINGS == ("linear", "sqrt", "none")


def test_planning_is_pure_arithmetic_below_the_server():
    # The server's layer plans with hpsjax.planning: importing it loads no JAX
    # and nothing of the packages above it.
    code = (
        "import sys, hpsjax.planning; "
        "above = ('hpsjax.ps', 'hpsjax.worker', 'hpsjax.profiling', "
        "'hpsjax.sim', 'hpsjax.launch', 'hpsjax.transforms'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'jax' "
        "or m.startswith(above)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_helpers_a_re_planner_shares():
    # The Replanner and the Pilot check reports and scale step sizes alike.
    from hpsjax.planning import check_report, lr_scale

    assert check_report(np.int64(8), 0.5, 3) == (8, 0.5)
    cases = [
        ((0, 1.0, 0.0), "batch_size must be an int >= 1"),
        ((8, 0.0, 0.0), "step_time must be a finite number > 0"),
        ((8, 1.0, math.nan), "now must be finite"),
        ((8, 1.0, "soon"), "now must be a number"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            check_report(*args)
    assert lr_scale(256, 64, "linear") == 4.0
    assert lr_scale(256, 64, "sqrt") == 2.0
    assert lr_scale(256, 64, "none") == 1.0
