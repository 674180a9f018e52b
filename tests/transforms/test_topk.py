"""Tests of the top-k codec (topk_encode/topk_decode) and the top_k transform."""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import _topk
from hpsjax.transforms._topk import (
    SAMPLE_SIZE,
    SLACK,
    TopKEncoded,
    last_topk_encoded,
    top_k,
    topk_count,
    topk_decode,
    topk_decode_tree,
    topk_encode,
    topk_nbytes,
)


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize(
    ("shape", "ratio", "index_bytes"),
    [
        ((300,), 0.01, 2),
        ((256, 256), 0.01, 2),
        ((1000, 300), 0.01, 4),
        ((7, 5), 0.1, 2),
    ],
)
def test_wire_size_is_what_the_ratio_promises(shape, ratio, index_bytes):
    x = _normal(shape)
    enc = jax.jit(topk_encode, static_argnums=1)(x, ratio, jax.random.key(1))
    n = math.prod(shape)
    k = math.ceil(round(ratio * n, 9))
    assert enc.indices.shape == enc.values.shape == (k,)
    assert enc.indices.dtype.itemsize == index_bytes
    nbytes = enc.indices.nbytes + enc.values.nbytes
    assert nbytes == topk_nbytes(shape, x.dtype, ratio) == k * (index_bytes + 4)
    if n >= 1000:
        # No header: within 5% of ratio * n entries of (index + value) bytes.
        promised = ratio * n * (index_bytes + 4)
        assert abs(nbytes - promised) <= 0.05 * promised


def test_small_arrays_keep_exactly_the_largest_magnitudes():
    x = _normal((40, 25))
    enc = topk_encode(x, 0.05)
    flat = np.abs(np.asarray(x)).ravel()
    expected = np.sort(np.argsort(-flat, kind="stable")[:50])
    np.testing.assert_array_equal(np.asarray(enc.indices), expected)
    np.testing.assert_array_equal(
        np.asarray(enc.values), np.asarray(x).ravel()[expected]
    )


def test_sampled_threshold_keeps_entries_among_the_top():
    # Larger than the sample: the threshold is estimated, then adjusted.
    x = _normal((SAMPLE_SIZE * 20,), seed=3)
    ratio = 0.01
    k = topk_count(x.size, ratio)
    enc = jax.jit(topk_encode, static_argnums=1)(x, ratio, jax.random.key(4))
    mag = np.sort(np.abs(np.asarray(x)))[::-1]
    kept = np.abs(np.asarray(enc.values))
    indices = np.asarray(enc.indices)
    assert len(np.unique(indices)) == k
    assert np.all(np.diff(indices.astype(np.int64)) > 0)
    # Every kept entry is among the SLACK * k largest magnitudes.
    assert kept.min() >= mag[math.floor(SLACK * k) - 1]
    np.testing.assert_array_equal(np.asarray(x)[indices], np.asarray(enc.values))


def test_decode_inverts_encode_and_zeros_the_rest():
    x = _normal((6, 7), dtype=jnp.bfloat16)
    enc = topk_encode(x, 0.2)
    assert enc.values.dtype == jnp.bfloat16
    out = np.asarray(topk_decode(enc, x.shape, jnp.bfloat16), np.float32)
    mask = np.zeros(x.size, bool)
    mask[np.asarray(enc.indices)] = True
    np.testing.assert_array_equal(
        out.ravel()[mask], np.asarray(x, np.float32).ravel()[mask]
    )
    assert not np.any(out.ravel()[~mask])


def test_output_equals_decode_of_what_is_sent():
    params = {"w": jnp.zeros((30, 20)), "b": jnp.zeros(20, jnp.bfloat16)}
    opt = top_k(0.05)
    state = opt.init(params)
    update = jax.jit(opt.update)
    for step in range(3):
        grads = jax.tree.map(
            lambda p, step=step: _normal(p.shape, step, p.dtype), params
        )
        out, state = update(grads, state)
        rebuilt = topk_decode_tree(last_topk_encoded(state), params)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(rebuilt), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_error_feedback_conserves_mass():
    params = {"w": jnp.zeros((50, 40)), "b": jnp.zeros(9)}
    opt = top_k(0.02, error_feedback=True)
    state = opt.init(params)
    update = jax.jit(opt.update)
    total_in = jax.tree.map(jnp.zeros_like, params)
    total_out = jax.tree.map(jnp.zeros_like, params)
    for step in range(20):
        grads = jax.tree.map(lambda p, step=step: _normal(p.shape, step), params)
        out, state = update(grads, state)
        total_in = jax.tree.map(jnp.add, total_in, grads)
        total_out = jax.tree.map(jnp.add, total_out, out)
    for name in params:
        np.testing.assert_allclose(
            total_out[name] + state.error[name], total_in[name], rtol=1e-5, atol=1e-4
        )
    # Without error feedback, what was not sent is lost.
    plain = top_k(0.02, error_feedback=False)
    grads = {"w": _normal((50, 40)), "b": _normal((9,))}
    out, _ = jax.jit(plain.update)(grads, plain.init(params))
    assert float(jnp.sum(jnp.abs(out["w"] - grads["w"]))) > 1.0


def test_error_feedback_sends_every_entry_eventually():
    # A constant gradient: the residual grows until each entry's turn comes.
    grads = {"w": jnp.linspace(0.5, 1.0, 20)}
    opt = top_k(0.1)
    state = opt.init(grads)
    sent = np.zeros(20, bool)
    for _ in range(30):
        out, state = opt.update(grads, state)
        sent |= np.asarray(out["w"]) != 0
    assert sent.all()


def test_inject_hyperparams_with_static_ratio():
    params = {"w": jnp.ones((10, 10))}
    opt = optax.inject_hyperparams(top_k, static_args=("ratio",))(0.1)
    out, _ = opt.update({"w": _normal((10, 10))}, opt.init(params))
    assert int(jnp.sum(out["w"] != 0)) == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio": 0.0}, "ratio must be in"),
        ({"ratio": 1.5}, "ratio must be in"),
        ({"ratio": True}, "ratio must be in"),
        ({"ratio": jnp.float32(0.1)}, "static_args"),
        ({"ratio": 0.1, "error_feedback": 1}, "error_feedback"),
        ({"ratio": 0.1, "seed": 1.5}, "seed"),
    ],
)
def test_bad_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        top_k(**kwargs)


def test_bad_codec_input_raises():
    with pytest.raises(ValueError, match="floating"):
        topk_encode(jnp.arange(5), 0.5)
    with pytest.raises(ValueError, match="PRNG key"):
        topk_encode(jnp.ones(SAMPLE_SIZE + 1), 0.1)
    enc = topk_encode(jnp.ones(10), 0.2)
    with pytest.raises(ValueError, match="uint32"):
        topk_decode(enc, (300, 300))
    with pytest.raises(ValueError, match="values must be"):
        topk_decode(TopKEncoded(enc.indices, enc.values[:1]), (10,))
    with pytest.raises(ValueError, match="encoded leaves"):
        topk_decode_tree([enc], {"a": jnp.ones(10), "b": jnp.ones(10)})
    with pytest.raises(ValueError, match="no TopKState"):
        last_topk_encoded(optax.sgd(0.1).init({"a": jnp.ones(1)}))


def test_ratio_one_sends_everything_and_empty_leaves_nothing():
    x = _normal((4, 5))
    np.testing.assert_array_equal(topk_decode(topk_encode(x, 1.0), (4, 5)), x)
    enc = topk_encode(jnp.zeros((0, 3)), 0.5)
    assert enc.indices.shape == (0,)
    assert topk_decode(enc, (0, 3)).shape == (0, 3)


def test_module_doctests():
    assert doctest.testmod(_topk).failed == 0
