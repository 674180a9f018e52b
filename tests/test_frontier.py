"""The newer asynchronous and low-communication methods: Ringmaster ASGD (a
policy), OrMo and SparseLoCo (transforms), Clipped ASGD and MuLoCo (configs),
on the server core and in the simulator."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import build, registry, train
from hpsjax.ps._core import ForcePull, PushAck, ServerCore
from hpsjax.ps._policies import Ringmaster, SaPS, get_policy
from hpsjax.transforms import (
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
    summary = train.train_and_evaluate(config, tmp_path, progress=False)
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


# ---------------------------------------------------------------------------
# SparseLoCo.
# ---------------------------------------------------------------------------


def _deltas(n, shape=(40, 25)):
    keys = jax.random.split(jax.random.PRNGKey(1), n)
    return [{"w": jax.random.normal(k, shape), "b": jnp.ones(5)} for k in keys]


def test_sparseloco_sends_k_entries_and_loses_nothing_without_decay():
    ratio, pushes = 0.02, _deltas(6)
    tx = sparseloco(ratio, bits=2, decay=1.0)
    state = tx.init(pushes[0])
    total_sent = jax.tree.map(jnp.zeros_like, pushes[0])
    for delta in pushes:
        sent, state = tx.update(delta, state)
        assert int(jnp.count_nonzero(sent["w"])) <= 20  # ceil(0.02 * 1000)
        assert int(jnp.count_nonzero(sent["b"])) <= 1
        total_sent = jax.tree.map(jnp.add, total_sent, sent)
    # decay 1: what was sent plus what is left is every pseudo-gradient.
    for key in ("w", "b"):
        expected = sum(np.asarray(d[key]) for d in pushes)
        got = np.asarray(total_sent[key]) + np.asarray(state.error[key])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_sparseloco_decays_its_accumulator():
    tx = sparseloco(0.5, bits=16, decay=0.5)
    delta = jnp.array([4.0, 1.0])
    sent, state = tx.update(delta, tx.init(delta))
    np.testing.assert_allclose(sent, [4.0, 0.0], atol=1e-3)
    np.testing.assert_allclose(state.error, [0.0, 1.0], atol=1e-3)
    sent, state = tx.update(jnp.zeros(2), state)  # e = 0.5 * [0, 1]
    np.testing.assert_allclose(sent, [0.0, 0.5], atol=1e-3)


def test_sparseloco_bytes():
    params = {"w": np.zeros((40, 25), np.float32), "b": np.zeros(70000, np.float32)}
    # w: 20 indices of 2 bytes, 20 codes of 2 bits (5 bytes) and a 4-byte scale;
    # b: 1400 indices of 4 bytes (more than 65536 entries), 350 + 4 bytes.
    assert sparseloco_nbytes(params, 0.02, bits=2) == (40 + 5 + 4) + (5600 + 354)
    tx = sparseloco(0.02, bits=2)
    state = optax.chain(tx, optax.sgd(1.0)).init(params)
    assert last_sparseloco_nbytes(state) == sparseloco_nbytes(params, 0.02, 2)
    with pytest.raises(ValueError, match="sparseloco"):
        last_sparseloco_nbytes(optax.sgd(1.0).init(params))
    for kwargs, match in [({"bits": 3}, "bits"), ({"decay": 1.5}, "decay"),
                          ({"ratio": 0.0}, "ratio")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            sparseloco(**{"ratio": 0.1, **kwargs})


def test_sparseloco_in_the_simulator_counts_its_bytes_and_trains(tmp_path):
    config = _quick("sparseloco")
    summary = train.train_and_evaluate(config, tmp_path, progress=False)
    setup = build.setup(config)
    per_push = sparseloco_nbytes(setup.params, config.worker.compress_ratio, 2)
    dense = sum(np.asarray(p).nbytes for p in jax.tree.leaves(setup.params))
    assert per_push < 0.1 * dense
    assert summary["pushes"] > 0
    # Every push carries per_push bytes of payload (plus its frame's header).
    assert per_push * summary["pushes"] <= summary["bytes_sent"]
    assert summary["bytes_sent"] < 0.2 * dense * summary["pushes"]
    assert summary["final_loss"] < 2.3


def test_sparseloco_is_refused_on_processes_in_one_line(tmp_path):
    from experiments import backends

    config = _quick("sparseloco")
    with pytest.raises(ValueError, match=r"^worker\.compression='sparseloco' runs"):
        backends._worker_flags(config, 0, plan_file=None)


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
