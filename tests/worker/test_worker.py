"""Tests of the worker runtime and heterogeneity injection.

Workers run against a real in-process ``hpsjax.ps.Server`` on loopback (port 0),
or against a scripted stand-in client where a test needs to control exactly what
the server answers (versions, hints, forced pulls).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import io
import itertools
import json
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import optax
import pytest
from _models import digits_mlp
from _servers import held_start

from hpsjax.ps import PlanNotice, ProtocolError, PushAck, Server, WorkerDropped
from hpsjax.transforms import staleness_factor
from hpsjax.worker import (
    Heterogeneity,
    Injector,
    JsonLinesSink,
    Worker,
    WorkerConfig,
    parse_schedule,
    summarize,
)

SECRET = "test-secret"
LIMIT = 90.0  # seconds any one async test may take


@pytest.fixture(scope="module")
def setup():
    """Generated digits and a small functional MLP (per-example losses)."""
    return digits_mlp(1200)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


async def _train(
    setup,
    configs: list[dict[str, Any]],
    *,
    policy: str = "asp",
    optimizer=None,
    local_optimizer=None,
    batch_size: int = 32,
    **server_kwargs,
):
    """Runs workers (one per config) against a fresh server; returns records."""
    train, params, loss_fn = setup
    records: list[dict] = []
    async with Server(
        params,
        optimizer or optax.sgd(0.1),
        policy,
        secret=SECRET,
        port=0,
        **server_kwargs,
    ) as server:
        workers = []
        for i, extra in enumerate(configs):
            stream = train.shard(len(configs), i).batches(batch_size, seed=i)
            config = WorkerConfig(
                port=server.port,
                worker_id=f"w{i}",
                secret=SECRET,
                batch_size=batch_size,
                **extra,
            )
            workers.append(
                Worker(
                    config,
                    loss_fn=loss_fn,
                    batches=stream.next,
                    local_optimizer=local_optimizer,
                    metrics=records.append,
                )
            )
        summaries = await asyncio.gather(*(w.run() for w in workers))
        pushes = {w: server.core.worker(w).pushes for w in server.core.workers()}
        version = server.version
    return records, summaries, pushes, version


def _rounds(records, worker=None):
    return [
        r
        for r in records
        if r["event"] == "round" and (worker is None or r["worker"] == worker)
    ]


# ---------------------------------------------------------------- heterogeneity


def test_schedule_parsing_and_lookup():
    assert parse_schedule("3") == ((0.0, 3.0),)
    het = Heterogeneity(slowdown="0:1,10:4,20:2", bandwidth="0:inf,5:1000")
    assert [het.slowdown_at(t) for t in (0, 9.9, 10, 15, 25)] == [1, 1, 4, 4, 2]
    assert het.bandwidth_at(1.0) is None
    assert het.bandwidth_at(6.0) == 1000.0
    assert het.compute_delay(0.5, now=12.0) == pytest.approx(1.5)
    assert het.transfer_delay(500, now=6.0) == pytest.approx(0.5)
    assert Heterogeneity.from_dict(json.loads(json.dumps(het.to_dict()))) == het
    assert Heterogeneity().is_identity and not het.is_identity


@pytest.mark.parametrize(
    "kwargs",
    [
        {"slowdown": 0.5},
        {"slowdown": math.nan},
        {"slowdown": "0:1,0:2"},
        {"slowdown": "5:2"},
        {"slowdown": "fast"},
        {"slowdown": [(0, 1), (10,)]},
        {"bandwidth": 0},
        {"bandwidth": -5.0},
        {"latency": -1.0},
    ],
)
def test_heterogeneity_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        Heterogeneity(**kwargs)


def test_injector_follows_the_schedule():
    now = [0.0]
    slept = []
    injector = Injector(
        Heterogeneity(slowdown=[(0, 1), (10, 3)], bandwidth=1000.0, latency=0.01),
        clock=lambda: now[0],
        sleep=slept.append,
    )
    injector.start()
    assert injector.after_compute(0.2) == 0.0
    now[0] = 11.0
    assert injector.after_compute(0.2) == pytest.approx(0.4)
    assert slept == [pytest.approx(0.4)]
    delay = asyncio.run(injector.transfer(100))
    assert delay == pytest.approx(0.01 + 0.1)
    assert injector.total_compute_delay == pytest.approx(0.4)
    assert injector.total_transfer_delay == pytest.approx(0.11)
    with pytest.raises(ValueError):
        Injector(Heterogeneity()).after_compute(-1.0)


def test_injector_slows_the_typical_step_not_its_hiccups():
    slept = []
    injector = Injector(Heterogeneity(slowdown=3), sleep=slept.append)
    # One step held up by a busy core: the device is 3 times slower, not its
    # hiccup 2 times longer.
    # A shape's first execution (compiling, allocating) is not slowed, nor
    # counted in the median: slower hardware, not a slower compiler.
    assert injector.after_compute(9.0, key=(32,)) == 0.0
    for c in (1.0, 1.0, 1.0, 5.0, 1.0):
        injector.after_compute(c, key=(32,))
    assert slept == [2.0] * 5
    # Each shape keeps its own steps; no key: this step's own time.
    assert injector.after_compute(7.0, key=(8,)) == 0.0
    assert injector.after_compute(0.5, key=(8,)) == 1.0
    assert injector.first_executions == 2
    assert injector.after_compute(4.0) == 8.0
    # The window follows a lasting change within half its length.
    for _ in range(Injector.window // 2 + 1):
        last = injector.after_compute(2.0, key=(32,))
    assert last == 4.0
    assert injector.total_compute_delay == pytest.approx(sum(slept))


def test_metrics_sink_and_summary(tmp_path):
    path = tmp_path / "m.jsonl"
    with JsonLinesSink(path) as sink:
        sink({"event": "round", "step": 0})
    with JsonLinesSink(path) as sink:
        sink({"event": "round", "step": 1})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]
    with pytest.raises(ValueError):
        JsonLinesSink(42)
    with pytest.raises(ValueError, match="not JSON compliant"):
        JsonLinesSink(io.StringIO())({"loss": math.nan})
    rounds = [
        {"event": "round", "compute_s": 3.0, "slowdown_s": 0.0, "wait_s": 1.0,
         "transfer_s": 2.0, "round_s": 4.0},
        {"event": "final", "transfer_s": 9.0},
    ]  # fmt: skip
    stats = summarize(rounds)
    assert stats["idle_fraction"] == 0.25 and stats["overlap"] == 0.5
    assert stats["rounds"] == 1
    with pytest.raises(ValueError, match="no round records"):
        summarize([{"event": "final"}])


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bits": 3},
        {"bits": True},
        {"lr_scale": 0.0},
        {"batch_size": 0},
        {"local_steps": 0},
        {"staleness_lr": "nope"},
        {"eager_pulls": 0},
        {"overlap": "sometimes"},
        {"port": 70000},
        {"worker_id": 1.5},
        {"device_batches": ()},
        {"timeout": -1.0},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        WorkerConfig(**kwargs)


def test_worker_rejects_inconsistent_arguments(setup):
    _, _, loss_fn = setup
    with pytest.raises(ValueError, match="local optimizer"):
        Worker(WorkerConfig(local_steps=2), loss_fn=loss_fn, batches=lambda n: None)
    with pytest.raises(ValueError, match="sum"):
        Worker(
            WorkerConfig(batch_size=8, device_batches=(3, 4)),
            loss_fn=loss_fn,
            batches=lambda n: None,
        )
    with pytest.raises(ValueError, match="not both"):
        Worker(
            WorkerConfig(),
            loss_fn=loss_fn,
            batches=lambda n: None,
            local_optimizer=optax.sgd(0.1),
            stages=[],
        )


def test_work_plan_sets_the_workers_share():
    from hpsjax.profiling import WorkerProfile, plan

    profiles = [WorkerProfile.synthetic(f"w{i}", s) for i, s in enumerate([1, 3])]
    work_plan = plan(profiles, "hps", global_batch=64)
    config = WorkerConfig(worker_id="w1", work_plan=work_plan)
    batches, batch, steps, scale = config.planned()
    assert batch == 48 and batches == (48,) and steps == 1
    # The server's sample-weighted average weighs the batch: no step-size scale.
    assert scale == work_plan.worker("w1").lr_scale == 1.0
    with pytest.raises(ValueError):
        WorkerConfig(worker_id="w9", work_plan=work_plan)


# ---------------------------------------------------------------- real server


def test_training_lowers_the_loss_and_records_metrics(setup):
    records, summaries, pushes, version = _run(
        _train(setup, [{"max_steps": 30}, {"max_steps": 30}], policy="asp")
    )
    for worker in ("w0", "w1"):
        rounds = _rounds(records, worker)
        assert len(rounds) == 30
        first = statistics.mean(r["loss"] for r in rounds[:5])
        last = statistics.mean(r["loss"] for r in rounds[-5:])
        assert last < first - 0.1
        for r in rounds:
            for key in (
                "compute_s",
                "slowdown_s",
                "transfer_s",
                "wait_s",
                "round_s",
                "bytes_sent",
                "bytes_received",
                "staleness",
                "version",
            ):
                assert key in r
            assert r["compute_s"] > 0 and r["wait_s"] >= 0 and r["bytes_received"] > 0
        assert all(r["staleness"] is not None for r in rounds[1:])
        assert pushes[worker] == 30
    assert [s.pushes for s in summaries] == [30, 30]
    assert version == 60
    out = io.StringIO()
    JsonLinesSink(out)(records[-1])
    assert json.loads(out.getvalue()) == records[-1]
    stats = summarize(records)
    assert 0 <= stats["idle_fraction"] < 1 and 0 <= stats["overlap"] <= 1


def test_quantized_pushes_send_the_encoded_bytes():
    sent = {}
    for bits in (None, 8):
        records, version = _run(
            _heavy_run([WorkerConfig(batch_size=8, bits=bits)], steps=4)
        )
        assert version == 4
        rounds = [r for r in _rounds(records) if r["pushed_step"] is not None]
        # A round's bytes_sent holds one push and one (tiny) pull request.
        sent[bits] = statistics.median(r["bytes_sent"] for r in rounds)
    assert 0.2 < sent[8] / sent[None] < 0.3


@pytest.mark.parametrize(
    "extra",
    [
        {"bits": 8},
        {
            "push_transform": '{"name": "sparseloco", "ratio": 0.1, "bits": 2}',
            "local_steps": 2,
        },
        {"compress_ratio": 0.25, "compress_from_stage": 0},
    ],
    ids=["quantized", "sparseloco", "top_k"],
)
def test_a_compressed_push_is_compiled_once(setup, extra):
    # The encoder's state starts on the worker's device as its outputs are:
    # were it not, the second push would compile the encoder again (2.5 s of
    # SparseLoCo's encoder on two shared cores, every worker, every run).
    train, params, loss_fn = setup

    async def run():
        async with Server(
            params, optax.sgd(0.1), "asp", secret=SECRET, port=0
        ) as server:
            worker = Worker(
                WorkerConfig(
                    port=server.port, worker_id="w0", secret=SECRET, batch_size=16,
                    max_steps=4, **extra,
                ),
                loss_fn=loss_fn,
                batches=train.batches(16, seed=0).next,
                local_optimizer=optax.sgd(0.1) if "local_steps" in extra else None,
            )  # fmt: skip
            summary = await worker.run()
        return worker, summary

    worker, summary = _run(run())
    assert summary.pushes == 4
    compute = worker._compute
    encode = compute._topk[1] if "compress_ratio" in extra else compute._compress_update
    assert encode._cache_size() == 1


def test_local_steps_push_every_h_steps(setup):
    records, summaries, pushes, version = _run(
        _train(
            setup,
            [{"max_steps": 4, "local_steps": 3}],
            optimizer=optax.sgd(1.0),
            local_optimizer=optax.sgd(0.1),
        )
    )
    assert [r["local_steps"] for r in _rounds(records)] == [3, 3, 3, 3]
    assert summaries[0].local_steps == 12
    assert pushes["w0"] == 4 and version == 4


# ---------------------------------------------------------------- heterogeneity


# The least a 256-sample step of _heavy_loss takes, on any device: far above what
# a round costs besides its step (drawing and placing a batch, the thread hop),
# so that wall time over compute time measures the injected slowdown alone.
HEAVY_STEP_S = 0.005


def _tanh_stack(layers: int):
    def loss_fn(w, batch):
        h = jax.lax.fori_loop(0, layers, lambda _, h: jnp.tanh(h @ w["m"]), batch)
        return jnp.mean(h**2, axis=-1)

    return loss_fn


@functools.cache
def _heavy_layers() -> int:
    """Layers of 256 x 256 for a 256-sample step of at least HEAVY_STEP_S.

    Four take milliseconds on a CPU core and microseconds on a GPU, where a
    round's fixed costs would then outweigh its step.
    """
    params = {"m": np.eye(256, dtype=np.float32) * 0.5}
    batch = np.ones((256, 256), np.float32)
    layers = 4
    for _ in range(3):
        loss_fn = _tanh_stack(layers)
        grad = jax.jit(jax.grad(lambda p, b, f=loss_fn: f(p, b).mean()))
        jax.block_until_ready(grad(params, batch))
        seconds = []
        for _ in range(3):
            start = time.perf_counter()
            jax.block_until_ready(grad(params, batch))
            seconds.append(time.perf_counter() - start)
        if min(seconds) >= HEAVY_STEP_S:
            break
        layers = min(4096, math.ceil(layers * 2 * HEAVY_STEP_S / min(seconds)))
    return layers


def _heavy_loss():
    """A loss whose step costs milliseconds, so timing ratios are measurable."""
    params = {"m": np.eye(256, dtype=np.float32) * 0.5}
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(4096, 256)).astype(np.float32)
    loss_fn = _tanh_stack(_heavy_layers())
    return loss_fn, params, lambda n: pool[rng.integers(0, len(pool), n)]


async def _heavy_run(
    configs: list[WorkerConfig],
    *,
    policy: str = "asp",
    steps: int | None = 8,
    seconds: float | None = None,
    server_kwargs: dict | None = None,
    until=None,
):
    """Runs workers with a compute-heavy step against a fresh server.

    ``until(records)``, when given, is checked every 20 ms: once true, the
    workers are asked to stop (``seconds`` then bounds a run that never gets
    there).
    """
    loss_fn, params, batches = _heavy_loss()
    records: list[dict] = []
    async with Server(
        params, optax.sgd(0.01), policy, secret=SECRET, **(server_kwargs or {})
    ) as server:
        workers = [
            Worker(
                dataclasses.replace(
                    config,
                    port=server.port,
                    secret=SECRET,
                    worker_id=f"w{i}",
                    max_steps=steps,
                    max_seconds=seconds,
                ),
                loss_fn=loss_fn,
                batches=batches,
                metrics=records.append,
            )
            for i, config in enumerate(configs)
        ]
        runs = asyncio.gather(*(w.run() for w in workers))
        if until is not None:
            while not runs.done() and not until(records):
                await asyncio.wait([runs], timeout=0.02)
            for w in workers:
                w.stop()
        await runs
        version = server.version
    return records, version


def _first_round_end() -> float:
    """Seconds from a heavy worker's start to the end of its third round, now.

    The first rounds wait for the step's compiles, seconds on a loaded machine;
    a schedule that must change after them changes at twice this and one
    second. Measured right before the run it is for, as the load changes.
    """
    rounds = _run(_solo(WorkerConfig(batch_size=256, overlap="none"), steps=3))
    return rounds[-1]["compute_end"]


async def _solo(config: WorkerConfig, **kwargs):
    records, _ = await _heavy_run([config], **kwargs)
    return _rounds(records)


def test_bsp_makes_the_fast_worker_wait_for_the_slow_one():
    slow = WorkerConfig(batch_size=256, heterogeneity=Heterogeneity(slowdown=4))
    fast = WorkerConfig(batch_size=256)
    # The start held until both joined: on a loaded machine their compiles
    # end seconds apart, and the first would train alone meanwhile.
    held = {"core_kwargs": held_start(2)}
    records, version = _run(
        _heavy_run([slow, fast], policy="bsp", steps=8, server_kwargs=held)
    )
    # Eight barriers, both workers in each.
    assert version == 8
    assert {r["worker"] for r in _rounds(records) if r["version"] == 0} == {"w0", "w1"}
    # Round 0 includes compiling; from round 2 on the barrier is steady.
    slow_idle = summarize(_rounds(records, "w0")[2:])["idle_fraction"]
    fast_idle = summarize(_rounds(records, "w1")[2:])["idle_fraction"]
    assert fast_idle > 0.4 and fast_idle > slow_idle + 0.25


def _compute_wall(record):
    """Wall seconds from a round's start until its compute (and sleep) ended."""
    return record["compute_end"] - record["time"]


def test_eager_pull_starts_before_compute_ends():
    rounds = _run(_solo(WorkerConfig(batch_size=1024), steps=6))
    # The pull for round r + 1 is issued (right behind round r - 1's push)
    # while round r still computes.
    assert all(r["pull_start"] < r["compute_end"] for r in rounds)
    assert all(r["pushed_step"] == r["step"] - 1 for r in rounds[1:])
    rounds = _run(_solo(WorkerConfig(batch_size=256, overlap="none"), steps=3))
    assert all(r["pull_start"] >= r["compute_end"] for r in rounds)
    assert all(r["pushed_step"] == r["step"] for r in rounds)


def test_slowdown_makes_steps_k_times_longer():
    # k = 4: each round sleeps 3 times the typical step (checked exactly below)
    # and its wall holds that sleep.
    base = _run(_solo(WorkerConfig(batch_size=256, overlap="none")))
    slow = _run(
        _solo(
            WorkerConfig(
                batch_size=256,
                overlap="none",
                heterogeneity=Heterogeneity(slowdown=4),
            )
        )
    )
    # Nothing is slept without a slowdown; with it, every round's wall holds
    # its sleep and its compute. Only lower bounds are checked: what a round
    # spends beyond them (the next batch, the dispatch) grows with the load on
    # the machine, so an upper bound would be a timing margin.
    assert all(r["slowdown_s"] == 0 for r in base)
    assert all(r["slowdown_s"] > 0 for r in slow)
    assert all(_compute_wall(r) >= r["slowdown_s"] for r in slow)
    assert (
        statistics.median(
            _compute_wall(r) / (r["compute_s"] + r["slowdown_s"]) for r in slow
        )
        > 0.9
    )
    # The sleep is (k - 1) times the median of the last steps of this shape;
    # its first execution, run before joining, is in no round.
    window = Injector.window
    computes = [r["compute_s"] for r in slow]
    for i, r in enumerate(slow):
        recent = computes[max(0, i - window + 1) : i + 1]
        assert r["slowdown_s"] == pytest.approx(3 * statistics.median(recent), rel=1e-6)


def test_slowdown_schedule_changes_mid_run():
    # The schedule's clock runs from the start of the run, whose first round
    # waits for the compile: the change comes well after a compile here takes.
    # A loaded machine can still hold the first rounds past it (one run's
    # first round ended at 2.6 s where the measured end was 0.57 s): the run
    # goes again with the change twice as late, at most twice.
    switch = 1.0 + 2 * _first_round_end()
    for _ in range(3):
        rounds = _run(
            _solo(
                WorkerConfig(
                    batch_size=256,
                    overlap="none",
                    heterogeneity=Heterogeneity(slowdown=[(0, 1), (switch, 5)]),
                ),
                steps=None,
                seconds=switch + 1.0,
            )
        )
        before = [r for r in rounds[1:] if r["compute_end"] < switch]
        after = [r for r in rounds if r["time"] > switch]
        if before and after:
            break
        switch *= 2
    assert before and after, (switch, [(r["time"], r["compute_end"]) for r in rounds])
    assert all(r["slowdown_s"] == 0 for r in before)
    # (5 - 1) times the median of the last steps of this shape, before the
    # switch's included.
    computes = [r["compute_s"] for r in rounds]
    for r in after:
        i = rounds.index(r)
        # The shape's first execution ran before joining: every round counts.
        recent = computes[max(0, i - Injector.window + 1) : i + 1]
        assert r["slowdown_s"] == pytest.approx(4 * statistics.median(recent))
    # And each of those rounds spent it: its wall holds its compute and its
    # sleep (a timer may fire a millisecond early). A ratio of medians of wall
    # to compute fell to 3.4 beside busy processes, steps varying as they do.
    assert all(
        _compute_wall(r) >= r["compute_s"] + r["slowdown_s"] - 0.002 for r in after
    )
    assert all(r["slowdown_s"] > 0 for r in after)


def test_bandwidth_cap_delays_transfers():
    nbytes = 256 * 256 * 4
    base = _run(_solo(WorkerConfig(batch_size=16, overlap="none"), steps=5))
    capped = _run(
        _solo(
            WorkerConfig(
                batch_size=16,
                overlap="none",
                heterogeneity=Heterogeneity(bandwidth=nbytes / 0.05),
            ),
            steps=5,
        )
    )
    for r in capped:
        # One push and one pull of the model: 0.05 s each, spent in the
        # transfer (its wall time holds the delay).
        assert r["link_delay_s"] == pytest.approx(0.1, rel=0.05)
        assert r["transfer_s"] >= r["link_delay_s"]
    # Without the cap no delay is added. (The two runs' transfer times are not
    # compared: on a loaded machine an uncapped run's transfers alone varied
    # by more than 0.1 s.)
    assert all(r["link_delay_s"] == 0 for r in base)


def _two_worker_plan(global_batch: int = 256):
    from hpsjax.profiling import WorkerProfile, plan

    profiles = [WorkerProfile.synthetic(w, 1000.0) for w in ("w0", "w1")]
    return plan(profiles, "hps", global_batch=global_batch)


def test_server_replans_from_the_reported_step_times(caplog):
    caplog.set_level("INFO")
    from hpsjax.profiling import Replanner
    from hpsjax.ps import Client

    _, params, _ = _heavy_loss()
    zeros = jax.tree.map(np.zeros_like, params)
    settings = dict(threshold=0.5, window=3, cooldown=0.0, warmup=0)
    replanner = Replanner(_two_worker_plan(), **settings)
    # What the server should see: each push of 2 local steps on 256 samples is
    # two steps of 128 samples; w0 becomes four times slower from its 3rd push.
    pushes = [
        (w, 0.128 * (4.0 if w == "w0" and step >= 2 else 1.0))
        for step in range(6)
        for w in ("w0", "w1")
    ]

    async def go():
        async with Server(
            params, optax.sgd(0.1), "asp", secret=SECRET, replanner=replanner
        ) as server:
            clients = {
                w: Client("127.0.0.1", server.port, worker_id=w, secret=SECRET)
                for w in ("w0", "w1")
            }
            for client in clients.values():
                await client.connect()
                await client.pull()
                # The plan in force comes with the join.
                assert client.plan.batch_size == 128
                assert client.plan.revision == 0
            for w, step_time in pushes:
                await clients[w].push(
                    zeros,
                    version=server.version,
                    step_time=2 * step_time,
                    num_samples=256,
                    local_steps=2,
                )
            final = server.work_plan
            async with asyncio.timeout(10):
                while any(c.plan.revision < final.revision for c in clients.values()):
                    await asyncio.sleep(0.01)
            plans = {w: c.plan for w, c in clients.items()}
            for client in clients.values():
                await client.close()
            return plans, final

    plans, final = _run(go())
    expected = Replanner(_two_worker_plan(), **settings)
    for i, (w, step_time) in enumerate(pushes):
        expected.observe(w, 128, step_time, now=float(i))
    assert final == expected.plan and final.revision >= 1
    for entry in final.workers:
        assert plans[entry.worker_id] == PlanNotice(
            revision=final.revision,
            batch_size=entry.batch_size,
            device_batches=(entry.batch_size,),
            local_steps=1,
            lr_scale=1.0,
        )
    assert plans["w0"].batch_size < 100 < plans["w1"].batch_size
    assert "after worker w0's speed drifted" in caplog.text


@pytest.mark.slow
def test_a_worker_made_slow_mid_run_gets_less_work():
    from hpsjax.profiling import Replanner

    # Planned equal; w0 becomes four times slower after its first rounds. The
    # plan's speed is not this machine's, so the first re-plans also correct
    # it; one after the slowdown must move work from w0 to w1. Each re-planned
    # batch compiles beside the rounds (seconds under load): the run goes on
    # until w0 has run a round on less work after the slowdown, or 80 s. On a
    # loaded machine a step's time varies tenfold from one round to the next:
    # eight rounds' average and a second between re-plans keep the plan from
    # chasing that (each new batch compiles before it runs).
    switch = 1.0 + 2 * _first_round_end()
    replanner = Replanner(_two_worker_plan(), threshold=0.5, window=8, cooldown=1.0)
    slow = WorkerConfig(
        batch_size=16,  # replaced by the server's plan on joining
        overlap="none",
        heterogeneity=Heterogeneity(slowdown=[(0, 1), (switch, 4)]),
    )
    fast = WorkerConfig(batch_size=16, overlap="none")

    def less_work_after_the_slowdown(r):
        return (
            r["event"] == "round"
            and r["worker"] == "w0"
            and r["time"] > switch + 0.5
            and r["plan_revision"] >= 1
            and r["batch_size"] < 128
        )

    records, _ = _run(
        _heavy_run(
            [slow, fast],
            steps=None,
            seconds=80.0,
            # Both join before either computes: under a parallel suite w0's
            # compile once let w1 push long enough for a first re-plan.
            server_kwargs={
                "replanner": replanner,
                "core_kwargs": {"expected_workers": 2},
            },
            until=lambda records: any(map(less_work_after_the_slowdown, records)),
        )
    )
    w0, w1 = _rounds(records, "w0"), _rounds(records, "w1")
    assert w0[0]["batch_size"] == w1[0]["batch_size"] == 128
    assert w0[0]["plan_revision"] == 0
    # Every revision keeps the global batch, so w0's round on fewer than half
    # of it is a plan that gave w1 more. (The plan in force when the run stops
    # can be a later revision, made from a noisy stretch of a loaded machine:
    # one ended at 141 and 115 after w0 had run on less work.)
    assert replanner.plan.revision >= 1
    assert sum(w.batch_size for w in replanner.plan.workers) == 256
    moved = [r for r in w0 if less_work_after_the_slowdown(r)]
    if not moved:  # what each worker ran, revision by revision, to read why

        def runs(rounds):
            spans = {}
            for r in rounds:
                key = (r["plan_revision"], r["batch_size"])
                first, _, n = spans.get(key, (r["time"], r["time"], 0))
                spans[key] = (first, r["time"], n + 1)
            return [(k, f"{a:.1f}-{b:.1f} s", n) for k, (a, b, n) in spans.items()]

        pytest.fail(
            f"w0 never ran on less work after the slowdown at {switch:.1f} s; "
            f"(revision, batch): span, rounds: w0 {runs(w0)}; w1 {runs(w1)}; "
            f"the plan in force: revision {replanner.plan.revision}, batches "
            f"{[w.batch_size for w in replanner.plan.workers]}"
        )
    assert all(r["lr_scale"] == 1.0 for r in moved)


def test_server_rejects_a_bad_replanner():
    _, params, _ = _heavy_loss()
    with pytest.raises(ValueError, match="Replanner"):
        Server(params, optax.sgd(0.1), secret=SECRET, replanner="hps")


# ---------------------------------------------------------------- scripted server


def _meta_fields(meta) -> dict:
    """A PushMeta's fields, ``None`` ones too (none without one)."""
    return {} if meta is None else msgspec.structs.asdict(meta)


class ScriptedClient:
    """Stands in for ``hpsjax.ps.Client``: serves fixed parameters, records pushes.

    Every pull answers a version ``advance`` higher than the last (as if other
    workers pushed meanwhile); ``acks`` is a list of dicts merged into the next
    push acknowledgements; ``local_steps`` and ``plan`` can be set by the test.
    """

    def __init__(self, params, *, advance: int = 1, acks=(), drop_after: int = -1):
        self.params = params
        self.version = 0
        self.advance = advance
        self.acks = list(acks)
        self.pushes: list[dict] = []
        self.pulls = 0
        self.push_pulls = 0
        self.local_steps: int | None = None
        self.plan: PlanNotice | None = None
        self.closed = True
        self.bytes_sent = 0
        self.bytes_received = 0
        self._drop_after = drop_after

    async def connect(self):
        self.closed = False

    async def close(self, *, timeout=None):
        self.closed = True

    async def pull(self, *, timeout=None):
        await asyncio.sleep(0)
        self.pulls += 1
        if self.pulls > 1:
            self.version += self.advance
        self.bytes_received += 1000
        return jax.tree.map(np.copy, self.params), self.version

    async def push(self, update=None, meta=None, **fields):
        await asyncio.sleep(0)
        if len(self.pushes) == self._drop_after:
            self._drop_after = -1
            raise WorkerDropped("dropped for the test")
        fields = {**_meta_fields(meta), **fields}
        version = fields["version"]
        self.pushes.append({"update": update, **fields})
        self.bytes_sent += 1000
        ack = dict(
            worker_id="w0",
            version=self.version,
            staleness=self.version - version,
            status="applied",
            weight=1.0,
            local_steps=None,
            reason=None,
            force_pull=False,
        )
        if self.acks:
            ack.update(self.acks.pop(0))
        return PushAck(**ack)

    async def push_pull(self, update=None, meta=None, **fields):
        self.push_pulls += 1
        ack = await self.push(update, meta, **fields)
        params, new_version = await self.pull()
        return ack, params, new_version


def _scripted_worker(setup, client, *, records, local_optimizer=None, **config):
    train, _, loss_fn = setup
    stream = train.batches(16, seed=0)
    return Worker(
        WorkerConfig(worker_id="w0", batch_size=16, **config),
        loss_fn=loss_fn,
        batches=stream.next,
        local_optimizer=local_optimizer,
        metrics=records.append,
        client=client,
    )


def test_ps_plus_scales_updates_by_the_staleness_factor(setup):
    train, params, loss_fn = setup
    client = ScriptedClient(params, advance=3)
    records: list[dict] = []
    worker = _scripted_worker(
        setup,
        client,
        records=records,
        max_steps=5,
        staleness_lr="inverse_plus_one",
    )
    _run(worker.run())
    stream = train.batches(16, seed=0)
    grad = jax.jit(jax.grad(lambda p, b: jnp.mean(loss_fn(p, b))))
    estimates = {
        r["pushed_step"]: r for r in records if r.get("pushed_step") is not None
    }
    assert len(client.pushes) == 5
    taus = []
    for step, push in enumerate(client.pushes):
        expected = grad(params, stream.next(16))
        tau = estimates[step]["staleness_estimate"]
        factor = float(staleness_factor("inverse_plus_one", tau))
        assert estimates[step]["lr_factor"] == pytest.approx(factor)
        assert factor == pytest.approx(1 / (1 + tau))
        for got, want in zip(
            jax.tree.leaves(push["update"]), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_allclose(
                got, factor * np.asarray(want), rtol=1e-4, atol=1e-7
            )
        taus.append(tau)
    assert max(taus) >= 3


def test_eager_pulls_fetch_fresher_parameters_while_compute_runs(setup):
    _, params, _ = setup
    client = ScriptedClient(params)
    records: list[dict] = []
    worker = _scripted_worker(
        setup,
        client,
        records=records,
        max_steps=6,
        overlap="eager",
        eager_pulls=3,
        # Long compute (sleeping) leaves room for several round trips; the
        # first round, the step's first execution, is not slowed, so the
        # compute estimate catches up over the rounds after it.
        heterogeneity=Heterogeneity(slowdown=40),
    )
    _run(worker.run())
    rounds = _rounds(records)
    assert rounds[0]["pulls"] == 1  # no estimates yet
    assert max(r["pulls"] for r in rounds[1:]) == 3
    # Each round starts on the newest parameters its pulls brought.
    for previous, current in itertools.pairwise(rounds):
        assert current["version"] == previous["pulled_version"]
    assert rounds[-1]["pulled_version"] == client.version


@pytest.mark.parametrize("pull_with_push", [True, False])
def test_pipelined_rounds_send_one_push_pull_each(setup, pull_with_push):
    _, params, _ = setup
    client = ScriptedClient(params)
    records: list[dict] = []
    worker = _scripted_worker(
        setup, client, records=records, max_steps=3, pull_with_push=pull_with_push
    )
    summary = _run(worker.run())
    # Rounds 0 and 1 are pushed as the next round starts, round 2 at the end.
    assert summary.pushes == 3 and len(client.pushes) == 3
    # Elided: rounds 1 and 2 pull inside the push of the round before (the
    # join and round 0, with nothing to push, pull alone; the last push is
    # a flush). Pulls answered either way: the join and one a round.
    assert client.push_pulls == (2 if pull_with_push else 0)
    assert client.pulls == 4
    rounds = _rounds(records)
    for previous, current in itertools.pairwise(rounds):
        assert current["version"] == previous["pulled_version"]


def test_force_pull_discards_the_round_computed_meanwhile(setup):
    _, params, _ = setup
    client = ScriptedClient(params, acks=[{}, {"force_pull": True, "reason": "saps"}])
    records: list[dict] = []
    worker = _scripted_worker(setup, client, records=records, max_steps=5)
    summary = _run(worker.run())
    rounds = _rounds(records)
    # Round 2 carried the forced pull (for round 1's push); round 2's own update
    # was computed on parameters the server gave up, so it is never pushed.
    assert [r["discarded"] for r in rounds] == [False, False, True, False, False]
    assert [p["version"] for p in client.pushes] == [
        rounds[i]["version"] for i in (0, 1, 3, 4)
    ]
    assert summary.discarded == 1 and summary.pushes == 4


def test_server_hints_set_local_steps_and_plan(setup):
    _, params, _ = setup
    client = ScriptedClient(params)
    records: list[dict] = []
    worker = _scripted_worker(
        setup,
        client,
        records=records,
        max_steps=4,
        local_optimizer=optax.sgd(0.05),
        compile_beside=False,
    )

    async def go():
        task = asyncio.ensure_future(worker.run())
        while len(records) < 1:
            await asyncio.sleep(0.001)
        client.local_steps = 3
        client.plan = PlanNotice(revision=1, batch_size=8, lr_scale=0.5)
        return await task

    _run(go())
    rounds = _rounds(records)
    assert rounds[0]["local_steps"] == 1 and rounds[-1]["local_steps"] == 3
    assert rounds[-1]["batch_size"] == 8 and rounds[-1]["lr_scale"] == 0.5
    assert rounds[-1]["plan_revision"] == 1
    assert [p["local_steps"] for p in client.pushes][-1] == 3
    assert client.pushes[-1]["num_samples"] == 24


def test_a_new_batch_compiles_beside_the_rounds_that_keep_the_last(setup):
    _, params, _ = setup
    client = ScriptedClient(params)
    records: list[dict] = []
    worker = _scripted_worker(setup, client, records=records, max_steps=10_000)

    async def go():
        task = asyncio.ensure_future(worker.run())
        while len(records) < 2:
            await asyncio.sleep(0.001)
        client.plan = PlanNotice(revision=1, batch_size=8)
        deadline = time.monotonic() + 120
        while not any(p["num_samples"] == 8 for p in client.pushes):
            assert time.monotonic() < deadline, "batch 8 never compiled"
            await asyncio.sleep(0.005)
        worker.stop()
        return await task

    _run(go())
    rounds = _rounds(records)
    samples = [p["num_samples"] for p in client.pushes]
    first_new = samples.index(8)
    # Rounds went on with batch 16 while 8 compiled, saying so in their
    # pushes and records; none compiled in the round.
    revised = [r for r in rounds if r["plan_revision"] == 1]
    assert revised[0]["batch_size"] == 16 and revised[0]["compile_s"] == 0.0
    assert samples[:first_new] == [16] * first_new
    assert set(samples[first_new:]) == {8}
    assert all(r["compile_s"] == 0.0 for r in revised)


def test_bad_plan_hint_is_refused(setup):
    _, params, _ = setup
    client = ScriptedClient(params)
    client.plan = PlanNotice(revision=1, device_batches=(4, 4))
    worker = _scripted_worker(setup, client, records=[], max_steps=2)
    with pytest.raises(ProtocolError, match="device_batches"):
        _run(worker.run())
    assert client.pushes == [] and client.closed


@pytest.mark.parametrize(
    "plan",
    [
        {"revision": 2, "batch_size": 8, "lr_scale": -1.0},
        {"revision": 2, "batch_size": 8, "local_steps": 0},
        {"revision": 2, "device_batches": "8"},
        {"revision": "2", "batch_size": 8},
        ["batch_size", 8],
    ],
)
def test_a_bad_plan_is_refused_where_it_arrives(plan):
    with pytest.raises(ProtocolError):
        PlanNotice.from_wire(plan)


def test_dropped_worker_joins_again(setup):
    _, params, _ = setup
    client = ScriptedClient(params, drop_after=1)
    records: list[dict] = []
    worker = _scripted_worker(setup, client, records=records, max_steps=4)
    summary = _run(worker.run())
    assert summary.rejoins == 1
    assert [r["rejoined"] for r in _rounds(records)] == [False, False, True, False]
    # Round 0's update went through; round 1's was lost with the drop, round 2's
    # was computed before the rejoin and is discarded; round 3's is flushed.
    assert [p["version"] for p in client.pushes] == [
        r["version"] for r in _rounds(records) if r["step"] in (0, 3)
    ]


def test_fault_injection_raises_after_n_rounds(setup):
    _, params, _ = setup
    client = ScriptedClient(params)
    worker = _scripted_worker(setup, client, records=[], fail_after_steps=2)
    with pytest.raises(RuntimeError, match="fault injected after 2 rounds"):
        _run(worker.run())
    assert client.closed
