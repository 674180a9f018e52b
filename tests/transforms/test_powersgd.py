"""Tests of the PowerSGD codec and the power_sgd transform."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _powersgd
from hpsjax.transforms._powersgd import (
    PowerSGDEncoded,
    last_powersgd_encoded,
    power_sgd,
    powersgd_decode,
    powersgd_decode_tree,
    powersgd_encode,
    powersgd_matrix_shape,
    powersgd_nbytes,
)


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _params():
    return {
        "conv": jnp.zeros((16, 3, 3, 4)),  # a (16, 36) matrix
        "dense": jnp.zeros((40, 24)),
        "thin": jnp.zeros((30, 2)),  # rank-4 factors would not shrink it
        "bias": jnp.zeros(24),
    }


def test_wire_size_is_the_factors_plus_leaves_sent_whole():
    rank = 4
    params = _params()
    opt = power_sgd(rank)
    grads = jax.tree.map(lambda p: _normal(p.shape), params)
    _, state = jax.jit(opt.update)(grads, opt.init(params))
    encoded = dict(zip(sorted(params), last_powersgd_encoded(state), strict=True))
    sizes = {name: enc.p.nbytes + enc.q.nbytes for name, enc in encoded.items()}
    assert sizes == {
        "conv": rank * (16 + 36) * 4,
        "dense": rank * (40 + 24) * 4,
        "thin": 30 * 2 * 4,
        "bias": 24 * 4,
    }
    for name, p in params.items():
        assert sizes[name] == powersgd_nbytes(p.shape, p.dtype, rank)
    assert encoded["thin"].q.shape == (0,) and encoded["bias"].q.shape == (0,)


def test_output_equals_decode_of_what_is_sent():
    params = {**_params(), "half": jnp.zeros((20, 12), jnp.bfloat16)}
    opt = power_sgd(2)
    state = opt.init(params)

    # Decoded in the same program: matrix products compiled apart may differ in
    # their last bit.
    @jax.jit
    def update(grads, state):
        out, state = opt.update(grads, state)
        return out, state, powersgd_decode_tree(last_powersgd_encoded(state), grads)

    for step in range(3):
        grads = jax.tree.map(
            lambda p, step=step: _normal(p.shape, step, p.dtype), params
        )
        out, state, rebuilt = update(grads, state)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(rebuilt), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_error_feedback_conserves_mass():
    params = _params()
    opt = power_sgd(2, error_feedback=True)
    state = opt.init(params)
    update = jax.jit(opt.update)
    total_in = jax.tree.map(jnp.zeros_like, params)
    total_out = jax.tree.map(jnp.zeros_like, params)
    for step in range(10):
        grads = jax.tree.map(lambda p, step=step: _normal(p.shape, step), params)
        out, state = update(grads, state)
        total_in = jax.tree.map(jnp.add, total_in, grads)
        total_out = jax.tree.map(jnp.add, total_out, out)
    for name in params:
        np.testing.assert_allclose(
            total_out[name] + state.error[name], total_in[name], rtol=1e-5, atol=1e-4
        )
    assert float(jnp.max(jnp.abs(state.error["dense"]))) > 0.1


def test_low_rank_matrix_is_recovered():
    u, v = _normal((40, 3), 1), _normal((24, 3), 2)
    w = u @ v.T
    conv = jnp.einsum("ir,jr->ij", _normal((16, 2), 3), _normal((36, 2), 4))
    grads = {"dense": w, "conv": conv.reshape(16, 3, 3, 4)}
    opt = power_sgd(3, error_feedback=False)
    state = opt.init(grads)
    for _ in range(3):
        out, state = opt.update(grads, state)
        for name, g in grads.items():
            err = float(jnp.linalg.norm(out[name] - g) / jnp.linalg.norm(g))
            assert err < 1e-5, (name, err)


def test_warm_start_converges_to_the_best_rank_r_approximation():
    # Singular values 3, 2.7, 2.4, ...: one cold power step is far from optimal.
    u, _ = jnp.linalg.qr(_normal((30, 10), 5))
    v, _ = jnp.linalg.qr(_normal((20, 10), 6))
    s = 3.0 - 0.3 * jnp.arange(10)
    m = (u * s) @ v.T
    best = float(jnp.sqrt(jnp.sum(s[2:] ** 2)))
    errors = {}
    for warm in (True, False):
        opt = power_sgd(2, error_feedback=False, warm_start=warm)
        state = opt.init({"m": m})
        update = jax.jit(opt.update)
        for _ in range(40):
            out, state = update({"m": m}, state)
        errors[warm] = float(jnp.linalg.norm(out["m"] - m))
    assert errors[True] < 1.01 * best
    assert errors[False] > 1.05 * best


def test_matrix_shape_rules():
    assert powersgd_matrix_shape((8, 2, 3), 1) == (8, 6)
    assert powersgd_matrix_shape((10,), 1) is None
    assert powersgd_matrix_shape((), 1) is None
    assert powersgd_matrix_shape((4, 4), 2) is None  # 2 * 8 >= 16
    assert powersgd_matrix_shape((5, 5), 2) == (5, 5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rank": 0}, "rank must be an int >= 1"),
        ({"rank": 1.5}, "rank must be an int >= 1"),
        ({"rank": jnp.int32(2)}, "static_args"),
        ({"rank": 2, "warm_start": "yes"}, "warm_start"),
        ({"rank": 2, "error_feedback": None}, "error_feedback"),
        ({"rank": 2, "seed": "0"}, "seed"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        power_sgd(**kwargs)


def test_bad_codec_input_raises():
    with pytest.raises(ValueError, match="q or a PRNG key"):
        powersgd_encode(jnp.ones((10, 10)), 2)
    with pytest.raises(ValueError, match="q for shape"):
        powersgd_encode(jnp.ones((10, 10)), 2, jnp.ones((9, 2)))
    enc = powersgd_encode(jnp.ones((10, 10)), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="do not fit"):
        powersgd_decode(enc, (10, 11))
    with pytest.raises(ValueError, match="sent whole"):
        powersgd_decode(PowerSGDEncoded(jnp.ones(3), jnp.ones(0)), (4,))
    with pytest.raises(ValueError, match="no PowerSGDState"):
        last_powersgd_encoded(optax.sgd(0.1).init({"a": jnp.ones(1)}))


def test_inject_hyperparams_with_static_rank():
    params = {"w": jnp.zeros((12, 10))}
    plain = power_sgd(2)
    injected = optax.inject_hyperparams(power_sgd, static_args=("rank",))(2)
    g = {"w": _normal((12, 10))}
    a, _ = plain.update(g, plain.init(params))
    b, _ = injected.update(g, injected.init(params))
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-6)


def test_module_doctests():
    assert doctest.testmod(_powersgd).failed == 0
