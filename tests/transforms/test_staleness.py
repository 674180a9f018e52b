"""Exact values of the staleness damping and delay-compensation transforms."""

from __future__ import annotations

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _staleness
from hpsjax.transforms._staleness import (
    STALENESS_POLICIES,
    delay_compensation,
    scale_by_staleness,
    staleness_factor,
)

GRADS = {"w": jnp.array([[1.0, -2.0], [4.0, 0.5]]), "b": jnp.array([8.0, -1.0])}


@pytest.mark.parametrize(
    ("policy", "kwargs", "taus", "expected"),
    [
        ("inverse", {}, [0, 1, 2, 4, 10], [1.0, 1.0, 0.5, 0.25, 0.1]),
        ("inverse", {}, [0.5, 2.5], [1.0, 0.4]),
        ("inverse_plus_one", {}, [0, 1, 3, 9], [1.0, 0.5, 0.25, 0.1]),
        ("exponential", {"gamma": 0.5}, [0, 1, 3], [1.0, 0.5, 0.125]),
        ("exponential", {}, [0, 2], [1.0, 0.81]),
        ("polynomial", {"power": 0.5}, [0, 3, 8], [1.0, 0.5, 1.0 / 3.0]),
        ("polynomial", {"power": 2.0}, [1, 4], [0.25, 0.04]),
        ("drop", {"max_staleness": 2}, [0, 1, 2, 3, 50], [1.0, 1.0, 1.0, 0.0, 0.0]),
        ("drop", {"max_staleness": 0}, [0, 1], [1.0, 0.0]),
        ("inverse", {"max_staleness": 3}, [2, 3, 4], [0.5, 1.0 / 3.0, 0.0]),
        ("exponential", {"gamma": 0.5, "max_staleness": 1}, [1, 2], [0.5, 0.0]),
    ],
)
def test_staleness_factor_values(policy, kwargs, taus, expected):
    got = [float(staleness_factor(policy, tau, **kwargs)) for tau in taus]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_factor_accepts_python_numpy_and_jax_scalars():
    for tau in (4, 4.0, np.int64(4), np.float32(4), jnp.array(4), jnp.array(4.0)):
        factor = staleness_factor("inverse", tau)
        assert factor.dtype == jnp.float32
        assert float(factor) == 0.25


def test_transform_scales_every_leaf_by_the_factor():
    tx = scale_by_staleness("inverse_plus_one")
    updates, state = tx.update(GRADS, tx.init(GRADS), staleness=3)
    expected = jax.tree.map(lambda g: 0.25 * g, GRADS)
    jax.tree.map(np.testing.assert_array_equal, updates, expected)
    assert state == tx.init(GRADS)


def test_inverse_leaves_fresh_updates_alone():
    tx = scale_by_staleness("inverse")
    updates, _ = tx.update(GRADS, tx.init(GRADS), staleness=0)
    jax.tree.map(np.testing.assert_array_equal, updates, GRADS)


def test_traced_staleness_under_jit():
    tx = scale_by_staleness("exponential", gamma=0.5)
    update = jax.jit(lambda g, s, tau: tx.update(g, s, staleness=tau))
    for tau, factor in [(0, 1.0), (2, 0.25), (3, 0.125)]:
        updates, _ = update(GRADS, tx.init(GRADS), jnp.asarray(tau))
        jax.tree.map(
            lambda u, g, f=factor: np.testing.assert_allclose(u, f * g, rtol=1e-6),
            updates,
            GRADS,
        )


def test_drop_beyond_max_staleness_gives_exact_zeros_even_for_nan():
    tx = scale_by_staleness("drop", max_staleness=2)
    grads = {"w": jnp.array([jnp.nan, jnp.inf, 1.0])}
    dropped, _ = tx.update(grads, tx.init(grads), staleness=3)
    np.testing.assert_array_equal(dropped["w"], np.zeros(3, np.float32))
    kept, _ = tx.update({"w": jnp.ones(3)}, tx.init(grads), staleness=2)
    np.testing.assert_array_equal(kept["w"], np.ones(3, np.float32))


def test_callable_policy():
    tx = scale_by_staleness(lambda tau: 1.0 / (1.0 + tau) ** 2)
    updates, _ = tx.update(GRADS, tx.init(GRADS), staleness=3)
    jax.tree.map(
        lambda u, g: np.testing.assert_allclose(u, g / 16.0, rtol=1e-6),
        updates,
        GRADS,
    )
    cut = scale_by_staleness(lambda tau: jnp.exp(-tau), max_staleness=1)
    updates, _ = cut.update(GRADS, cut.init(GRADS), staleness=2)
    assert all(not np.any(u) for u in jax.tree.leaves(updates))


def test_callable_policy_must_return_a_scalar():
    with pytest.raises(ValueError, match="scalar"):
        staleness_factor(lambda tau: jnp.ones(2) * tau, 1)


def test_unknown_policy_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown staleness policy 'linear'") as info:
        scale_by_staleness("linear")
    for name in STALENESS_POLICIES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="valid names"):
        staleness_factor("linear", 1)
    with pytest.raises(ValueError, match="callable"):
        scale_by_staleness(3)


def test_registry_names_and_read_only():
    assert set(STALENESS_POLICIES) == {
        "inverse",
        "inverse_plus_one",
        "exponential",
        "polynomial",
        "drop",
    }
    with pytest.raises(TypeError):
        STALENESS_POLICIES["mine"] = lambda tau, **kw: tau  # type: ignore[index]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "exponential", "gamma": 0.0},
        {"policy": "exponential", "gamma": 1.5},
        {"policy": "exponential", "gamma": -0.1},
        {"policy": "polynomial", "power": -1.0},
        {"policy": "inverse", "max_staleness": -1},
        {"policy": "drop"},
        {"policy": "inverse", "gamma": jnp.ones(2)},
        {"policy": "inverse", "max_staleness": True},
        {"policy": "exponential", "gamma": "0.5"},
        {"policy": "exponential", "gamma": 0.5 + 0.1j},
    ],
)
def test_bad_hyperparameters_raise_at_construction(kwargs):
    with pytest.raises(ValueError):
        scale_by_staleness(**kwargs)


def test_missing_staleness_is_a_clear_error():
    tx = scale_by_staleness()
    with pytest.raises(ValueError, match="keyword extra argument `staleness`"):
        tx.update(GRADS, tx.init(GRADS))


@pytest.mark.parametrize(
    "staleness",
    [-1, -0.5, np.int32(-2), jnp.array(-3), float("nan"), jnp.ones(2), True, "1"],
)
def test_bad_static_staleness_raises(staleness):
    tx = scale_by_staleness()
    with pytest.raises(ValueError, match="staleness"):
        tx.update(GRADS, tx.init(GRADS), staleness=staleness)


def test_traced_negative_or_nan_staleness_counts_as_fresh():
    factor = jax.jit(functools.partial(staleness_factor, "inverse_plus_one"))
    assert float(factor(jnp.array(-5))) == 1.0
    assert float(factor(jnp.array(jnp.nan))) == 1.0
    assert float(factor(jnp.array(jnp.inf))) == 0.0
    assert float(factor(jnp.array(1))) == 0.5


def test_inject_hyperparams_with_string_policy():
    tx = optax.inject_hyperparams(scale_by_staleness)(policy="exponential", gamma=0.8)
    state = tx.init(GRADS)
    assert set(state.hyperparams) == {"gamma", "power"}
    update = jax.jit(lambda g, s: tx.update(g, s, staleness=2))
    updates, state = update(GRADS, state)
    np.testing.assert_allclose(updates["b"], 0.64 * GRADS["b"], rtol=1e-6)
    state.hyperparams["gamma"] = jnp.asarray(0.5)
    updates, _ = update(GRADS, state)
    np.testing.assert_allclose(updates["b"], 0.25 * GRADS["b"], rtol=1e-6)


def test_inject_hyperparams_with_max_staleness_and_callable_policy():
    tx = optax.inject_hyperparams(scale_by_staleness, static_args="policy")(
        policy=lambda tau: 0.5**tau, max_staleness=2
    )
    state = tx.init(GRADS)
    assert int(state.hyperparams["max_staleness"]) == 2
    updates, state = tx.update(GRADS, state, staleness=2)
    np.testing.assert_allclose(updates["b"], 0.25 * GRADS["b"])
    state.hyperparams["max_staleness"] = jnp.asarray(1)
    updates, _ = tx.update(GRADS, state, staleness=2)
    np.testing.assert_array_equal(updates["b"], np.zeros(2, np.float32))


def test_bfloat16_updates_stay_bfloat16():
    grads = jax.tree.map(lambda g: g.astype(jnp.bfloat16), GRADS)
    tx = scale_by_staleness("inverse")
    updates, _ = tx.update(grads, tx.init(grads), staleness=4)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads), strict=True):
        assert u.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(u, np.float32), np.asarray(g, np.float32) / 4
        )


PARAMS = {"w": jnp.array([0.5, 0.5, 0.5]), "b": jnp.array([2.0])}
STALE = {"w": jnp.array([0.0, 1.0, 0.5]), "b": jnp.array([1.0])}
DC_GRADS = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array([-0.5])}


def test_delay_compensation_by_hand():
    tx = delay_compensation(lam=0.04)
    updates, _ = tx.update(DC_GRADS, tx.init(PARAMS), PARAMS, stale_params=STALE)
    # g + lam * g*g * (w - w_bak), element by element.
    np.testing.assert_allclose(
        updates["w"],
        [1.0 + 0.04 * 1 * 0.5, -2.0 + 0.04 * 4 * -0.5, 3.0 + 0.0],
        rtol=1e-6,
    )
    np.testing.assert_allclose(updates["b"], [-0.5 + 0.04 * 0.25 * 1.0], rtol=1e-6)


def test_delay_compensation_then_sgd_is_the_paper_update():
    tx = optax.chain(delay_compensation(lam=0.5), optax.sgd(0.1))
    updates, _ = tx.update(DC_GRADS, tx.init(PARAMS), PARAMS, stale_params=STALE)
    new = optax.apply_updates(PARAMS, updates)
    g, w, w_bak = (np.asarray(t["w"]) for t in (DC_GRADS, PARAMS, STALE))
    np.testing.assert_allclose(
        new["w"], w - 0.1 * (g + 0.5 * g * g * (w - w_bak)), rtol=1e-6
    )


def test_delay_compensation_without_drift_is_identity():
    tx = delay_compensation(lam=0.3)
    updates, _ = tx.update(DC_GRADS, tx.init(PARAMS), PARAMS, stale_params=PARAMS)
    jax.tree.map(np.testing.assert_array_equal, updates, DC_GRADS)


def test_adaptive_delay_compensation_by_hand():
    lam, decay, eps = 2.0, 0.9, 1e-7
    tx = delay_compensation(lam, adaptive=True, decay=decay, eps=eps)
    state = tx.init(PARAMS)
    g = np.asarray(DC_GRADS["w"])
    drift = np.asarray(PARAMS["w"]) - np.asarray(STALE["w"])
    mean_square = np.zeros(3)
    for _ in range(2):
        updates, state = tx.update(DC_GRADS, state, PARAMS, stale_params=STALE)
        mean_square = decay * mean_square + (1 - decay) * g * g
        expected = g + lam / np.sqrt(mean_square + eps) * g * g * drift
        np.testing.assert_allclose(updates["w"], expected, rtol=1e-5)
        np.testing.assert_allclose(state.mean_square["w"], mean_square, rtol=1e-6)


def test_delay_compensation_needs_params_and_stale_params():
    tx = delay_compensation()
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(DC_GRADS, state, stale_params=STALE)
    with pytest.raises(ValueError, match="stale_params"):
        tx.update(DC_GRADS, state, PARAMS)
    with pytest.raises(ValueError, match="tree structure"):
        tx.update(DC_GRADS, state, PARAMS, stale_params={"w": STALE["w"]})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lam": -0.1},
        {"lam": 0.1, "adaptive": "yes"},
        {"lam": 0.1, "adaptive": True, "decay": 1.0},
        {"lam": 0.1, "adaptive": True, "decay": -0.5},
        {"lam": 0.1, "adaptive": True, "eps": 0.0},
    ],
)
def test_delay_compensation_bad_hyperparameters(kwargs):
    with pytest.raises(ValueError):
        delay_compensation(**kwargs)


def test_docstring_examples():
    results = doctest.testmod(_staleness, optionflags=doctest.ELLIPSIS)
    assert results.attempted > 0
    assert results.failed == 0
