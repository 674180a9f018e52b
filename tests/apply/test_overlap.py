"""Tests of hiding the link: the plan's choice of overlap and the look-ahead
momentum that lets a one-round-stale gradient converge."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax._optimizers import make_optimizer
from hpsjax.profiling import (
    LINK_SHARE_THRESHOLD,
    WorkerProfile,
    choose_overlap,
    link_share,
    plan,
)
from hpsjax.transforms import (
    LookaheadMomentumState,
    lookahead_coefficient,
    lookahead_momentum,
)

PARAMS = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.25)}


def _grads(k):
    """A fixed sequence of gradient trees, one per step ``k``."""
    return jax.tree.map(lambda p: jnp.sin(p * (k + 1)) + 0.1 * k, PARAMS)


def _run(tx, staleness, steps=6, params=PARAMS, **kwargs):
    """The updates of ``steps`` applications of ``tx`` at ``staleness``."""
    state = tx.init(params)
    out = []
    for k in range(steps):
        extra = {} if staleness is None else {"staleness": staleness}
        updates, state = tx.update(_grads(k), state, params, **extra, **kwargs)
        out.append(updates)
    return out, state


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        jax.tree.map(
            lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7), x, y
        )


# --- the plan's choice ---------------------------------------------------------


def _plan(transfer, *, samples_per_second=1000.0, global_batch=64):
    profiles = [
        WorkerProfile.synthetic(i, samples_per_second, transfer_seconds=transfer)
        for i in range(2)
    ]
    return plan(profiles, "hps", global_batch=global_batch)


def test_link_share_is_the_largest_transfer_over_the_round():
    work_plan = _plan(0.03)
    transfer = max(w.transfer_seconds for w in work_plan.workers)
    assert link_share(work_plan) == pytest.approx(transfer / work_plan.round_time)
    assert 0 < link_share(work_plan) < 1


def test_choose_overlap_pipelines_only_above_the_threshold():
    slow_link, fast_link = _plan(0.1), _plan(0.001)
    assert link_share(slow_link) > LINK_SHARE_THRESHOLD > link_share(fast_link)
    assert choose_overlap(slow_link) == "pipeline"
    assert choose_overlap(fast_link) == "none"
    share = link_share(slow_link)
    assert choose_overlap(slow_link, threshold=share) == "none"  # strictly above
    assert choose_overlap(slow_link, threshold=share * 0.99) == "pipeline"
    assert choose_overlap(slow_link, threshold=1.0) == "none"


def test_a_plan_without_a_link_never_pipelines():
    assert link_share(_plan(0.0)) == 0.0
    assert choose_overlap(_plan(0.0), threshold=1e-9) == "none"


@pytest.mark.parametrize("threshold", [0, -0.5, 1.5, True, None, "0.3", float("nan")])
def test_choose_overlap_rejects_a_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold must be in") as err:
        choose_overlap(_plan(0.03), threshold=threshold)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fn", [link_share, choose_overlap])
def test_choose_overlap_rejects_what_is_not_a_plan(fn):
    with pytest.raises(ValueError, match=r"must be a hpsjax\.planning\.WorkPlan"):
        fn({"round_time": 1.0})


# --- lookahead_momentum ----------------------------------------------------------


def test_lookahead_coefficient():
    assert float(lookahead_coefficient(0.9, 0)) == 0.0
    assert float(lookahead_coefficient(0.9, 1)) == pytest.approx(0.9)
    assert float(lookahead_coefficient(0.9, 2)) == pytest.approx(0.9 + 0.81)
    assert float(lookahead_coefficient(0.0, 3)) == 0.0


def test_fresh_updates_are_heavy_ball_momentum():
    ours, _ = _run(lookahead_momentum(0.1, 0.9, gamma=0.25), staleness=0)
    theirs, _ = _run(optax.sgd(0.1, momentum=0.9), staleness=None)
    _assert_same(ours, theirs)


@pytest.mark.parametrize("gamma", [1.0, 0.25])
def test_one_version_late_updates_are_nesterov_at_gamma_times_the_step(gamma):
    ours, _ = _run(lookahead_momentum(0.1, 0.9, gamma=gamma), staleness=1)
    theirs, _ = _run(optax.sgd(0.1 * gamma, momentum=0.9, nesterov=True), None)
    _assert_same(ours, theirs)


def test_the_parameters_hold_the_heavy_ball_iterate_plus_the_look_ahead():
    # Whatever the staleness along the way, w = x - lr * lookahead * m, with x
    # the heavy-ball iterate of the steps taken.
    lr, beta, gamma = 0.1, 0.8, 0.5
    tx = lookahead_momentum(lr, beta, gamma=gamma)
    chain_state = tx.init(PARAMS)
    w = x = PARAMS
    for k, tau in enumerate([0, 1, 1, 2, 0, 1]):
        updates, chain_state = tx.update(_grads(k), chain_state, w, staleness=tau)
        w = optax.apply_updates(w, updates)
        state = chain_state[0]
        step, ahead = gamma**tau, float(state.lookahead)
        x = jax.tree.map(lambda p, m, s=step: p - lr * s * m, x, state.momentum)
        expected = jax.tree.map(lambda p, m, a=ahead: p - lr * a * m, x, state.momentum)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            w,
            expected,
        )
    assert isinstance(state, LookaheadMomentumState)


def _delayed_quadratic(tx, curvature, steps=400):
    """|x| after ``steps`` updates of f = h x^2 / 2 whose gradient is one step
    late (computed on the parameters before the last update)."""
    x = previous = jnp.array(1.0)
    state = tx.init(x)
    for _ in range(steps):
        updates, state = tx.update(curvature * previous, state, x, staleness=1)
        previous, x = x, x + updates
    value = abs(float(x))
    return value if np.isfinite(value) else np.inf


def test_a_one_round_late_gradient_converges_with_the_look_ahead_only():
    # eta h = 0.2: heavy-ball momentum 0.9 is stable fresh up to 3.8 but one
    # round late only up to 1 - 0.9 = 0.1; with the look-ahead up to 0.25.
    heavy = optax.with_extra_args_support(optax.sgd(0.2, momentum=0.9))
    assert _delayed_quadratic(heavy, 1.0) > 1e3
    assert _delayed_quadratic(lookahead_momentum(0.2, 0.9), 1.0) < 1e-3
    # A quarter of the step is stable even at eta h = 0.8.
    assert _delayed_quadratic(lookahead_momentum(0.8, 0.9), 1.0) > 1e3
    assert _delayed_quadratic(lookahead_momentum(0.8, 0.9, gamma=0.25), 1.0) < 1e-3


def test_jit_chain_and_multisteps():
    tx = lookahead_momentum(0.1, 0.9, gamma=0.5)
    eager, _ = _run(tx, staleness=1, steps=3)
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    for k in range(3):
        updates, state = update(_grads(k), state, PARAMS, staleness=jnp.int32(1))
        _assert_same([updates], [eager[k]])
    chained = optax.chain(optax.clip_by_global_norm(1e6), tx)
    _assert_same(_run(chained, staleness=1, steps=3)[0], eager)
    multi = optax.MultiSteps(tx, every_k_schedule=1)
    _assert_same(_run(multi, staleness=1, steps=3)[0], eager)


def test_inject_hyperparams():
    tx = optax.inject_hyperparams(lookahead_momentum)(
        learning_rate=0.1, momentum=0.9, gamma=0.5
    )
    ours, state = _run(tx, staleness=1, steps=3)
    _assert_same(ours, _run(lookahead_momentum(0.1, 0.9, gamma=0.5), 1, steps=3)[0])
    assert float(state.hyperparams["gamma"]) == 0.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtype_is_kept(dtype):
    params = jax.tree.map(lambda p: p.astype(dtype), PARAMS)
    tx = lookahead_momentum(0.1, 0.9)
    state = tx.init(params)
    grads = jax.tree.map(lambda p: p.astype(dtype), _grads(0))
    updates, state = tx.update(grads, state, params, staleness=1)
    for leaf in jax.tree.leaves((updates, state[0].momentum)):
        assert leaf.dtype == dtype


def test_state_structure_is_stable_under_cond():
    tx = lookahead_momentum(0.1, 0.9)
    state = tx.init(PARAMS)

    def step(flag, state):
        return jax.lax.cond(
            flag,
            lambda s: tx.update(_grads(0), s, PARAMS, staleness=1)[1],
            lambda s: s,
            state,
        )

    new = jax.jit(step)(True, state)
    assert jax.tree.structure(new) == jax.tree.structure(state)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\)"),
        ({"momentum": True}, "momentum must be a finite number"),
        ({"gamma": 0.0}, r"gamma must be in \(0, 1\]"),
        ({"gamma": 1.5}, r"gamma must be in \(0, 1\]"),
    ],
)
def test_bad_hyperparameters_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        lookahead_momentum(0.1, **kwargs)
    assert "\n" not in str(err.value)


def test_a_missing_or_negative_staleness_fails_at_update():
    tx = lookahead_momentum(0.1)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="Missing the keyword extra argument"):
        tx.update(_grads(0), state, PARAMS)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        tx.update(_grads(0), state, PARAMS, staleness=-1)


def test_the_optimizer_registry_builds_it():
    ours, _ = _run(make_optimizer("lookahead_momentum", 0.1, gamma=0.5), 1)
    _assert_same(ours, _run(lookahead_momentum(0.1, 0.9, gamma=0.5), 1)[0])
    with pytest.raises(ValueError, match="bad arguments for optimizer"):
        make_optimizer("lookahead_momentum", 0.1, gamma=2.0)


# --- the experiments' config ------------------------------------------------------


def _hps(setting="quick", **plan):
    from experiments import registry

    config = registry.load_config("hps", setting)
    for key, value in plan.items():
        config.plan[key] = value
    return config


def test_hps_fresh_rounds_step_as_heavy_ball_momentum():
    from experiments import build

    config = _hps()
    ours, _ = _run(build.server_optimizer(config), staleness=0)
    lr = float(config.server.learning_rate)
    _assert_same(ours, _run(optax.sgd(lr, momentum=0.9), None)[0])


def test_the_plan_chooses_the_overlap_where_the_config_asks():
    from experiments import backends

    slow_link = _plan(0.1)
    assert backends._overlap(_hps(), slow_link) == "none"  # worker.overlap
    asked = _hps(overlap_link_share=0.25)
    assert backends._overlap(asked, slow_link) == "pipeline"
    assert backends._overlap(asked, _plan(0.001)) == "none"
    assert backends._overlap(asked, None) == "none"


def test_real_workers_get_the_plans_choice(tmp_path):
    from experiments import backends

    plan_file = tmp_path / "plan.json"
    plan_file.write_text(_plan(0.1).to_json())
    asked = _hps(overlap_link_share=0.25)
    flags = backends._worker_flags(asked, 0, plan_file=plan_file)
    assert flags[flags.index("--overlap") + 1] == "pipeline"
    flags = backends._worker_flags(_hps(), 0, plan_file=plan_file)
    assert flags[flags.index("--overlap") + 1] == "none"


@pytest.mark.parametrize(
    ("plan_fields", "match"),
    [
        ({"overlap_link_share": 1.5}, "plan.overlap_link_share must be in"),
        ({"overlap_link_share": 0.25, "scheme": "none"}, "needs a plan.scheme"),
    ],
)
def test_a_bad_overlap_link_share_is_refused_before_anything_runs(plan_fields, match):
    from experiments import registry

    with pytest.raises(ValueError, match=match) as err:
        registry.check_config(_hps(**plan_fields))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_a_simulated_run_pipelines_where_the_plan_says(tmp_path):
    from experiments import train

    config = _hps(overlap_link_share=0.01)
    config.budget_seconds = 4.0
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    assert summary["info"]["overlap"] == "pipeline"
    assert summary["info"]["staleness_histogram"].get("1", 0) > 0
    assert summary["final_loss"] is not None  # finite
