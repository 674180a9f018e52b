"""A worker that compiles a plan's batch sizes before joining: a later plan's
batch then runs from its next round, with nothing compiled beside the rounds.

One worker in this process against an in-process ``hpsjax.ps.Server`` over
loopback (port 0).
"""

from __future__ import annotations

import asyncio
import logging

import optax
import pytest
from _models import digits_mlp

from hpsjax.ps import Server
from hpsjax.worker import Worker, WorkerConfig

SECRET = "precompile-secret"
LIMIT = 120.0  # seconds the test may take


@pytest.fixture(scope="module")
def setup():
    """Generated digits and a small functional MLP (per-example losses)."""
    return digits_mlp(900)


def test_precompiled_batches_run_from_the_next_round(setup, caplog):
    caplog.set_level(logging.INFO, "hpsjax.worker")
    train, params, loss_fn = setup
    records: list[dict] = []

    async def go():
        async with Server(params, optax.sgd(0.1), "bsp", secret=SECRET) as server:
            worker = Worker(
                WorkerConfig(
                    port=server.port,
                    secret=SECRET,
                    worker_id="w0",
                    batch_size=16,
                    max_steps=6,
                    precompile="8,16,24",
                ),
                loss_fn=loss_fn,
                batches=train.batches(16, seed=0).next,
                metrics=records.append,
            )
            task = asyncio.ensure_future(worker.run())
            while sum(r["event"] == "round" for r in records) < 2:
                await asyncio.sleep(0.001)
            server.send_plan("w0", {"revision": 1, "batch_size": 8})
            await task

    asyncio.run(asyncio.wait_for(go(), LIMIT))
    # 16 compiled first, then the two others (16 already was).
    (first,) = [r for r in records if r["event"] == "compile"]
    (more,) = [r for r in records if r["event"] == "precompile"]
    assert first["batch_size"] == 16 and more["batch_sizes"] == 2
    assert more["compile_s"] > 0
    rounds = [r for r in records if r["event"] == "round"]
    revised = [r for r in rounds if r["plan_revision"] == 1]
    # No round of the new plan kept the last batch while 8 compiled.
    assert revised and all(r["batch_size"] == 8 for r in revised)
    assert all(r["compile_s"] == 0 for r in rounds)
    assert any("compiled its step for 2 more batch sizes" in m for m in caplog.messages)


def test_a_bad_precompile_list_is_a_one_line_error():
    for text in ("8,x", "0,8", "8,,16", ""):
        with pytest.raises(ValueError, match="precompile must be batch sizes") as info:
            WorkerConfig(precompile=text)
        assert "\n" not in str(info.value)
    assert WorkerConfig(precompile=" 8, 16").precompile_sizes == (8, 16)
    assert WorkerConfig().precompile_sizes == ()
