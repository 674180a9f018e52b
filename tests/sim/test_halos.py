"""HALoS's two-level server (hpsjax.sim.HalosCore): steps by hand, convergence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax.decisions import (
    SendParams,
    Tick,
    WorkerJoined,
    WorkerPulled,
    WorkerPushed,
    get_policy,
)
from hpsjax.sim import ComputeModel, HalosCore, SimConfig, WorkerSpec, simulate
from hpsjax.wire import PushMeta


def _halos(**kwargs):
    settings = {
        "regions": 2,
        "accumulation": 2,
        "merge_weight": 0.5,
        "global_learning_rate": 1.0,
        "global_momentum": 0.5,
        "global_delay": 1,
        "global_latency": 1.0,
    }
    return get_policy("halos", **{**settings, **kwargs})


def _push(core, worker, value, version, now):
    update = {"w": jnp.array([value], jnp.float32)}
    return core.handle(WorkerPushed(worker, update, PushMeta(version=version), now))


def _w(params) -> float:
    return float(params["w"][0])


def test_two_global_updates_and_merges_by_hand():
    # LPS: sgd(1.0), so a push u moves the region's model by -u. K = 2 local
    # updates per send; the link takes 1 s each way; GPS: Nesterov with
    # momentum 0.5 and step 1 (delay 1); merge weight 0.5.
    core = HalosCore(
        {"w": jnp.zeros(1)}, optax.sgd(1.0), _halos(), worker_ids=["a", "b"]
    )
    assert core.handle(WorkerJoined("a", 0.0)) == [SendParams("a", 0)]
    core.handle(WorkerJoined("b", 0.0))
    _push(core, "a", 1.0, 0, 1.0)  # region 0: w = -1, one update
    assert core.next_deadline() is None
    _push(core, "a", 0.5, 1, 2.0)  # w = -1.5: K reached, 0 - (-1.5) sent
    assert core.next_deadline() == 3.0 and core.global_bytes == 4
    core.handle(Tick(3.0))
    # GPS: m = 1.5, w_g = 0 - (0.5 * 1.5 + 1.5) = -2.25; sent back.
    assert core.version == 1 and _w(core.params) == pytest.approx(-2.25)
    _push(core, "a", 0.5, 2, 3.5)  # w = -2 (an exchange in flight: no send)
    core.handle(Tick(4.0))  # merged: 0.5 * -2 + 0.5 * -2.25
    assert _w(core.local[0].params) == pytest.approx(-2.125)
    assert _w(core.local[1].params) == 0.0  # region 1 untouched
    (send,) = core.handle(WorkerPulled("a", 4.5))
    key, params = core.sent_params(send)
    assert key == (0, 1, 3) and _w(params) == pytest.approx(-2.125)
    _push(core, "a", 0.25, 3, 5.0)  # w = -2.375, one update since the merge
    assert core.next_deadline() is None
    _push(core, "a", 0.25, 4, 6.0)  # w = -2.625: -2.125 - (-2.625) sent
    core.handle(Tick(7.0))
    # GPS: m = 0.5 * 1.5 + 0.5 = 1.25, w_g = -2.25 - (0.5 * 1.25 + 0.5).
    assert core.version == 2 and _w(core.params) == pytest.approx(-3.375)
    assert [e[:2] for e in core.exchanges] == [[2.0, 0], [6.0, 0]]
    assert core.exchanges[0][2] == 4.0 and core.exchanges[1][2] is None


def test_regions_are_contiguous_runs_of_workers():
    core = HalosCore(
        {"w": jnp.zeros(1)},
        optax.sgd(1.0),
        _halos(regions=3),
        worker_ids=list("abcdefg"),
    )
    assert core.region == dict(zip("abcdefg", (0, 0, 0, 1, 1, 2, 2), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regions": 0}, "regions"),
        ({"accumulation": 0}, "accumulation"),
        ({"merge_weight": 1.5}, "merge_weight"),
        ({"global_learning_rate": 0.0}, "global_learning_rate"),
        ({"global_momentum": 1.0}, "global_momentum"),
        ({"global_bandwidth": -1.0}, "global_bandwidth"),
        ({"aggregat": 2}, "aggregat"),
    ],
)
def test_a_bad_setting_is_a_one_line_error(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        _halos(**kwargs)
    assert "\n" not in str(err.value)


def test_more_regions_than_workers_or_a_replanner_is_refused():
    with pytest.raises(ValueError, match="2 workers cannot fill 3 regions"):
        HalosCore({"w": jnp.zeros(1)}, optax.sgd(1.0), _halos(regions=3),
                  worker_ids=["a", "b"])  # fmt: skip
    with pytest.raises(ValueError, match="re-planner"):
        HalosCore({"w": jnp.zeros(1)}, optax.sgd(1.0), _halos(),
                  worker_ids=["a", "b"], replanner=object())  # fmt: skip


def _regression(n: int = 512):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, x @ np.arange(1.0, 5.0, dtype=np.float32)


def _loss(w, batch):
    return jnp.mean((batch[0] @ w - batch[1]) ** 2)


def test_halos_trains_a_model_in_the_simulator():
    # Four workers of unequal speed in two regions: fast links to their local
    # servers, a slow one (0.5 s) between the local servers and the global.
    data = _regression()
    workers = [
        WorkerSpec(ComputeModel(step_time=t), batch_size=16, local_steps=4)
        for t in (0.05, 0.1, 0.05, 0.2)
    ]
    policy = _halos(
        accumulation=4, global_learning_rate=0.6, global_delay=2, global_latency=0.5
    )
    config = SimConfig(
        policy=policy,
        server_optimizer=optax.sgd(1.0),
        local_optimizer=optax.sgd(0.02),
        duration=15.0,
        eval_every=5.0,
    )
    result = simulate(_loss, jnp.zeros(4), data, workers, config, eval_data=data)
    losses = result.metrics["loss"]
    assert losses[0] > 25.0 and losses[-1] < 0.01 * losses[0]
    assert result.num_updates >= 10  # the global server's updates
    np.testing.assert_allclose(result.params, np.arange(1.0, 5.0), atol=0.2)


def test_without_an_exchange_the_global_model_stays_put():
    # K beyond the run: the local servers train, the global one never moves.
    data = _regression(128)
    workers = [WorkerSpec(ComputeModel(step_time=0.1), batch_size=8) for _ in "ab"]
    config = SimConfig(
        policy=_halos(accumulation=10_000),
        server_optimizer=optax.sgd(0.1),
        duration=5.0,
    )
    result = simulate(_loss, jnp.zeros(4), data, workers, config)
    assert len(result.applies) >= 50  # the local servers' versions
    assert result.num_updates == 0
    np.testing.assert_array_equal(result.params, np.zeros(4))
