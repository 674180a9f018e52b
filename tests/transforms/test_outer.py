"""Tests of the outer optimizers: Delayed Nesterov and DiLoCo's Nesterov step."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _outer
from hpsjax.transforms._outer import delayed_nesterov, diloco_outer


def _run(opt, grads):
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    state = opt.init(params)
    outs, momenta = [], []
    for g in grads:
        out, state = opt.update(g, state, params)
        outs.append(out)
        momenta.append(getattr(state, "momentum", None))
    return outs, momenta


def _grads(n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    return [
        {"w": jax.random.normal(k, (3,)), "b": jax.random.normal(k, ())} for k in keys
    ]


@pytest.mark.parametrize("c", [0.0, 0.7])
def test_delay_one_is_nesterov(c):
    grads = _grads(6)
    dn, _ = _run(
        delayed_nesterov(0.3, momentum=0.8, delay=1, momentum_fraction=c), grads
    )
    for reference in (
        optax.sgd(0.3, momentum=0.8, nesterov=True),
        diloco_outer(0.3, 0.8),
    ):
        ref, _ = _run(reference, grads)
        for a, b in zip(dn, ref, strict=True):
            for name in a:
                np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7)


def test_hand_computed_sequence_with_delay_two():
    # eps = 1, beta = 0.5, N = 2, pseudo-gradients 2, 4, 2, 6:
    # t=0: plain step -g/N = -1, m stays 0
    # t=1: m = 0.5*0 + (2+4)/2 = 3;  step = -(0.5*3 + 4/2) = -3.5
    # t=2: plain step -1, m stays 3
    # t=3: m = 0.5*3 + (2+6)/2 = 5.5; step = -(0.5*5.5 + 6/2) = -5.75
    opt = delayed_nesterov(1.0, momentum=0.5, delay=2)
    state = opt.init(jnp.zeros(1))
    steps, momenta = [], []
    for g in (2.0, 4.0, 2.0, 6.0):
        out, state = opt.update(jnp.array([g]), state)
        steps.append(float(out[0]))
        momenta.append(float(state.momentum[0]))
    assert steps == [-1.0, -3.5, -1.0, -5.75]
    assert momenta == [0.0, 3.0, 3.0, 5.5]


def test_hand_computed_sequence_with_momentum_fraction():
    # As above with c = 0.25: between momentum updates c*beta*m = 0.125 m is
    # applied, at them (1 - c N + c) beta m = 0.375 m.
    # t=0: -(0.125*0 + 1) = -1;        t=1: -(0.375*3 + 2) = -3.125
    # t=2: -(0.125*3 + 1) = -1.375;    t=3: -(0.375*5.5 + 3) = -5.0625
    opt = delayed_nesterov(1.0, momentum=0.5, delay=2, momentum_fraction=0.25)
    state = opt.init(jnp.zeros(1))
    steps = []
    for g in (2.0, 4.0, 2.0, 6.0):
        out, state = opt.update(jnp.array([g]), state)
        steps.append(float(out[0]))
    assert steps == [-1.0, -3.125, -1.375, -5.0625]


def test_momentum_changes_only_every_delay_updates():
    delay = 3
    _, momenta = _run(delayed_nesterov(0.1, delay=delay), _grads(9, seed=1))
    for t in range(1, 9):
        changed = not np.array_equal(momenta[t]["w"], momenta[t - 1]["w"])
        assert changed == ((t + 1) % delay == 0), t
    assert not np.any(momenta[0]["w"])


def test_momentum_is_the_mean_of_the_buffered_pseudo_gradients():
    grads = _grads(4, seed=2)
    _, momenta = _run(delayed_nesterov(0.1, momentum=0.9, delay=4), grads)
    mean = sum(g["w"] for g in grads) / 4
    np.testing.assert_allclose(momenta[-1]["w"], mean, rtol=1e-6)


def test_jit_and_schedule():
    schedule = optax.linear_schedule(1.0, 0.0, 4)
    opt = delayed_nesterov(schedule, momentum=0.0, delay=2)
    state = opt.init(jnp.zeros(2))
    update = jax.jit(opt.update)
    steps = []
    for _ in range(4):
        out, state = update(jnp.ones(2), state)
        steps.append(float(out[0]))
    # momentum 0: steps are -lr_t * g / N at every update, lr 1, 0.75, 0.5, 0.25.
    np.testing.assert_allclose(steps, [-0.5, -0.375, -0.25, -0.125])


def test_diloco_outer_averages_like_fedavg():
    theta = jnp.array([1.0, -2.0])
    locals_ = [jnp.array([0.0, 0.0]), jnp.array([1.0, 1.0])]
    pseudo = sum(theta - w for w in locals_) / len(locals_)
    opt = diloco_outer(1.0, momentum=0.0)
    updates, _ = opt.update(pseudo, opt.init(theta))
    np.testing.assert_allclose(optax.apply_updates(theta, updates), [0.5, 0.5])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"learning_rate": -1.0}, "learning_rate"),
        ({"learning_rate": 0.1, "momentum": 1.5}, "momentum must be in"),
        ({"learning_rate": 0.1, "delay": 0}, "delay must be an int >= 1"),
        ({"learning_rate": 0.1, "delay": 2.5}, "delay must be an int >= 1"),
        ({"learning_rate": 0.1, "delay": 4, "momentum_fraction": 0.5}, "momentum_f"),
        ({"learning_rate": "fast"}, "learning_rate must be a finite number"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        delayed_nesterov(**kwargs)


def test_diloco_outer_bad_hyperparameters_raise():
    with pytest.raises(ValueError, match="momentum"):
        diloco_outer(0.7, momentum=-0.1)


def test_module_doctests():
    assert doctest.testmod(_outer).failed == 0
