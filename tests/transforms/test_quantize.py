"""Tests of the quantization codec (encode/decode) and the quantize transform."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import optax
import pytest

from hpsjax.transforms._quantize import (
    Codec,
    Encoded,
    QuantizeState,
    decode,
    decode_tree,
    encode,
    encode_tree,
    encoded_nbytes,
    last_encoded,
    quantize,
)
from hpsjax.wire._decoders import DecoderCache

# Grouped so that each group compiles as one program.
CODEC_GROUPS = {
    "uniform_stochastic": (
        *[Codec("uniform", bits) for bits in (2, 4, 8, 16)],
        Codec("uniform", 2, block_size=5),
    ),
    "uniform_nearest": (
        *[Codec("uniform", bits, block_size=5, stochastic=False) for bits in (2, 4, 8)],
        Codec("uniform", 16, block_size=5, stochastic=False),
        Codec("uniform", 16, stochastic=False),
    ),
    "qsgd": (
        Codec("qsgd", levels=1),
        Codec("qsgd", levels=127, block_size=5),
        Codec("qsgd", levels=300, stochastic=False),
    ),
    "sign_none": (
        Codec("sign"),
        Codec("sign", block_size=5),
        Codec("sign", stochastic=True),
        Codec("sign", block_size=5, stochastic=True),
        Codec("none"),
    ),
}
CODECS = [codec for group in CODEC_GROUPS.values() for codec in group]


def _id(codec):
    block = "leaf" if codec.block_size is None else f"block{codec.block_size}"
    rounding = "stoch" if codec.stochastic else "near"
    return f"{codec.scheme}{codec.bits}-{block}-{rounding}"


def _data(shape, dtype=np.float32, seed=0):
    # numpy data: no compilation per shape.
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape).astype(dtype))


_encode = jax.jit(encode, static_argnums=1)
_decode = jax.jit(decode, static_argnums=(1, 2, 3))


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip(x, codec, key):
    encoded = encode(x, codec, key)
    return encoded, decode(encoded, codec, x.shape, x.dtype)


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip_tree(tree, codec, key):
    encoded = encode_tree(tree, codec, key)
    return encoded, decode_tree(encoded, codec, tree)


def _steps_per_element(scales, codec, size):
    """Each element's step, from the scales, as float64."""
    scales = np.asarray(scales, np.float64)
    if codec.block_size is None:
        return np.full(size, scales[0])
    return np.repeat(scales, codec.block_size)[:size]


def _unpack_reference(codes, bits, size):
    """Reads the documented byte layout with numpy, independently of decode."""
    codes = np.asarray(codes)
    if bits == 16:
        return codes.view("<u2")[:size].astype(np.int64)
    if bits == 8:
        return codes.astype(np.int64)
    bitstream = np.unpackbits(codes, bitorder="little").reshape(-1, bits)
    weights = 2 ** np.arange(bits)
    return (bitstream * weights).sum(axis=1)[:size]


# Round trips


def _decode_reference(encoded, codec, size):
    """Decodes with numpy from the documented layout, as float32."""
    if codec.scheme == "none":
        return np.asarray(encoded.codes).view("<f4")
    q = _unpack_reference(encoded.codes, codec.bits, size)
    step = np.repeat(
        np.asarray(encoded.scales),
        size if codec.block_size is None else codec.block_size,
    )[:size]
    if codec.scheme == "sign":
        return (2 * q - 1).astype(np.float32) * step
    levels = codec.levels if codec.scheme == "qsgd" else 2 ** (codec.bits - 1) - 1
    return (q - levels).astype(np.float32) * step


def _check_roundtrip(x, codec, encoded, y):
    size = x.size
    assert isinstance(encoded, Encoded)
    assert encoded.codes.dtype == jnp.uint8 and encoded.codes.ndim == 1
    assert encoded.scales.dtype == jnp.float32 and encoded.scales.ndim == 1
    nbytes = encoded.codes.nbytes + encoded.scales.nbytes
    assert nbytes == encoded_nbytes(x.shape, codec)
    assert encoded.codes.shape == (math.ceil(size * codec.bits / 8),)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert np.all(np.isfinite(np.asarray(y)))
    if size == 0:
        return
    # decode is the float32 value of the documented layout, rounded once to the
    # dtype (up to subnormals, which the CPU may flush to zero).
    ref32 = _decode_reference(encoded, codec, size)
    ref = ref32.astype(x.dtype).astype(np.float64)
    np.testing.assert_allclose(
        np.asarray(y, np.float64).ravel(), ref, rtol=0, atol=1e-37
    )
    xs, ys = np.asarray(x, np.float64).ravel(), ref32.astype(np.float64)
    if codec.scheme == "none":
        np.testing.assert_array_equal(ys, xs)
        return
    step = _steps_per_element(encoded.scales, codec, size)
    if codec.scheme == "sign":
        np.testing.assert_allclose(np.abs(ys), step, rtol=1e-6)
        if not codec.stochastic:
            sent = step > 0
            np.testing.assert_array_equal(
                np.sign(ys[sent]), np.where(xs[sent] >= 0, 1, -1)
            )
        return
    # Nearest rounding is off by at most half a step, stochastic by at most one.
    bound = step * (0.5 if not codec.stochastic else 1.0) * (1 + 1e-5) + 1e-30
    assert np.all(np.abs(ys - xs) <= bound)


@functools.partial(jax.jit, static_argnums=1)
def _roundtrip_trees(tree, codecs, key):
    return [_roundtrip_tree(tree, codec, key) for codec in codecs]


@pytest.mark.parametrize("group", CODEC_GROUPS)
def test_roundtrip_shape_dtype_size_and_error(group):
    tiny = np.zeros((2, 5), np.float32)
    tiny[0, :4] = [1e-40, -3e-39, 1e-45, -1e-45]
    tree = {
        # 21 elements: odd, not a multiple of any packing factor, a partial block.
        "odd": _data((3, 7), seed=1),
        "bf16": _data((4, 4), jnp.bfloat16, seed=2),
        "f16": _data((), np.float16, seed=3),
        "empty": jnp.asarray(np.zeros((0,), np.float32)),
        "empty2d": jnp.asarray(np.zeros((2, 0, 3), np.float32)),
        # Zeros, and subnormals that must not turn into 0 * inf = NaN.
        "tiny": jnp.asarray(tiny),
        "zeros": jnp.asarray(np.zeros((3,), np.float32)),
    }
    codecs = CODEC_GROUPS[group]
    results = _roundtrip_trees(tree, codecs, jax.random.key(0))
    for codec, (encoded, out) in zip(codecs, results, strict=True):
        try:
            _check_roundtrip_tree(tree, codec, encoded, out)
        except AssertionError as e:
            raise AssertionError(f"{codec}: {e}") from e


def _check_roundtrip_tree(tree, codec, encoded, out):
    for leaf, enc, y in zip(
        jax.tree.leaves(tree), encoded, jax.tree.leaves(out), strict=True
    ):
        _check_roundtrip(leaf, codec, enc, y)
    np.testing.assert_array_equal(np.asarray(out["zeros"]), 0.0)
    if codec.scheme != "none":
        zeros = encoded[sorted(tree).index("zeros")]
        np.testing.assert_array_equal(np.asarray(zeros.scales), 0.0)
    # Subnormal steps are sent as 0 whether or not the platform flushes them
    # (a GPU keeps 3.1e-40 as the sign code's whole-leaf step here).
    tiny_out = np.asarray(out["tiny"])
    if codec.scheme == "none":
        np.testing.assert_array_equal(tiny_out, tree["tiny"])
    else:
        np.testing.assert_array_equal(tiny_out, 0.0)
        scales = np.asarray(encoded[sorted(tree).index("tiny")].scales)
        np.testing.assert_array_equal(scales, 0.0)


@functools.partial(jax.jit, static_argnums=1)
def _encode_trees(tree, codecs, key):
    return [encode_tree(tree, codec, key) for codec in codecs]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _decode_trees(encoded_per_codec, codecs, shapes):
    return [
        [decode(e, codec, shape) for e, shape in zip(encoded, shapes, strict=True)]
        for encoded, codec in zip(encoded_per_codec, codecs, strict=True)
    ]


def test_zero_blocks_decode_to_exact_zeros_on_every_path():
    # Normal numbers beside the zeros, so that no flush of subnormals to zero
    # can make a zero out of a small step: only a zero step does.
    tree = {
        "mixed": jnp.asarray(
            [[1.5, -2.0, 0.25, 3.0, -1.0], [0.0] * 5, [0.0, 0.0, 0.0, 0.0, 0.5]],
            jnp.float32,
        ),
        "zeros": jnp.zeros((7,), jnp.float32),
    }
    specs = [(leaf.shape, "float32") for leaf in tree.values()]
    shapes = tuple(leaf.shape for leaf in tree.values())
    # Each group encodes, and decodes with decode, in one compiled program.
    encoded_all, decoded_all = {}, {}
    for codecs in CODEC_GROUPS.values():
        encoded_group = _encode_trees(tree, codecs, jax.random.key(1))
        decoded_group = _decode_trees(encoded_group, codecs, shapes)
        encoded_all.update(zip(codecs, encoded_group, strict=True))
        decoded_all.update(zip(codecs, decoded_group, strict=True))
    for codec in CODECS:
        encoded = encoded_all[codec]
        decoders = {
            "decode": lambda enc, codec=codec: decoded_all[codec],
            "wire, numpy": DecoderCache(specs).decoder(codec),
            "wire, compiled": DecoderCache(specs).compile(codec),
        }
        for path, decoder in decoders.items():
            mixed, zeros = (np.asarray(y) for y in decoder(encoded))
            where = f"{codec}, {path}"
            np.testing.assert_array_equal(zeros, 0.0, err_msg=where)
            if codec.scheme == "none":
                continue
            np.testing.assert_array_equal(encoded[1].scales, 0.0, err_msg=where)
            if codec.scheme == "sign" and codec.block_size is None:
                # One step for the leaf: a zero is sent as +step (or -step).
                step = float(encoded[0].scales[0])
                assert step > 0 and np.all(np.abs(mixed[1]) == np.float32(step))
            else:
                # Row 1 is a block of its own with block_size 5; the other
                # schemes send a zero as the zero level at any step.
                np.testing.assert_array_equal(mixed[1], 0.0, err_msg=where)
            if codec.block_size is not None:
                np.testing.assert_array_equal(encoded[0].scales[1], 0.0)


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_byte_layout_matches_the_documented_packing(bits):
    codec = Codec("uniform", bits, stochastic=False)
    levels = 2 ** (bits - 1) - 1
    x = _data((37,), seed=bits)
    encoded = _encode(x, codec, None)
    step = np.float32(encoded.scales[0])
    assert step == np.max(np.abs(np.asarray(x))) * np.float32(1 / levels)
    y = np.asarray(x) * (np.float32(1) / step)
    want = np.clip(np.round(y), -levels, levels).astype(np.int64) + levels
    got = _unpack_reference(encoded.codes, bits, 37)
    np.testing.assert_array_equal(got, want)
    # Unused high bits of the last byte are zero.
    pad_bits = len(encoded.codes) * 8 - 37 * bits
    if pad_bits:
        assert int(encoded.codes[-1]) >> (8 - pad_bits) == 0


def test_sign_bits_are_little_endian_within_bytes():
    x = jnp.asarray(np.array([1, -2, 3, -4, 5, 6, -7, 8, -9, 10], np.float32))
    encoded = _encode(x, Codec("sign"), None)
    assert encoded.codes.tolist() == [0b10110101, 0b10]
    np.testing.assert_allclose(np.asarray(encoded.scales), [5.5])


def test_none_codes_are_little_endian_float32_bytes():
    x = _data((5,))
    encoded = _encode(x, Codec("none"), None)
    assert encoded.codes.tobytes() == np.asarray(x, "<f4").tobytes()
    assert encoded.scales.shape == (0,)


@pytest.mark.parametrize("codec", [Codec("uniform", 16), Codec("none")], ids=_id)
def test_portable_byte_order_matches_the_cpu_bitcast(codec, monkeypatch):
    x = _data((101,), seed=5)
    key = jax.random.key(0)
    fast = jax.jit(lambda x: encode(x, codec, key).codes)(x)
    # Any other backend takes the portable path, with shifts.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    portable = jax.jit(lambda x: encode(x, codec, key).codes)(x)
    np.testing.assert_array_equal(np.asarray(portable), np.asarray(fast))


def test_blocks_have_their_own_scales():
    x = jnp.asarray(np.array([100.0] * 4 + [0.01] * 4 + [-3.0], np.float32))
    codec = Codec("uniform", 8, block_size=4, stochastic=False)
    encoded, y = _roundtrip(x, codec, None)
    np.testing.assert_allclose(
        np.asarray(encoded.scales), np.array([100.0, 0.01, 3.0]) / 127, rtol=1e-6
    )
    np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6)


@pytest.mark.parametrize(
    "codec, shape, want",
    [
        (Codec("uniform", 8), (1000, 1000), 10**6 + 4),
        (Codec("uniform", 4, block_size=4096), (1000, 1000), 500000 + 4 * 245),
        (Codec("uniform", 2), (7,), 2 + 4),
        (Codec("uniform", 16, block_size=3), (7,), 14 + 12),
        (Codec("qsgd", levels=5), (10,), 5 + 4),
        (Codec("sign"), (9,), 2 + 4),
        (Codec("none"), (3, 3), 36),
        (Codec("uniform", 8), (0,), 4),
        (Codec("uniform", 8, block_size=8), (0,), 0),
    ],
)
def test_encoded_nbytes_formula(codec, shape, want):
    assert encoded_nbytes(shape, codec) == want


@pytest.mark.parametrize(
    "codec, fraction",
    [
        (Codec("uniform", 2), 2 / 32),
        (Codec("uniform", 4), 4 / 32),
        (Codec("uniform", 8), 8 / 32),
        (Codec("uniform", 16), 16 / 32),
        (Codec("sign"), 1 / 32),
        (Codec("qsgd", levels=7), 4 / 32),
    ],
)
def test_compression_is_bits_over_32_plus_scales(codec, fraction):
    n = 2**20
    for block in (None, 4096):
        c = Codec(codec.scheme, codec.bits, block, codec.stochastic, codec.levels)
        scales = 1 if block is None else n // block
        assert encoded_nbytes((n,), c) == n * 4 * fraction + 4 * scales
        assert encoded_nbytes((n,), c) / (4 * n) == pytest.approx(fraction, rel=0.02)


# Statistics of stochastic rounding


def _draws(x, codecs, n_draws, seed=0):
    """Decoded draws and scales of each codec, one compiled program for all."""
    keys = jax.random.split(jax.random.key(seed), n_draws)

    @jax.jit
    @jax.vmap
    def roundtrip(key):
        out = []
        for codec in codecs:
            encoded = encode(x, codec, key)
            out.append((decode(encoded, codec, x.shape, jnp.float32), encoded.scales))
        return out

    return roundtrip(keys)


UNBIASED = (
    Codec("uniform", 2),
    Codec("uniform", 4, block_size=5),
    Codec("uniform", 8),
    Codec("uniform", 16, block_size=5),
    Codec("qsgd", levels=1),
    Codec("qsgd", levels=127, block_size=5),
    Codec("sign", stochastic=True),
    Codec("sign", block_size=5, stochastic=True),
)


def test_stochastic_rounding_is_unbiased():
    x = _data((3, 17), seed=7)
    n_draws = 4000
    xs = np.asarray(x, np.float64)
    for codec, (y, scales) in zip(UNBIASED, _draws(x, UNBIASED, n_draws), strict=True):
        y = np.asarray(y, np.float64)
        # The scales do not depend on the key.
        assert np.all(np.asarray(scales) == np.asarray(scales)[0]), codec
        step = _steps_per_element(scales[0], codec, x.size).reshape(x.shape)
        # Per-element standard deviation of one draw: at most half a step, and
        # max|x| for the stochastic sign (values are +-max|x|).
        sd = step if codec.scheme == "sign" else step / 2
        se = sd / math.sqrt(n_draws)
        err = np.abs(y.mean(axis=0) - xs)
        assert np.all(err <= 5 * se + 1e-7 * np.abs(xs)), (codec, np.max(err / se))
        # The check has power: nearest rounding's bias would fail it.
        if codec.scheme != "sign":
            bias = np.abs(np.round(xs / step) - xs / step) * step
            assert np.any(bias > 5 * se), codec


def test_stochastic_rounding_probability_is_the_fraction():
    # Every element sits at 0.3 of a step above a level: 30% round up.
    codec = Codec("uniform", 8)
    x = jnp.asarray(np.array([127.0] + [10.3] * 2047, np.float32))
    [(y, _)] = _draws(x, (codec,), 200)
    up = np.asarray(y)[:, 1:] > 10.5
    n = up.size
    assert abs(up.mean() - 0.3) < 5 * math.sqrt(0.21 / n)


def test_rounding_decisions_are_uncorrelated():
    codec = Codec("uniform", 8)
    x = jnp.asarray(np.array([127.0] + [10.5] * (2**16 - 1), np.float32))
    [((y1, y2), _)] = _draws(x, (codec,), 2, seed=11)
    d1 = (np.asarray(y1)[1:] > 10.5).astype(np.float64)
    d2 = (np.asarray(y2)[1:] > 10.5).astype(np.float64)
    n = d1.size
    assert abs(d1.mean() - 0.5) < 5 * 0.5 / math.sqrt(n)
    tol = 5 / math.sqrt(n)
    for lag in (1, 2, 3, 4, 8, 256):
        assert abs(np.corrcoef(d1[:-lag], d1[lag:])[0, 1]) < tol, lag
    # Successive keys draw independent decisions.
    assert abs(np.corrcoef(d1, d2)[0, 1]) < tol


def test_qsgd_variance_matches_theory_and_bound():
    v = _data((64,), seed=3)
    vs = np.asarray(v, np.float64)
    norm2 = (vs**2).sum()
    n, n_draws = v.size, 3000
    all_levels = (1, 4, 16)
    codecs = tuple(Codec("qsgd", levels=s) for s in all_levels)
    for levels, (q, _) in zip(all_levels, _draws(v, codecs, n_draws), strict=True):
        sq_err = ((np.asarray(q, np.float64) - vs) ** 2).sum(axis=1)
        # Exact: each element rounds between levels l/s and (l+1)/s of ||v||.
        y = np.abs(vs) * levels / math.sqrt(norm2)
        frac = y - np.floor(y)
        exact = norm2 / levels**2 * (frac * (1 - frac)).sum()
        se = sq_err.std() / math.sqrt(n_draws)
        assert abs(sq_err.mean() - exact) < 5 * se, levels
        assert exact <= min(n / levels**2, math.sqrt(n) / levels) * norm2, levels


def test_qsgd_levels_are_multiples_of_norm_over_s():
    codec = Codec("qsgd", levels=3)
    v = _data((50,), seed=4)
    [(q, _)] = _draws(v, (codec,), 8)
    norm = float(np.linalg.norm(np.asarray(v, np.float64)))
    k = np.asarray(q, np.float64) / (norm / 3)
    np.testing.assert_allclose(k, np.round(k), atol=1e-4)
    assert np.all(np.abs(k) <= 3 + 1e-4)


def test_nearest_sign_is_scaled_sign():
    x = _data((5, 8), seed=9)
    for block in (None, 16):
        codec = Codec("sign", block_size=block)
        _, y = _roundtrip(x, codec, None)
        flat = np.asarray(x, np.float64).ravel()
        blocks = [flat] if block is None else np.split(flat, [16, 32])
        want = np.concatenate(
            [np.abs(b).mean() * np.where(b >= 0, 1, -1) for b in blocks]
        )
        np.testing.assert_allclose(np.asarray(y).ravel(), want, rtol=1e-6)


def test_stochastic_without_key_raises_and_nearest_needs_none():
    with pytest.raises(ValueError, match="key"):
        _encode(np.ones(3, np.float32), Codec("uniform", 8), None)
    _encode(np.ones(3, np.float32), Codec("uniform", 8, stochastic=False), None)


def test_same_key_same_codes_other_key_other_codes():
    x = _data((1000,))
    codec = Codec("uniform", 4)
    a = _encode(x, codec, jax.random.key(1)).codes
    b = _encode(x, codec, jax.random.key(1)).codes
    c = _encode(x, codec, jax.random.key(2)).codes
    raw = _encode(x, codec, jax.random.key_data(jax.random.key(1))).codes
    assert np.array_equal(a, b) and np.array_equal(a, raw)
    assert not np.array_equal(a, c)


# Bad input


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 3}, r"\(2, 4, 8, 16\)"),
        ({"bits": True}, "bits"),
        ({"bits": 8.0}, "bits"),
        ({"scheme": "ternary"}, "'none', 'uniform', 'qsgd', 'sign'"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"scheme": "qsgd", "levels": 0}, "levels"),
        ({"scheme": "qsgd", "levels": 40000}, "levels"),
        ({"scheme": "qsgd", "levels": 127, "bits": 4}, r"\(8, 16\)"),
        ({"scheme": "uniform", "levels": 7}, "levels"),
        ({"scheme": "sign", "bits": 8}, "1"),
        ({"scheme": "none", "stochastic": True}, "stochastic"),
        ({"scheme": "none", "block_size": 8}, "block_size"),
        ({"stochastic": "yes"}, "stochastic"),
    ],
)
def test_bad_codec_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Codec(**kwargs)
    kwargs = dict(kwargs)
    with pytest.raises(ValueError, match=match):
        quantize(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"error_feedback": 1}, {"seed": 1.5}, {"seed": True}, {"seed": "0"}]
)
def test_bad_quantize_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        quantize(8, **kwargs)


@pytest.mark.parametrize("codec", CODECS, ids=_id)
def test_codec_dict_roundtrips_through_json_and_msgpack(codec):
    d = codec.to_dict()
    assert Codec.from_dict(json.loads(json.dumps(d))) == codec
    assert Codec.from_dict(msgpack.unpackb(msgpack.packb(d))) == codec


@pytest.mark.parametrize(
    "junk, match",
    [
        ({"scheme": "uniform", "bits": 8, "extra": 1}, "unknown codec keys 'extra'"),
        ({"scheme": "uniform", "bits": "8"}, "bits"),
        ({"scheme": "uniform", "bits": 7}, "bits"),
        ({"scheme": b"uniform"}, "scheme"),
        ({"scheme": None}, "scheme"),
        ({"block_size": [4]}, "block_size"),
        ({"stochastic": 1}, "stochastic"),
        ({1: 2}, "unknown"),
        ([("scheme", "uniform")], "mapping"),
        ("uniform", "mapping"),
    ],
)
def test_codec_from_dict_rejects_junk(junk, match):
    with pytest.raises(ValueError, match=match):
        Codec.from_dict(junk)


def test_codec_is_frozen_and_hashable():
    codec = Codec("uniform", 4)
    with pytest.raises(AttributeError):
        codec.bits = 8
    assert {codec: 1}[Codec("uniform", 4, None, True)] == 1


def test_decode_rejects_mismatched_input():
    codec = Codec("uniform", 4, block_size=4)
    good = _encode(np.ones(10, np.float32), codec, jax.random.key(0))
    assert _decode(good, codec, (10,), jnp.float32).shape == (10,)
    with pytest.raises(ValueError, match=r"uint8\[5\]"):
        decode(good, codec, (11,))
    with pytest.raises(ValueError, match=r"float32\[3\]"):
        decode(Encoded(good.codes, good.scales[:2]), codec, (10,))
    with pytest.raises(ValueError, match="uint8"):
        decode(Encoded(np.asarray(good.codes, np.int32), good.scales), codec, (10,))
    with pytest.raises(ValueError, match="float32"):
        decode(Encoded(good.codes, np.asarray(good.scales, np.float16)), codec, (10,))
    with pytest.raises(ValueError, match="floating"):
        decode(good, codec, (10,), jnp.int32)
    with pytest.raises(ValueError, match="shape"):
        decode(good, codec, (-10,))
    with pytest.raises(ValueError, match="Codec"):
        decode(good, codec.to_dict(), (10,))
    with pytest.raises(ValueError, match="Encoded"):
        decode((good.codes, good.scales), codec, (10,))


def test_encode_rejects_non_floating():
    with pytest.raises(ValueError, match="floating"):
        _encode(np.arange(4), Codec("uniform", 8, stochastic=False), None)
    with pytest.raises(ValueError, match="shape"):
        encoded_nbytes(5, Codec())


# Trees


def test_encode_tree_folds_the_leaf_index_into_the_key():
    tree = {"a": _data((4, 5)), "b": [_data((3,), jnp.bfloat16, 1), _data((0,))]}
    codec = Codec("uniform", 4)
    key = jax.random.key(5)
    encoded, out = _roundtrip_tree(tree, codec, key)
    leaves = jax.tree.leaves(tree)
    assert len(encoded) == 3
    for i, (leaf, enc) in enumerate(zip(leaves, encoded, strict=True)):
        want = _encode(leaf, codec, jax.random.fold_in(key, i))
        np.testing.assert_array_equal(np.asarray(enc.codes), np.asarray(want.codes))
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    assert [o.dtype for o in jax.tree.leaves(out)] == [x.dtype for x in leaves]
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    out2 = jax.jit(lambda e: decode_tree(e, codec, like))(encoded)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(out2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="2 encoded leaves for a tree of 3"):
        decode_tree(encoded[:2], codec, tree)
    with pytest.raises(ValueError, match="key"):
        encode_tree(tree, codec)


# The transform


def _grads(step, tree):
    rng = np.random.default_rng(100 + step)
    return jax.tree.map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype)), tree
    )


@functools.partial(jax.jit, static_argnums=(2, 4))
def _reference(grads, error, codec, key, error_feedback):
    """decode(encode(p)) as the transform should compute it, in its own program."""
    _, step_key = jax.random.split(key)
    if error_feedback:
        sent = jax.tree.map(lambda g, e: g.astype(jnp.float32) + e, grads, error)
    else:
        sent = grads
    encoded = encode_tree(sent, codec, step_key)
    return encoded, decode_tree(encoded, codec, grads)


PARAMS = {
    "w": jnp.asarray(np.zeros((5, 7), np.float32)),
    "b": jnp.asarray(np.zeros((3,), jnp.bfloat16)),
    "s": jnp.asarray(np.zeros((), np.float32)),
}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bits": 2},
        {"scheme": "qsgd", "levels": 3, "block_size": 4, "error_feedback": True},
        {"scheme": "sign", "error_feedback": True},
    ],
)
def test_output_is_decode_of_encode_and_last_encoded_holds_its_codes(kwargs):
    opt = quantize(**kwargs)
    codec = Codec(
        scheme=kwargs.get("scheme", "uniform"),
        bits=kwargs.get("bits"),
        block_size=kwargs.get("block_size"),
        stochastic=kwargs.get("stochastic"),
        levels=kwargs.get("levels"),
    )
    state = opt.init(PARAMS)
    update = jax.jit(opt.update)
    for step in range(2):
        grads = _grads(step, PARAMS)
        want_encoded, want = _reference(
            grads, state.error, codec, state.key, bool(kwargs.get("error_feedback"))
        )
        out, new_state = update(grads, state)
        assert int(new_state.count) == step + 1
        assert not np.array_equal(np.asarray(new_state.key), np.asarray(state.key))
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        got_encoded = last_encoded(new_state)
        for a, b in zip(got_encoded, want_encoded, strict=True):
            np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes))
            np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
        # What the wire carries decodes to exactly what the optimizer applied.
        for enc, o in zip(got_encoded, jax.tree.leaves(out), strict=True):
            wire = _decode_reference(enc, codec, o.size).astype(o.dtype)
            np.testing.assert_array_equal(wire, np.asarray(o).ravel())
        state = new_state


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bits": 2},
        {"scheme": "sign", "block_size": 4},
        {"scheme": "qsgd", "levels": 1},
        {"scheme": "sign", "stochastic": True},
    ],
)
def test_error_feedback_conserves_mass(kwargs):
    opt = quantize(error_feedback=True, **kwargs)
    params = {"w": np.zeros((6, 5), np.float32), "b": np.zeros((7,), np.float32)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    total_in = jax.tree.map(lambda p: np.zeros(p.shape), params)
    total_out = jax.tree.map(lambda p: np.zeros(p.shape), params)
    largest = 0.0
    steps = 20
    for step in range(steps):
        grads = _grads(step, params)
        out, state = update(grads, state)
        total_in = jax.tree.map(
            lambda t, g: t + np.asarray(g, np.float64), total_in, grads
        )
        total_out = jax.tree.map(
            lambda t, o: t + np.asarray(o, np.float64), total_out, out
        )
        for o in jax.tree.leaves(out):
            largest = max(largest, float(np.abs(np.asarray(o)).max()))
    residual = jax.tree.map(lambda e: np.asarray(e, np.float64), state.error)
    assert any(np.abs(r).max() > 1e-3 for r in jax.tree.leaves(residual))
    # Each step rounds g + e and p - C(p) once in float32.
    atol = steps * 2 * largest * np.finfo(np.float32).eps
    for t_in, t_out, e in zip(
        jax.tree.leaves(total_in),
        jax.tree.leaves(total_out),
        jax.tree.leaves(residual),
        strict=True,
    ):
        np.testing.assert_allclose(t_out + e, t_in, rtol=0, atol=atol)


def test_without_error_feedback_the_state_has_no_residual():
    opt = quantize(4)
    state = opt.init(PARAMS)
    assert state.error == optax.EmptyState()
    assert jax.tree.leaves(state.error) == []
    _, new_state = jax.jit(opt.update)(_grads(0, PARAMS), state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)


def test_state_structure_is_fixed_under_cond_and_jit():
    opt = quantize(4, error_feedback=True, block_size=8)
    state = opt.init(PARAMS)

    @jax.jit
    def maybe_update(flag, grads, state):
        return jax.lax.cond(flag, lambda s: opt.update(grads, s)[1], lambda s: s, state)

    grads = _grads(0, PARAMS)
    skipped = maybe_update(False, grads, state)
    taken = maybe_update(True, grads, state)
    assert jax.tree.structure(skipped) == jax.tree.structure(state)
    assert int(skipped.count) == 0 and int(taken.count) == 1


def test_inject_hyperparams_needs_static_int_args():
    with pytest.raises(ValueError, match="static_args"):
        optax.inject_hyperparams(quantize)(bits=4).init(PARAMS)
    opt = optax.inject_hyperparams(quantize, static_args=("bits", "block_size"))(
        bits=4, block_size=8, error_feedback=True, seed=3
    )
    state = opt.init(PARAMS)
    update = jax.jit(opt.update)
    out, state = update(_grads(0, PARAMS), state)
    assert [o.dtype for o in jax.tree.leaves(out)] == [
        p.dtype for p in jax.tree.leaves(PARAMS)
    ]
    assert last_encoded(state)[2].codes.shape == (18,)
    # With every int left at None, only the seed is injected, and it works.
    default = optax.inject_hyperparams(quantize)()
    out, _ = jax.jit(default.update)(_grads(0, PARAMS), default.init(PARAMS))
    assert jax.tree.structure(out) == jax.tree.structure(PARAMS)


def test_last_encoded_finds_the_state_in_nested_wrappers():
    wrappers = [
        quantize(8),
        optax.chain(optax.clip(1.0), quantize(8), optax.adam(1e-2)),
        optax.named_chain(("q", quantize(8)), ("sgd", optax.sgd(0.1))),
        optax.MultiSteps(optax.chain(quantize(8), optax.sgd(0.1)), 2),
        optax.inject_hyperparams(quantize, static_args="bits")(bits=4),
    ]
    for opt in wrappers:
        encoded = last_encoded(opt.init(PARAMS))
        assert [e.codes.shape for e in encoded] == [(3,), (1,), (35,)] or [
            e.codes.shape for e in encoded
        ] == [(2,), (1,), (18,)]
    with pytest.raises(ValueError, match="no QuantizeState"):
        last_encoded(
            optax.inject_hyperparams(optax.sgd)(learning_rate=0.1).init(PARAMS)
        )
    two = optax.chain(quantize(8), quantize(4))
    with pytest.raises(ValueError, match="2 QuantizeStates"):
        last_encoded(two.init(PARAMS))


def test_chain_with_adam_trains_a_quadratic():
    target = _data((20,), seed=3)
    params = jnp.asarray(np.zeros((20,), np.float32))
    opt = optax.chain(quantize(2, error_feedback=True), optax.adam(0.05))
    state = opt.init(params)
    assert isinstance(state[0], QuantizeState)

    @jax.jit
    def step(params, state):
        grads = params - target
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(300):
        params, state = step(params, state)
    assert np.max(np.abs(np.asarray(params) - np.asarray(target))) < 0.05
