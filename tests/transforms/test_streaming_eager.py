"""Streaming DiLoCo's eager updates (``streaming_local(eager=True)``).

The driver below runs the pipelined BSP rounds of ``overlap='pipeline'``: round
k computes on the global parameters after push k - 2 (push k - 1 travels
while it computes), so a fragment pushed at the end of round k - 1 merges at
the start of round k + 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax._optimizers import make_optimizer
from hpsjax.transforms import (
    StreamingEagerState,
    streaming_local,
    streaming_outer,
    streaming_push,
)


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


def _data(workers):
    rng = np.random.default_rng(0)
    x = [jnp.asarray(rng.normal(size=(16, 3)), jnp.float32) for _ in range(workers)]
    y = [xi @ jnp.array([1.0, -2.0, 0.5]) + 0.3 for xi in x]
    return x, y


def _pipelined_rounds(
    rounds, *, workers=2, steps=3, eager=True, eta=0.7, beta=0.9, fragments=2
):
    """``workers`` workers, BSP with pipelined pushes: returns the global
    parameters, the workers' local states, the server's outer state and the
    data."""
    x, y = _data(workers)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    # One transform of each kind, its update compiled once (the states differ).
    local = streaming_local(
        optax.sgd(0.05),
        eager=eager,
        fragments=fragments,
        outer_learning_rate=eta,
        outer_momentum=beta,
        workers=workers,
    )
    states = [local.init(params) for _ in range(workers)]
    push = streaming_push(fragments, bits=None)
    push_states = [push.init(params) for _ in range(workers)]
    outer = streaming_outer(eta, beta, fragments)
    outer_state = outer.init(params)

    @jax.jit
    def inner_step(p, state, xi, yi):
        u, state = local.update(jax.grad(_loss)(p, xi, yi), state, p)
        return optax.apply_updates(p, u), state

    push_update, outer_update = jax.jit(push.update), jax.jit(outer.update)
    sent_by_push = []
    for k in range(rounds):
        if k >= 2:  # push k - 2 is applied before round k's pull is answered
            sent = sent_by_push[k - 2]
            mean = jax.tree.map(lambda *a: sum(a) / workers, *sent)
            u, outer_state = outer_update(mean, outer_state)
            params = optax.apply_updates(params, u)
        pulled = params
        sent = []
        for i in range(workers):
            p = pulled
            for _ in range(steps):
                p, states[i] = inner_step(p, states[i], x[i], y[i])
            delta = jax.tree.map(jnp.subtract, pulled, p)
            out, push_states[i] = push_update(delta, push_states[i])
            sent.append(out)
        sent_by_push.append(sent)
    return params, states, outer_state, (x, y)


def test_one_worker_with_plain_outer_steps_loses_no_inner_step():
    """M = 1, eta = 1, beta = 0: the stand-in is the worker's own outer
    gradient, exactly what the server applies, so every merge leaves the
    worker's parameters where its inner steps took them: its trajectory is
    plain SGD over all its inner steps. Without eager updates the merge
    overwrites the tau steps taken on a fragment while it travelled."""
    rounds, steps = 8, 3
    (x,), (y,) = _data(1)
    grad = jax.grad(_loss)
    p = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    for _ in range(rounds * steps - (rounds - 1)):  # a merge starts rounds 1..
        p = jax.tree.map(lambda a, g: a - 0.05 * g, p, grad(p, x, y))
    _, (state,), _, _ = _pipelined_rounds(
        rounds, workers=1, steps=steps, eta=1.0, beta=0.0
    )
    for a, b in zip(jax.tree.leaves(state.local), jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    _, (plain,), _, _ = _pipelined_rounds(
        rounds, workers=1, steps=steps, eager=False, eta=1.0, beta=0.0
    )
    assert not np.allclose(plain.local["w"], p["w"], rtol=1e-3)


def test_workers_mirror_the_servers_momentum_and_average():
    """Each worker reads the server's outer momentum and last average off the
    server's steps: the same as the server's own momentum."""
    _, states, outer_state, _ = _pipelined_rounds(9, workers=2)
    for state in states:
        assert isinstance(state.eager, StreamingEagerState)
        assert int(state.eager.merges) == 8
        for mine, server in zip(
            jax.tree.leaves(state.eager.momentum),
            jax.tree.leaves(outer_state.momentum),
            strict=True,
        ):
            np.testing.assert_allclose(mine, server, rtol=1e-4, atol=1e-6)
            assert np.any(np.asarray(server) != 0)


def test_eager_step_is_corrected_by_the_servers_step():
    """After a merge, a fragment synchronised is the global value plus the
    inner steps since the eager step; the fragment just pushed is its global
    value plus the eager step (held as ``pending``)."""
    tx = streaming_local(
        optax.sgd(1.0),
        eager=True,
        fragments=2,
        outer_learning_rate=0.5,
        outer_momentum=0.0,
        workers=1,
    )
    # Elements: b (fragment 0), w (fragment 1).
    params = {"b": jnp.zeros(1), "w": jnp.zeros(1)}
    state = tx.init(params)
    g = {"b": jnp.ones(1), "w": jnp.ones(1)}
    u, state = tx.update(g, state, params)  # an inner step: own = -1, -1
    own = optax.apply_updates(params, u)
    # Round 1 starts from the pulled (unchanged) global: the merge eager-steps
    # fragment 0 (push 0: delta = 0 - (-1) = 1): b = 0 - 0.5 * 1.
    u, state = tx.update(g, state, params)
    p = optax.apply_updates(params, u)
    np.testing.assert_allclose(p["b"], [-0.5])
    np.testing.assert_allclose(p["w"], own["w"])
    np.testing.assert_allclose(state.eager.pending["b"], [-0.5])
    u, state = tx.update(g, state, p)  # an inner step: b = -1.5, w = -2
    p = optax.apply_updates(p, u)
    # Round 2: the server stepped b by -0.8 (not the -0.5 guessed): b keeps
    # its inner step since the eager one: -0.8 - 1; w (push 1: delta 2) is
    # stepped eagerly from its global value 0: -1.
    pulled = {"b": jnp.array([-0.8]), "w": jnp.zeros(1)}
    u, state = tx.update(g, state, pulled)
    p = optax.apply_updates(pulled, u)
    np.testing.assert_allclose(p["b"], [-1.8], rtol=1e-6)
    np.testing.assert_allclose(p["w"], [-1.0], rtol=1e-6)
    np.testing.assert_allclose(state.eager.pending["b"], [0.0])
    np.testing.assert_allclose(state.eager.pending["w"], [-1.0])


@pytest.mark.parametrize("eager", [False, True])
def test_pipelined_streaming_trains_with_and_without_eager_updates(eager):
    final, _, _, (x, y) = _pipelined_rounds(40, workers=2, eager=eager)
    start = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    for xi, yi in zip(x, y, strict=True):
        assert float(_loss(final, xi, yi)) < 0.05 * float(_loss(start, xi, yi))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"eager": "yes"}, r"^eager must be a bool"),
        ({"eager": True, "fragments": 1}, r"^eager updates need fragments >= 2"),
        ({"eager": True, "fragments": 0}, r"^fragments must be an int >= 1"),
        (
            {"eager": True, "outer_learning_rate": 0.0},
            r"^outer_learning_rate must be > 0",
        ),
        (
            {"eager": True, "outer_momentum": 1.0},
            r"^outer_momentum must be in \[0, 1\)",
        ),
        ({"eager": True, "workers": 0}, r"^workers must be an int >= 1"),
    ],
)
def test_eager_bad_arguments_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        streaming_local(optax.sgd(0.1), **kwargs)
    assert "\n" not in str(err.value)


def test_the_optimizer_registry_builds_eager_updates_by_name():
    tx = make_optimizer(
        "streaming_local",
        0.01,
        inner="adam",
        eager=True,
        fragments=2,
        workers=8,
        outer_learning_rate=0.7,
        outer_momentum=0.9,
    )
    state = tx.init({"w": jnp.zeros(4)})
    assert isinstance(state.eager, StreamingEagerState)
    assert (
        make_optimizer("streaming_local", 0.01).init({"w": jnp.zeros(4)}).eager is None
    )


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("server.learning_rate", 0.5, "outer_learning_rate"),
        ("server.momentum", 0.5, "outer_momentum"),
        ("worker.streaming_fragments", 4, "fragments"),
    ],
)
def test_eager_config_must_mirror_the_servers_step(key, value, field):
    from experiments import registry

    config = registry.load_config("streaming_diloco_eager", "quick")
    registry.check_config(config)
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ValueError, match=rf"local_optimizer_args\.{field} = ") as e:
        registry.check_config(config)
    assert "\n" not in str(e.value)


def test_a_server_step_of_zero_still_corrects_the_eager_step():
    """The fragment synchronised is known from the merges, not from a change
    of value: a 4-bit push can leave an element's step exactly 0, and its
    eager step must still be taken back."""
    tx = streaming_local(
        optax.sgd(1.0),
        eager=True,
        fragments=2,
        outer_learning_rate=0.5,
        outer_momentum=0.0,
        workers=1,
    )
    params = {"b": jnp.zeros(1), "w": jnp.zeros(1)}
    g = {"b": jnp.ones(1), "w": jnp.ones(1)}
    state = tx.init(params)
    _, state = tx.update(g, state, params)  # own: -1, -1
    u, state = tx.update(g, state, params)  # merge: b eager-stepped to -0.5
    p = optax.apply_updates(params, u)
    u, state = tx.update(g, state, p)  # b = -1.5
    p = optax.apply_updates(p, u)
    # The server's step on b was 0: b takes back its eager -0.5, keeps -1.
    u, state = tx.update(g, state, {"b": jnp.zeros(1), "w": jnp.zeros(1)})
    p = optax.apply_updates({"b": jnp.zeros(1), "w": jnp.zeros(1)}, u)
    np.testing.assert_allclose(p["b"], [-1.0], rtol=1e-6)
    np.testing.assert_allclose(state.eager.pending["b"], [0.0])
