"""Asynchronous DiLoCo with one-step-delayed outer updates (PCCL's form).

``experiments/configs/diloco_delayed.py`` is DiLoCo's BSP rounds with the
push and pull overlapping the next round (``worker.overlap='pipeline'``); these
tests check that the simulator then applies round t's average at the end of
round t + 1, on parameters already moved by round t - 1's, and hides a link
faster than a round.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments import registry
from experiments.configs import diloco_delayed
from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
from hpsjax.worker import Heterogeneity, WorkerOptions

# Worker 0 draws only y = 1, worker 1 only y = 3 (disjoint shards).
_Y = np.array([[1.0], [3.0]] * 8, np.float32)


def _loss(w, batch):
    return jnp.mean(0.5 * (w[0] - batch[:, 0]) ** 2)


def _rounds(overlap: str, updates: int, latency: float = 0.0):
    workers = [
        WorkerSpec(
            ComputeModel(step_time=1.0),
            heterogeneity=Heterogeneity(latency=latency) if latency else None,
            batch_size=1,
            worker_id=i,
        )
        for i in range(2)
    ]
    config = SimConfig(
        policy="bsp",
        server_optimizer=optax.sgd(0.5),  # the outer step, lr 0.5, no momentum
        local_optimizer=optax.sgd(0.1),  # one inner step of 0.1 a round
        worker=WorkerOptions(overlap=overlap),
        max_updates=updates,
        duration=100.0,
    )
    return simulate(_loss, jnp.zeros(1), _Y, workers, config)


def test_three_outer_steps_by_hand():
    # A round from w: local w - 0.1 (w - y_i); its pseudo-gradient, averaged,
    # is 0.1 (w - 2). DiLoCo: w_{t+1} = w_t - 0.5 * 0.1 (w_t - 2).
    # Delayed: rounds 0 and 1 both start from w_0 (the bootstrap), and
    # w_{t+1} = w_t - 0.5 * 0.1 (w_{t-1} - 2).
    delayed = _rounds("pipeline", 3)
    w1 = 0.0 - 0.05 * (0.0 - 2.0)  # round 0's average, on w_0
    w2 = w1 - 0.05 * (0.0 - 2.0)  # round 1's, computed on w_0 too
    w3 = w2 - 0.05 * (w1 - 2.0)  # round 2's, computed on w_1
    assert float(delayed.params[0]) == pytest.approx(w3) == pytest.approx(0.295)
    assert [(p.version, p.staleness) for p in delayed.pushes] == [
        (0, 0), (0, 0), (0, 1), (0, 1), (1, 1), (1, 1),
    ]  # fmt: skip
    synchronous = _rounds("none", 3)
    s = 0.0
    for _ in range(3):
        s -= 0.05 * (s - 2.0)
    assert float(synchronous.params[0]) == pytest.approx(s) == pytest.approx(0.28525)


def test_the_link_is_hidden_behind_the_next_round():
    # 0.3 s each way on a 1 s round: a DiLoCo round takes 1.6 s, a delayed one 1 s.
    delayed = _rounds("pipeline", 6, latency=0.3)
    synchronous = _rounds("none", 6, latency=0.3)
    assert delayed.end_time < 6 * 1.0 + 1.0
    assert synchronous.end_time > 6 * 1.6 - 0.1


def test_the_config_is_pccl_s():
    config = registry.load_config("diloco_delayed", "sim8")
    registry.check_config(config)
    assert config.server.policy == "bsp" and config.worker.overlap == "pipeline"
    assert config.server.optimizer == "sgd" and config.server.learning_rate == 0.7
    assert config.server.momentum == 0.0 and config.worker.local_steps == 8
    assert diloco_delayed.OUTER_MOMENTUM == 0.0


def test_delayed_diloco_trains_a_model():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 4)).astype(np.float32)
    data = (x, x @ np.arange(1.0, 5.0, dtype=np.float32))

    def loss(w, batch):
        return jnp.mean((batch[0] @ w - batch[1]) ** 2)

    workers = [
        WorkerSpec(ComputeModel(step_time=t), batch_size=16, local_steps=8)
        for t in (0.05, 0.1, 0.05, 0.2)
    ]
    config = SimConfig(
        policy="bsp",
        server_optimizer=optax.sgd(0.7),
        local_optimizer=optax.sgd(0.02),
        worker=WorkerOptions(overlap="pipeline"),
        duration=30.0,
        eval_every=5.0,
    )
    result = simulate(loss, jnp.zeros(4), data, workers, config, eval_data=data)
    losses = result.metrics["loss"]
    assert losses[0] > 25.0 and losses[-1] < 0.01 * losses[0]
    np.testing.assert_allclose(result.params, np.arange(1.0, 5.0), atol=0.2)
