"""The experiments' piloted plans (``config.plan.pilot``): the server's
:class:`hpsjax.profiling.Pilot` plans real processes from their first rounds."""

from __future__ import annotations

import pytest

from experiments import backends, registry


def test_a_pilot_needs_a_plan_scheme_and_real_processes():
    config = registry.load_config("bsp", "proc4")
    config.plan.pilot = True
    with pytest.raises(ValueError, match=r"^plan.pilot needs a plan.scheme$"):
        registry.check_config(config)
    config = registry.load_config("hps", "quick")
    config.plan.pilot = True
    with pytest.raises(ValueError, match=r"runs on real processes"):
        registry.check_config(config)
    config = registry.load_config("hps", "proc4")
    config.plan.pilot = True
    registry.check_config(config)


def test_the_replanner_of_a_pilot_keeps_its_plan_without_replan():
    config = registry.load_config("hps", "proc4")
    config.plan.pilot = True
    config.plan.pilot_tolerance = 0.5
    config.plan.pilot_rounds = 4
    seen = []
    pilot = backends._replanner(config, None, lambda now, p: seen.append(p))
    assert [w.batch_size for w in pilot.plan.workers] == [32, 32, 32, 32]
    # H-PS's proc4 config scales no step size (plan.lr_scaling "none"): nor
    # do the pilot's plans.
    assert [w.lr_scale for w in pilot.plan.workers] == [1.0] * 4
    now, speeds = 0.0, {0: 0.1, 1: 0.1, 2: 0.05, 3: 0.025}
    while not pilot.done and now < 500:
        # A barrier's rounds: each push its step (and 10 ms) after the round
        # starts, the next round at the last push.
        pushes = []
        for w in pilot.plan.workers:
            steps = speeds[w.worker_id] * (1 + w.batch_size / 32)
            pushes.append((now + steps + 0.01, w.worker_id, w.batch_size, steps))
        for at, worker, batch, steps in sorted(pushes):
            pilot.observe(worker, batch, steps, at)
        now = max(p[0] for p in pushes)
    assert pilot.done and seen, "the pilot never planned"
    planned = [w.batch_size for w in pilot.plan.workers]
    assert planned[3] > planned[2] > planned[0], planned  # faster, more
    assert all(p.workers[0].lr_scale == 1.0 for p in seen)
    revisions = len(seen)
    for _ in range(40):  # a worker slows 4x: without plan.replan, no re-plan
        pilot.observe(0, planned[0], 4 * speeds[0] * (1 + planned[0] / 32), now)
        now += 1.0
    assert len(seen) == revisions


def test_pilot_rounds_compares_the_last_plan_with_the_rounds_after_it():
    info = {}
    records = [
        {"event": "replan", "time": 5.0, "predicted_round_s": 0.2},
        *({"event": "round", "worker": 0, "time": 1.0 + i, "round_s": 9.0}
          for i in range(3)),  # before the plan
        *({"event": "round", "worker": 0, "time": 5.5, "round_s": 7.0,
           "batch_size": 32},),  # the old batch, while the new one compiles
        *({"event": "round", "worker": 0, "time": 6.0 + i, "round_s": s,
           "batch_size": 16}
          for i, s in enumerate((5.0, 4.0, 0.2, 0.3))),  # 2 warm-up rounds
    ]  # fmt: skip
    backends._pilot_rounds(info, records)
    assert info["predicted_round_s"] == 0.2
    assert info["measured_mean_round_s"] == pytest.approx(0.25)
    assert info["pilot_seconds"] == 5.0


def test_a_pilot_plans_on_the_grid_its_workers_compile_before_joining():
    from hpsjax.planning import batch_grid

    config = registry.load_config("hps", "proc4")
    config.plan.pilot = True
    grid = batch_grid(128)  # 4 workers of 32; plan.pilot_grid 4 by default
    argv = backends.run_config(config).worker_argv(0)
    assert argv[argv.index("--precompile") + 1] == ",".join(map(str, grid))
    pilot = backends._replanner(config, None, lambda now, p: None)
    now, steps = 0.0, {0: 0.1, 1: 0.1, 2: 0.05, 3: 0.025}
    while not pilot.done and now < 500:
        pushes = []
        for w in pilot.plan.workers:
            t = steps[w.worker_id] * (1 + w.batch_size / 32)
            pushes.append((now + t + 0.01, w.worker_id, w.batch_size, t))
        for at, worker, batch, t in sorted(pushes):
            pilot.observe(worker, batch, t, at)
        now = max(p[0] for p in pushes)
    assert pilot.done
    assert all(w.batch_size in grid for w in pilot.plan.workers)
    # plan.pilot_grid 0: any batch, nothing compiled ahead.
    config.plan.pilot_grid = 0
    assert "--precompile" not in backends.run_config(config).worker_argv(0)
