"""Tests of the run's own measurements (hpsjax.telemetry) and their exports.

A real server and two workers (one slowed down) train on loopback under BSP;
their round records, the server's version records, the Prometheus
expositions and the TensorBoard scalars are read back and checked against
one another. Margins are loose: the machine is small and shared.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np
import optax
import pytest
from _models import digits_mlp

from hpsjax import telemetry
from hpsjax.data import Batch
from hpsjax.metrics import MetricsWriter, RoundMetrics, ServerMetrics, read_tensorboard
from hpsjax.ps import Server
from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
from hpsjax.worker import Heterogeneity, Worker, WorkerConfig, summarize

SECRET = "test-secret"
SLOWDOWN = 6
TOKENS = 16  # tokens per example, as a language model's sequence length
SLACK = 0.05  # seconds a round's parts may exceed it by (clock reads, the loop)


@pytest.fixture(scope="module")
def setup():
    return digits_mlp(1200)


def _record(**changes):
    fields = dict(
        worker="w0", round=0, version=0, time=0.0, batch_size=8, samples=16,
        local_steps=2, compute_s=0.05, encode_s=0.002, decode_s=0.001,
        push_s=0.0, pull_s=0.03, server_s=0.02, wait_s=0.035, round_s=0.1,
        tokens_per_s=160.0,
    )  # fmt: skip
    fields.update(changes)
    return telemetry.RoundTelemetry(**fields)


async def _bsp_run(setup, tmp_path, steps: int = 12):
    """A BSP server and two workers (the first slowed down), each writing its
    rounds to a metrics file, TensorBoard and Prometheus."""
    train, params, loss_fn = setup
    server_metrics = ServerMetrics(
        jsonl=tmp_path / "server.jsonl", tensorboard_dir=tmp_path / "tb" / "server"
    )
    prometheus = RoundMetrics()
    workers = []
    async with Server(
        params,
        optax.sgd(0.1),
        "bsp",
        secret=SECRET,
        port=0,
        metrics=server_metrics,
    ) as server:
        sinks = []
        for i, slowdown in enumerate((SLOWDOWN, 1)):
            sink = MetricsWriter(
                tmp_path / f"metrics_{i}.jsonl",
                tensorboard_dir=tmp_path / "tb",
                prometheus=prometheus,
            )
            sinks.append(sink)
            config = WorkerConfig(
                port=server.port,
                secret=SECRET,
                worker_id=f"w{i}",
                batch_size=128,
                local_steps=2,
                max_steps=steps,
                overlap="none",
                heterogeneity=Heterogeneity(slowdown=slowdown),
            )
            workers.append(
                Worker(
                    config,
                    loss_fn=loss_fn,
                    batches=train.shard(2, i).batches(128, seed=i).next,
                    local_optimizer=optax.sgd(0.05),
                    metrics=sink,
                    tokens_per_example=TOKENS,
                )
            )
        await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 120)
        server_exposition = server_metrics.exposition()
    for sink in sinks:
        sink.close()
    server_metrics.close()
    return workers, prometheus, server_exposition


@pytest.fixture(scope="module")
def bsp_run(setup, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("telemetry")
    with _capture("hpsjax.worker") as logged:
        workers, prometheus, exposition = asyncio.run(_bsp_run(setup, tmp_path))
    return tmp_path, workers, prometheus, exposition, logged


class _capture:
    """Collects the messages of a logger at INFO."""

    def __init__(self, name: str):
        self.logger = logging.getLogger(name)
        self.messages: list[str] = []

    def __enter__(self):
        self.handler = logging.Handler(logging.INFO)
        self.handler.emit = lambda record: self.messages.append(record.getMessage())
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.messages

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


# ---------------------------------------------------------------- a real run


def test_round_records_are_filled_and_add_up(bsp_run):
    tmp_path, *_ = bsp_run
    rounds = telemetry.read_rounds(tmp_path)
    assert {r.worker for r in rounds} == {"w0", "w1"}
    for r in rounds:
        assert r.samples == r.batch_size * r.local_steps == 256
        assert r.compute_s > 0 and r.round_s > 0
        for part in ("encode_s", "decode_s", "push_s", "pull_s", "server_s"):
            assert getattr(r, part) >= 0.0
        # Without overlap a round is decode, compute, then the push-pull: its
        # parts do not exceed it, and the server's hold is within the trip.
        assert r.decode_s + r.busy_s + r.encode_s + r.pull_s <= r.round_s + SLACK
        assert r.server_s <= r.push_s + r.pull_s + 1e-6
        assert r.wire_s >= 0.0 and 0.0 <= r.other_s <= r.round_s
        assert r.tokens_per_s == pytest.approx(r.samples * TOKENS / r.round_s)
    # Every round's update went out in a push-pull (overlap none).
    assert all(r.pull_s > 0 for r in rounds)


def test_the_slow_worker_computes_and_the_fast_one_waits_on_the_server(bsp_run):
    tmp_path, *_ = bsp_run
    # Round 0 includes compiling; from round 2 on the barrier is steady.
    steady = [r for r in telemetry.read_rounds(tmp_path) if r.round >= 2]
    summary = telemetry.round_summary(steady)
    slow, fast = summary["w0"], summary["w1"]
    assert slow["compute"] > fast["compute"]
    assert slow["compute_s"] > 2 * fast["compute_s"]
    # The fast worker waits at the barrier for the slow one: the server held
    # its pulls, and says how much of that hold was the barrier's (the wait
    # for the slow one's push), and how much its own work.
    assert fast["barrier"] > slow["barrier"]
    assert fast["barrier_s"] > 0.3 * fast["wait_s"]
    for r in steady:
        assert 0.0 <= r.barrier_s <= r.server_s + 1e-9
        assert r.server_own_s == pytest.approx(r.server_s - r.barrier_s)
    idle = telemetry.idle_fraction(steady)
    assert set(idle) == {"w0", "w1"}
    assert all(0.0 <= f <= 1.0 for f in idle.values())
    # The barrier's wait is idle: the fast one idles more than the slow one,
    # most of its idle the barrier's, most of its wait idle.
    assert idle["w1"] > idle["w0"]
    fast_rounds = [r for r in steady if r.worker == "w1"]
    other = sum(r.other_s for r in fast_rounds)
    assert sum(r.barrier_s for r in fast_rounds) >= 0.5 * other
    assert other >= 0.3 * sum(r.wait_s for r in fast_rounds)


def test_the_server_reports_apply_and_serve_time_per_version(bsp_run):
    tmp_path, _, _, exposition, _ = bsp_run
    versions = telemetry.read_versions(tmp_path / "server.jsonl")
    assert len(versions) >= 10
    numbers = [v.version for v in versions]
    assert numbers == sorted(set(numbers))
    applied = [v for v in versions if v.version > 0]
    assert all(v.apply_s > 0 for v in applied)
    # Under BSP both workers pull every version made.
    assert sum(v.pulls for v in versions) >= 2 * len(applied) - 2
    assert all(v.serve_s >= 0 for v in versions)
    text = exposition.decode()
    assert "hpsjax_server_serve_seconds_count" in text
    count = _value(text, "hpsjax_server_serve_seconds_count")
    assert count >= sum(v.pulls for v in versions) - 2
    scalars = read_tensorboard(tmp_path / "tb" / "server")
    assert len(scalars[""]["version/apply_s"]) == len(versions)


def test_prometheus_and_tensorboard_carry_the_rounds(bsp_run):
    tmp_path, workers, prometheus, _, _ = bsp_run
    text = prometheus.exposition().decode()
    for i, worker in enumerate(workers):
        rounds = len(worker.telemetry)
        assert rounds > 0
        name = 'hpsjax_worker_round_part_seconds_count{part="%s",worker="w%d"}'
        for part in ("compute", "encode", "decode", "push", "pull", "server"):
            assert _value(text, name % (part, i)) == rounds
        assert _value(text, f'hpsjax_worker_rounds_total{{worker="w{i}"}}') == rounds
        assert _value(text, f'hpsjax_worker_samples_total{{worker="w{i}"}}') == (
            256 * rounds
        )
    scalars = read_tensorboard(tmp_path / "tb")
    for i, worker in enumerate(workers):
        run = scalars[f"workerw{i}"]
        for field in ("compute_s", "encode_s", "pull_s", "server_s", "tokens_per_s"):
            assert len(run[f"round/{field}"]) == len(worker.telemetry)
        assert [v for _, v in run["round/server_s"]] == pytest.approx(
            [r.server_s for r in worker.telemetry], rel=1e-6, abs=1e-9
        )


def test_the_reader_round_trips_and_the_worker_prints_its_summary(bsp_run):
    tmp_path, workers, _, _, logged = bsp_run
    read = telemetry.read_rounds(tmp_path)
    for worker in workers:
        mine = [r for r in read if r.worker == worker.config.worker_id]
        assert mine == worker.telemetry
    tables = [m for m in logged if m.startswith("where each worker's round went")]
    assert len(tables) == 2
    for table in tables:
        rows = table.splitlines()
        assert "compute" in rows[1] and "server" in rows[1]
        assert rows[2].split()[0] in ("w0", "w1")
    assert telemetry.read_rounds([tmp_path / "metrics_0.jsonl"]) == [
        r for r in read if r.worker == "w0"
    ]
    # The worker's summary of a run takes its other idle from the telemetry.
    records = telemetry.read_records(tmp_path / "metrics_1.jsonl")
    assert summarize(records)["other_idle_fraction"] == pytest.approx(
        telemetry.idle_fraction(records)["w1"]
    )


def test_pipelined_rounds_time_their_push_and_pull_apart(setup):
    train, params, loss_fn = setup
    records: list[dict] = []

    async def main():
        async with Server(
            params, optax.sgd(0.1), "asp", secret=SECRET, port=0
        ) as server:
            workers = [
                Worker(
                    WorkerConfig(
                        port=server.port,
                        secret=SECRET,
                        worker_id=f"w{i}",
                        batch_size=32,
                        max_steps=8,
                        overlap="pipeline",
                        pull_with_push=False,
                    ),
                    loss_fn=loss_fn,
                    batches=train.shard(2, i).batches(32, seed=i).next,
                    metrics=records.append,
                )
                for i in range(2)
            ]
            await asyncio.wait_for(asyncio.gather(*(w.run() for w in workers)), 120)

    asyncio.run(main())
    rounds = telemetry.rounds(records)
    assert len(rounds) == 16
    # From round 1 on each round pushes the last one's update and pulls on
    # its own request; the server's hold (an apply) is within the trips.
    later = [r for r in rounds if r.round >= 1]
    assert all(r.push_s > 0 and r.pull_s > 0 and r.encode_s > 0 for r in later)
    assert all(0.0 <= r.server_s <= r.push_s + r.pull_s for r in rounds)
    assert all(r.wire_s <= r.push_s + r.pull_s for r in rounds)
    # The transfers run beside the compute: the idle wait is at most theirs.
    assert sum(r.wait_s for r in later) <= sum(
        r.encode_s + r.push_s + r.pull_s for r in later
    ) + SLACK * len(later)


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the exposition")


# ---------------------------------------------------------------- the record


def test_record_round_trips_through_json():
    r = _record(worker=3, round=7, discarded=True)
    line = json.dumps(r.to_record())
    back = telemetry.from_record(json.loads(line))
    assert back == r
    assert json.loads(line)["step"] == 7 and json.loads(line)["event"] == "round"


def test_reader_fills_parts_older_records_lack():
    old = {
        "event": "round", "worker": "w1", "step": 4, "time": 2.0, "version": 3,
        "batch_size": 16, "local_steps": 2, "compute_s": 0.04, "slowdown_s": 0.04,
        "wait_s": 0.01, "round_s": 0.1, "loss": None,
    }  # fmt: skip
    r = telemetry.from_record(old)
    assert r.samples == 32 and r.push_s == 0.0 and r.server_s == 0.0
    assert r.tokens_per_s == pytest.approx(320.0)
    assert r.busy_s == pytest.approx(0.08)
    assert telemetry.from_record({"event": "final", "step": 3}) is None
    assert telemetry.from_record({"event": "round", "step": 3}) is None


def test_other_idle_is_what_neither_the_wire_nor_the_server_explains():
    # No overlap: 0.05 compute + 0.001 decode + min(0.035, 0.032) exposed.
    r = _record()
    assert r.wire_s == pytest.approx(0.01)
    assert r.other_s == pytest.approx(0.1 - 0.05 - 0.001 - 0.032)
    # Of the server's 20 ms hold, 15 ms were a barrier's wait for the others:
    # idle, not the server's work, and not exposed communication.
    held = _record(barrier_s=0.015)
    assert held.wire_s == r.wire_s and held.server_own_s == pytest.approx(0.005)
    assert held.other_s == pytest.approx(0.1 - 0.05 - 0.001 - (0.032 - 0.015))
    summary = telemetry.round_summary([held])["w0"]
    assert summary["server_s"] == pytest.approx(0.005)
    assert summary["barrier"] == pytest.approx(0.15)
    # A pipelined round whose transfers hid behind compute idles for nothing.
    hidden = _record(compute_s=0.099, wait_s=0.0, decode_s=0.0, pull_s=0.08)
    assert hidden.other_s == pytest.approx(0.001)
    assert telemetry.idle_fraction([r, hidden]) == {
        "w0": pytest.approx((r.other_s + hidden.other_s) / 0.2)
    }


def test_summary_means_and_shares():
    rs = [_record(round=i, compute_s=0.05 + 0.01 * i) for i in range(3)]
    rs.append(_record(worker="w1", compute_s=0.02, slowdown_s=0.06))
    summary = telemetry.round_summary([*rs, {"event": "final"}])
    assert list(summary) == ["w0", "w1"]
    w0 = summary["w0"]
    assert w0["rounds"] == 3 and w0["round_s"] == pytest.approx(0.1)
    assert w0["compute_s"] == pytest.approx(0.06)
    assert w0["compute"] == pytest.approx(0.6)
    assert summary["w1"]["compute"] == pytest.approx(0.8)
    assert w0["tokens_per_s"] == pytest.approx(160.0)
    text = telemetry.format_summary(summary)
    lines = text.splitlines()
    assert len(lines) == 4
    assert lines[1].split()[:4] == ["worker", "rounds", "round", "compute"]
    assert lines[2].split()[:5] == ["w0", "3", "100.0", "60.0", "60%"]
    assert telemetry.round_summary([]) == {}


def test_read_records_walks_a_workdir(tmp_path):
    (tmp_path / "workers").mkdir()
    with open(tmp_path / "workers" / "metrics_0.jsonl", "w") as f:
        f.write(json.dumps(_record().to_record()) + "\n")
        f.write(json.dumps({"event": "final", "worker": "w0", "step": 1}) + "\n")
    version = telemetry.VersionTelemetry(1, 0.5, 0.001, 0.0002, 2)
    with open(tmp_path / "server.jsonl", "w") as f:
        f.write(json.dumps(version.to_record()) + "\n")
    assert telemetry.read_rounds(tmp_path) == [_record()]
    assert telemetry.read_versions(tmp_path) == [version]
    assert len(telemetry.read_records(tmp_path)) == 3
    # The summaries read a workdir or a file as they take its records.
    records = telemetry.read_records(tmp_path)
    assert telemetry.round_summary(tmp_path) == telemetry.round_summary(records)
    file = tmp_path / "workers" / "metrics_0.jsonl"
    assert telemetry.round_summary(str(file)) == telemetry.round_summary(records)
    assert telemetry.idle_fraction(file) == telemetry.idle_fraction(records)
    with pytest.raises(ValueError, match="no metrics file or directory"):
        telemetry.round_summary(tmp_path / "nope")


def test_reader_refuses_a_missing_path_and_a_bad_line(tmp_path):
    with pytest.raises(ValueError, match="no metrics file or directory"):
        telemetry.read_rounds(tmp_path / "nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        telemetry.read_rounds(bad)


# ---------------------------------------------------------------- exporters


def test_round_metrics_export_each_part():
    m = RoundMetrics(seconds_buckets=(0.01, 0.1))
    m(_record().to_record())
    m(_record(round=1, compute_s=0.2, barrier_s=0.015).to_record())
    m({"event": "final", "worker": "w0"})
    text = m.exposition().decode()
    p = "hpsjax_worker_"
    assert _value(text, p + 'round_part_seconds_count{part="compute",worker="w0"}') == 2
    # The server's hold (server) and, of it, the barrier's wait (barrier).
    assert _value(text, p + 'round_part_seconds_sum{part="barrier",worker="w0"}') == (
        pytest.approx(0.015)
    )
    assert (
        _value(
            text, p + 'round_part_seconds_bucket{le="0.1",part="compute",worker="w0"}'
        )
        == 1
    )
    assert _value(text, p + 'rounds_total{worker="w0"}') == 2
    assert _value(text, p + 'samples_total{worker="w0"}') == 32
    assert _value(text, p + 'tokens_per_second{worker="w0"}') == 160.0
    port = m.serve(0)
    try:
        assert port > 0
        with pytest.raises(ValueError, match="already serving"):
            m.serve(0)
    finally:
        m.stop()


def test_server_metrics_write_one_record_per_version(tmp_path):
    m = ServerMetrics(jsonl=tmp_path / "s.jsonl")
    m.served(0.001, version=0)
    m.apply(0.01, version=1)
    m.served(0.002, version=1)
    m.served(0.003, version=1, pull=False)
    m.apply(0.02, version=2)
    point = m.write_scalars({"version": 2, "live_workers": 1})
    m.close()
    m.close()
    versions = telemetry.read_versions(tmp_path / "s.jsonl")
    assert [(v.version, v.pulls) for v in versions] == [(0, 1), (1, 1), (2, 0)]
    assert versions[1].apply_s == pytest.approx(0.01)
    assert versions[1].serve_s == pytest.approx(0.005)
    assert point["apply_s"] == pytest.approx(0.015)
    assert point["serve_s"] == pytest.approx(0.0015)
    text = m.exposition().decode()
    assert _value(text, "hpsjax_server_serve_seconds_count") == 2


def test_bad_input_is_refused_in_one_line(setup, tmp_path):
    train, _, loss_fn = setup
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(ValueError, match="tokens_per_example") as info:
            Worker(
                WorkerConfig(port=1, worker_id="w0"),
                loss_fn=loss_fn,
                batches=train.batches(8, seed=0).next,
                tokens_per_example=bad,
            )
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="prometheus must be"):
        MetricsWriter(tmp_path / "m.jsonl", prometheus=3)
    with pytest.raises(ValueError, match="strictly increasing"):
        RoundMetrics(seconds_buckets=(1, 0.5))
    assert not math.isnan(_record().other_s)


# ---------------------------------------------------------------- the simulator


def test_simulated_rounds_read_as_the_real_ones():
    train, params, loss_fn = digits_mlp(256)
    data = (np.asarray(train.x), np.asarray(train.y))

    def mean_loss(p, batch):
        return loss_fn(p, Batch(*batch)).mean()

    workers = [
        WorkerSpec(
            ComputeModel(step_time=t),
            heterogeneity=Heterogeneity(bandwidth=1e6, latency=0.005),
            batch_size=16,
            worker_id=i,
        )
        for i, t in enumerate((0.1, 0.4))
    ]
    result = simulate(
        mean_loss, params, data, workers, SimConfig(policy="bsp", duration=5.0)
    )
    rounds = telemetry.from_simulation(result, tokens_per_example=TOKENS)
    assert {r.worker for r in rounds} == {0, 1}
    kept = [r for r in rounds if r.round >= 1 and r.samples]
    for r in kept:
        assert r.samples == 16 and r.local_steps == 1
        assert r.compute_s == pytest.approx((0.1, 0.4)[r.worker], rel=1e-6)
        assert r.server_s <= r.pull_s and r.wait_s <= r.round_s + 1e-9
        assert r.tokens_per_s == pytest.approx(16 * TOKENS / r.round_s)
    summary = telemetry.round_summary(kept)
    # The fast worker waits at the barrier (the simulator's waits are all
    # the barrier's), the slow one computes; their rounds take the same time.
    assert summary["0"]["barrier"] > 0.5 > summary["1"]["barrier"]
    assert summary["0"]["server"] == summary["1"]["server"] == 0.0
    assert telemetry.idle_fraction(kept)["0"] > 0.5
    assert summary["1"]["compute"] > 0.8
    assert summary["0"]["round_s"] == pytest.approx(summary["1"]["round_s"], rel=0.1)
    assert summary["0"]["round_s"] == pytest.approx(
        np.diff([a.time for a in result.applies]).mean(), rel=0.1
    )


@pytest.mark.slow
def test_the_server_command_writes_its_versions_with_metrics(tmp_path):
    """``hpsjax-server --metrics PATH``: one line per version, read back by
    hpsjax.telemetry; a path that cannot be written is one line, exit 2."""
    import subprocess
    import sys

    from hpsjax.cli import worker as worker_cli

    small = ["--dataset_arg", "num_examples=64", "--model_arg", "hidden=[16]"]
    init = tmp_path / "init.npz"
    worker_cli.write_init(worker_cli.parse_args(small), init)
    versions = tmp_path / "versions.jsonl"
    server = subprocess.Popen(
        [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
         "--policy", "asp", "--loop", "asyncio", "--metrics", str(versions),
         "--log_level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = server.stdout.readline().rsplit(":", 1)[1].strip()
        worker = subprocess.run(
            [sys.executable, "-m", "hpsjax.cli.worker", *small, "--port", port,
             "--batch_size", "8", "--max_steps", "8", "--log_level", "WARNING"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        server.terminate()
        server.communicate(timeout=60)
    assert worker.returncode == 0, worker.stderr
    read = telemetry.read_versions(versions)
    assert len(read) >= 6
    assert [v.version for v in read] == sorted({v.version for v in read})
    assert all(v.apply_s >= 0 and v.serve_s >= 0 for v in read)
    bad = subprocess.run(
        [sys.executable, "-m", "hpsjax.ps._cli", "--init", str(init),
         "--metrics", str(tmp_path / "no" / "such" / "v.jsonl")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    assert bad.stderr.startswith("hpsjax-server: --metrics ") and not bad.stdout
