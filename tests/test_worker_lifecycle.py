"""A worker's life against a real server: the overlap its policy calls for, a
compile that keeps no barrier waiting, and divergence as an event.

Workers run in this process against an in-process ``hpsjax.ps.Server`` over
loopback sockets (port 0); the divergence test also runs a real
``hpsjax-worker`` process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hpsjax import data
from hpsjax.ps import Server
from hpsjax.worker import Worker, WorkerConfig

SECRET = "lifecycle-secret"
LIMIT = 120.0  # seconds any one async test may take


@pytest.fixture(scope="module")
def setup():
    """Generated digits and a small functional MLP (per-example losses)."""
    train = data.synthetic_digits(900, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "hidden": {
            "kernel": (rng.normal(size=(64, 32)) / 8).astype(np.float32),
            "bias": np.zeros(32, np.float32),
        },
        "out": {
            "kernel": (rng.normal(size=(32, 10)) / 6).astype(np.float32),
            "bias": np.zeros(10, np.float32),
        },
    }

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        h = jax.nn.relu(x @ p["hidden"]["kernel"] + p["hidden"]["bias"])
        logits = h @ p["out"]["kernel"] + p["out"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch.y)

    return train, params, loss_fn


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


def _workers(setup, port, configs, records, *, cls=Worker, first=0):
    train, _, loss_fn = setup
    return [
        cls(
            dataclasses.replace(
                config,
                port=port,
                secret=SECRET,
                worker_id=f"w{first + i}",
                batch_size=16,
            ),
            loss_fn=loss_fn,
            batches=train.shard(len(configs), i).batches(16, seed=i).next,
            metrics=records.append,
        )
        for i, config in enumerate(configs)
    ]


async def _train(setup, configs, *, policy):
    _, params, _ = setup
    records: list[dict] = []
    async with Server(params, optax.sgd(0.1), policy, secret=SECRET) as server:
        workers = _workers(setup, server.port, configs, records)
        await asyncio.gather(*(w.run() for w in workers))
        version = server.version
    return records, version


def _pushed(records):
    """The rounds whose records carry a push's acknowledgement."""
    return [r for r in records if r.get("pushed_step") is not None]


# ---------------------------------------------------------------- overlap


def test_under_bsp_every_push_of_default_workers_has_staleness_0(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    steps = 10
    records, version = _run(
        _train(setup, [WorkerConfig(max_steps=steps)] * 3, policy="bsp")
    )
    pushed = _pushed(records)
    assert len(pushed) == 3 * steps
    assert {r["staleness"] for r in pushed} == {0}
    assert all(r["pushed_step"] == r["step"] for r in pushed)
    # One version a round once all three are in (each joins when its step is
    # compiled, and the first rounds may have fewer workers).
    assert steps <= version < steps + 5
    said = [m for m in caplog.messages if "synchronous" in m]
    assert len(said) == 3 and all("staleness 0" in m for m in said)


def test_asked_for_pipelining_under_bsp_it_pipelines_and_says_so(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    config = WorkerConfig(max_steps=6, overlap="pipeline")
    records, _ = _run(_train(setup, [config] * 2, policy="bsp"))
    pushed = [r for r in _pushed(records) if r["event"] == "round"]
    # Each push travels during the next round: one version stale (but the
    # first ones, sent before the other worker's first push was applied).
    stale = [r["staleness"] for r in pushed]
    assert set(stale) <= {0, 1} and stale.count(1) >= len(stale) - 2, stale
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and all("1 version stale" in m for m in warned)


def test_under_asp_the_default_pipelines(setup):
    records, _ = _run(_train(setup, [WorkerConfig(max_steps=6)], policy="asp"))
    rounds = [r for r in records if r["event"] == "round"]
    assert all(r["pushed_step"] == r["step"] - 1 for r in rounds[1:])


# ---------------------------------------------------------------- compile


class _SlowCompile(Worker):
    """A worker whose first compile takes ``DELAY`` seconds longer (a device
    whose step compiles slowly)."""

    DELAY = 5.0

    def _compile(self, args):
        if not getattr(self, "_slowed", False):
            self._slowed = True
            time.sleep(self.DELAY)
        return super()._compile(args)


def test_a_slow_compile_keeps_no_barrier_waiting(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    _, params, _ = setup
    delay = _SlowCompile.DELAY
    records: list[dict] = []

    async def go():
        async with Server(params, optax.sgd(0.1), "bsp", secret=SECRET) as server:
            fast = _workers(
                setup, server.port, [WorkerConfig(max_seconds=delay + 3)] * 2, records
            )
            slow = _workers(
                setup, server.port, [WorkerConfig(max_steps=5)], records,
                cls=_SlowCompile, first=2,
            )  # fmt: skip
            await asyncio.gather(*(w.run() for w in (*fast, *slow)))

    _run(go())
    rounds = [r for r in records if r["event"] == "round"]
    fast_waits = [r["wait_s"] for r in rounds if r["worker"] != "w2"]
    slow_rounds = [r for r in rounds if r["worker"] == "w2"]
    compiles = {r["worker"]: r["compile_s"] for r in records if r["event"] == "compile"}
    # Every worker compiled before joining, the slow one while the others went on...
    assert sorted(compiles) == ["w0", "w1", "w2"] and compiles["w2"] >= delay
    assert len(slow_rounds) == 5 and all(r["compile_s"] == 0 for r in slow_rounds)
    assert slow_rounds[0]["version"] > 0
    assert any("compiled its step for batch 16" in m for m in caplog.messages)
    # ...and no round of theirs waited for it at the barrier.
    assert max(fast_waits) < delay / 2, sorted(fast_waits)[-5:]
