"""A worker runs each step it compiles before joining once, and warms its
push's compressor there: no round holds a step's first execution or the
compressor's compile (on proc4 they took 2-8 steps and 0.7-1 s of the first
round).

One worker in this process against an in-process ``hpsjax.ps.Server`` over
loopback (port 0).
"""

from __future__ import annotations

import asyncio

import optax
import pytest
from _models import digits_mlp

from hpsjax.ps import Server
from hpsjax.worker import Heterogeneity, Worker, WorkerConfig
from hpsjax.worker._compute import RoundCompute

SECRET = "warm-start-secret"
LIMIT = 120.0  # seconds the test may take


@pytest.fixture(scope="module")
def setup():
    """Generated digits and a small functional MLP (per-example losses)."""
    return digits_mlp(900)


def test_steps_and_compressor_run_before_joining(setup, monkeypatch):
    train, params, loss_fn = setup
    records: list[dict] = []
    made: list = []
    real_make = RoundCompute._make_compressor

    def counting_make(self):
        made.append(self)
        return real_make(self)

    async def go():
        async with Server(params, optax.sgd(0.1), "bsp", secret=SECRET) as server:
            worker = Worker(
                WorkerConfig(
                    port=server.port,
                    secret=SECRET,
                    worker_id="w0",
                    batch_size=16,
                    max_steps=5,
                    precompile="8,16,24",
                    bits=8,
                    heterogeneity=Heterogeneity(slowdown=2.0),
                ),
                loss_fn=loss_fn,
                batches=train.batches(16, seed=0).next,
                metrics=records.append,
            )
            compute = worker._compute
            task = asyncio.ensure_future(worker.run())
            while not any(r["event"] == "round" for r in records):
                await asyncio.sleep(0.001)
            warmed = compute._compressor_warm
            # Three shapes, each run once before the first round.
            assert worker._injector.first_executions == 3
            server.send_plan("w0", {"revision": 1, "batch_size": 8})
            await task
            return compute, warmed

    monkeypatch.setattr(RoundCompute, "_make_compressor", counting_make)
    compute, warmed = asyncio.run(asyncio.wait_for(go(), LIMIT))
    # The compressor warmed before joining is the one every push used: joining
    # (new parameters, the same shapes) made no new one.
    assert warmed is not None and compute._compress_update is warmed
    assert len(made) == 1
    rounds = [r for r in records if r["event"] == "round"]
    assert len(rounds) == 5
    # No first execution in a round: the slowdown slows every round, the
    # first one and the first at the new batch included.
    assert all(r["slowdown_s"] > 0 for r in rounds)
    assert any(r["batch_size"] == 8 for r in rounds)
