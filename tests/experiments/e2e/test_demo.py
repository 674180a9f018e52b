"""DeMo: the chunked DCT, the worker's push and the server's signed step."""

import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.transforms import (
    _demo,
    block_dct,
    block_idct,
    demo,
    demo_chunk,
    demo_nbytes,
    demo_outer,
    sparse_encoded,
    sparse_push_transform,
)


def test_module_doctests():
    assert doctest.testmod(_demo).failed == 0


def test_chunk_is_the_largest_divisor_not_above_the_target():
    assert [demo_chunk(n, 64) for n in (1, 64, 128, 96, 100, 97)] == [
        1,
        64,
        64,
        48,
        50,
        1,
    ]
    assert demo_chunk(10, 100) == 10


def test_block_dct_matches_the_dct_ii_formula_and_inverts():
    x = np.arange(1.0, 5.0, dtype=np.float32)  # one chunk of 4
    n = 4
    expected = [
        (math.sqrt(1 / n) if k == 0 else math.sqrt(2 / n))
        * sum(x[i] * math.cos(math.pi * (2 * i + 1) * k / (2 * n)) for i in range(n))
        for k in range(n)
    ]
    np.testing.assert_allclose(block_dct(jnp.asarray(x), 4), expected, rtol=1e-5)
    rng = np.random.default_rng(0)
    for shape in [(6,), (4, 6), (2, 3, 8), ()]:
        y = jnp.asarray(rng.normal(size=shape), jnp.float32)
        np.testing.assert_allclose(block_idct(block_dct(y, 2), 2), y, atol=1e-5)
    # Orthonormal: energy is kept.
    y = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
    assert float(jnp.sum(block_dct(y, 4) ** 2)) == pytest.approx(
        float(jnp.sum(y**2)), rel=1e-5
    )


def test_a_matrix_is_chunked_in_two_dimensions():
    # A constant 2x2 chunk has one nonzero coefficient: its mean times 2.
    x = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    np.testing.assert_allclose(
        block_dct(x, 2), [[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], atol=1e-6
    )


def test_two_steps_computed_by_hand():
    # Chunks [3, 1] and [1, 4]: DCT (a+b, a-b)/sqrt2, keep the larger.
    opt = demo(decay=0.5, topk=1, chunk=2)
    state = opt.init(jnp.zeros(4))
    q, state = opt.update(jnp.array([3.0, 1.0, 1.0, 4.0]), state)
    r2 = math.sqrt(2)
    np.testing.assert_allclose(q, [4 / r2, 0, 5 / r2, 0], rtol=1e-5)
    # Sent: (2, 2) and (2.5, 2.5); left in the momentum: the differences.
    np.testing.assert_allclose(state.momentum, [1, -1, -1.5, 1.5], atol=1e-5)
    q, state = opt.update(jnp.zeros(4), state)
    # Momentum decayed to (0.5, -0.5, -0.75, 0.75): only the a-b coefficients.
    np.testing.assert_allclose(q, [0, 1 / r2, 0, -1.5 / r2], atol=1e-5)
    np.testing.assert_allclose(state.momentum, np.zeros(4), atol=1e-6)


def test_the_push_keeps_topk_per_chunk_and_what_is_sent_leaves_the_momentum():
    rng = np.random.default_rng(1)
    g = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}
    opt = demo(decay=0.9, topk=3, chunk=4)
    q, state = opt.update(g, opt.init(g))
    blocks = np.asarray(q["w"]).reshape(2, 4, 4, 4).transpose(0, 2, 1, 3)
    assert (np.count_nonzero(blocks.reshape(2, 4, 16), axis=-1) == 3).all()
    np.testing.assert_allclose(
        block_idct(q["w"], 4) + state.momentum["w"], g["w"], atol=1e-5
    )
    # On the wire: 3 coefficients a chunk, as demo_nbytes counts.
    (encoded,) = sparse_encoded(q)
    assert encoded.indices.nbytes + encoded.values.nbytes == demo_nbytes(
        g, topk=3, chunk=4
    )


def test_the_server_step_decodes_and_signs():
    q = block_dct(jnp.array([[0.5, -2.0], [3.0, 0.0]]), 2)
    step, _ = demo_outer(0.1, chunk=2).update(q, demo_outer(0.1, chunk=2).init(q))
    np.testing.assert_allclose(step, [[-0.1, 0.1], [-0.1, 0.0]], atol=1e-6)
    plain = demo_outer(0.1, chunk=2, sign=False)
    step, _ = plain.update(q, plain.init(q))
    np.testing.assert_allclose(step, [[-0.05, 0.2], [-0.3, 0.0]], atol=1e-6)


def test_four_workers_train_a_least_squares_model():
    rng = np.random.default_rng(2)
    true = rng.normal(size=(16, 4)).astype(np.float32)
    xs = [rng.normal(size=(64, 16)).astype(np.float32) for _ in range(4)]
    ys = [x @ true for x in xs]

    def loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    grad = jax.jit(jax.grad(loss))
    w = jnp.zeros((16, 4))
    workers = [demo(decay=0.9, topk=4, chunk=4) for _ in range(4)]
    states = [opt.init(w) for opt in workers]
    server = demo_outer(optax.exponential_decay(0.05, 50, 0.5), chunk=4)
    server_state = server.init(w)
    start = float(sum(loss(w, x, y) for x, y in zip(xs, ys, strict=True)))
    for _ in range(300):
        pushes = []
        for i, opt in enumerate(workers):
            q, states[i] = opt.update(grad(w, xs[i], ys[i]), states[i])
            pushes.append(q)
        step, server_state = server.update(sum(pushes) / 4, server_state)
        w = optax.apply_updates(w, step)
    end = float(sum(loss(w, x, y) for x, y in zip(xs, ys, strict=True)))
    assert end < start / 50, (start, end)


def test_a_spec_names_demo():
    tx = sparse_push_transform('{"name": "demo", "topk": 2, "chunk": 8}')
    q, _ = tx.update(jnp.ones(16), tx.init(jnp.ones(16)))
    # A constant chunk has one coefficient (the others round to about 1e-8).
    assert int(jnp.sum(jnp.abs(q) > 1e-6)) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": 1.0}, r"decay must be in \[0, 1\), got 1.0"),
        ({"decay": -0.1}, "decay must be >= 0.0"),
        ({"topk": 0}, "topk must be an int >= 1, got 0"),
        ({"chunk": 2.5}, "chunk must be an int >= 1, got 2.5"),
    ],
)
def test_bad_hyperparameters_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        demo(**kwargs)
    assert "\n" not in str(err.value)


def test_bad_server_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="learning_rate must be a finite number > 0"):
        demo_outer(0.0)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        demo_outer(0.1, chunk=0)
    with pytest.raises(ValueError, match="bad arguments for push transform 'demo'"):
        sparse_push_transform('{"name": "demo", "k": 2}')


# ---------------------------------------------------------------------------
# DeMo as a scheme: the optimizer's name, the config, the simulator's bytes,
# the real worker's pushes.
# ---------------------------------------------------------------------------


def test_the_server_optimizer_is_named_demo_outer():
    from hpsjax._optimizers import make_optimizer

    q = block_dct(jnp.array([[0.5, -2.0], [3.0, 0.0]]), 2)
    ours = make_optimizer("demo_outer", 0.1, momentum=0.9, chunk=2)
    step, _ = ours.update(q, ours.init(q))
    np.testing.assert_allclose(step, [[-0.1, 0.1], [-0.1, 0.0]], atol=1e-6)


def _quick(**changes):
    from experiments import registry

    config = registry.load_config("demo", "quick")
    for key, value in changes.items():
        section, name = key.split(".")
        config[section][name] = value
    registry.check_config(config)
    return config


@pytest.mark.slow
def test_the_demo_config_trains_in_the_simulator_and_counts_demo_nbytes(tmp_path):
    from experiments import build, train

    config = _quick()
    assert (config.server.policy, config.worker.local_steps) == ("bsp", 1)
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    params = build.setup(config).params
    per_push = demo_nbytes(params, topk=32, chunk=64)
    dense = sum(np.asarray(p).nbytes for p in jax.tree.leaves(params))
    assert per_push < dense / 10
    assert summary["pushes"] > 0
    # Every push is demo_nbytes of coefficients and indices.
    assert summary["bytes_sent"] == per_push * summary["pushes"]
    assert summary["final_loss"] < 2.0


def test_a_real_worker_gets_the_simulators_demo_push():
    import json

    from experiments import backends, build

    config = _quick()
    flags = backends._worker_flags(config, 1, plan_file=None)
    spec = flags[flags.index("--push_transform") + 1]
    assert json.loads(spec) == {"name": "demo", "decay": 0.999, "topk": 32,
                                "chunk": 64}  # fmt: skip
    params = build.setup(config).params
    sim_tx, _, nbytes = backends._push_compression(config, params)
    g = jax.tree.map(jnp.ones_like, params)
    ours, _ = sparse_push_transform(spec).update(g, sparse_push_transform(spec).init(g))
    theirs, _ = sim_tx.update(g, sim_tx.init(g))
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(a, b)
    assert nbytes == demo_nbytes(params, topk=32, chunk=64)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"worker.demo_topk": 0}, r"^worker\.demo_topk must be an int >= 1"),
        ({"worker.demo_decay": 1.0}, r"^worker\.demo_decay must be"),
        ({"worker.demo_chunk": 32}, r"needs server\.optimizer='demo_outer' with"),
        ({"server.optimizer": "sgd"}, r"needs server\.optimizer='demo_outer' with"),
    ],
)
def test_demo_config_errors_are_one_line(change, message):
    with pytest.raises(ValueError, match=message) as err:
        _quick(**change)
    assert "\n" not in str(err.value)


def test_a_workers_bad_demo_push_transform_is_one_line():
    from hpsjax.worker import WorkerConfig

    with pytest.raises(ValueError, match=r"^topk must be an int >= 1, got 0") as err:
        WorkerConfig(push_transform='{"name": "demo", "topk": 0}')
    assert "\n" not in str(err.value)


def test_a_real_worker_pushes_demo_coefficients_to_a_server():
    """An asyncio server and worker on loopback: each push carries the top
    coefficients a chunk (demo_nbytes) and the server takes signed steps."""
    import asyncio

    from hpsjax import data
    from hpsjax._optimizers import make_optimizer
    from hpsjax.net import Server
    from hpsjax.worker import Worker, WorkerConfig

    train_set = data.synthetic_digits(256, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "bias": np.zeros(10, np.float32),
        "kernel": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
    }
    per_push = demo_nbytes(params, topk=8, chunk=16)  # 4 chunks of the kernel

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        logits = x @ p["kernel"] + p["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)

    records = []

    async def main():
        server = Server(
            params, make_optimizer("demo_outer", 0.01, chunk=16), "asp",
            port=0, secret="s" * 32,
        )  # fmt: skip
        await server.start()
        try:
            config = WorkerConfig(
                port=server.port, worker_id="w0", secret="s" * 32, batch_size=16,
                overlap="none", max_steps=4,
                push_transform='{"name": "demo", "topk": 8, "chunk": 16}',
            )  # fmt: skip
            worker = Worker(
                config,
                loss_fn=loss_fn,
                batches=train_set.batches(16, seed=0).next,
                metrics=records.append,
            )
            summary = await worker.run()
            return summary, server.version, server.params
        finally:
            await server.close()

    summary, version, final = asyncio.run(asyncio.wait_for(main(), 120))
    assert summary.pushes == 4 and version == 4
    rounds = [r for r in records if r.get("event") == "round"]
    dense = sum(x.nbytes for x in params.values())
    for r in rounds:  # a push (and a small pull request), far below dense
        assert per_push <= r["bytes_sent"] < per_push + 200 < dense / 5
    # Four signed steps of 0.01: every entry moved a whole number of them.
    moved = (np.asarray(final["kernel"]) - params["kernel"]) / 0.01
    np.testing.assert_allclose(moved, np.round(moved), atol=1e-3)
    assert np.abs(moved).max() <= 4 + 1e-3 and np.abs(moved).max() >= 1 - 1e-3
