"""Per-leaf optimizer steps: which optimizers are separable, and that the
per-leaf path gives the whole-tree path's parameters and optimizer state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.apply._overlap import OverlapAggregator
from hpsjax.apply._separable import LeafSteps
from hpsjax.ps import ServerCore
from hpsjax.transforms import delay_compensation, scale_by_staleness


def _params():
    return {
        "a": jnp.zeros((4, 5)),
        "b": jnp.zeros(7),
        "c": {"d": jnp.zeros((2, 3), jnp.bfloat16)},
    }


def _steps(optimizer, params=None):
    params = _params() if params is None else params
    leaves, treedef = jax.tree.flatten(params)
    shapes = tuple(x.shape for x in leaves)
    dtypes = tuple(x.dtype for x in leaves)
    return LeafSteps(optimizer, treedef, shapes, dtypes)


SEPARABLE = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "staleness": lambda: optax.chain(scale_by_staleness(), optax.sgd(0.1)),
    "clip": lambda: optax.chain(optax.clip(0.05), optax.adam(1e-2)),
    "inject": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


@pytest.mark.parametrize("name", sorted(SEPARABLE))
def test_elementwise_chains_are_separable(name):
    assert _steps(SEPARABLE[name]()).separable


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    ],
)
def test_global_norm_is_not_separable(optimizer):
    assert not _steps(optimizer).separable


def test_one_leaf_has_no_per_leaf_step():
    assert not _steps(optax.sgd(0.1), {"w": jnp.zeros(3)}).separable


def _random(params, rng, scale):
    return jax.tree.map(
        lambda p: jnp.asarray((rng.standard_normal(p.shape) * scale).astype(p.dtype)),
        params,
    )


def _assert_close(a, b, rtol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol
        )


@pytest.mark.parametrize("name", ["momentum", "adam", "staleness", "inject"])
def test_per_leaf_apply_matches_whole_tree(name):
    optimizer = optax.with_extra_args_support(SEPARABLE[name]())
    steps = _steps(optimizer)
    rng = np.random.default_rng(1)
    params = _random(_params(), rng, 1.0)

    @jax.jit
    def whole(p, s, u, tau):
        d, s = optimizer.update(u, s, p, staleness=tau)
        return optax.apply_updates(p, d), s

    a = b = (params, optimizer.init(params))
    for tau in (0, 3, 1):
        update = _random(params, rng, 0.1)
        a = whole(*a, update, jnp.int32(tau))
        b = steps.apply(*b, update, jnp.int32(tau))
    _assert_close(a, b, 1e-6)


def test_per_leaf_apply_passes_stale_params():
    optimizer = optax.chain(delay_compensation(0.5), optax.sgd(0.1))
    steps = _steps(optimizer)
    opt = optax.with_extra_args_support(optimizer)
    rng = np.random.default_rng(2)
    params = _random(_params(), rng, 1.0)
    stale = _random(params, rng, 1.0)
    update = _random(params, rng, 0.1)
    state = opt.init(params)
    d, s = opt.update(update, state, params, staleness=1, stale_params=stale)
    want = (optax.apply_updates(params, d), s)
    _assert_close(want, steps.apply(params, state, update, jnp.int32(1), stale), 1e-5)


def test_core_leaf_steps_follow_its_push():
    params = {"a": jnp.zeros((3, 4)), "b": jnp.ones(5)}
    core = ServerCore(params, optax.adam(1e-2), "asp", aggregator=OverlapAggregator)
    steps = core.aggregator.leaf_steps
    assert steps is not None and steps.separable
    core.join("w", now=0.0)
    update = {"a": np.full((3, 4), 0.5, np.float32), "b": np.full(5, -1.0, np.float32)}
    p0, s0 = core.params, core.opt_state
    core.push("w", update, version=0, now=1.0)
    want = (core.params, core.opt_state)
    _assert_close(want, steps.apply(p0, s0, update, jnp.int32(0)), 1e-6)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    assert OverlapAggregator(params, clipped).leaf_steps is None
