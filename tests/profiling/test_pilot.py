"""Tests of plans made from the run: the Pilot, and the Replanner following a
worker whose speed changes (hpsjax.profiling)."""

from __future__ import annotations

import math
import random

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.planning import batch_grid, on_grid
from hpsjax.profiling import Pilot, Replanner, WorkerProfile, WorkPlan, plan
from hpsjax.ps import ServerCore
from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
from hpsjax.worker import Heterogeneity

# Worker i's true step: COSTS[i] = (fixed seconds, seconds per sample).
COSTS = {"a": (0.010, 0.0010), "b": (0.030, 0.0010), "c": (0.005, 0.0030)}


def _drive(pilot, costs, *, noise=0.0, seed=0, rounds=200, links=None):
    """Feeds the pilot every worker's step per round as its plan says, as a
    barrier's rounds come (each push at the round's start plus the worker's
    link and step; the next round starts at the last push); noise: lognormal
    spread of each step. Returns the plans it installed."""
    rng = random.Random(seed)
    installed, start = [], 0.0
    for _ in range(rounds):
        if pilot.done:
            break
        pushes = []
        for w in pilot.plan.workers:
            a, c = costs[w.worker_id]
            t = (a + c * w.batch_size) * math.exp(rng.gauss(0.0, noise))
            link = (links or {}).get(w.worker_id, 0.0)
            pushes.append((start + link + t, w.worker_id, w.batch_size, t))
        for now, worker, batch, t in sorted(pushes):
            new = pilot.observe(worker, batch, t, now)
            if new is not None:
                installed.append(new)
        start = max(p[0] for p in pushes)
    return installed


def _true_step(costs, worker):
    a, c = costs[worker.worker_id]
    return a + c * worker.batch_size


def test_pilot_recovers_known_costs_from_noisy_reports():
    pilot = Pilot(["a", "b", "c"], global_batch=96, tolerance=0.02, max_rounds=400)
    installed = _drive(pilot, COSTS, noise=0.05, seed=1, rounds=400)
    assert pilot.done
    # The second phase: each worker's batch in proportion to its speed at the
    # even share (32 each: 42, 62 and 101 ms a step), so a step of each
    # takes about as long.
    second = installed[0]
    # (46, 31 and 19 without noise)
    assert [w.batch_size for w in second.workers] == pytest.approx([46, 31, 19], abs=1)
    # (in proportion to the speed at 32, not yet to the fixed costs)
    times = [_true_step(COSTS, w) for w in second.workers]
    assert max(times) / min(times) < 1.25
    for w in pilot.plan.workers:
        fit = pilot.fits[w.worker_id]
        assert len(fit.batch_sizes) == 2
        # The step where the plan puts the worker is the true one.
        assert fit.step_time(w.batch_size) == pytest.approx(
            _true_step(COSTS, w), rel=0.03
        )
    # Where the two batches are far apart, the line is the true one at both
    # (its slope within 15%; only the first phase's five reports at 32,
    # whose median has a standard error of 2.8% at a spread of 5%).
    for w in "ac":
        a, c = COSTS[w]
        fit = pilot.fits[w]
        assert fit.slope == pytest.approx(c, rel=0.15)
        for b in fit.batch_sizes:
            assert fit.step_time(b) == pytest.approx(a + c * b, rel=0.07)
    # Every plan it installed is one revision further; the last is the fitted
    # hps plan, whose workers finish a step together.
    assert [p.revision for p in installed] == list(range(1, len(installed) + 1))
    final = installed[-1]
    assert final.scheme == "hps" and final.global_batch == 96
    times = [_true_step(COSTS, w) for w in final.workers]
    assert max(times) / min(times) < 1.1


def test_pilot_stops_early_on_clean_data_and_not_on_noisy_data():
    clean = Pilot(["a", "b"], global_batch=64, tolerance=0.05, max_rounds=60)
    _drive(clean, COSTS)
    # Two batches, each after its two warm-up reports and five kept ones.
    assert clean.done and clean.pilot_rounds <= 10
    noisy = Pilot(["a", "b"], global_batch=64, tolerance=0.05, max_rounds=60)
    _drive(noisy, COSTS, noise=0.3, seed=2)
    assert noisy.done and noisy.pilot_rounds > 3 * clean.pilot_rounds


def test_the_second_batch_follows_each_workers_speed():
    # Speeds 1 : 1 : 2 : 4 (proc4's), steps all per sample: the second phase
    # is the balanced split, and the pilot needs no third batch.
    costs = {"a": (0.0, 0.008), "b": (0.0, 0.008), "c": (0.0, 0.004), "d": (0.0, 0.002)}
    pilot = Pilot(["a", "b", "c", "d"], global_batch=128, max_rounds=60)
    assert [w.batch_size for w in pilot.plan.workers] == [32] * 4
    installed = _drive(pilot, costs, noise=0.02, seed=3)
    assert pilot.done and len(installed) == 2
    assert [w.batch_size for w in installed[0].workers] == [16, 16, 32, 64]
    assert all(p.global_batch == 128 for p in installed)
    # Worker c's share is its even one: one batch, its steps per sample.
    assert [len(pilot.fits[w].batch_sizes) for w in "abcd"] == [2, 2, 1, 2]
    assert pilot.fits["c"].intercept == 0.0
    # Equal workers have nothing to move to: no second phase, the even split.
    equal = Pilot(["a", "b", "c", "d"], global_batch=64, max_rounds=60)
    same = {w: (0.01, 0.001) for w in "abcd"}
    installed = _drive(equal, same, noise=0.02, seed=3)
    assert equal.done and len(installed) == 1
    assert [w.batch_size for w in installed[0].workers] == [16] * 4


def test_equal_workers_come_out_equal():
    # Steps spread 15%: the stopping rule (2%) holds the pilot until the
    # medians tell the workers apart to within a sample or two of 30.
    for seed in range(4):
        pilot = Pilot(["a", "b", "c"], global_batch=90, tolerance=0.02, max_rounds=200)
        costs = {w: (0.02, 0.002) for w in "abc"}
        _drive(pilot, costs, noise=0.15, seed=seed, rounds=400)
        batches = [w.batch_size for w in pilot.plan.workers]
        assert pilot.done and pilot.pilot_rounds < 200
        assert max(batches) - min(batches) <= 2, batches


def test_rounds_with_a_compile_are_left_out():
    # Worker "a" changes batch; its first report there is a first execution
    # (10 times its step) and, before it, two rounds at its old batch while
    # the new one compiled, slowed by the compile (3 times): none is fitted.
    costs = {"a": (0.0, 0.002), "b": (0.0, 0.004)}
    pilot = Pilot(["a", "b"], global_batch=48, tolerance=0.01, max_rounds=60)
    _drive(pilot, costs, rounds=8)
    assert [w.batch_size for w in pilot.plan.workers] == [32, 16]
    now = 100.0
    for batch_a, factor in [(24, 3), (24, 3), (32, 10), (32, 1), (32, 1)] + [
        (32, 1)
    ] * 4:
        now += 1.0
        pilot.observe("a", batch_a, factor * costs["a"][1] * batch_a, now)
        pilot.observe("b", 16, costs["b"][1] * 16, now + 0.001)
    fit = pilot.fits["a"]
    assert fit.step_time(32) == pytest.approx(0.064, rel=1e-6)
    assert fit.spread == 0.0


def test_pilot_counts_the_link():
    # The link is what a round leaves beyond the barrier: "a"'s 50 ms, not
    # the wait of the faster worker for the slower one.
    pilot = Pilot(["a", "b"], global_batch=64, plan_options={"min_batch": 1})
    _drive(pilot, COSTS, links={"a": 0.05, "b": 0.002})
    final = pilot.plan
    assert pilot.link("a") == pytest.approx(0.05)
    assert pilot.link("b") == pytest.approx(0.002)
    assert final.worker("a").transfer_seconds == pytest.approx(0.05)
    # Worker a's round is its step plus the link: it gets less than without.
    alone = Pilot(["a", "b"], global_batch=64, plan_options={"min_batch": 1})
    _drive(alone, COSTS)
    assert final.worker("a").batch_size < alone.plan.worker("a").batch_size
    a, b = (final.worker(w) for w in "ab")
    assert a.round_time == pytest.approx(b.round_time, rel=0.1)
    # Without a barrier (ADSP) the link is the server's, as observe_link says.
    asynchronous = Pilot(["a", "b"], global_batch=64, scheme="adsp")
    asynchronous.observe_link("a", 0.05)
    asynchronous.observe_link("nobody", 1.0)  # not in the run: ignored
    assert asynchronous.link("a") == 0.05 and asynchronous.link("b") is None


def test_after_the_pilot_it_replans_as_a_replanner():
    pilot = Pilot(["a", "b"], global_batch=64, cooldown=0.0)
    _drive(pilot, COSTS)
    final = pilot.plan
    now, revised = 1e3, None
    slower = {"a": (0.02, 0.002), "b": COSTS["b"]}
    for _ in range(8):
        for w in pilot.plan.workers:
            a, c = slower[w.worker_id]
            now += 0.1
            revised = pilot.observe(
                w.worker_id, w.batch_size, a + c * w.batch_size, now
            )
            if revised is not None:
                break
        if revised is not None:
            break
    assert revised is not None and revised.revision == final.revision + 1
    assert revised.worker("a").batch_size < final.worker("a").batch_size


def test_server_core_passes_the_link_to_a_pilot():
    pilot = Pilot(["a", "b"], global_batch=8)
    core = ServerCore({"w": np.zeros(2)}, optax.sgd(0.1), "asp", replanner=pilot)
    core.join("a", now=0.0)
    core.pull("a", now=0.0)
    # Sent at 0 s, pushed at 1 s after 0.75 s of compute: 0.25 s on the link.
    core.push("a", {"w": np.zeros(2)}, version=0, now=1.0, step_time=0.75,
              num_samples=4, local_steps=1)  # fmt: skip
    assert pilot._links == {"a": pytest.approx(0.25)}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"worker_ids": []}, "worker_ids is empty"),
        ({"worker_ids": "ab"}, "worker_ids must be a sequence"),
        ({"worker_ids": ["a", "a"]}, "worker ids repeat"),
        ({"worker_ids": [True]}, "a worker id must be"),
        ({"global_batch": 1}, "global_batch must be an int >= 2"),
        ({"scheme": "fastest"}, "unknown scheme 'fastest'"),
        ({"tolerance": 0.0}, "tolerance"),
        ({"max_rounds": 0}, "max_rounds"),
        ({"min_reports": 0}, "min_reports"),
        ({"warmup": 0}, "warmup"),
        ({"plan_options": {"global_batch": 3}}, "unknown plan option"),
        ({"plan_options": {"lr_scaling": "cubic"}}, "unknown lr_scaling"),
        ({"plan_options": {"min_batch": 64}}, "min_batch"),
    ],
)
def test_pilot_bad_arguments_are_one_line_errors(kwargs, message):
    args = {"worker_ids": ["a", "b"], "global_batch": 64, **kwargs}
    with pytest.raises(ValueError, match=message) as info:
        Pilot(args.pop("worker_ids"), args.pop("global_batch"), **args)
    assert "\n" not in str(info.value)


def test_pilot_bad_reports_change_nothing():
    pilot = Pilot(["a", "b"], global_batch=64)
    for args, message in [
        (("nobody", 10, 1.0, 0.0), "no worker 'nobody'"),
        (("a", 0, 1.0, 0.0), "batch_size must be an int >= 1"),
        (("a", 10, -1.0, 0.0), "step_time must be a finite number > 0"),
        (("a", 10, 1.0, math.nan), "now must be finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            pilot.observe(*args)
    with pytest.raises(ValueError, match="seconds must be a finite number"):
        pilot.observe_link("a", -1.0)
    assert pilot.pilot_rounds == 0 and pilot.plan.revision == 0


# --- on the simulator ----------------------------------------------------------

_X = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
_DATA = (_X, _X @ np.arange(1.0, 5.0, dtype=np.float32))


def _loss(w, batch):
    return jnp.mean((batch[0] @ w - batch[1]) ** 2)


class _Timed:
    """Remembers when each plan came (the simulator's clock)."""

    def __init__(self):
        self.times: list[tuple[float, WorkPlan]] = []

    def wrap(self, replanner):
        observe = replanner.observe

        def timed(worker_id, batch_size, step_time, now):
            new = observe(worker_id, batch_size, step_time, now)
            if new is not None:
                self.times.append((now, new))
            return new

        replanner.observe = timed
        return replanner


def _measured_round(result, since, batches, until=math.inf) -> float:
    """The median seconds between a worker's pushes at ``batches`` from
    ``since`` to ``until``."""
    gaps = []
    for w, b in batches.items():
        times = [p.time for p in result.pushes
                 if p.worker_id == w and since < p.time < until
                 and p.batch_size == b]  # fmt: skip
        gaps += np.diff(times).tolist()
    return float(np.median(gaps))


def _workers(profiles, slowdown=None):
    return [
        WorkerSpec(
            ComputeModel.from_profile(p),
            worker_id=p.worker_id,
            heterogeneity=Heterogeneity(slowdown=slowdown)
            if i == 1 and slowdown
            else None,
        )
        for i, p in enumerate(profiles)
    ]


def test_replanner_follows_a_worker_whose_step_doubles_on_the_simulator():
    profiles = [WorkerProfile.synthetic(i, 400.0, overhead=0.01) for i in range(2)]
    start = plan(profiles, "hps", global_batch=64)
    timed = _Timed()
    replanner = timed.wrap(Replanner(start, cooldown=1.0))
    result = simulate(
        _loss,
        jnp.zeros(4),
        _DATA,
        _workers(profiles, slowdown=[(0.0, 1.0), (3.0, 2.0)]),
        SimConfig(policy="bsp", learning_rate=0.01, duration=14.0),
        work_plan=replanner,
    )
    after = [(t, p) for t, p in timed.times if t > 3.0]
    # Within two re-plans of the change, the plan's round is the run's: the
    # first may come on reports from before the change too.
    assert 1 <= len(after) <= 3
    errors = []
    for k, (when, followed) in enumerate(after):
        until = after[k + 1][0] if k + 1 < len(after) else math.inf
        batches = {w.worker_id: w.batch_size for w in followed.workers}
        measured = _measured_round(result, when + 0.3, batches, until)
        errors.append(abs(followed.round_time / measured - 1))
    assert min(errors[:2]) <= 0.15, errors
    assert errors[-1] <= 0.15, errors
    # The final plan: worker 0's 0.01 + b / 400 s and worker 1's twice that
    # finish together at 44 and 20 samples.
    assert [w.batch_size for w in replanner.plan.workers] == [44, 20]


def test_pilot_then_its_plan_on_the_simulator():
    # Worker 1 is three times slower per sample, both with a fixed cost.
    truth = [WorkerProfile.synthetic(0, 600.0, overhead=0.01),
             WorkerProfile.synthetic(1, 200.0, overhead=0.01)]  # fmt: skip
    timed = _Timed()
    pilot = timed.wrap(Pilot([0, 1], global_batch=64, tolerance=0.05))
    workers = [
        WorkerSpec(ComputeModel.from_profile(p, sigma=0.05), worker_id=p.worker_id)
        for p in truth
    ]
    result = simulate(
        _loss, jnp.zeros(4), _DATA, workers,
        SimConfig(policy="bsp", learning_rate=0.01, duration=12.0, seed=0),
        work_plan=pilot,
    )  # fmt: skip
    assert pilot.done
    assert [p.revision for p in result.work_plans] == list(
        range(len(result.work_plans))
    )
    final_at, final = next(
        (t, p) for t, p in timed.times if p.revision == pilot.plan.revision
    )
    expected = plan(truth, "hps", global_batch=64)
    assert [w.batch_size for w in final.workers] == pytest.approx(
        [w.batch_size for w in expected.workers], abs=2
    )
    batches = {w.worker_id: w.batch_size for w in final.workers}
    measured = _measured_round(result, final_at + 0.5, batches)
    assert final.round_time == pytest.approx(measured, rel=0.15)


def test_the_pilots_plans_scale_the_step_size_as_its_final_plan():
    # plan()'s default scales no step size: nor does a phase of the pilot (a
    # phase at 4 times the step size set the model back on proc4).
    costs = {"a": (0.0, 0.002), "b": (0.0, 0.004)}
    for options, scale in [(None, 1.0), ({"lr_scaling": "linear"}, 2.0)]:
        pilot = Pilot(["a", "b"], global_batch=64, plan_options=options)
        installed = _drive(pilot, costs)
        assert pilot.done
        for p in [pilot.plan, *installed]:
            assert [w.lr_scale for w in p.workers] == [scale, scale], options


def test_the_second_phases_batches_are_kept_when_the_fit_gains_little():
    # Small fixed costs: the fit's plan ([16, 16, 33, 63]) moves a sample or
    # two from the proportional split ([17, 17, 33, 61]), for a round under
    # 3% shorter; a new batch would be a compile beside the rounds, so the
    # pilot keeps the split it runs, and predicts its round.
    costs = {"a": (0.002, 0.008), "b": (0.002, 0.008), "c": (0.002, 0.004),
             "d": (0.006, 0.002)}  # fmt: skip
    pilot = Pilot(list(costs), global_batch=128)
    installed = _drive(pilot, costs, links=dict.fromkeys(costs, 0.01))
    assert pilot.done and len(installed) == 2
    second, final = installed
    assert [w.batch_size for w in final.workers] == [
        w.batch_size for w in second.workers
    ]
    assert "the batches it ran kept" in pilot.reason
    true_round = max(_true_step(costs, w) + 0.01 for w in final.workers)
    assert final.round_time == pytest.approx(true_round, rel=0.05)
    # Larger fixed costs: the fit's plan gains more, and comes.
    heavy = {w: (0.03, c) for w, (_, c) in costs.items()}
    pilot = Pilot(list(heavy), global_batch=128)
    installed = _drive(pilot, heavy, links=dict.fromkeys(heavy, 0.01))
    second, final = installed
    assert "kept" not in pilot.reason
    assert [w.batch_size for w in final.workers] != [
        w.batch_size for w in second.workers
    ]
    times = [_true_step(heavy, w) for w in pilot.plan.workers]
    assert max(times) / min(times) < 1.05


def test_the_barrier_replay_gives_links_only_for_rounds_it_saw_end():
    from hpsjax.profiling._pilot import _Barrier

    barrier = _Barrier(["a", "b"])
    # No round has ended yet: no link.
    assert barrier.push("a", 1.0, 0.5) is None
    assert barrier.push("b", 2.0, 1.5) is None  # the round ends at 2.0
    # Each next push: the time since the round's end less its compute.
    assert barrier.push("a", 2.8, 0.7) == pytest.approx(0.1)
    assert barrier.push("b", 3.9, 1.6) == pytest.approx(0.3)  # ends at 3.9
    # A worker pushing twice in one round (no barrier, or out of step): the
    # replay starts over and gives no link until a round ends again.
    assert barrier.push("a", 4.5, 0.5) == pytest.approx(0.1)
    assert barrier.push("a", 5.0, 0.4) is None
    assert barrier.push("b", 5.5, 1.5) is None  # ends at 5.5
    assert barrier.push("a", 6.2, 0.6) == pytest.approx(0.1)


def test_speeds_within_their_errors_are_pooled():
    from hpsjax.profiling._pilot import _pooled

    assert _pooled([1.0, 1.05, 2.0, 4.1], [0.05] * 4) == pytest.approx(
        [1.025, 1.025, 2.0, 4.1]
    )
    # Tight errors tell 1.0 and 1.05 apart.
    assert _pooled([1.0, 1.05, 2.0], [0.005] * 3) == [1.0, 1.05, 2.0]
    assert _pooled([3.0], [0.0]) == [3.0]


def test_the_pilots_batches_stay_on_its_grid():
    # proc4's speeds 1:1:2:4 with a fixed cost of 30 ms and links of 10 ms;
    # the grid of four sizes a doubling up to 128 (..., 16, 19, 23, 27, 32,
    # 38, 45, 54, 64, 76, ...), the shapes the workers compiled ahead.
    costs = {"a": (0.03, 0.008), "b": (0.03, 0.008), "c": (0.03, 0.004),
             "d": (0.03, 0.002)}  # fmt: skip
    links = dict.fromkeys(costs, 0.01)
    grid = batch_grid(128)
    free = Pilot(list(costs), global_batch=128)
    free_second, _ = _drive(free, costs, links=links)
    pilot = Pilot(list(costs), global_batch=128, batch_sizes=grid)
    second, final = _drive(pilot, costs, links=links)
    # The second phase: the proportional split [18, 19, 34, 57] (worker b
    # takes the remainder) down on the grid, [16, 19, 32, 54], and worker a
    # raised to 19, as fast as b's: its round stays within the slowest's.
    assert [w.batch_size for w in free_second.workers] == [18, 19, 34, 57]
    assert [w.batch_size for w in second.workers] == [19, 19, 32, 54]
    # The final plan: the fit's [16, 16, 33, 63] down on the grid, [16, 16,
    # 32, 54], worker d raised to 64: 30 + 2 * 64 = 158 ms, as long as a's
    # 30 + 8 * 16; the round 158 + 10 ms of link, as the fits predict it.
    assert [w.batch_size for w in final.workers] == [16, 16, 32, 64]
    assert final.global_batch == 128
    assert final.round_time == pytest.approx(0.168, rel=1e-6)
    assert all(w.batch_size in grid for p in (second, final) for w in p.workers)


def test_pilot_refuses_a_bad_grid_in_one_line():
    for sizes, message in [
        ([], "non-empty list"),
        ("8,16", "non-empty list"),
        ([8, 8], "ascend without repeats"),
        ([16, 8], "ascend without repeats"),
        ([0, 8], "a batch size of batch_sizes"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            Pilot(["a", "b"], global_batch=64, batch_sizes=sizes)
        assert "\n" not in str(info.value)


def test_batch_grid_and_on_grid():
    assert batch_grid(128) == (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 23,
                               27, 32, 38, 45, 54, 64, 76, 91, 108, 128)  # fmt: skip
    assert batch_grid(100, per_doubling=1, low=3) == (3, 6, 12, 24, 48, 96, 100)
    assert batch_grid(5, low=5) == (5,)
    grid = (8, 10, 13)
    assert [on_grid(b, grid) for b in (1, 8, 9, 12, 13, 99)] == [8, 8, 8, 10, 13, 13]
    for kwargs, message in [
        ({"high": 0}, "high"),
        ({"high": 8, "low": 0}, "low"),
        ({"high": 4, "low": 8}, "high"),
        ({"high": 8, "per_doubling": 0}, "per_doubling"),
    ]:
        with pytest.raises(ValueError, match=message):
            batch_grid(**kwargs)
