"""The newer asynchronous and low-communication methods: Ringmaster ASGD (a
policy), OrMo and SparseLoCo (transforms), Clipped ASGD and MuLoCo (configs),
on the server core and in the simulator."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import build, registry, train
from hpsjax.decisions._core import ForcePull, PushAck, ServerCore
from hpsjax.decisions._policies import Ringmaster, SaPS, get_policy
from hpsjax.transforms import (
    centroid_quantize,
    last_sparseloco_nbytes,
    ordered_momentum,
    sparseloco,
    sparseloco_nbytes,
)


def upd(x):
    return {"w": np.full(2, x, np.float32)}


def make(policy, optimizer=None):
    return ServerCore(
        {"w": jnp.zeros(2, jnp.float32)}, optimizer or optax.sgd(1.0), policy
    )


def script(core):
    """Fast a and b push twice each while slow c computes on version 0; then c
    pushes at staleness 4, pulls, and pushes again at staleness 0."""
    for w in "abc":
        core.join(w, 0.0)
    fast = []
    for t, w in [(1.0, "a"), (1.1, "b"), (2.0, "a"), (2.1, "b")]:
        fast += core.push(w, upd(1.0), version=core.pulled_version(w), now=t)
        core.pull(w, t)
    slow = core.push("c", upd(1.0), version=0, now=5.0)
    return fast, slow


# ---------------------------------------------------------------------------
# Ringmaster ASGD.
# ---------------------------------------------------------------------------


def test_ringmaster_ignores_pushes_delayed_r_or_more_and_forces_a_pull():
    core = make(Ringmaster(delay_threshold=4))
    fast, slow = script(core)
    assert [a.staleness for a in fast if isinstance(a, PushAck)] == [0, 1, 1, 1]
    assert all(a.status == "applied" for a in fast if isinstance(a, PushAck))
    ack = slow[0]
    assert (ack.staleness, ack.status, ack.weight) == (4, "dropped", 0.0)
    assert ack.force_pull
    assert ForcePull("c", "ringmaster: delay 4 >= R = 4, ignored") in slow
    assert core.version == 4 and np.asarray(core.params["w"]).tolist() == [-4, -4]
    # After its forced pull the worker's fresh gradient is applied.
    core.pull("c", 5.0)
    again = core.push("c", upd(1.0), version=4, now=6.0)
    assert again[0].status == "applied" and core.version == 5


def test_ringmaster_keeps_delays_below_r():
    core = make(Ringmaster(delay_threshold=5))
    _, slow = script(core)
    assert (slow[0].staleness, slow[0].status) == (4, "applied")
    assert not any(isinstance(a, ForcePull) for a in slow)


def test_ringmaster_default_r_is_the_number_of_live_workers():
    core = make("ringmaster")
    for w in "abc":
        core.join(w, 0.0)
    assert core.policy.current_threshold(core) == 3
    # It drops what SaPS(threshold=R - 1, drop) drops.
    for tau in range(7):
        ring = core.policy.judge(core, "a", tau)
        saps = SaPS(threshold=2, on_straggler="drop").judge(core, "a", tau)
        assert ring.weight == saps.weight and ring.force_pull == saps.force_pull


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3"])
def test_ringmaster_bad_threshold_is_one_line(bad):
    with pytest.raises(ValueError) as err:
        get_policy("ringmaster", delay_threshold=bad)
    assert "delay_threshold" in str(err.value) and "\n" not in str(err.value)


def _quick(scheme, **changes):
    config = registry.load_config(scheme, "quick")
    for key, value in changes.items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    registry.check_config(config)
    return config


def test_ringmaster_in_the_simulator_drops_exactly_the_late_gradients(tmp_path):
    config = _quick("ringmaster", **{"server.policy_kwargs.delay_threshold": 2})
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    info = summary["info"]
    late = sum(n for tau, n in info["staleness_histogram"].items() if int(tau) >= 2)
    # Every gradient delayed 2 or more is ignored, every other one applied (one
    # may still be in flight when the run ends).
    assert late > 0
    assert info["num_gradients"] - info["num_updates"] in (late, late + 1)
    assert summary["final_loss"] < 0.8 * 2.3  # it trains (ln 10 at the start)


# ---------------------------------------------------------------------------
# OrMo.
# ---------------------------------------------------------------------------


def _run(tx, grads, staleness):
    state = tx.init(grads[0])
    out = []
    for g, tau in zip(grads, staleness, strict=True):
        u, state = tx.update(g, state, staleness=tau)
        out.append(np.asarray(u))
    return out, state


GRADS = [jnp.array([1.0, -2.0]) * (k + 1) for k in range(6)]


def test_ormo_on_fresh_gradients_is_heavy_ball_momentum():
    ours, _ = _run(ordered_momentum(0.1, momentum=0.8), GRADS, [0] * 6)
    heavy = optax.sgd(0.1, momentum=0.8)
    state = heavy.init(GRADS[0])
    for g, mine in zip(GRADS, ours, strict=True):
        u, state = heavy.update(g, state)
        np.testing.assert_allclose(mine, u, rtol=1e-6)


def test_ormo_without_momentum_is_sgd_whatever_the_delay():
    ours, _ = _run(ordered_momentum(0.1, momentum=0.0), GRADS, [0, 3, 1, 7, 0, 2])
    for g, mine in zip(GRADS, ours, strict=True):
        np.testing.assert_allclose(mine, -0.1 * np.asarray(g), rtol=1e-6)


@pytest.mark.parametrize("tau", [0, 1, 4])
def test_ormo_every_gradient_weighs_lr_over_one_minus_beta_whatever_its_delay(tau):
    # One gradient of delay tau, then fresh zero gradients: the parameters move
    # by lr * g / (1 - beta) in all, as the gradient would have on time.
    lr, beta, g = 0.1, 0.75, jnp.array([2.0, -1.0])
    grads = [g] + [jnp.zeros(2)] * 80
    out, _ = _run(ordered_momentum(lr, momentum=beta), grads, [tau] + [0] * 80)
    np.testing.assert_allclose(sum(out), -lr * g / (1 - beta), rtol=1e-5)
    # What is applied at once is what it would have moved the parameters by in
    # the tau + 1 iterations since it was computed.
    np.testing.assert_allclose(
        out[0], -lr * g * sum(beta**i for i in range(tau + 1)), rtol=1e-6
    )


def test_ormo_takes_the_staleness_from_the_server_core():
    core = make("asp", ordered_momentum(1.0, momentum=0.5))
    _, slow = script(core)  # four fresh-ish pushes, then one 4 versions late
    assert slow[0].staleness == 4 and slow[0].status == "applied"
    u = 0.0
    w = 0.0
    for tau in (0, 1, 1, 1, 4):
        u = 0.5 * u + 0.5**tau
        w -= u + (1 - 0.5**tau) / 0.5
    np.testing.assert_allclose(np.asarray(core.params["w"]), [w, w], rtol=1e-6)


def test_ormo_needs_the_staleness_and_a_valid_momentum():
    tx = ordered_momentum(0.1)
    with pytest.raises(ValueError, match="staleness"):
        tx.update(GRADS[0], tx.init(GRADS[0]))
    for bad in (1.0, -0.1, True):
        with pytest.raises(ValueError, match="momentum"):
            ordered_momentum(0.1, momentum=bad)
    with pytest.raises(ValueError, match="learning_rate"):
        ordered_momentum(0.0)
    with pytest.raises(ValueError, match="gradients_per_iteration"):
        ordered_momentum(0.1, gradients_per_iteration=0)
    with pytest.raises(ValueError, match="delay_adaptive"):
        ordered_momentum(0.1, delay_adaptive=0.0)


def test_ormo_iterations_of_k_gradients_by_hand():
    # K = 2, beta = 0.5, eta = 1, gradients of 1. Iteration 0 takes versions
    # 0 and 1; the third gradient, computed at version 0, arrives at version
    # 2 (iteration 1): it opens iteration 1 (u = 0.5 * 2, applied), then is
    # applied for iterations 0 and 1 (1 + 0.5) and joins u at weight 0.5.
    tx = ordered_momentum(1.0, momentum=0.5, gradients_per_iteration=2)
    state = tx.init(jnp.zeros(1))
    steps = []
    for staleness in (0, 1, 2):
        step, state = tx.update(jnp.ones(1), state, staleness=staleness)
        steps.append(float(step[0]))
    assert steps == [-1.0, -1.0, -2.5]
    assert float(state.momentum[0]) == 1.5
    # Sequential momentum with iteration 0's three gradients: moved by
    # G0 + beta G0 = 4.5 so far, beta G0 = 1.5 to carry.
    assert -sum(steps) == 4.5


def test_ormo_da_shrinks_the_step_of_a_late_gradient():
    # D = 1: a gradient 3 iterations late weighs 1/3: catch-up
    # (1 - 0.5^4) / 0.5 / 3 = 0.625, momentum 0.5^3 / 3.
    tx = ordered_momentum(1.0, momentum=0.5, delay_adaptive=1.0)
    step, state = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)), staleness=3)
    np.testing.assert_allclose(step, [-0.625], rtol=1e-6)
    np.testing.assert_allclose(state.momentum, [0.125 / 3], rtol=1e-6)
    fresh, _ = tx.update(jnp.ones(1), tx.init(jnp.zeros(1)), staleness=1)
    plain, _ = ordered_momentum(1.0, momentum=0.5).update(
        jnp.ones(1), tx.init(jnp.zeros(1)), staleness=1
    )
    np.testing.assert_allclose(fresh, plain)  # a delay within D: untouched


@pytest.mark.parametrize("delay_adaptive", [None, 1.0])
def test_ormo_converges_under_round_robin_delays(delay_adaptive):
    # Four workers on 0.5 ||x - c||^2 push in turn, each gradient computed on
    # the parameters of its previous push (staleness 3), K = 4.
    c = jnp.arange(1.0, 6.0)
    tx = ordered_momentum(
        0.05, momentum=0.9, gradients_per_iteration=4, delay_adaptive=delay_adaptive
    )
    update = jax.jit(tx.update)
    x, state = jnp.zeros(5), tx.init(jnp.zeros(5))
    pulled = [(x, 0)] * 4
    for version in range(400):
        w = version % 4
        at, v = pulled[w]
        step, state = update(at - c, state, staleness=version - v)
        x = x + step
        pulled[w] = (x, version + 1)
    assert float(jnp.linalg.norm(x - c)) < 0.01 * float(jnp.linalg.norm(c))


# ---------------------------------------------------------------------------
# SparseLoCo.
# ---------------------------------------------------------------------------


def _deltas(n, shape=(40, 25)):
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    return [{"w": jax.random.normal(k, shape), "b": jnp.ones(5)} for k in keys]


def test_sparseloco_one_push_by_hand():
    # Two chunks of 4 entries, k = ceil(2/16 * 4**2) = 2 per chunk: 4 and -4,
    # 2 and -2 are kept. Their mean is 0, sigma = sqrt(40/3) = 3.651, the bin
    # width 6 sigma / 4 = 5.477: 4 -> bin 3, -4 -> bin 1, 2 and -2 -> bin 2,
    # whose centroid is 0.
    push = sparseloco(2 / 16, bits=2, decay=0.5, chunk=4)
    delta = jnp.array([4, -1, 0.5, -4, 0.1, 2, -2, 0.2])
    sent, state = push.update(delta, push.init(delta))
    np.testing.assert_allclose(sent, [4, 0, 0, -4, 0, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(state.error, [0, -1, 0.5, 0, 0.1, 2, -2, 0.2])
    # Next push of nothing: e = 0.5 e sends -0.5, 0.25 | 1, -1; mean -0.0625,
    # sigma 0.875, width 1.3125: -0.5 and 0.25 share bin 2 (centroid
    # -0.0625, decoded -0.125), 1 -> bin 3, -1 -> bin 1.
    sent, state = push.update(jnp.zeros(8), state)
    np.testing.assert_allclose(sent, [0, -0.125, -0.125, 0, 0, 1, -1, 0], atol=1e-6)
    np.testing.assert_allclose(
        state.error, [0, -0.375, 0.375, 0, 0.05, 0, 0, 0.1], atol=1e-6
    )
    assert int(state.count) == 2


def test_sparseloco_takes_top_k_per_chunk_not_per_leaf():
    # A (4, 4) leaf in 2 x 2 chunks, one entry kept per chunk: the large
    # entries all in the first chunk cannot crowd the other chunks out.
    w = jnp.array([[9.0, 8, 0.1, 0.2], [7, 6, 0.3, 0.4], [1, 2, 3, 4], [5, 6, 7, 8]])
    push = sparseloco(1 / 4, bits=32, decay=0.0, chunk=2)
    sent, _ = push.update(w, push.init(w))
    kept = np.argwhere(np.asarray(sent) != 0).tolist()
    assert kept == [[0, 0], [1, 3], [3, 1], [3, 3]]
    np.testing.assert_allclose(np.asarray(sent)[np.asarray(sent) != 0], [9, 0.4, 6, 8])


def test_centroid_quantize_uses_four_bins_and_their_means():
    values = jnp.array([-3.0, -2.9, -0.1, 0.0, 0.1, 1.0, 1.1, 3.0, 3.1, 9.0])
    decoded = np.asarray(centroid_quantize(values, bits=2))
    assert len(set(decoded.round(6).tolist())) <= 4
    # Each value is decoded to the mean of its bin: the bins keep the sum.
    np.testing.assert_allclose(decoded.sum(), float(values.sum()), rtol=1e-5)
    assert decoded[0] == decoded[1] and decoded[-1] > decoded[5]
    with pytest.raises(ValueError, match="bits"):
        centroid_quantize(values, bits=0)


def test_sparseloco_loses_nothing_without_decay():
    pushes = _deltas(6)
    tx = sparseloco(0.02, bits=2, decay=1.0)
    state = tx.init(pushes[0])
    total_sent = jax.tree.map(jnp.zeros_like, pushes[0])
    for delta in pushes:
        sent, state = tx.update(delta, state)
        # w (40, 25): chunks of 40 x 25 (divisors <= 64), ceil(0.02 * 4096) = 82
        # kept of its 1000; b (5,): one chunk of 5, sent whole.
        assert int(jnp.count_nonzero(sent["w"])) <= 82
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    for key in ("w", "b"):  # decay 1: sent plus left is every pseudo-gradient
        expected = sum(np.asarray(d[key]) for d in pushes)
        got = np.asarray(total_sent[key]) + np.asarray(state.error[key])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_sparseloco_bytes():
    params = {"w": np.zeros((128, 64), np.float32), "b": np.zeros(64, np.float32)}
    # w: 2 chunks x 64 values: 12-bit indices (192 B), 2-bit codes (32 B), a
    # mean and 4 centroids (20 B); b: one chunk sent whole, 96 + 16 + 20.
    assert sparseloco_nbytes(params, 1 / 64, bits=2) == 244 + 132
    assert sparseloco_nbytes(params, 1 / 64, bits=32) == (192 + 512) + (96 + 256)
    tx = sparseloco(1 / 64, bits=2)
    state = optax.chain(tx, optax.sgd(1.0)).init(params)
    assert last_sparseloco_nbytes(state) == sparseloco_nbytes(params, 1 / 64, 2)
    with pytest.raises(ValueError, match="sparseloco"):
        last_sparseloco_nbytes(optax.sgd(1.0).init(params))
    for kwargs, match in [({"bits": 3}, "bits"), ({"decay": 1.5}, "decay"),
                          ({"ratio": 0.0}, "ratio"), ({"chunk": 0}, "chunk"),
                          ({"range_in_sigmas": 0}, "range")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            sparseloco(**{"ratio": 0.1, **kwargs})


def test_sparseloco_with_an_outer_step_converges_on_a_quadratic():
    # Four workers whose pseudo-gradient is a small step towards c plus noise
    # of their own: SparseLoCo's pushes at 3% density, averaged, reach c.
    c = jax.random.normal(jax.random.PRNGKey(0), (64, 64))
    x = jnp.zeros((64, 64))
    push = sparseloco(1 / 32, bits=2, decay=0.95)
    update = jax.jit(push.update)
    states = [push.init(x) for _ in range(4)]
    noise = jax.random.normal(jax.random.PRNGKey(1), (100, 4, 64, 64))
    start = float(jnp.linalg.norm(x - c))
    for t in range(100):
        sent = []
        for i in range(4):
            s, states[i] = update(0.05 * (x - c) + 0.01 * noise[t, i], states[i])
            sent.append(s)
        x = x - 1.0 * sum(sent) / 4  # the outer step, alpha = 1
    assert float(jnp.linalg.norm(x - c)) < 0.05 * start


def test_sparseloco_in_the_simulator_counts_its_bytes_and_trains(tmp_path):
    config = _quick("sparseloco")
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    setup = build.setup(config)
    per_push = sparseloco_nbytes(setup.params, config.worker.compress_ratio, 2)
    dense = sum(np.asarray(p).nbytes for p in jax.tree.leaves(setup.params))
    assert per_push < 0.1 * dense
    assert summary["pushes"] > 0
    # Every push carries per_push bytes of payload (plus its frame's header).
    assert per_push * summary["pushes"] <= summary["bytes_sent"]
    assert summary["bytes_sent"] < 0.2 * dense * summary["pushes"]
    assert summary["final_loss"] < 2.3


@pytest.mark.parametrize("scheme", ["sparseloco", "streaming_diloco"])
def test_sparse_pushes_reach_the_workers_flags(scheme):
    import json

    from experiments import backends
    from hpsjax.transforms import sparse_push_transform

    config = _quick(scheme)
    flags = backends._worker_flags(config, 1, plan_file=None)
    spec = flags[flags.index("--push_transform") + 1]
    if scheme == "streaming_diloco":  # SparseLoCo's push draws nothing
        assert json.loads(spec)["seed"] == int(config.seed) * 1000 + 1
    params = build.setup(config).params
    tx = sparse_push_transform(spec)
    sim_tx, _, _ = backends._push_compression(config, params)
    # The same transform as the simulator's, the worker's own seed aside.
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(
        sim_tx.init(params)
    )


def test_a_sparse_push_goes_out_as_its_nonzero_entries():
    from hpsjax.transforms import sparse_encoded, sparseloco, topk_decode

    params = {"w": jnp.linspace(-1.0, 1.0, 300).reshape(30, 10), "b": jnp.ones(3)}
    tx = sparseloco(0.05, bits=2)
    sent, _ = tx.update(params, tx.init(params))
    encoded = sparse_encoded(sent)
    for enc, leaf in zip(encoded, jax.tree.leaves(sent), strict=True):
        assert enc.indices.size == np.count_nonzero(np.asarray(leaf))
        np.testing.assert_array_equal(
            topk_decode(enc, leaf.shape, leaf.dtype), np.asarray(leaf)
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"push_transform": "{"}, r"^a push transform is a JSON object"),
        ({"push_transform": '{"name": "top"}'}, r"^unknown push transform 'top'"),
        (
            {"push_transform": '{"name": "sparseloco", "ratio": 2}'},
            r"^ratio must be",
        ),
        (
            {"push_transform": '{"name": "sparseloco"}', "bits": 4},
            r"^give push_transform or bits",
        ),
    ],
)
def test_a_workers_bad_push_transform_is_one_line(kwargs, message):
    from hpsjax.worker import WorkerConfig

    with pytest.raises(ValueError, match=message) as err:
        WorkerConfig(**kwargs)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------
# Clipped ASGD and MuLoCo (configs).
# ---------------------------------------------------------------------------


def test_clipped_asgd_clips_each_push_on_the_server():
    config = _quick("clipped_asgd", **{"server.clip_norm": 0.5})
    tx = build.server_optimizer(config)
    params = {"w": jnp.zeros(3)}
    big = {"w": jnp.array([3.0, 4.0, 0.0])}  # norm 5
    u, _ = tx.update(big, tx.init(params), params)
    np.testing.assert_allclose(
        u["w"], -config.server.learning_rate * 0.1 * big["w"], rtol=1e-6
    )
    config.server.clip_norm = -1.0
    with pytest.raises(ValueError, match=r"server\.clip_norm must be a number > 0"):
        build.server_optimizer(config)


def test_muloco_runs_muon_inside_diloco():
    config = _quick("muloco")
    inner = build.local_optimizer(config)
    params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
    muon = optax.contrib.muon(config.worker.local_learning_rate)
    assert jax.tree.structure(inner.init(params)) == jax.tree.structure(
        muon.init(params)
    )
    u, _ = inner.update(params, inner.init(params), params)
    expected, _ = muon.update(params, muon.init(params), params)
    np.testing.assert_allclose(u["w"], expected["w"], rtol=1e-6)
    assert config.server.optimizer == "nesterov" and config.worker.bits == 4


def test_mulocos_ablations_change_only_the_pushes_or_the_inner_optimizer():
    def fields(config):
        out = config.to_dict()
        out.pop("scheme")
        return out

    diloco, muloco = _quick("diloco"), _quick("muloco")
    ef4, f32 = _quick("diloco_ef4"), _quick("muloco_f32")
    assert (ef4.worker.bits, ef4.worker.error_feedback) == (4, True)
    assert (muloco.worker.bits, muloco.worker.error_feedback) == (4, True)
    assert f32.worker.bits is None and diloco.worker.bits is None
    ef4.worker.bits = None
    assert fields(ef4) == fields(diloco)
    f32.worker.bits = 4
    assert fields(f32) == fields(muloco)


def test_ormo_configs_take_k_as_the_workers_and_ormo_da_its_delay_rule():
    ormo, da = _quick("ormo"), _quick("ormo_da")
    n = len(ormo.workers.slowdowns)
    assert ormo.server.optimizer_args == {"gradients_per_iteration": n}
    assert da.server.optimizer_args == {
        "gradients_per_iteration": n,
        "delay_adaptive": 1.0,
    }
    tx = build.server_optimizer(da)
    state = tx.init({"w": jnp.zeros(2)})
    # A gradient 2 iterations late (2n versions) weighs 1/2.
    step, _ = tx.update({"w": jnp.ones(2)}, state, staleness=2 * n)
    lr = da.server.learning_rate
    beta = da.server.momentum
    expected = -lr * 0.5 * (1 - beta**3) / (1 - beta)
    np.testing.assert_allclose(step["w"], [expected] * 2, rtol=1e-5)


def test_sparseloco_config_runs_templars_chunks_and_bits():
    config = _quick("sparseloco")
    assert config.worker.compress_ratio == 1 / 64
    assert config.worker.sparseloco_chunk == 64
    config.worker.sparseloco_bits = 16
    with pytest.raises(ValueError, match="sparseloco_bits"):
        registry.check_config(config)
    config.worker.sparseloco_bits = 32
    registry.check_config(config)


def test_sparseloco_chunk_reaches_the_simulator_and_the_workers_flags():
    import json

    from experiments import worker_flags

    config = _quick("sparseloco")
    config.worker.sparseloco_chunk = 8
    params = build.setup(config).params
    _, _, nbytes = worker_flags._make_push_compression(config, params)
    assert nbytes == sparseloco_nbytes(params, 1 / 64, 2, chunk=8)
    assert nbytes != sparseloco_nbytes(params, 1 / 64, 2)
    spec = json.loads(worker_flags._push_transform_spec(config, 0))
    assert spec == {
        "name": "sparseloco", "ratio": 1 / 64, "bits": 2, "decay": 0.95, "chunk": 8,
    }  # fmt: skip


# ---------------------------------------------------------------------------
# Streaming DiLoCo (transforms).
# ---------------------------------------------------------------------------


def _tree3():
    return {
        "b": jnp.linspace(-1.0, 1.0, 8),
        "v": jnp.linspace(0.5, -0.5, 32).reshape(8, 4),
        "w": jnp.linspace(-2.0, 2.0, 64).reshape(8, 8),
    }


def _fragment_of(tree, fragments):
    """Per leaf, the fragment of each element (from fragment_bounds)."""
    from hpsjax.transforms import fragment_bounds

    bounds = np.asarray(fragment_bounds(tree, fragments))
    out, offset = [], 0
    for leaf in jax.tree.leaves(tree):
        flat = offset + np.arange(np.size(leaf))
        out.append(
            (np.searchsorted(bounds, flat, side="right") - 1).reshape(np.shape(leaf))
        )
        offset += np.size(leaf)
    return out


def test_fragments_are_equal_chunks_of_the_flat_parameters_from_shapes_only():
    from hpsjax.transforms import fragment_bounds, streaming_fragment_nbytes

    tree = _tree3()  # b (8), v (32), w (64)
    assert fragment_bounds(tree, 1) == (0, 104)
    assert fragment_bounds(tree, 2) == (0, 52, 104)
    assert fragment_bounds(tree, 3) == (0, 34, 69, 104)
    zeros = jax.tree.map(jnp.zeros_like, tree)
    assert fragment_bounds(zeros, 3) == fragment_bounds(tree, 3)
    # The peak a link carries: the largest fragment; 4-bit codes, one scale a
    # leaf reached: b (8) + v (32) + 12 of w | 52 of w.
    assert streaming_fragment_nbytes(tree, 2, bits=4) == (
        4 + 4 + 16 + 4 + 6 + 4,
        26 + 4,
    )
    assert streaming_fragment_nbytes(tree, 3, bits=None) == (136, 140, 140)
    with pytest.raises(ValueError, match=r"^fragments \(105\) must not exceed"):
        fragment_bounds(tree, 105)
    with pytest.raises(ValueError, match=r"^fragments must be an int >= 1"):
        fragment_bounds(tree, 0)


def test_streaming_outer_with_one_fragment_is_diloco_outer():
    from hpsjax.transforms import diloco_outer, streaming_outer

    params = _tree3()
    ours, theirs = streaming_outer(0.7, 0.9, fragments=1), diloco_outer(0.7, 0.9)
    s1, s2 = ours.init(params), theirs.init(params)
    for step in range(4):
        g = jax.tree.map(lambda p, step=step: jnp.cos(p + step), params)
        u1, s1 = ours.update(g, s1)
        u2, s2 = theirs.update(g, s2)
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_streaming_outer_steps_only_the_due_fragment_in_turn():
    from hpsjax.transforms import diloco_outer, streaming_outer

    params = _tree3()
    owner = _fragment_of(params, 2)
    outer = streaming_outer(0.5, 0.9, fragments=2)
    state = outer.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    # Each fragment, stepped every other update, follows its own Nesterov.
    ref = diloco_outer(0.5, 0.9)
    ref_state = ref.init(params)
    for c in range(6):
        u, state = outer.update(g, state)
        if c % 2 == 0:
            ref_u, ref_state = ref.update(g, ref_state)
        for leaf, r, frag in zip(
            jax.tree.leaves(u), jax.tree.leaves(ref_u), owner, strict=True
        ):
            due = frag == c % 2
            np.testing.assert_allclose(np.asarray(leaf)[due], r[due], rtol=1e-6)
            assert not np.any(np.asarray(leaf)[~due])


def test_streaming_push_sends_the_due_fragment_quantized():
    from hpsjax.transforms import (
        last_streaming_nbytes,
        streaming_fragment_nbytes,
        streaming_push,
    )

    delta = _tree3()
    owner = _fragment_of(delta, 3)
    push = streaming_push(3, bits=4)
    state = push.init(delta)
    sizes = streaming_fragment_nbytes(delta, 3, bits=4)
    assert last_streaming_nbytes(state) == -(-sum(sizes) // 3)
    for c in range(6):
        sent, state = push.update(delta, state)
        quantized = False
        for leaf, ref, frag in zip(
            jax.tree.leaves(sent), jax.tree.leaves(delta), owner, strict=True
        ):
            leaf, ref, due = np.asarray(leaf), np.asarray(ref), frag == c % 3
            assert not np.any(leaf[~due])
            if due.any():
                # 4 bits: within one step (2 max|x| / 15) of the truth.
                step = 2 * float(np.max(np.abs(ref[due]))) / 15
                np.testing.assert_array_less(np.abs(leaf - ref)[due], step + 1e-6)
                quantized |= bool(np.any(leaf[due] != ref[due]))
        assert quantized
    exact = streaming_push(3, bits=None)
    sent, _ = exact.update(delta, exact.init(delta))
    np.testing.assert_array_equal(sent["b"], delta["b"])  # b is in fragment 0


def test_streaming_push_error_feedback_carries_each_fragments_residual():
    from hpsjax.transforms import streaming_push

    delta = {"a": jnp.full(16, 0.3), "b": jnp.linspace(-1.0, 1.0, 16)}
    push = streaming_push(2, bits=1, error_feedback=True)  # scaled sign
    state = push.init(delta)
    total = jax.tree.map(jnp.zeros_like, delta)
    for _ in range(40):
        sent, state = push.update(delta, state)
        total = jax.tree.map(jnp.add, total, sent)
    # Each fragment was due 20 times: what was sent plus what is held is all.
    for name in ("a", "b"):
        np.testing.assert_allclose(
            total[name] + state.error[name], 20 * delta[name], rtol=1e-5, atol=1e-5
        )


def test_streaming_bad_arguments_are_one_line():
    from hpsjax.transforms import streaming_local, streaming_outer, streaming_push

    with pytest.raises(ValueError, match=r"^bits must be one of"):
        streaming_push(2, bits=3)
    with pytest.raises(ValueError, match=r"^mixing must be in \[0, 1\]"):
        streaming_local(optax.sgd(0.1), mixing=1.5)
    with pytest.raises(ValueError, match=r"^momentum must be in \[0, 1\)"):
        streaming_outer(0.7, momentum=1.0)
    with pytest.raises(ValueError, match=r"^streaming_local needs params"):
        tx = streaming_local(optax.sgd(0.1))
        tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}))


def _loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2)


def _streaming_rounds(inner_steps, fragments, rounds, *, mixing=0.0):
    """Two workers, BSP, rounds of ``inner_steps`` SGD steps each, as a driver
    runs them: every round starts from the pulled parameters, pushes the
    pseudo-gradient (pulled minus local), the server averages and steps."""
    from hpsjax.transforms import streaming_local, streaming_outer, streaming_push

    rng = np.random.default_rng(0)
    x = [jnp.asarray(rng.normal(size=(16, 3)), jnp.float32) for _ in range(2)]
    y = [xi @ jnp.array([1.0, -2.0, 0.5]) + 0.3 for xi in x]
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    local = [streaming_local(optax.sgd(0.05), mixing) for _ in range(2)]
    local_states = [tx.init(params) for tx in local]
    pushes = [streaming_push(fragments, bits=None) for _ in range(2)]
    push_states = [p.init(params) for p in pushes]
    outer = streaming_outer(0.7, 0.9, fragments)
    outer_state = outer.init(params)
    grad = jax.grad(_loss)
    sent_log = []
    for _ in range(rounds):
        deltas = []
        for i in range(2):
            p = params
            for _ in range(inner_steps):
                u, local_states[i] = local[i].update(
                    grad(p, x[i], y[i]), local_states[i], p
                )
                p = optax.apply_updates(p, u)
            delta = jax.tree.map(jnp.subtract, params, p)
            sent, push_states[i] = pushes[i].update(delta, push_states[i])
            deltas.append(sent)
        sent_log.append(deltas)
        mean = jax.tree.map(lambda a, b: (a + b) / 2, *deltas)
        u, outer_state = outer.update(mean, outer_state)
        params = optax.apply_updates(params, u)
    return params, local_states, sent_log, (x, y)


def test_streaming_with_one_fragment_is_diloco_with_one_step_less():
    """P = 1: each round's first step is the merge (the whole global model),
    then H inner steps; DiLoCo takes H steps: the same parameters. (The first
    round starts on the worker's own parameters: no merge, H + 1 steps.)"""
    from hpsjax.transforms import diloco_outer

    ours, _, _, (x, y) = _streaming_rounds(4, 1, 5)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    outer = diloco_outer(0.7, 0.9)
    state = outer.init(params)
    grad = jax.grad(_loss)
    for r in range(5):
        deltas = []
        for i in range(2):
            p = params
            for _ in range(4 if r == 0 else 3):
                p = jax.tree.map(lambda a, g: a - 0.05 * g, p, grad(p, x[i], y[i]))
            deltas.append(jax.tree.map(jnp.subtract, params, p))
        u, state = outer.update(jax.tree.map(lambda a, b: (a + b) / 2, *deltas), state)
        params = optax.apply_updates(params, u)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_streaming_keeps_local_progress_pushes_fragments_in_turn_and_trains():
    """P = 2: a fragment not due keeps the worker's own values across rounds,
    the pushes alternate between the fragments, and the model trains."""
    params, states, sent_log, _ = _streaming_rounds(3, 2, 4)
    for state in states:
        # The worker's own parameters are not the global ones: its last
        # round's steps are kept, not replaced by the pulled parameters.
        assert not np.allclose(state.local["w"], params["w"])
    # 4 elements (b, then w): round 0 pushes b and w[0], round 1 w[1:].
    assert all(not np.any(np.asarray(s["w"])[1:]) for s in sent_log[0])
    assert all(np.all(np.asarray(s["w"])[1:] != 0) for s in sent_log[1])
    assert all(not np.any(np.asarray(s["b"])) for s in sent_log[1])
    final, _, _, (x, y) = _streaming_rounds(3, 2, 30)
    start = {"w": jnp.zeros(3), "b": jnp.zeros(())}
    assert float(_loss(final, x[0], y[0])) < 0.05 * float(_loss(start, x[0], y[0]))


def test_streaming_local_takes_its_own_parameters_up_to_a_drivers_rounding():
    """A driver may round p + u differently (a fused multiply-add): far more
    than 1e-6 of an element near zero. That is still an inner step."""
    from hpsjax.transforms import streaming_local

    tx = streaming_local(optax.sgd(0.1))
    params = {"b": jnp.zeros(3), "w": jnp.ones(3)}
    grads = {"b": jnp.array([1e-4, -1.0, 2.0]), "w": jnp.ones(3)}
    u, state = tx.update(grads, tx.init(params), params)
    rounded = optax.apply_updates(params, u)
    # b[0] = -1e-5 off by 1e-9: 100 times its 1e-6, a rounding of the leaf's
    # largest element (0.2).
    rounded["b"] = rounded["b"].at[0].add(1e-9)
    u2, _ = tx.update(grads, state, rounded)
    np.testing.assert_allclose(u2["b"], -0.1 * grads["b"], rtol=1e-6)


def test_streaming_diloco_in_the_simulator_counts_fragments_and_trains(tmp_path):
    from hpsjax.transforms import streaming_fragment_nbytes

    config = _quick("streaming_diloco")
    summary = train.train_and_evaluate(config, tmp_path, progress=False, formats=())
    setup = build.setup(config)
    fragments = config.worker.streaming_fragments
    layout = config.worker.streaming_layout
    assert (layout, config.worker.streaming_bits) == ("strided", "e2m1")
    sizes = streaming_fragment_nbytes(setup.params, fragments, 4, layout)
    dense = sum(np.asarray(p).nbytes for p in jax.tree.leaves(setup.params))
    # A push: one fragment (a layer of the two), on 4 bits (plus scales).
    assert sum(sizes) < dense / 7
    assert summary["pushes"] > 0
    per_push = -(-sum(sizes) // fragments)
    assert per_push * summary["pushes"] <= summary["bytes_sent"]
    assert summary["bytes_sent"] < 2 * per_push * summary["pushes"]
    assert summary["final_loss"] < 2.2


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("worker.streaming_fragments", 0, r"worker\.streaming_fragments must be"),
        ("worker.streaming_bits", "e3m0", r"worker\.streaming_bits must be one of"),
        ("worker.streaming_layout", "rows", r"worker\.streaming_layout must be one"),
        ("server.optimizer_args.layout", "contiguous", r"needs server\.optimizer_args"),
        ("worker.local_optimizer_args.delay", 4, r"tau = 4\) must be below"),
        ("worker.local_optimizer", "adam", r"needs worker\.local_optimizer="),
        ("plan.scheme", "hps", r"needs plan\.scheme='none'"),
    ],
)
def test_streaming_diloco_config_errors_are_one_line(key, value, message):
    config = _quick("streaming_diloco")
    *parents, name = key.split(".")
    node = config
    for part in parents:
        node = node[part]
    node[name] = value
    with pytest.raises(ValueError, match=message) as err:
        registry.check_config(config)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("spec", "optimizer", "local", "share"),
    [
        (
            '{"name": "streaming_push", "fragments": 2, "bits": 4}',
            ("streaming_nesterov", {"fragments": 2}),
            ("streaming_local", {"inner": "adam"}),
            0.8,  # half the values, at 4 + 2 index bytes each
        ),
        (
            '{"name": "sparseloco", "ratio": 0.002, "bits": 2}',
            ("sgd", {}),
            ("adam", {}),
            # 9 of the kernel's 640 values (its one chunk) and the 10 biases
            # (a chunk sent whole), at 4 + 2 index bytes each.
            0.15,
        ),
    ],
    ids=["streaming_diloco", "sparseloco"],
)
def test_a_real_worker_sends_its_sparse_push_as_top_k_leaves(
    spec, optimizer, local, share
):
    """An asyncio server and worker on loopback: each push carries the
    transform's nonzero entries (a fragment, or the top 2%) and no more."""
    import asyncio

    from hpsjax import data
    from hpsjax._optimizers import make_optimizer
    from hpsjax.ps import Server
    from hpsjax.worker import Worker, WorkerConfig

    train_set = data.synthetic_digits(256, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "bias": np.zeros(10, np.float32),
        "kernel": (rng.normal(size=(64, 10)) / 8).astype(np.float32),
    }
    dense = sum(x.nbytes for x in params.values())

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        logits = x @ p["kernel"] + p["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)

    name, kwargs = optimizer

    async def main():
        server = Server(
            params, make_optimizer(name, 0.7, **kwargs), "asp",
            port=0, secret="s" * 32,
        )  # fmt: skip
        await server.start()
        try:
            config = WorkerConfig(
                port=server.port, worker_id="w0", secret="s" * 32, batch_size=16,
                local_steps=3, overlap="none", max_steps=4, push_transform=spec,
            )  # fmt: skip
            worker = Worker(
                config,
                loss_fn=loss_fn,
                batches=train_set.batches(16, seed=0).next,
                local_optimizer=make_optimizer(local[0], 0.01, **local[1]),
            )
            summary = await worker.run()
            return summary, server.version, server.params
        finally:
            await server.close()

    summary, version, final = asyncio.run(asyncio.wait_for(main(), 120))
    assert summary.pushes == 4 and version == 4
    # Everything the worker wrote (pushes, pull requests, handshake) against
    # four dense pushes.
    assert summary.bytes_sent < share * 4 * dense
    moved = [not np.allclose(final[k], params[k]) for k in params]
    assert all(moved)
