"""The hybrid stage machine: switching rules, flushes, settings read back."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _stages
from hpsjax.transforms._local_steps import local_steps, pending_update, push_due
from hpsjax.transforms._stages import (
    STAGE_MODES,
    HybridStagesState,
    Stage,
    StageInfo,
    current_stage,
    hybrid_stages,
    stage_settings,
)
from hpsjax.transforms._staleness import scale_by_staleness

PARAMS = {"w": jnp.zeros((2, 3)), "b": jnp.zeros(2)}
ONES = jax.tree.map(jnp.ones_like, PARAMS)


def _drive(tx, losses=None, steps=None, **extra):
    """Runs updates of ones; returns the stage after each and the scales applied."""
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    steps = len(losses) if steps is None else steps
    stages_seen, scales = [], []
    for step in range(steps):
        if losses is not None:
            extra["loss"] = losses[step]
        updates, state = update(ONES, state, PARAMS, **extra)
        scales.append(float(updates["b"][0]))
        stages_seen.append(int(current_stage(state)))
    return stages_seen, scales, state


def test_switch_on_the_step_boundary():
    stages = [
        Stage(optax.scale(1.0), local_steps=2, until_step=3),
        Stage(optax.scale(10.0), mode="semi_async", max_staleness=1),
    ]
    seen, scales, state = _drive(hybrid_stages(stages), steps=5)
    # Updates of global steps 0, 1, 2 go through stage 0; from step 3 on, stage 1.
    assert scales == [1.0, 1.0, 1.0, 10.0, 10.0]
    assert seen == [0, 0, 1, 1, 1]
    assert int(state.step) == 5 and int(state.stage_step) == 2
    assert stage_settings(stages, state) == StageInfo(1, "semi_async", 1, 1)


def test_three_stages_and_settings_per_index():
    stages = [
        Stage(optax.scale(1.0), mode="async", local_steps=8, until_step=2),
        Stage(
            optax.scale(2.0),
            mode="semi_async",
            local_steps=2,
            max_staleness=3,
            until_step=4,
        ),
        Stage(optax.scale(3.0), mode="sync"),
    ]
    seen, scales, _ = _drive(hybrid_stages(stages), steps=6)
    assert scales == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert seen == [0, 1, 1, 2, 2, 2]
    assert [stage_settings(stages, i) for i in range(3)] == [
        StageInfo(0, "async", 8, None),
        StageInfo(1, "semi_async", 2, 3),
        StageInfo(2, "sync", 1, 0),
    ]
    assert stage_settings(stages, jnp.asarray(1)).mode == "semi_async"
    assert stage_settings(stages, np.int64(2)).max_staleness == 0


def _plateau_stages(window=3, threshold=0.01):
    return [
        Stage(
            optax.scale(1.0),
            local_steps=1,
            plateau_window=window,
            plateau_threshold=threshold,
        ),
        Stage(optax.scale(10.0), mode="semi_async", max_staleness=0),
    ]


def test_flat_loss_ends_the_stage_after_window_plus_one_updates():
    seen, scales, _ = _drive(hybrid_stages(_plateau_stages(3)), losses=[2.0] * 6)
    assert seen == [0, 0, 0, 1, 1, 1]
    assert scales == [1.0] * 4 + [10.0] * 2


def test_improving_loss_never_ends_the_stage():
    losses = [2.0 * 0.9**t for t in range(12)]
    seen, _, state = _drive(hybrid_stages(_plateau_stages(2)), losses=losses)
    assert seen == [0] * 12
    assert int(state.plateau_count) == 0
    np.testing.assert_allclose(float(state.best_loss), losses[-1], rtol=1e-6)


def test_improvement_below_the_threshold_counts_as_flat():
    # 0.5% per update, under the 1% threshold: a plateau.
    losses = [2.0 * 0.995**t for t in range(5)]
    seen, _, _ = _drive(hybrid_stages(_plateau_stages(2)), losses=losses)
    assert seen == [0, 0, 1, 1, 1]
    seen, _, _ = _drive(
        hybrid_stages(_plateau_stages(2, threshold=0.001)), losses=losses
    )
    assert seen == [0] * 5


def test_a_worse_loss_or_nan_never_improves():
    seen, _, _ = _drive(
        hybrid_stages(_plateau_stages(2)), losses=[1.0, 0.5, 3.0, float("nan"), 0.1]
    )
    assert seen == [0, 0, 0, 1, 1]


def test_loss_smoothing_uses_the_bias_corrected_average():
    tx = hybrid_stages(_plateau_stages(5), loss_smoothing=0.5)
    _, _, state = _drive(tx, losses=[4.0, 2.0])
    # m1 = 2, m2 = 0.5*2 + 0.5*2 = 2; corrected: 2/0.5 = 4, then 2/0.75.
    np.testing.assert_allclose(float(state.loss_average), 2.0)
    np.testing.assert_allclose(float(state.best_loss), 8.0 / 3.0, rtol=1e-6)


def test_plateau_and_step_rules_together_whichever_first():
    stages = [
        Stage(optax.scale(1.0), until_step=10, plateau_window=1),
        Stage(optax.scale(2.0)),
    ]
    seen, _, _ = _drive(hybrid_stages(stages), losses=[1.0, 1.0, 1.0])
    assert seen == [0, 1, 1]
    seen, _, _ = _drive(hybrid_stages(stages), losses=[0.5**t for t in range(11)])
    assert seen == [0] * 9 + [1, 1]


def test_a_stage_whose_until_step_has_passed_is_skipped():
    stages = [
        Stage(optax.scale(1.0), plateau_window=1),
        Stage(optax.scale(2.0), until_step=2),
        Stage(optax.scale(3.0)),
    ]
    seen, scales, _ = _drive(hybrid_stages(stages), losses=[1.0] * 4)
    assert seen == [0, 2, 2, 2]
    assert scales == [1.0, 1.0, 3.0, 3.0]


def test_switch_resets_the_loss_tracking():
    stages = _plateau_stages(1)
    _, _, state = _drive(hybrid_stages(stages), losses=[1.0, 1.0])
    assert int(state.stage) == 1
    assert int(state.stage_step) == 0 and int(state.plateau_count) == 0
    assert float(state.loss_average) == 0.0 and np.isinf(float(state.best_loss))


def test_local_steps_per_stage_and_flush_at_the_switch():
    stages = [
        Stage(optax.scale(1.0), local_steps=5, until_step=3),
        Stage(optax.scale(1.0), mode="semi_async", local_steps=2, max_staleness=1),
    ]
    tx = hybrid_stages(stages)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    dues, sums = [], []
    for step in range(7):
        grads = jax.tree.map(lambda p, s=step: jnp.full_like(p, 2.0**s), PARAMS)
        _, state = update(grads, state, PARAMS)
        dues.append(bool(push_due(state)))
        sums.append(float(pending_update(state)["w"][0, 0]))
    # Stage 0 ends after 3 of its 5 local steps: that sum (1+2+4) is pushed; then
    # stage 1 pushes every 2 updates.
    assert dues == [False, False, True, False, True, False, True]
    assert sums == [1.0, 3.0, 7.0, 8.0, 24.0, 32.0, 96.0]


def test_extra_args_reach_the_stage_transforms():
    stages = [
        Stage(
            optax.chain(scale_by_staleness("inverse"), optax.scale(1.0)),
            until_step=1,
        ),
        Stage(scale_by_staleness("exponential", gamma=0.5)),
    ]
    _, scales, _ = _drive(hybrid_stages(stages), steps=2, staleness=4)
    assert scales == [0.25, 0.0625]
    tx = hybrid_stages(stages)
    with pytest.raises(ValueError, match="staleness"):
        tx.update(ONES, tx.init(PARAMS), PARAMS)


def test_inner_states_of_other_stages_are_kept():
    stages = [
        Stage(optax.adam(0.1), until_step=2),
        Stage(optax.adam(0.1)),
    ]
    _, _, state = _drive(hybrid_stages(stages), steps=5)
    counts = [int(s[0].count) for s in state.inner_states]
    assert counts == [2, 3]


def test_loss_required_only_with_a_plateau_rule():
    tx = hybrid_stages(_plateau_stages())
    with pytest.raises(ValueError, match="`loss`"):
        tx.update(ONES, tx.init(PARAMS), PARAMS)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        tx.update(ONES, tx.init(PARAMS), PARAMS, loss=jnp.ones(2))
    steps_only = hybrid_stages(
        [Stage(optax.scale(1.0), until_step=1), Stage(optax.identity())]
    )
    updates, _ = steps_only.update(ONES, steps_only.init(PARAMS), PARAMS)
    jax.tree.map(np.testing.assert_array_equal, updates, ONES)


def test_inject_hyperparams_and_chain():
    stages = _plateau_stages(1)
    tx = optax.chain(
        optax.inject_hyperparams(hybrid_stages)(stages, loss_smoothing=0.0),
        optax.sgd(0.5),
    )
    seen, scales, state = _drive(tx, losses=[1.0, 1.0, 1.0])
    assert seen == [0, 1, 1]
    assert scales == [-0.5, -0.5, -5.0]
    assert stage_settings(stages, state).index == 1


def test_helpers_reject_bad_states_and_indices():
    stages = _plateau_stages()
    with pytest.raises(ValueError, match="found no"):
        current_stage(optax.sgd(0.1).init(PARAMS))
    with pytest.raises(ValueError, match="out of range"):
        stage_settings(stages, 2)
    with pytest.raises(ValueError, match="out of range"):
        stage_settings(stages, -1)
    with pytest.raises(ValueError, match="concrete"):
        jax.jit(lambda i: stage_settings(stages, i).local_steps)(jnp.asarray(0))
    both = optax.chain(hybrid_stages(stages), hybrid_stages(stages))
    with pytest.raises(ValueError, match="found 2"):
        current_stage(both.init(PARAMS))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "bulk"},
        {"local_steps": 0},
        {"local_steps": 2.0},
        {"max_staleness": -1},
        {"mode": "semi_async"},
        {"mode": "sync", "max_staleness": 2},
        {"until_step": 0},
        {"plateau_window": 0},
        {"plateau_threshold": 1.0},
        {"plateau_threshold": -0.1},
    ],
)
def test_bad_stage_raises(kwargs):
    with pytest.raises(ValueError):
        Stage(optax.sgd(0.1), **kwargs)


def test_bad_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="bulk") as info:
        Stage(optax.sgd(0.1), mode="bulk")
    for mode in STAGE_MODES:
        assert mode in str(info.value)


def test_stage_transform_must_be_an_optax_transform():
    with pytest.raises(ValueError, match="GradientTransformation"):
        Stage(optax.MultiSteps(optax.sgd(0.1), 2))


@pytest.mark.parametrize(
    ("stages", "match"),
    [
        ([], "at least one"),
        (Stage(optax.sgd(0.1)), "list of Stage"),
        ([optax.sgd(0.1)], r"stages\[0\] must be a Stage"),
        ([Stage(optax.sgd(0.1), until_step=3)], "never ends"),
        ([Stage(optax.sgd(0.1)), Stage(optax.sgd(0.1))], "no rule"),
        (
            [
                Stage(optax.sgd(0.1), until_step=5),
                Stage(optax.sgd(0.1), until_step=5),
                Stage(optax.sgd(0.1)),
            ],
            "increase",
        ),
    ],
)
def test_bad_stage_lists_raise_at_construction(stages, match):
    with pytest.raises(ValueError, match=match):
        hybrid_stages(stages)


@pytest.mark.parametrize("smoothing", [1.0, -0.5, "0.9"])
def test_bad_loss_smoothing_raises(smoothing):
    with pytest.raises(ValueError, match="loss_smoothing"):
        hybrid_stages(_plateau_stages(), loss_smoothing=smoothing)


def test_local_steps_inside_a_stage_is_ambiguous_for_the_helpers():
    stages = [Stage(local_steps(2), until_step=1), Stage(optax.identity())]
    state = hybrid_stages(stages).init(PARAMS)
    with pytest.raises(ValueError, match="found 2"):
        push_due(state)


def test_state_layout():
    state = hybrid_stages(_plateau_stages()).init(PARAMS)
    assert isinstance(state, HybridStagesState)
    assert len(state.inner_states) == 2
    assert state.stage.dtype == jnp.int32 and state.best_loss.dtype == jnp.float32


def test_docstring_examples():
    results = doctest.testmod(_stages)
    assert results.attempted > 0
    assert results.failed == 0
