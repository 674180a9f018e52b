"""Tests of the virtual-clock simulator (hpsjax.sim)."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.profiling import Replanner, WorkerProfile, plan, tree_wire_nbytes
from hpsjax.sim import (
    ComputeModel,
    SimConfig,
    WorkerSpec,
    make_workers,
    simulate,
)
from hpsjax.transforms import (
    Codec,
    Stage,
    delay_compensation,
    encoded_nbytes,
    hybrid_stages,
    quantize,
    scale_by_staleness,
)
from hpsjax.worker import Heterogeneity, WorkerOptions

# ---------------------------------------------------------------------------
# A small problem: 4 Gaussian classes in 8 dimensions, a one-hidden-layer MLP.
# Module-level functions and optimizers, so the simulator reuses compiled code.
# ---------------------------------------------------------------------------

_DIM, _HIDDEN, _CLASSES = 8, 16, 4


def _make_data(n, seed):
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(size=(_CLASSES, _DIM)) * 1.2
    y = rng.integers(0, _CLASSES, n).astype(np.int32)
    x = (centers[y] + rng.normal(size=(n, _DIM))).astype(np.float32)
    return x, y


TRAIN = _make_data(1024, 0)
TEST = _make_data(256, 1)


def _init_params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.normal(size=(_DIM, _HIDDEN)) * 0.3, jnp.float32),
        "b1": jnp.zeros(_HIDDEN),
        "w2": jnp.asarray(rng.normal(size=(_HIDDEN, _CLASSES)) * 0.3, jnp.float32),
        "b2": jnp.zeros(_CLASSES),
    }


PARAMS = _init_params()


def _logits(p, x):
    return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def loss_fn(p, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(_logits(p, x), y).mean()


def eval_fn(p, batch):
    x, y = batch
    logits = _logits(p, x)
    return {
        "loss": optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        "accuracy": (logits.argmax(-1) == y).mean(),
    }


LOCAL_SGD = optax.sgd(0.05)
QUANTIZE8 = quantize(8, error_feedback=True, seed=0)
CODEC8 = Codec("uniform", 8)


def constant_workers(step_times, *, batch_size=16, **spec):
    return [
        WorkerSpec(
            ComputeModel(step_time=t), batch_size=batch_size, worker_id=i, **spec
        )
        for i, t in enumerate(step_times)
    ]


def run(workers, config, **kwargs):
    kwargs.setdefault("eval_data", TEST)
    kwargs.setdefault("eval_fn", eval_fn)
    return simulate(loss_fn, PARAMS, TRAIN, workers, config, **kwargs)


def pushes_of(result, worker_id, status=None):
    return [
        p
        for p in result.pushes
        if p.worker_id == worker_id and (status is None or p.status == status)
    ]


# ---------------------------------------------------------------------------
# Determinism.
# ---------------------------------------------------------------------------


def test_same_seed_same_metrics_other_seed_differs():
    workers = make_workers(4, step_time=0.1, speed_sigma=0.5, jitter=0.3, seed=3)
    config = SimConfig(policy="asp", learning_rate=0.1, duration=2.0, eval_every=1.0)
    first = run(workers, config)
    again = run(workers, config)
    other = run(
        workers,
        SimConfig(
            policy="asp", learning_rate=0.1, duration=2.0, eval_every=1.0, seed=1
        ),
    )
    for key in first.metrics:
        np.testing.assert_array_equal(first.metrics[key], again.metrics[key])
    assert first.pushes == again.pushes
    assert first.timelines == again.timelines
    assert not np.array_equal(first.metrics["loss"], other.metrics["loss"])
    assert [p.time for p in first.pushes] != [p.time for p in other.pushes]


# ---------------------------------------------------------------------------
# BSP: aggregation and round time.
# ---------------------------------------------------------------------------


def test_bsp_aggregates_every_round_and_round_time_is_the_slowest():
    step_times = (0.10, 0.25, 0.40)
    bandwidths = (4e5, 1e5, 2e5)
    latency = 0.01
    workers = [
        WorkerSpec(
            ComputeModel(step_time=t),
            heterogeneity=Heterogeneity(bandwidth=b, latency=latency),
            batch_size=16,
            worker_id=i,
        )
        for i, (t, b) in enumerate(zip(step_times, bandwidths, strict=True))
    ]
    result = run(workers, SimConfig(policy="bsp", learning_rate=0.2, duration=10.0))
    nbytes = tree_wire_nbytes(PARAMS)
    # A round: parameters down, compute, update up, each link at its own speed.
    rounds = [
        (latency + nbytes / b) + t + (latency + nbytes / b)
        for t, b in zip(step_times, bandwidths, strict=True)
    ]
    expected = max(rounds)
    applies = result.applies
    assert len(applies) >= 5
    for a in applies:
        assert a.num_updates == 3
        assert sorted(a.contributors) == [0, 1, 2]
        assert a.staleness == 0
    # The first round also waits for the join request to arrive.
    assert applies[0].time == pytest.approx(latency + expected)
    gaps = np.diff([a.time for a in applies])
    np.testing.assert_allclose(gaps, expected, rtol=1e-9)
    assert set(result.staleness) == {0}
    # The fastest worker waits at the barrier for most of each round.
    fast = result.time_in(0)
    assert fast["wait"] > 0
    assert result.idle_fraction(0) > result.idle_fraction(1) > result.idle_fraction(2)
    assert result.metrics["loss"][-1] < result.metrics["loss"][0]


# ---------------------------------------------------------------------------
# The server's service time and the workers' start-up.
# ---------------------------------------------------------------------------


def test_server_service_time_queues_pushes_that_arrive_together():
    # Two equal workers push at 0.125 s, together (times exact in binary).
    workers = constant_workers((0.125, 0.125))
    plain = run(
        workers, SimConfig(policy="asp", duration=1.0), eval_data=None, eval_fn=None
    )
    assert [p.time for p in plain.pushes[:2]] == [0.125, 0.125]
    config = SimConfig(policy="asp", duration=1.0, server_service_time=0.25)
    result = run(workers, config, eval_data=None, eval_fn=None)
    first, second = result.pushes[:2]
    # One server, one message at a time: the first push is handled after one
    # service time, the second waits for it and takes its own.
    assert first.time == 0.125 + 0.25
    assert second.time == first.time + 0.25
    assert first.sent == second.sent == 0.125
    assert {first.worker_id, second.worker_id} == {0, 1}
    # The server can handle at most one push per service time.
    times = [p.time for p in result.pushes]
    assert np.all(np.diff(times) >= 0.25 - 1e-12)
    assert len(result.pushes) == 3  # at 0.375, 0.625 and 0.875
    assert result.idle_fraction() > plain.idle_fraction()


def test_a_pull_queues_behind_the_pushes_at_the_server():
    # Pipelined workers send their pull right behind their push; the pull is
    # answered only once the pushes ahead of it were handled.
    workers = constant_workers((0.125, 0.125))
    config = SimConfig(
        policy="asp",
        duration=0.75,
        server_service_time=0.25,
        worker=WorkerOptions(overlap="pipeline"),
        local_optimizer=LOCAL_SGD,
    )
    result = run(workers, config, eval_data=None, eval_fn=None)
    # Both send their first push and, behind it, a pull at 0.125; each pull is
    # answered once the pushes ahead of it were handled (not at 0.125).
    after = [(s.time, s.worker_id) for s in result.sends if s.time > 0]
    assert after == [(0.375, 0), (0.625, 1)]
    assert [p.time for p in result.pushes] == [0.375, 0.625]


def test_startup_time_lengthens_the_first_round_only():
    result = run(
        constant_workers((0.125,), startup_time=0.5),
        SimConfig(policy="asp", duration=1.0),
        eval_data=None,
        eval_fn=None,
    )
    times = [p.time for p in result.pushes]
    assert times == [0.625, 0.75, 0.875, 1.0]
    (first, *_) = result.timelines[0]
    # Counted as compute, as real processes count a slow first round.
    assert (first.start, first.end, first.kind) == (0.0, 0.625, "compute")
    hot = run(
        constant_workers((0.125,)),
        SimConfig(policy="asp", duration=1.0),
        eval_data=None,
        eval_fn=None,
    )
    assert len(hot.pushes) == len(result.pushes) + 4


# ---------------------------------------------------------------------------
# ASP: a 1:4 speed ratio.
# ---------------------------------------------------------------------------


def test_asp_fast_worker_pushes_four_times_as_often_and_slow_one_is_stale():
    # Times exact in binary, so that simultaneous pushes tie exactly.
    result = run(
        constant_workers((0.125, 0.5)),
        SimConfig(policy="asp", learning_rate=0.1, duration=25.0),
    )
    fast, slow = pushes_of(result, 0), pushes_of(result, 1)
    assert len(fast) == 200 and len(slow) == 50
    assert all(p.status == "applied" for p in result.pushes)
    assert result.num_updates == 250
    # In each round of the slow worker the fast one pushes 4 times, so the slow
    # update is about 4 versions stale and a fast one about 1/4 on average.
    slow_stale = [p.staleness for p in slow]
    assert 3.5 <= np.mean(slow_stale) <= 4.5 and max(slow_stale) <= 5
    fast_stale = [p.staleness for p in fast]
    assert max(fast_stale) == 1 and 0.1 < np.mean(fast_stale) < 0.4
    assert result.idle_fraction() == pytest.approx(0.0)


# ---------------------------------------------------------------------------
# SSP: the clock bound holds.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bound", [0, 2])
def test_ssp_no_worker_more_than_s_clocks_ahead(bound):
    workers = constant_workers((0.05, 0.1, 0.2, 0.6))
    ssp = run(
        workers,
        SimConfig(
            policy="ssp",
            policy_kwargs={"staleness_bound": bound},
            learning_rate=0.1,
            duration=8.0,
        ),
    )
    gaps = [s.clock - s.min_clock for s in ssp.sends]
    assert max(gaps) == bound
    assert ssp.time_in(0)["wait"] > 0
    # Without the bound the fast worker runs far ahead: the check can fail.
    asp = run(workers, SimConfig(policy="asp", learning_rate=0.1, duration=8.0))
    assert max(s.clock - s.min_clock for s in asp.sends) > bound + 10


# ---------------------------------------------------------------------------
# A worker that becomes slower mid-run.
# ---------------------------------------------------------------------------


def test_worker_slowing_down_mid_run_pushes_less():
    workers = constant_workers((0.1, 0.1))
    workers[0] = WorkerSpec(
        ComputeModel(step_time=0.1),
        heterogeneity=Heterogeneity(slowdown=[(0.0, 1.0), (10.05, 4.0)]),
        batch_size=16,
        worker_id=0,
    )
    result = run(workers, SimConfig(policy="asp", learning_rate=0.1, duration=20.05))
    times = np.array([p.time for p in pushes_of(result, 0)])
    # Steps that start before 10.05 s take 0.1 s, later ones 0.4 s.
    assert np.sum(times <= 10.05) == 100
    np.testing.assert_allclose(np.diff(times[100:]), 0.4)
    assert np.sum(times > 10.05) == 25
    assert len(pushes_of(result, 1)) == 200


def test_replanner_moves_work_off_a_worker_that_slowed_down():
    profiles = [WorkerProfile.synthetic(i, 160.0) for i in range(2)]
    work_plan = plan(profiles, "hps", global_batch=32)
    workers = [
        WorkerSpec(ComputeModel.from_profile(profiles[0]), worker_id=0),
        WorkerSpec(
            ComputeModel.from_profile(profiles[1]),
            heterogeneity=Heterogeneity(slowdown=[(0.0, 1.0), (2.0, 3.0)]),
            worker_id=1,
        ),
    ]
    result = run(
        workers,
        SimConfig(policy="bsp", learning_rate=0.1, duration=8.0),
        work_plan=Replanner(work_plan, cooldown=4.0, min_observations=2),
    )
    first, last = result.work_plans[0], result.work_plans[-1]
    assert len(result.work_plans) >= 2
    assert first.worker(1).batch_size == 16
    assert last.worker(1).batch_size < 10 < last.worker(0).batch_size
    late = [p for p in result.pushes if p.time > 6.0]
    assert {p.worker_id: p.batch_size for p in late} == {
        0: last.worker(0).batch_size,
        1: last.worker(1).batch_size,
    }


# ---------------------------------------------------------------------------
# Links and compression.
# ---------------------------------------------------------------------------


def test_compressed_pushes_shorten_transfer_by_the_codec_ratio():
    bandwidth = 2e4
    workers = [
        WorkerSpec(
            ComputeModel(step_time=0.1),
            heterogeneity=Heterogeneity(bandwidth=bandwidth),
            batch_size=16,
        )
    ]
    raw = run(workers, SimConfig(policy="asp", learning_rate=0.1, duration=6.0))
    packed = run(
        workers,
        SimConfig(
            policy="asp",
            learning_rate=0.1,
            duration=6.0,
            push_transform=QUANTIZE8,
            codec=CODEC8,
        ),
    )
    raw_bytes = tree_wire_nbytes(PARAMS)
    packed_bytes = sum(encoded_nbytes(x.shape, CODEC8) for x in jax.tree.leaves(PARAMS))
    assert packed_bytes < raw_bytes / 3.5

    def push_seconds(result):
        spans = [s.end - s.start for s in result.transfers[0] if s.kind == "push"]
        assert spans
        return np.array(spans)

    np.testing.assert_allclose(push_seconds(raw), raw_bytes / bandwidth)
    np.testing.assert_allclose(push_seconds(packed), packed_bytes / bandwidth)
    assert raw.bytes_sent[0] == raw_bytes * len(raw.pushes)
    assert packed.bytes_sent[0] == packed_bytes * len(packed.pushes)
    # Shorter pushes make shorter rounds, so more of them in the same time.
    assert len(packed.pushes) > len(raw.pushes)
    assert packed.metrics["loss"][-1] < 0.7 * packed.metrics["loss"][0]
    # The codec is read from the quantizer when not given.
    inferred = run(
        workers,
        SimConfig(
            policy="asp", learning_rate=0.1, duration=1.0, push_transform=QUANTIZE8
        ),
    )
    assert inferred.bytes_sent[0] == packed_bytes * len(inferred.pushes)


def test_pipeline_hides_transfer_behind_compute():
    bandwidth = 1e4
    nbytes = tree_wire_nbytes(PARAMS)
    transfer = 2 * nbytes / bandwidth
    assert 0.1 < transfer < 1.0
    workers = [
        WorkerSpec(
            ComputeModel(step_time=1.0),
            heterogeneity=Heterogeneity(bandwidth=bandwidth),
            batch_size=16,
        )
    ]
    plain = run(workers, SimConfig(policy="asp", learning_rate=0.1, duration=20.0))
    piped = run(
        workers,
        SimConfig(
            policy="asp",
            worker=WorkerOptions(overlap="pipeline"),
            learning_rate=0.1,
            duration=20.0,
        ),
    )
    plain_gaps = np.diff([p.sent for p in plain.pushes])
    piped_gaps = np.diff([p.sent for p in piped.pushes])
    np.testing.assert_allclose(plain_gaps, 1.0 + transfer)
    np.testing.assert_allclose(piped_gaps, 1.0)
    # Pipelined, an update is pushed one round after it was computed.
    assert piped.staleness == {0: 1, 1: len(piped.pushes) - 1}
    assert piped.idle_fraction(0) < 0.06 < plain.idle_fraction(0)


def test_eager_pulls_start_rounds_on_fresher_parameters():
    workers = [
        WorkerSpec(
            ComputeModel(step_time=t),
            heterogeneity=Heterogeneity(latency=0.02),
            batch_size=16,
            worker_id=i,
        )
        for i, t in enumerate((0.3, 0.3, 0.3, 0.3))
    ]
    common = dict(policy="asp", learning_rate=0.1, duration=10.0)
    piped = run(workers, SimConfig(worker=WorkerOptions(overlap="pipeline"), **common))
    eager = run(
        workers,
        SimConfig(worker=WorkerOptions(overlap="eager", eager_pulls=3), **common),
    )
    assert len(eager.sends) > 1.5 * len(piped.sends)
    mean = lambda r: np.mean([p.staleness for p in r.pushes])
    assert mean(eager) < mean(piped)


def test_ps_plus_scales_stale_updates_down():
    workers = constant_workers((0.1, 0.5), heterogeneity=Heterogeneity(latency=0.01))
    common = dict(policy="asp", learning_rate=0.1, duration=5.0)
    eager = dict(overlap="eager", eager_pulls=3)
    plain = run(workers, SimConfig(worker=WorkerOptions(**eager), **common))
    modulated = run(
        workers,
        SimConfig(
            worker=WorkerOptions(staleness_lr="inverse_plus_one", **eager), **common
        ),
    )
    # Same timing: the modulation changes the values, not the clock.
    assert [p.time for p in plain.pushes] == [p.time for p in modulated.pushes]
    assert not np.array_equal(plain.metrics["loss"], modulated.metrics["loss"])
    # A factor that zeroes every stale update leaves only the fresh ones.
    frozen = run(
        workers,
        SimConfig(
            worker=WorkerOptions(
                staleness_lr=lambda tau: jnp.where(tau > 0, 0.0, 1.0), **eager
            ),
            **common,
        ),
    )
    assert not np.array_equal(frozen.metrics["loss"], plain.metrics["loss"])


# ---------------------------------------------------------------------------
# Faults: force-pulls and deadline drops.
# ---------------------------------------------------------------------------


def test_saps_force_pull_discards_the_round_computed_meanwhile():
    workers = constant_workers((0.05, 0.05, 0.05, 0.4))
    result = run(
        workers,
        SimConfig(
            policy="saps",
            policy_kwargs={"threshold": 3, "on_straggler": "drop"},
            worker=WorkerOptions(overlap="pipeline"),
            learning_rate=0.1,
            duration=6.0,
        ),
    )
    dropped = pushes_of(result, 3, "dropped")
    assert dropped and all(p.staleness > 3 for p in dropped)
    assert result.time_in(3)["discarded"] > 0
    assert result.time_in(0)["discarded"] == 0
    assert result.metrics["loss"][-1] < result.metrics["loss"][0]


def test_worker_missing_a_barrier_deadline_is_dropped_and_rejoins():
    workers = constant_workers((0.1, 0.1, 0.1))
    workers[2] = WorkerSpec(
        ComputeModel(step_time=0.1),
        heterogeneity=Heterogeneity(slowdown=[(0.0, 1.0), (3.0, 30.0), (6.0, 1.0)]),
        batch_size=16,
        worker_id=2,
    )
    result = run(
        workers,
        SimConfig(
            policy="bsp",
            learning_rate=0.1,
            duration=12.0,
            core_kwargs={"deadline_factor": 3.0, "min_timeout": 0.5},
        ),
    )
    assert result.drops >= 1
    assert any("dropped" in e for e in result.errors)
    # Rounds went on without it, and it took part again after rejoining.
    sizes = [a.num_updates for a in result.applies]
    assert 2 in sizes and sizes[-1] == 3
    assert result.time_in(2)["discarded"] > 0


def test_worker_leaving_lets_the_barrier_go_on():
    workers = constant_workers((0.1, 0.1, 0.1))
    workers[1] = WorkerSpec(
        ComputeModel(step_time=0.1), batch_size=16, worker_id=1, leave_time=2.0
    )
    result = run(workers, SimConfig(policy="bsp", learning_rate=0.1, duration=4.0))
    late = [a for a in result.applies if a.time > 2.5]
    assert late and all(a.num_updates == 2 for a in late)
    assert max(p.time for p in pushes_of(result, 1)) <= 2.0 + 1e-9
    assert sum(iv.end - iv.start for iv in result.timelines[1]) == pytest.approx(2.0)


# ---------------------------------------------------------------------------
# Timelines, callback, helpers.
# ---------------------------------------------------------------------------


def test_timelines_cover_each_worker_without_gaps():
    workers = make_workers(5, step_time=0.1, speed_sigma=0.6, latency=0.01, seed=2)
    result = run(workers, SimConfig(policy="ssp", learning_rate=0.1, duration=3.0))
    for w, line in result.timelines.items():
        assert line[0].start == pytest.approx(0.0)
        assert line[-1].end == pytest.approx(3.0)
        for a, b in itertools.pairwise(line):
            assert a.end == pytest.approx(b.start)
        assert {iv.kind for iv in line} <= {"compute", "transfer", "wait", "discarded"}
        assert sum(result.time_in(w).values()) == pytest.approx(3.0)
    assert 0 < result.idle_fraction() < 1


def test_callback_sees_every_evaluation_and_can_stop():
    seen = []

    def callback(record):
        seen.append(record)
        return record["time"] >= 2.0

    result = run(
        constant_workers((0.1, 0.2)),
        SimConfig(policy="asp", learning_rate=0.1, duration=10.0, eval_every=0.5),
        callback=callback,
    )
    assert [r["time"] for r in seen] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert result.end_time == 2.0
    assert set(seen[0]) == {
        "time",
        "version",
        "gradients",
        "train_loss",
        "loss",
        "accuracy",
    }
    np.testing.assert_array_equal(result.metrics["time"], [r["time"] for r in seen])


def test_eval_every_updates_and_max_updates():
    result = run(
        constant_workers((0.1, 0.3)),
        SimConfig(
            policy="asp", learning_rate=0.1, max_updates=40, eval_every_updates=10
        ),
    )
    assert result.num_updates == 40
    assert list(result.metrics["version"]) == [0, 10, 20, 30, 40]


def test_compute_models():
    model = ComputeModel(step_time=0.2, reference_batch=32, overhead=0.04)
    assert model.mean_step_time(32) == pytest.approx(0.2)
    assert model.mean_step_time(64) == pytest.approx(0.36)
    rng = np.random.default_rng(0)
    jittery = ComputeModel(step_time=1.0, reference_batch=1, sigma=0.5)
    draws = jittery.draw(rng, 1, 20000)
    assert np.mean(draws) == pytest.approx(1.0, rel=0.03)
    assert np.std(np.log(draws)) == pytest.approx(0.5, rel=0.03)
    straggly = ComputeModel(
        step_time=1.0, reference_batch=1, straggle_probability=0.1, straggle_slowdown=5
    )
    assert np.mean(straggly.draw(rng, 1, 20000) == 5.0) == pytest.approx(0.1, abs=0.01)
    two = WorkerProfile.synthetic(0, [100.0, 300.0], overhead=0.01)
    assert ComputeModel.from_profile(two).mean_step_time(40) == pytest.approx(0.11)
    workers = make_workers(10, straggler_fraction=0.3, straggler_slowdown=5.0, seed=1)
    times = sorted(w.compute.step_time for w in workers)
    assert times == pytest.approx([0.1] * 7 + [0.5] * 3)
    assert [w.worker_id for w in workers] == list(range(10))


# ---------------------------------------------------------------------------
# Every scheme trains.
# ---------------------------------------------------------------------------

_STAGES = [
    Stage(optax.sgd(0.05), mode="async", local_steps=4, until_step=40),
    Stage(optax.sgd(0.05), mode="semi_async", local_steps=1, max_staleness=2),
]
_HYBRID_OPTIMIZER = hybrid_stages(_STAGES)
_DC_SERVER = optax.chain(delay_compensation(0.04), optax.sgd(0.1))
_STALENESS_SERVER = optax.chain(scale_by_staleness("inverse"), optax.sgd(0.1))


def _hps_plan():
    profiles = [
        WorkerProfile.synthetic(i, 160.0 / s) for i, s in enumerate((1, 1, 2, 4))
    ]
    return plan(profiles, "hps", global_batch=64, lr_scaling="none")


SCHEMES = {
    "bsp": dict(policy="bsp"),
    "asp": dict(policy="asp"),
    "ssp": dict(policy="ssp", policy_kwargs={"staleness_bound": 2}),
    "staleness_aware_asp": dict(policy="asp", server_optimizer=_STALENESS_SERVER),
    "dc_asgd": dict(
        policy="asp",
        server_optimizer=_DC_SERVER,
        core_kwargs={"keep_stale_params": True},
    ),
    "local_sgd": dict(policy="asp", local_optimizer=LOCAL_SGD, local_steps=4),
    "saps": dict(policy="saps", policy_kwargs={"threshold": 4}),
    "adsp": dict(
        policy="adsp",
        policy_kwargs={"check_period": 1.0},
        local_optimizer=LOCAL_SGD,
    ),
    "semi_async": dict(policy="semi_async", policy_kwargs={"max_staleness": 3}),
    "hybrid": dict(
        policy="hybrid",
        policy_kwargs={"stages": _STAGES},
        local_optimizer=_HYBRID_OPTIMIZER,
    ),
    "hps": dict(
        policy="bsp",
        worker=WorkerOptions(overlap="pipeline"),
        push_transform=QUANTIZE8,
        codec=CODEC8,
        plan=True,
    ),
    "ps_plus": dict(
        policy="asp",
        worker=WorkerOptions(
            overlap="eager", eager_pulls=3, staleness_lr="inverse_plus_one"
        ),
    ),
    "ashl": dict(
        policy="hybrid",
        policy_kwargs={"stages": _STAGES},
        local_optimizer=_HYBRID_OPTIMIZER,
        push_transform=QUANTIZE8,
    ),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_reduces_the_loss(scheme):
    settings = dict(SCHEMES[scheme])
    local_steps = settings.pop("local_steps", 1)
    with_plan = settings.pop("plan", False)
    settings.setdefault("learning_rate", 0.1)
    workers = [
        WorkerSpec(
            ComputeModel(step_time=t),
            heterogeneity=Heterogeneity(latency=0.005),
            batch_size=16,
            local_steps=local_steps,
            worker_id=i,
        )
        for i, t in enumerate((0.05, 0.05, 0.1, 0.2))
    ]
    result = run(
        workers,
        SimConfig(duration=4.0, eval_every=2.0, **settings),
        work_plan=_hps_plan() if with_plan else None,
    )
    loss = result.metrics["loss"]
    assert np.all(np.isfinite(loss))
    assert loss[-1] < 0.6 * loss[0], loss
    assert result.metrics["accuracy"][-1] > 0.7
    assert not [e for e in result.errors if "dropped" not in e]


def test_hybrid_policy_moves_to_the_second_stage():
    settings = SCHEMES["hybrid"]
    workers = [
        WorkerSpec(ComputeModel(step_time=0.05), batch_size=16, worker_id=i)
        for i in range(3)
    ]
    result = run(workers, SimConfig(duration=3.0, **settings))
    steps = [p.local_steps for p in result.pushes]
    assert steps[0] == 4 and steps[-1] == 1
    assert result.applies[-1].version > 40


def _recording_core(monkeypatch):
    """Makes the simulator's core record the announcements it returns."""
    from hpsjax.ps import PlanChanged, StageChanged
    from hpsjax.sim import _server_side

    seen = []

    class Recording(_server_side.ServerCore):
        pass

    def recorded(name):
        method = getattr(_server_side.ServerCore, name)

        def call(self, *args, **kwargs):
            actions = method(self, *args, **kwargs)
            seen.extend(a for a in actions if isinstance(a, StageChanged | PlanChanged))
            return actions

        return call

    for name in ("join", "leave", "pull", "push_message", "tick", "observe_speed"):
        setattr(Recording, name, recorded(name))
    monkeypatch.setattr(_server_side, "ServerCore", Recording)
    return seen


def test_the_simulator_follows_the_stage_its_core_announces_once(monkeypatch):
    from hpsjax.ps import StageChanged

    seen = _recording_core(monkeypatch)
    workers = [
        WorkerSpec(ComputeModel(step_time=0.05), batch_size=16, worker_id=i)
        for i in range(3)
    ]
    result = run(workers, SimConfig(duration=3.0, **SCHEMES["hybrid"]))
    # The workers' staged optimizers move on, a push says so: announced once.
    assert len(seen) == 1 and seen[0] == StageChanged(1, seen[0].version)
    after = [p for p in result.pushes if p.version > seen[0].version]
    assert after and {p.local_steps for p in after} == {1}


def test_the_simulator_applies_the_plans_its_core_announces(monkeypatch):
    seen = _recording_core(monkeypatch)
    profiles = [WorkerProfile.synthetic(i, 160.0) for i in range(2)]
    workers = [
        WorkerSpec(ComputeModel.from_profile(profiles[0]), worker_id=0),
        WorkerSpec(
            ComputeModel.from_profile(profiles[1]),
            heterogeneity=Heterogeneity(slowdown=[(0.0, 1.0), (2.0, 3.0)]),
            worker_id=1,
        ),
    ]
    result = run(
        workers,
        SimConfig(policy="bsp", learning_rate=0.1, duration=8.0),
        work_plan=Replanner(
            plan(profiles, "hps", global_batch=32), cooldown=4.0, min_observations=2
        ),
    )
    assert seen and [a.plan for a in seen] == list(result.work_plans[1:])
    assert all(a.reason.endswith("speed drifted") for a in seen)


@pytest.mark.parametrize("scheme", ["asp", "local_sgd", "hps"])
def test_sequential_evaluation_matches_batched(scheme):
    settings = dict(SCHEMES[scheme])
    local_steps = settings.pop("local_steps", 1)
    with_plan = settings.pop("plan", False)
    workers = constant_workers(
        (0.05, 0.05, 0.1, 0.2),
        local_steps=local_steps,
        heterogeneity=Heterogeneity(latency=0.005),
    )
    results = [
        run(
            workers,
            SimConfig(learning_rate=0.1, duration=1.0, batch_rows=rows, **settings),
            work_plan=_hps_plan() if with_plan else None,
        )
        for rows in (None, 1)
    ]
    batched, sequential = results
    assert batched.padded_gradients > 0 and sequential.padded_gradients == 0
    assert [p.time for p in batched.pushes] == [p.time for p in sequential.pushes]
    np.testing.assert_allclose(
        batched.metrics["loss"], sequential.metrics["loss"], rtol=1e-4
    )


# ---------------------------------------------------------------------------
# Many workers.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [pytest.param("asp", marks=pytest.mark.slow), "bsp"])
def test_256_workers(policy):
    workers = make_workers(256, step_time=0.1, speed_sigma=0.3, batch_size=8, seed=0)
    result = run(
        workers,
        SimConfig(
            policy=policy,
            learning_rate=0.1 if policy == "bsp" else 0.002,
            duration=0.5,
            data_sharding="shared",
        ),
    )
    assert len(result.timelines) == 256
    assert result.num_gradients >= 256
    assert {p.worker_id for p in result.pushes} == set(range(256))
    if policy == "bsp":
        assert all(a.num_updates == 256 for a in result.applies)
    assert result.metrics["loss"][-1] < result.metrics["loss"][0]


# ---------------------------------------------------------------------------
# Bad input.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "at least one of duration"),
        (dict(duration=1.0, worker="pipeline"), "worker must be a"),
        (
            dict(duration=1.0, worker=WorkerOptions(staleness_lr="drop")),
            "max_staleness",
        ),
        (dict(duration=-1.0), "duration"),
        (dict(duration=1.0, data_sharding="mixed"), "data_sharding"),
        (dict(duration=1.0, codec=CODEC8), "push_transform"),
        (dict(duration=1.0, server_optimizer="sgd"), "server_optimizer"),
        (dict(duration=1.0, seed=-1), "seed"),
        (dict(duration=1.0, server_service_time=-0.1), "server_service_time"),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**kwargs)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ComputeModel(step_time=0.0), "step_time"),
        (lambda: ComputeModel(step_time=0.1, overhead=0.2), "overhead"),
        (lambda: ComputeModel(straggle_probability=1.5), "straggle_probability"),
        (lambda: WorkerSpec(batch_size=0), "batch_size"),
        (lambda: WorkerSpec(join_time=2.0, leave_time=1.0), "leave_time"),
        (lambda: WorkerSpec(startup_time=-1.0), "startup_time"),
        (lambda: make_workers(0), "num_workers"),
        (lambda: make_workers(4, straggler_fraction=2.0), "straggler_fraction"),
    ],
)
def test_bad_worker_description_is_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_simulation_arguments_are_refused_before_running():
    config = SimConfig(duration=1.0)
    calls = []

    def counting_loss(p, batch):
        calls.append(1)
        return loss_fn(p, batch)

    cases = [
        (dict(workers=[]), "empty"),
        (dict(workers=[WorkerSpec(local_steps=2)]), "local_optimizer"),
        (dict(config=SimConfig(duration=1.0, policy="adsp")), "local_optimizer"),
        (dict(config=SimConfig(duration=1.0, policy="nope")), "Unknown policy"),
        (dict(eval_fn=eval_fn, eval_data=None), "eval_fn"),
        (
            dict(
                train_data=(TRAIN[0][:2], TRAIN[1][:2]),
                workers=constant_workers((0.1,) * 3),
            ),
            "disjoint",
        ),
        (dict(train_data=(TRAIN[0], TRAIN[1][:5])), "leading"),
        (
            dict(work_plan=_hps_plan(), workers=constant_workers((0.1,) * 5)),
            "no worker 4",
        ),
        (dict(params={"w": jnp.zeros(3, jnp.int32)}), "floating"),
    ]
    for overrides, message in cases:
        args = dict(
            workers=constant_workers((0.1,)),
            config=config,
            train_data=TRAIN,
            eval_data=TEST,
            eval_fn=None,
            work_plan=None,
            params=PARAMS,
        )
        args.update(overrides)
        with pytest.raises(ValueError, match=message):
            simulate(
                counting_loss,
                args["params"],
                args["train_data"],
                args["workers"],
                args["config"],
                eval_data=args["eval_data"],
                eval_fn=args["eval_fn"],
                work_plan=args["work_plan"],
            )
    assert calls == []
    assert math.isfinite(float(loss_fn(PARAMS, TRAIN)))


# ---------------------------------------------------------------------------
# Batch weighting: the server owns it.
# ---------------------------------------------------------------------------


def _sum_loss(p, batch):
    del batch
    return jnp.sum(p["w"])


@pytest.mark.parametrize(
    "overheads", [(0.0, 0.0), (0.1, 0.05, 0.1, 0.05)], ids=["speeds", "fixed_cost"]
)
def test_a_plan_does_not_change_the_step_of_equal_gradients(overheads):
    # Unequal batches from unequal speeds or fixed costs; every gradient is 1.
    profiles = [
        WorkerProfile.synthetic(i, 1e4 / (1 + 2.34 * (i % 2)), overhead=a)
        for i, a in enumerate(overheads)
    ]
    work_plan = plan(profiles, "hps", global_batch=256)
    assert len({w.batch_size for w in work_plan.workers}) > 1
    workers = constant_workers([0.1] * len(profiles), batch_size=1)
    result = simulate(
        _sum_loss,
        {"w": jnp.zeros(())},
        TRAIN,
        workers,
        SimConfig(policy="bsp", learning_rate=1.0, max_updates=1),
        work_plan=work_plan,
    )
    (apply,) = result.applies
    assert apply.num_updates == len(profiles)
    assert float(result.params["w"]) == pytest.approx(-1.0, rel=1e-6)


# ---------------------------------------------------------------------------
# Rounds on one version evaluated summed (sim/_engine.SummedRows).
# ---------------------------------------------------------------------------


def _runs_with_and_without_sums(monkeypatch, workers, config, **kwargs):
    """The same run with summed rounds and with every round evaluated alone,
    and how many rounds were summed in the first."""
    from hpsjax.sim import _engine

    summed = []
    original = _engine.Engine._sum

    def counting(self, active, finished):
        left = original(self, active, finished)
        summed.append(len(active) - len(left))
        return left

    monkeypatch.setattr(_engine.Engine, "_sum", counting)
    with_sums = run(workers, config, **kwargs)
    monkeypatch.setattr(_engine, "SUM_MIN_ROWS", 10**9)
    alone = run(workers, config, **kwargs)
    return with_sums, alone, sum(summed)


def _assert_same_run(a, b):
    assert a.pushes[0].loss is not None
    # Every decision the same; losses and parameters up to the rounding of
    # one sum against many.
    assert [p[:8] for p in a.pushes] == [p[:8] for p in b.pushes]
    np.testing.assert_allclose(
        [p.loss for p in a.pushes], [p.loss for p in b.pushes], rtol=1e-5
    )
    assert a.applies == b.applies
    np.testing.assert_allclose(a.metrics["loss"], b.metrics["loss"], rtol=1e-4)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("rows", [None, 1])
@pytest.mark.parametrize("policy", ["bsp", "ssp", "asp"])
def test_summed_rounds_give_the_run_of_rounds_evaluated_alone(
    monkeypatch, policy, rows
):
    workers = constant_workers(
        (0.05, 0.05, 0.07, 0.1, 0.2, 0.2), heterogeneity=Heterogeneity(latency=0.005)
    )
    config = SimConfig(
        policy=policy, learning_rate=0.1, duration=1.0, batch_rows=rows,
        policy_kwargs={"staleness_bound": 2} if policy == "ssp" else {},
    )  # fmt: skip
    with_sums, alone, summed = _runs_with_and_without_sums(monkeypatch, workers, config)
    # Only a barrier's rounds are summed (all of them, and those in flight at
    # the end): elsewhere a version takes one push.
    if policy == "bsp":
        assert summed >= len(with_sums.pushes)
    else:
        assert summed == 0
    _assert_same_run(with_sums, alone)


def test_summed_rounds_with_unequal_batches_and_a_dropped_worker(monkeypatch):
    # Other batch sizes make other groups (pushes weighted by their samples),
    # and a worker dropped at a deadline leaves a version without its row.
    workers = [
        WorkerSpec(ComputeModel(step_time=t), batch_size=b, worker_id=i)
        for i, (t, b) in enumerate([(0.05, 8), (0.05, 8), (0.1, 32), (0.1, 32)])
    ]
    workers.append(
        WorkerSpec(
            ComputeModel(step_time=0.05),
            heterogeneity=Heterogeneity(slowdown=[(0.0, 1.0), (0.5, 40.0)]),
            batch_size=8,
            worker_id=4,
        )
    )
    config = SimConfig(
        policy="bsp",
        learning_rate=0.1,
        duration=3.0,
        core_kwargs={"deadline_factor": 3.0, "min_timeout": 0.3},
    )
    with_sums, alone, summed = _runs_with_and_without_sums(monkeypatch, workers, config)
    assert summed > 0
    assert any("dropped" in e for e in with_sums.errors)
    assert {a.num_updates for a in with_sums.applies} >= {4, 5}
    _assert_same_run(with_sums, alone)


def _nan_for_label_3(p, batch):
    # Non-finite gradients exactly where a batch holds class 3.
    _, y = batch
    loss = loss_fn(p, batch)
    return loss * jnp.where(jnp.any(y == 3), jnp.nan, 1.0)


def test_a_sum_that_is_not_finite_refuses_exactly_the_pushes_alone_would(monkeypatch):
    x, y = TRAIN
    keep = (y != 3) | (np.arange(len(y)) < 4)  # four examples of class 3
    data = (x[keep], y[keep])
    workers = constant_workers((0.05, 0.05, 0.1, 0.1), batch_size=32)
    # Pushes sent and refused by the server, the run going on (by default it
    # would stop at the first non-finite round: test_sim_divergence.py).
    config = SimConfig(
        policy="bsp", learning_rate=0.1, max_gradients=24, stop_on_divergence=False
    )
    results = []
    for min_rows in (2, 10**9):
        from hpsjax.sim import _engine

        monkeypatch.setattr(_engine, "SUM_MIN_ROWS", min_rows)
        results.append(simulate(_nan_for_label_3, PARAMS, data, workers, config))
    with_sums, alone = results
    refused = [p for p in alone.pushes if p.status == "rejected"]
    assert refused and len(refused) < len(alone.pushes)
    assert [p[:7] for p in with_sums.pushes] == [p[:7] for p in alone.pushes]
    assert with_sums.errors == alone.errors
