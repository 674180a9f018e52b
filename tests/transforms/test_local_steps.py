"""Local steps: pushes fall every k updates with the right accumulated sum."""

from __future__ import annotations

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _local_steps
from hpsjax.transforms._local_steps import (
    LocalStepsState,
    local_steps,
    pending_update,
    push_due,
)

PARAMS = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(3)}


def _updates(step):
    # Distinct per step, so a sum over the wrong steps cannot pass.
    return jax.tree.map(lambda p: jnp.full_like(p, 2.0**step), PARAMS)


def _run(tx, steps, **extra):
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    dues, sums = [], []
    for step in range(steps):
        out, state = update(_updates(step), state, PARAMS, **extra)
        jax.tree.map(np.testing.assert_array_equal, out, _updates(step))
        dues.append(bool(push_due(state)))
        sums.append(float(pending_update(state)["b"][0]))
    return dues, sums, state


def test_push_due_exactly_every_k_with_the_sum_and_reset_after():
    dues, sums, state = _run(local_steps(3), 7)
    assert dues == [False, False, True, False, False, True, False]
    # 2^0+2^1+2^2 = 7 at the first push, 2^3+2^4+2^5 = 56 at the second; each
    # push is followed by a fresh sum holding only the next update.
    assert sums == [1.0, 3.0, 7.0, 8.0, 24.0, 56.0, 64.0]
    assert int(state.count) == 1


def test_k_equal_one_pushes_every_update():
    dues, sums, _ = _run(local_steps(1), 3)
    assert dues == [True, True, True]
    assert sums == [1.0, 2.0, 4.0]


def test_pending_update_is_how_far_the_worker_moved():
    tx = optax.chain(optax.adam(0.1), local_steps(4))
    params, last_push = PARAMS, PARAMS
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(8):
        grads = jax.tree.map(lambda p, s=step: jnp.sin(p + s) + 0.5, params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if push_due(state):
            moved = jax.tree.map(lambda a, b: a - b, params, last_push)
            jax.tree.map(
                lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                pending_update(state),
                moved,
            )
            last_push = params
    assert step == 7 and bool(push_due(state))


def test_helpers_find_the_state_in_nested_optax_states():
    # name -> (transform, scale its chain puts on the updates before summing)
    wrapped = {
        "alone": (local_steps(2), 1.0),
        "chain": (optax.chain(optax.sgd(0.1), local_steps(2)), -0.1),
        "named_chain": (
            optax.named_chain(("sgd", optax.sgd(0.1)), ("local", local_steps(2))),
            -0.1,
        ),
        "inject": (optax.inject_hyperparams(local_steps)(k=2), 1.0),
        "multisteps": (optax.MultiSteps(local_steps(2), every_k_schedule=1), 1.0),
    }
    for name, (tx, scale) in wrapped.items():
        tx = optax.with_extra_args_support(tx)
        state = tx.init(PARAMS)
        assert not bool(push_due(state)), name
        for step in range(2):
            _, state = tx.update(_updates(step), state, PARAMS)
        assert bool(push_due(state)), name
        np.testing.assert_allclose(
            pending_update(state)["b"], np.full(3, 3.0 * scale), rtol=1e-6
        )


def test_helpers_reject_states_without_or_with_several_local_steps():
    with pytest.raises(ValueError, match="found no"):
        push_due(optax.sgd(0.1).init(PARAMS))
    twice = optax.chain(local_steps(2), local_steps(3))
    with pytest.raises(ValueError, match="found 2"):
        pending_update(twice.init(PARAMS))


def test_traced_k_changes_through_inject_hyperparams():
    tx = optax.inject_hyperparams(local_steps)(k=4)
    update = jax.jit(tx.update)
    state = tx.init(PARAMS)
    for step in range(2):
        _, state = update(_updates(step), state, PARAMS)
    assert not bool(push_due(state))
    # Lowered below what is already summed: the sum is due at the next update.
    state.hyperparams["k"] = jnp.asarray(2)
    _, state = update(_updates(2), state, PARAMS)
    assert bool(push_due(state))
    assert float(pending_update(state)["b"][0]) == 7.0
    _, state = update(_updates(3), state, PARAMS)
    _, state = update(_updates(4), state, PARAMS)
    assert bool(push_due(state))
    assert float(pending_update(state)["b"][0]) == 24.0


def test_local_steps_extra_argument_overrides_k():
    dues, _, _ = _run(local_steps(5), 4, local_steps=2)
    assert dues == [False, True, False, True]
    tx = local_steps(5)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        tx.update(_updates(0), tx.init(PARAMS), local_steps=0)


def test_accumulator_dtype():
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
    tx = local_steps(2, accumulator_dtype="float32")
    state = tx.init(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.accumulated))
    updates = jax.tree.map(lambda p: jnp.full_like(p, 1.0 / 3.0), params)
    out, state = tx.update(updates, state)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(out))
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(state.accumulated))
    default = local_steps(2).init(params)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(default.accumulated))


@pytest.mark.parametrize("k", [0, -3, 1.5, True, jnp.array([2, 2]), "4"])
def test_bad_k_raises_at_construction(k):
    with pytest.raises(ValueError, match="k must be"):
        local_steps(k)


def test_bad_accumulator_dtype_raises():
    with pytest.raises(ValueError, match="accumulator_dtype"):
        local_steps(2, accumulator_dtype="float99")


def test_state_fields():
    state = local_steps(3).init(PARAMS)
    assert isinstance(state, LocalStepsState)
    assert state.count.dtype == jnp.int32 and state.count.shape == ()
    assert state.push_due.dtype == jnp.bool_


def test_docstring_examples():
    results = doctest.testmod(_local_steps)
    assert results.attempted > 0
    assert results.failed == 0
