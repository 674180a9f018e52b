"""Tests of hpsjax.data and hpsjax.models."""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from hpsjax import data, models
from hpsjax.data import Batch, Dataset, load_npz, synthetic_digits
from hpsjax.models import (
    MLP,
    SmallCNN,
    accuracy,
    loss_fn,
    make_train_functions,
    merge_model,
    per_example_loss,
    split_model,
)
from hpsjax.storage._checkpoint import CheckpointManager


def _ids(n: int = 23, classes: int = 3) -> Dataset:
    """Examples whose single feature is their own index, to track them."""
    return Dataset(np.arange(n, dtype=np.float32)[:, None], np.arange(n) % classes)


def _members(dataset: Dataset) -> list[int]:
    return [int(v) for v in dataset.x[:, 0]]


# -- synthetic digits ----------------------------------------------------------


@pytest.mark.parametrize("size", [8, 28])
def test_synthetic_digits_shapes_range_and_balance(size):
    d = synthetic_digits(500, image_size=size, seed=3)
    assert d.x.shape == (500, size, size, 1) and d.x.dtype == np.float32
    assert d.y.shape == (500,) and d.y.dtype == np.int32
    assert d.input_shape == (size, size, 1) and d.num_classes == 10
    assert d.x.min() >= 0.0 and d.x.max() <= 1.0
    assert np.bincount(d.y, minlength=10).tolist() == [50] * 10
    # Strokes are drawn: the mean image of every class has clear ink.
    for c in range(10):
        assert d.x[d.y == c].mean(axis=0).max() > 0.5


def test_synthetic_digits_are_deterministic():
    a = synthetic_digits(200, seed=5)
    b = synthetic_digits(200, seed=5)
    c = synthetic_digits(200, seed=6)
    np.testing.assert_array_equal(a.x, b.x)
    np.testing.assert_array_equal(a.y, b.y)
    assert not np.array_equal(a.x, c.x)


def test_examples_of_one_class_differ():
    d = synthetic_digits(100, seed=0, noise=0.0)
    threes = d.x[d.y == 3]
    assert len(threes) == 10
    assert np.abs(threes[0] - threes[1]).max() > 0.2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_examples": 5},
        {"num_examples": 0},
        {"num_examples": 10.0},
        {"image_size": 4},
        {"image_size": 100},
        {"seed": -1},
        {"noise": -0.1},
        {"noise": "x"},
        {"jitter": 0.5},
    ],
)
def test_synthetic_digits_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        synthetic_digits(**{"num_examples": 100, **kwargs})


# -- Dataset -------------------------------------------------------------------


def test_dataset_is_read_only():
    d = _ids()
    with pytest.raises(ValueError):
        d.x[0, 0] = 1.0
    with pytest.raises(ValueError):
        d.y[0] = 1


def test_uint8_is_scaled_and_others_cast():
    d = Dataset(np.array([[0, 255], [51, 102]], np.uint8), [0, 1])
    np.testing.assert_allclose(d.x, [[0.0, 1.0], [0.2, 0.4]])
    d = Dataset(np.array([[0, 300]], np.int64), np.array([2.0]), num_classes=4)
    assert d.x.dtype == np.float32 and d.x.tolist() == [[0.0, 300.0]]
    assert d.y.tolist() == [2] and d.num_classes == 4


@pytest.mark.parametrize(
    "x, y, kwargs, match",
    [
        (np.zeros((3, 2)), np.zeros(4, int), {}, "3 examples but y has 4"),
        (np.zeros(3), np.zeros(3, int), {}, "leading example axis"),
        (np.zeros((3, 2)), np.zeros((3, 1), int), {}, "1-D"),
        (np.zeros((0, 2)), np.zeros(0, int), {}, "no examples"),
        (np.array([[np.nan, 0.0]]), np.zeros(1, int), {}, "NaN"),
        (np.array([["a", "b"]]), np.zeros(1, int), {}, "real numbers"),
        (np.ones((1, 2), np.complex64), np.zeros(1, int), {}, "real numbers"),
        (np.zeros((2, 2)), np.array([0.5, 1.0]), {}, "integers"),
        (np.zeros((2, 2)), np.array(["a", "b"]), {}, "integers"),
        (np.zeros((2, 2)), np.array([0, -1]), {}, "non-negative"),
        (np.zeros((2, 2)), np.array([0, 3]), {"num_classes": 3}, "not below"),
        (np.zeros((2, 2)), np.array([0, 1]), {"num_classes": 0}, "num_classes"),
    ],
)
def test_dataset_validation(x, y, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Dataset(x, y, **kwargs)


def test_split_is_disjoint_covering_and_deterministic():
    d = _ids(50)
    train, test = d.split(0.2, seed=1)
    assert (len(train), len(test)) == (40, 10)
    assert set(_members(train)).isdisjoint(_members(test))
    assert sorted(_members(train) + _members(test)) == list(range(50))
    again, _ = d.split(0.2, seed=1)
    assert _members(again) == _members(train)
    other, _ = d.split(0.2, seed=2)
    assert _members(other) != _members(train)
    assert train.num_classes == test.num_classes == 3


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 2, "0.2", True])
def test_split_bad_fraction(fraction):
    with pytest.raises(ValueError, match="test_fraction"):
        _ids().split(fraction)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 7, 23])
def test_shards_are_disjoint_covering_and_balanced(num_shards):
    d = _ids(23)
    shards = [d.shard(num_shards, i) for i in range(num_shards)]
    members = [_members(s) for s in shards]
    flat = [m for ms in members for m in ms]
    assert sorted(flat) == list(range(23)) and len(flat) == len(set(flat))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_shards_of_sorted_labels_see_every_class():
    d = Dataset(np.zeros((30, 1)), np.repeat(np.arange(3), 10))
    for i in range(4):
        assert set(d.shard(4, i).y.tolist()) == {0, 1, 2}


@pytest.mark.parametrize(
    "num_shards, index", [(0, 0), (3, 3), (3, -1), (24, 0), (2.0, 0), (2, 1.0)]
)
def test_shard_bad_arguments(num_shards, index):
    with pytest.raises(ValueError):
        _ids(23).shard(num_shards, index)


# -- batches -------------------------------------------------------------------


def test_batches_are_deterministic_and_seeded():
    d = _ids(40)
    s1, s2, s3 = d.batches(8, seed=1), d.batches(8, seed=1), d.batches(8, seed=2)
    a = [s1.next().x[:, 0].tolist() for _ in range(12)]
    b = [s2.next().x[:, 0].tolist() for _ in range(12)]
    c = [s3.next().x[:, 0].tolist() for _ in range(12)]
    assert a == b and a != c
    assert sorted(v for batch in a[:5] for v in batch) == list(range(40))


def test_changing_batch_sizes_visit_every_example_once_per_epoch():
    d = _ids(23)
    stream = d.batches(5, seed=0)
    sizes = [5, 1, 9, 3, 3, 7, 2, 6, 10]  # 46 = two epochs of 23
    seen = []
    for i, size in enumerate(sizes):
        if i % 2:
            stream.batch_size = size
            batch = stream.next()
        else:
            batch = next(stream) if size == 5 else stream.next(batch_size=size)
        assert isinstance(batch, Batch)
        assert batch.x.shape == (size, 1) and batch.y.shape == (size,)
        np.testing.assert_array_equal(batch.y, batch.x[:, 0].astype(int) % 3)
        seen += [int(v) for v in batch.x[:, 0]]
    assert sorted(seen[:23]) == list(range(23))
    assert sorted(seen[23:]) == list(range(23))
    assert seen[:23] != seen[23:], "each epoch has its own order"
    assert stream.position() == {"seed": 0, "epoch": 2, "offset": 0}


def test_stream_resumes_from_its_position():
    d = _ids(17)
    stream = d.batches(4, seed=9)
    for _ in range(6):
        stream.next()
    position = stream.position()
    resumed = d.batches(
        4, seed=position["seed"], epoch=position["epoch"], offset=position["offset"]
    )
    for size in (3, 11, 40):
        np.testing.assert_array_equal(stream.next(size).x, resumed.next(size).x)


def test_batch_larger_than_the_dataset_spans_epochs():
    d = _ids(5)
    batch = d.batches(12, seed=0).next()
    counts = collections.Counter(int(v) for v in batch.x[:, 0])
    assert sorted(counts) == list(range(5)) and sum(counts.values()) == 12
    assert max(counts.values()) == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": -3},
        {"batch_size": 2.5},
        {"batch_size": 4, "seed": -1},
        {"batch_size": 4, "epoch": -1},
        {"batch_size": 4, "offset": 23},
        {"batch_size": 4, "offset": -1},
    ],
)
def test_stream_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        _ids(23).batches(**{"seed": 0, **kwargs})


def test_stream_bad_batch_size_changes_nothing():
    stream = _ids(23).batches(4, seed=0)
    with pytest.raises(ValueError):
        stream.batch_size = 0
    with pytest.raises(ValueError):
        stream.next(batch_size=-1)
    assert stream.batch_size == 4
    assert stream.position() == {"seed": 0, "epoch": 0, "offset": 0}


def test_eval_batches_cover_all_in_order():
    d = _ids(10)
    batches = list(d.eval_batches(4))
    assert [len(b.y) for b in batches] == [4, 4, 2]
    assert [int(v) for b in batches for v in b.x[:, 0]] == list(range(10))
    with pytest.raises(ValueError):
        d.eval_batches(0)


# -- npz loader ----------------------------------------------------------------


def test_load_npz_round_trip(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, (12, 4, 4, 1)).astype(np.uint8)
    y = np.arange(12) % 4
    path = tmp_path / "mine.npz"
    np.savez(path, x=x, y=y)
    d = load_npz(path)
    np.testing.assert_allclose(d.x, x / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(d.y, y)
    assert d.num_classes == 4 and d.name == "mine.npz"
    np.savez(tmp_path / "keys.npz", images=x.astype(np.float32), labels=y)
    d = load_npz(tmp_path / "keys.npz", "images", "labels", num_classes=10)
    assert d.num_classes == 10 and d.x.max() > 1.0


def test_load_npz_missing_key_lists_keys(tmp_path):
    np.savez(tmp_path / "a.npz", images=np.zeros((2, 3)), y=np.zeros(2, int))
    with pytest.raises(ValueError, match=r"no array 'x'.*\['images', 'y'\]"):
        load_npz(tmp_path / "a.npz")


def test_load_npz_mismatched_lengths(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((5, 3)), y=np.zeros(4, int))
    with pytest.raises(ValueError, match="5 examples but y has 4"):
        load_npz(tmp_path / "a.npz")


def test_load_npz_refuses_other_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_npz(tmp_path / "missing.npz")
    (tmp_path / "text.npz").write_text("not an archive")
    with pytest.raises(ValueError, match=r"not a readable \.npz"):
        load_npz(tmp_path / "text.npz")
    np.save(tmp_path / "single.npy", np.zeros(3))
    with pytest.raises(ValueError, match="single array"):
        load_npz(tmp_path / "single.npy")
    np.savez(tmp_path / "obj.npz", x=np.array([[1], [None]], dtype=object), y=[0, 1])
    with pytest.raises(ValueError, match="cannot read arrays"):
        load_npz(tmp_path / "obj.npz")


def test_get_dataset_registry(tmp_path):
    assert len(data.get_dataset("synthetic_digits", num_examples=20)) == 20
    np.savez(tmp_path / "a.npz", x=np.zeros((3, 2)), y=[0, 1, 0])
    assert len(data.get_dataset("npz", path=tmp_path / "a.npz")) == 3
    with pytest.raises(
        ValueError,
        match=r"valid names: npz, sklearn_digits, synthetic_digits, "
        r"synthetic_regression, text$",
    ):
        data.get_dataset("mnist")


# -- models --------------------------------------------------------------------
# Compiling is most of the cost of these tests on CPU, so they reuse a few layer
# shapes, take numpy inputs and call models through jitted functions.


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, x):
    return merge_model(graphdef, params)(x)


def _images(n, size, *, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, size, size, 1)).astype("f4")


def test_mlp_forward_and_checks():
    model = MLP(64, (64, 64), 10, rngs=nnx.Rngs(0))
    assert len(model.layers) == 3
    assert _apply(*split_model(model), _images(3, 8)).shape == (3, 10)
    linear = MLP(64, (), 10, rngs=nnx.Rngs(0))
    assert len(linear.layers) == 1
    assert _apply(*split_model(linear), np.ones((2, 64), "f4")).shape == (2, 10)
    with pytest.raises(ValueError, match="expects 64 features"):
        model(np.ones((3, 28, 28), "f4"))
    for bad in [
        {"in_features": 0},
        {"hidden": 32},
        {"hidden": (0,)},
        {"num_classes": -1},
    ]:
        with pytest.raises(ValueError):
            MLP(**{"in_features": 64, **bad}, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("size", [8, 28])
def test_cnn_forward_and_backward(size):
    model = SmallCNN(10, in_channels=1, image_size=size, rngs=nnx.Rngs(0))
    graphdef, params = split_model(model)
    x = _images(4, size)
    batch = (x, np.array([0, 1, 2, 3], np.int32))
    assert _apply(graphdef, params, x).shape == (4, 10)
    np.testing.assert_allclose(
        _apply(graphdef, params, x[..., 0]), _apply(graphdef, params, x), rtol=1e-6
    )
    loss, grads = make_train_functions(graphdef).loss_and_grad(params, batch)
    assert np.isfinite(float(loss))
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    norms = [float(np.linalg.norm(g)) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and all(n > 0 for n in norms)
    with pytest.raises(ValueError, match="expects images of shape"):
        model(np.ones((2, size + 1, size, 1), "f4"))


def test_cnn_bad_arguments():
    with pytest.raises(ValueError, match="at least 4"):
        SmallCNN(10, image_size=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError):
        SmallCNN(0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError):
        SmallCNN(10, in_channels=0, rngs=nnx.Rngs(0))


# -- functional bridge ---------------------------------------------------------


def _all_keys(tree, out=None):
    out = [] if out is None else out
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.append(k)
            _all_keys(v, out)
    return out


@pytest.mark.parametrize(
    "model",
    [
        lambda: MLP(64, (64, 64), 10, rngs=nnx.Rngs(1)),
        lambda: SmallCNN(10, in_channels=1, image_size=8, rngs=nnx.Rngs(1)),
    ],
)
def test_split_merge_round_trip(model):
    model = model()
    graphdef, params = split_model(model)
    assert type(params) is dict
    assert all(type(k) is str for k in _all_keys(params))
    assert all(isinstance(v, jax.Array) for v in jax.tree.leaves(params))
    x = _images(2, 8)
    rebuilt = merge_model(graphdef, params)
    assert type(rebuilt) is type(model)
    for a, b in zip(
        jax.tree.leaves(nnx.state(rebuilt)),
        jax.tree.leaves(nnx.state(model)),
        strict=True,
    ):
        assert a is b

    zeros = jax.tree.map(np.zeros_like, params)
    np.testing.assert_array_equal(_apply(graphdef, zeros, x), np.zeros((2, 10)))
    again_graphdef, again = split_model(rebuilt)
    assert again_graphdef == graphdef
    assert jax.tree.structure(again) == jax.tree.structure(params)


def test_params_survive_a_checkpoint(tmp_path):
    graphdef, params = split_model(MLP(64, (64, 64), 10, rngs=nnx.Rngs(2)))
    manager = CheckpointManager(tmp_path)
    manager.save(0, params)
    _, restored, _ = manager.restore_latest()
    x = np.ones((1, 64), "f4")
    np.testing.assert_array_equal(
        _apply(graphdef, restored, x), _apply(graphdef, params, x)
    )


def test_merge_checks_keys():
    graphdef, params = split_model(MLP(64, (64, 64), 10, rngs=nnx.Rngs(0)))
    renamed = {"layers": dict(params["layers"])}
    renamed["layers"]["0"] = dict(params["layers"]["0"])
    renamed["layers"]["0"]["kernal"] = renamed["layers"]["0"].pop("kernel")
    with pytest.raises(ValueError, match="kernal"):
        merge_model(graphdef, renamed)
    with pytest.raises(ValueError, match="expected 6 leaves"):
        merge_model(graphdef, {"layers": {"0": params["layers"]["0"]}})
    with pytest.raises(ValueError, match="must be a dict"):
        merge_model(graphdef, [params])


def test_split_refuses_non_param_state():
    class WithBatchNorm(nnx.Module):
        def __init__(self):
            self.norm = nnx.BatchNorm(3, rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="BatchStat"):
        split_model(WithBatchNorm())
    with pytest.raises(ValueError, match=r"nnx\.Module"):
        split_model({"w": np.ones(2)})


def test_loss_accuracy_and_train_functions_agree_with_hand_computation():
    # Float32 products at full precision: an accelerator's default (TF32 or
    # bfloat16 passes) is too coarse for hand arithmetic and central differences.
    with jax.default_matmul_precision("highest"):
        _check_loss_accuracy_and_train_functions()


def _check_loss_accuracy_and_train_functions():
    graphdef, params = split_model(MLP(64, (64, 64), 10, rngs=nnx.Rngs(0)))
    x = np.random.default_rng(2).normal(size=(8, 64)).astype("f4")
    y = np.array([0, 1, 2, 9, 1, 2, 0, 1], np.int32)
    logits = np.asarray(_apply(graphdef, params, x), np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -log_probs[np.arange(8), y]
    acc = float(np.mean(logits.argmax(-1) == y))

    @functools.partial(jax.jit, static_argnums=1)
    def hand_checked(params, graphdef, batch):
        # The three functions in one compiled program.
        return [
            fn(params, graphdef, batch) for fn in (per_example_loss, loss_fn, accuracy)
        ]

    losses, loss, accuracy_value = hand_checked(params, graphdef, Batch(x, y))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    assert float(accuracy_value) == pytest.approx(acc)

    loss_and_grad, evaluate = make_train_functions(graphdef)
    loss, grads = loss_and_grad(params, (x, y))
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    # Directional derivative of the loss against a central difference.
    rng = np.random.default_rng(3)
    direction = jax.tree.map(lambda p: rng.normal(size=p.shape), params)
    norm = np.sqrt(sum(float(np.sum(d * d)) for d in jax.tree.leaves(direction)))
    direction = jax.tree.map(lambda d: (d / norm).astype("f4"), direction)
    eps = 1e-2

    def shifted(sign):
        moved = jax.tree.map(lambda p, d: p + sign * eps * d, params, direction)
        return float(loss_and_grad(moved, (x, y))[0])

    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    analytic = sum(
        float(np.vdot(g, d))
        for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction), strict=True)
    )
    assert analytic == pytest.approx(numeric, rel=2e-2, abs=2e-4)
    metrics = evaluate(params, (x, y))
    assert set(metrics) == {"loss", "accuracy"}
    assert float(metrics["accuracy"]) == pytest.approx(acc)
    np.testing.assert_allclose(metrics["loss"], expected.mean(), rtol=1e-5)
    with pytest.raises(ValueError, match="GraphDef"):
        make_train_functions(params)


def test_get_model_registry():
    d = synthetic_digits(20, seed=0)
    for name, cls in (("mlp", MLP), ("cnn", SmallCNN)):
        model = models.get_model(name, input_shape=d.input_shape, num_classes=10)
        assert type(model) is cls
        assert _apply(*split_model(model), d.x[:2]).shape == (2, 10)
    mlp = models.get_model("mlp", input_shape=(8, 8, 1), num_classes=10, hidden=(64,))
    assert len(mlp.layers) == 2 and mlp.layers[0].out_features == 64
    with pytest.raises(ValueError, match=r"valid names: cnn, mlp, resnet, t"):
        models.get_model("vit", input_shape=(8, 8, 1), num_classes=10)
    with pytest.raises(ValueError, match="images"):
        models.get_model("cnn", input_shape=(64,), num_classes=10)
    with pytest.raises(ValueError, match="resnet takes images"):
        models.get_model("resnet", input_shape=(64,), num_classes=10)


# -- learning ------------------------------------------------------------------


def _train(model, train, steps, *, sizes=(64,)):
    graphdef, params = split_model(model)
    loss_and_grad, evaluate = make_train_functions(graphdef)
    optimizer = optax.sgd(0.1, momentum=0.9)
    opt_state = optimizer.init(params)

    @jax.jit
    def apply(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    stream = train.batches(sizes[0], seed=0)
    for step in range(steps):
        stream.batch_size = sizes[step * len(sizes) // steps]
        _, grads = loss_and_grad(params, stream.next())
        params, opt_state = apply(params, opt_state, grads)
    return params, evaluate


def test_mlp_learns_synthetic_digits_and_a_linear_model_does_not_saturate():
    train, test = synthetic_digits(6000, seed=0).split(0.2, seed=0)
    full_test = (test.x, test.y)

    params, evaluate = _train(MLP(64, (64, 64), 10, rngs=nnx.Rngs(0)), train, 300)
    mlp_accuracy = float(evaluate(params, full_test)["accuracy"])
    # Documented in synthetic_digits: about 0.93 after 300 steps.
    assert mlp_accuracy >= 0.90

    params, evaluate = _train(MLP(64, (), 10, rngs=nnx.Rngs(0)), train, 300)
    linear_accuracy = float(evaluate(params, full_test)["accuracy"])
    # Documented: about 0.86; the data are not linearly separable.
    assert 0.6 < linear_accuracy < 0.9
    assert mlp_accuracy > linear_accuracy + 0.03


def test_training_with_a_batch_size_that_changes_between_rounds():
    train, test = synthetic_digits(2000, seed=1).split(0.2, seed=0)
    params, evaluate = _train(
        MLP(64, (64,), 10, rngs=nnx.Rngs(0)), train, 200, sizes=(16, 96, 40, 64)
    )
    assert float(evaluate(params, (test.x, test.y))["accuracy"]) > 0.75


# -- scikit-learn digits -------------------------------------------------------


def test_sklearn_digits_are_the_real_bundled_images():
    digits = data.get_dataset("sklearn_digits")
    assert len(digits) == 1797
    assert digits.input_shape == (8, 8, 1)
    assert digits.num_classes == 10
    assert float(digits.x.min()) == 0.0 and float(digits.x.max()) == 1.0
    counts = np.bincount(digits.y, minlength=10)
    assert counts.min() >= 170 and counts.sum() == 1797
    train, test = digits.split(0.2, seed=3)
    again_train, again_test = data.sklearn_digits().split(0.2, seed=3)
    assert len(test) == 359
    np.testing.assert_array_equal(train.y, again_train.y)
    np.testing.assert_array_equal(test.x, again_test.x)
    with pytest.raises(ValueError, match="8x8 images"):
        data.sklearn_digits(image_size=28)


def test_an_mlp_learns_sklearn_digits():
    train, test = data.sklearn_digits().split(0.2, seed=0)
    model = models.get_model("mlp", input_shape=(8, 8, 1), num_classes=10, seed=0)
    graphdef, params = split_model(model)
    fns = make_train_functions(graphdef)
    optimizer = optax.sgd(0.1, momentum=0.9)
    state = optimizer.init(params)
    stream = train.batches(64, seed=0)
    for _ in range(150):
        _, grads = fns.loss_and_grad(params, stream.next())
        updates, state = optimizer.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    assert float(fns.evaluate(params, (test.x, test.y))["accuracy"]) > 0.9


# -- models from a module:factory path -----------------------------------------

_FACTORY = """
from flax import nnx
import jax

from hpsjax.models import MLP


def make_model(*, rngs, hidden=(16,), shape=(8, 8, 1)):
    return MLP(64, hidden, 10, rngs=rngs), shape


def make_struct(*, rngs):
    return MLP(64, (), 10, rngs=rngs), jax.ShapeDtypeStruct((8, 8, 1), "float32")


def not_a_pair(*, rngs):
    return MLP(64, (), 10, rngs=rngs)


def not_a_module(*, rngs):
    return "model", (8, 8, 1)


def bad_shape(*, rngs):
    return MLP(64, (), 10, rngs=rngs), (8, -1)


value = 3
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_factories"


def test_resolve_model_builds_from_a_factory(factory_module):
    resolved = models.resolve_model(
        f"{factory_module}:make_model", input_shape=(8, 8, 1), seed=1, hidden=[8]
    )
    assert isinstance(resolved.model, MLP)
    assert resolved.input_shape == (8, 8, 1)
    _, params = split_model(resolved.model)
    assert params["layers"]["0"]["kernel"].shape == (64, 8)
    again = models.resolve_model(f"{factory_module}:make_model", seed=1, hidden=[8])
    np.testing.assert_array_equal(
        split_model(again.model)[1]["layers"]["0"]["kernel"],
        params["layers"]["0"]["kernel"],
    )
    struct = models.resolve_model(f"{factory_module}:make_struct")
    assert struct.input_shape == (8, 8, 1)
    builtin = models.resolve_model("cnn", input_shape=(8, 8, 1), num_classes=3)
    assert isinstance(builtin.model, SmallCNN) and builtin.input_shape == (8, 8, 1)


@pytest.mark.parametrize(
    ("spec", "kwargs", "match"),
    [
        ("nope", {}, r"unknown model 'nope'; valid names: .* 'package.module:factory'"),
        ("mlp", {}, "needs input_shape and num_classes"),
        (":make_model", {}, "must be 'package.module:factory'"),
        ("no_such_module_xyz:f", {}, "cannot import module 'no_such_module_xyz'"),
        ("{m}:missing", {}, "module 'my_factories' has no attribute 'missing'"),
        ("{m}:value", {}, "is not callable"),
        ("{m}:make_model", {"depth": 3}, "refused its arguments"),
        ("{m}:not_a_pair", {}, r"must return \(module, input_shape\), got MLP"),
        ("{m}:not_a_module", {}, "must return an nnx.Module first, got str"),
        ("{m}:bad_shape", {}, "input_shape a tuple of positive ints"),
        ("{m}:make_model", {"input_shape": (28, 28, 1)}, "the data have"),
    ],
)
def test_resolve_model_refuses_bad_specs(factory_module, spec, kwargs, match):
    with pytest.raises(ValueError, match=match):
        models.resolve_model(spec.format(m=factory_module), **kwargs)


# -- batch statistics ----------------------------------------------------------

# One small ResNet serves the batch-statistics tests: its weights' initializers
# compile once per kernel shape (about a second each on CPU), so the tests share
# the widths and the batch shape of their jitted steps.
_RESNET_WIDTHS = (4, 4)
_RESNET_BATCH = 32


@pytest.fixture(scope="module")
def resnet():
    return models.get_model(
        "resnet", input_shape=(8, 8, 1), num_classes=10, widths=_RESNET_WIDTHS
    )


@pytest.fixture(scope="module")
def resnet_functions(resnet):
    graphdef, _, _ = models.split_with_batch_stats(resnet)
    return models.make_stateful_train_functions(graphdef)


def test_split_model_points_batchnorm_models_to_split_with_batch_stats(resnet):
    with pytest.raises(ValueError, match=r"BatchStat.*split_with_batch_stats"):
        split_model(resnet)
    with pytest.raises(ValueError, match="also holds"):
        models.split_with_batch_stats(nnx.Dropout(0.5, rngs=nnx.Rngs(0)))


def test_a_resnet_trains_and_keeps_its_batch_stats_apart(resnet, resnet_functions):
    train, test = synthetic_digits(600, seed=0).split(0.2, seed=0)
    assert train.input_shape == resnet.image_shape
    graphdef, params, stats = models.split_with_batch_stats(resnet)
    assert sorted(stats["stem_bn"]) == ["mean", "var"]
    assert sorted(params["stem_bn"]) == ["bias", "scale"]
    fns = resnet_functions
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(params)

    @jax.jit
    def apply(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    stream = train.batches(_RESNET_BATCH, seed=0)
    first = stats
    losses = []
    for _ in range(12):
        loss, grads, stats = fns.loss_and_grad(params, stats, stream.next())
        params, opt_state = apply(params, opt_state, grads)
        losses.append(float(loss))
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert not np.allclose(stats["stem_bn"]["mean"], first["stem_bn"]["mean"])
    evaluated = fns.evaluate(params, stats, (test.x, test.y))

    @jax.jit
    def merged_logits(params, stats, x):
        merged = merge_model(graphdef, params, batch_stats=stats)
        merged.eval()
        return merged(x)

    logits = merged_logits(params, stats, test.x)
    accuracy_merged = float(np.mean(np.argmax(logits, -1) == test.y))
    assert float(evaluated["accuracy"]) == pytest.approx(accuracy_merged, abs=1e-6)
    with pytest.raises(ValueError, match="batch_stats do not fit"):
        merge_model(graphdef, params, batch_stats={**stats, "extra": {"x": 1.0}})


def test_split_trainable_splits_either_kind_and_the_loss_updates_the_stats(
    resnet, resnet_functions
):
    graphdef, params, stats = models.split_trainable(resnet)
    _, expected_params, expected_stats = models.split_with_batch_stats(resnet)
    assert jax.tree.structure(params) == jax.tree.structure(expected_params)
    assert jax.tree.structure(stats) == jax.tree.structure(expected_stats)
    x = _images(_RESNET_BATCH, 8)
    y = np.arange(_RESNET_BATCH, dtype=np.int32) % 10
    losses, new_stats = jax.jit(models.per_example_loss_with_stats, static_argnums=2)(
        params, stats, graphdef, Batch(x, y)
    )
    assert losses.shape == (_RESNET_BATCH,)
    assert jax.tree.structure(new_stats) == jax.tree.structure(stats)
    assert not np.allclose(new_stats["stem_bn"]["mean"], stats["stem_bn"]["mean"])
    trained = resnet_functions.loss_and_grad(params, stats, (x, y))
    assert float(np.mean(losses)) == pytest.approx(float(trained[0]), rel=1e-5)
    mlp = models.get_model("mlp", input_shape=(8, 8, 1), num_classes=10)
    _, mlp_params, none = models.split_trainable(mlp)
    assert none is None and sorted(mlp_params) == ["layers"]
    with pytest.raises(ValueError, match="also holds"):
        models.split_trainable(nnx.Dropout(0.5, rngs=nnx.Rngs(0)))


# -- init.npz ------------------------------------------------------------------


def test_params_npz_round_trip_in_the_servers_format(tmp_path):
    from hpsjax.ps._cli import load_npz_tree

    params = {
        "layers": {"0": {"kernel": np.ones((3, 2)), "bias": np.zeros(2, np.float32)}},
        "count": np.arange(3, dtype=np.int32),
    }
    path = tmp_path / "init.npz"
    models.save_params_npz(path, params)
    with np.load(path) as archive:
        assert sorted(archive.files) == [
            "__hpsjax_params__",
            "count",
            "layers/0/bias",
            "layers/0/kernel",
        ]
    loaded = models.load_params_npz(path)
    assert loaded["layers"]["0"]["kernel"].dtype == np.float32
    assert loaded["count"].dtype == np.int32
    served = load_npz_tree(path)
    assert jax.tree.structure(served) == jax.tree.structure(loaded)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    model = MLP(64, (4,), 10, rngs=nnx.Rngs(0))
    graphdef, model_params = split_model(model)
    models.save_params_npz(path, model_params)
    merge_model(graphdef, models.load_params_npz(path))


def test_params_npz_refuses_bad_input(tmp_path):
    path = tmp_path / "p.npz"
    with pytest.raises(ValueError, match="non-empty dict"):
        models.save_params_npz(path, {})
    with pytest.raises(ValueError, match="bad parameter key 'a/b'"):
        models.save_params_npz(path, {"a/b": np.ones(1)})
    with pytest.raises(ValueError, match="not numeric"):
        models.save_params_npz(path, {"a": np.array(["x"])})
    with pytest.raises(ValueError, match="bad parameter key '__hpsjax_params__'"):
        models.save_params_npz(path, {"__hpsjax_params__": np.ones(1)})
    with pytest.raises(FileNotFoundError):
        models.load_params_npz(tmp_path / "missing.npz")
    np.savez(path, **{"a": np.ones(1), "a/b": np.ones(1)})
    with pytest.raises(ValueError, match="clashes"):
        models.load_params_npz(path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"not a readable \.npz archive") as e:
        models.load_params_npz(tmp_path / "bad.npz")
    # Named as what it is, not as numpy's guess (a pickle).
    assert "not a zip file" in str(e.value) and "pickle" not in str(e.value)
