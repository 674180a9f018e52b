"""Tests of hpsjax.metrics: JSON lines, TensorBoard event files, Prometheus."""

from __future__ import annotations

import io
import math
import time
import urllib.request

import pytest

from hpsjax.metrics import MetricsWriter, ServerMetrics, read_jsonl, read_tensorboard
from hpsjax.worker import JsonLinesSink

# -- JSON lines ----------------------------------------------------------------


def test_jsonl_lines_match_the_workers_sink(tmp_path):
    records = [
        {"event": "round", "worker": 1, "step": 0, "time": 0.5, "loss": 2.25},
        {"event": "round", "worker": 1, "step": 1, "device_batches": [8, 8]},
        {"event": "final", "worker": 1, "ended_by": "steps", "lr_factor": None},
    ]
    out = io.StringIO()
    sink = JsonLinesSink(out)
    with MetricsWriter(tmp_path / "m.jsonl") as writer:
        for record in records:
            sink(record)
            writer(record)
    assert (tmp_path / "m.jsonl").read_text() == out.getvalue()
    assert read_jsonl(tmp_path / "m.jsonl") == records


def test_jsonl_appends_and_writes_non_finite_as_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path) as writer:
        writer({"event": "eval", "accuracy": 0.5})
    with MetricsWriter(path) as writer:
        writer({"event": "eval", "loss": math.nan, "time": math.inf})
    assert read_jsonl(path) == [
        {"event": "eval", "accuracy": 0.5},
        {"event": "eval", "loss": None, "time": None},
    ]


def test_read_jsonl_names_a_bad_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"event": "eval"}\n\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"m.jsonl:3: not a JSON object"):
        read_jsonl(path)


def test_writer_refuses_bad_use(tmp_path):
    with pytest.raises(ValueError, match="needs a jsonl path or a tensorboard_dir"):
        MetricsWriter()
    with pytest.raises(ValueError, match="flush_secs must be a finite number > 0"):
        MetricsWriter(tmp_path / "m.jsonl", flush_secs=0)
    writer = MetricsWriter(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="a record must be a mapping"):
        writer([("event", "eval")])
    writer.close()
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer({"event": "eval"})


# -- TensorBoard ---------------------------------------------------------------


def test_tensorboard_scalars_read_back_per_worker_run(tmp_path):
    with MetricsWriter(tensorboard_dir=tmp_path) as writer:
        for step, loss in enumerate((2.0, 1.5, 1.25)):
            writer({"event": "round", "worker": 0, "step": step, "loss": loss})
        writer({"event": "round", "worker": "w1", "step": 4, "loss": 0.75})
        writer({"event": "eval", "version": 10, "accuracy": 0.5, "time": 3.0})
        writer({"event": "eval", "version": 20, "accuracy": 0.75, "time": 6.0})
        writer({"event": "summary", "target": "none", "ok": True, "batches": [1]})
    runs = read_tensorboard(tmp_path)
    assert set(runs) == {"", "worker0", "workerw1"}
    assert runs["worker0"] == {"round/loss": [(0, 2.0), (1, 1.5), (2, 1.25)]}
    assert runs["workerw1"] == {"round/loss": [(4, 0.75)]}
    assert runs[""] == {
        "eval/version": [(10, 10.0), (20, 20.0)],
        "eval/accuracy": [(10, 0.5), (20, 0.75)],
        "eval/time": [(10, 3.0), (20, 6.0)],
    }


def test_tensorboard_step_counts_records_without_step_or_version(tmp_path):
    with MetricsWriter(tensorboard_dir=tmp_path) as writer:
        for loss in (3.0, 2.0, math.nan, 1.0):
            writer({"event": "push", "loss": loss})
    assert read_tensorboard(tmp_path)[""] == {
        "push/loss": [(0, 3.0), (1, 2.0), (3, 1.0)]
    }


def test_read_tensorboard_stops_at_a_truncated_last_record(tmp_path):
    with MetricsWriter(tensorboard_dir=tmp_path) as writer:
        writer({"event": "eval", "step": 1, "accuracy": 0.25})
        writer({"event": "eval", "step": 2, "accuracy": 0.5})
    (path,) = tmp_path.glob("events.out.tfevents.*")
    path.write_bytes(path.read_bytes()[:-3])
    assert read_tensorboard(tmp_path)[""] == {"eval/accuracy": [(1, 0.25)]}
    path.write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="corrupt record header"):
        read_tensorboard(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_tensorboard(tmp_path / "missing")


# -- Prometheus ----------------------------------------------------------------


def _parse(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _scrape(port: int) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return _parse(response.read().decode())


def test_prometheus_endpoint_serves_the_server_metrics():
    state = {"version": 3, "live_workers": 2}
    metrics = ServerMetrics(state=lambda: state)
    port = metrics.serve(0)
    try:
        assert port > 0
        for staleness in (0, 1, 1, 5):
            metrics.push(staleness=staleness, received_bytes=100)
        metrics.pull(sent_bytes=400)
        metrics.transfer(received_bytes=7, sent_bytes=3)
        metrics.barrier_wait(0.003)
        metrics.barrier_wait(2.0)
        metrics.apply(0.0005)
        metrics.worker_left("dropped")
        metrics.worker_left("done")
        metrics.worker_left("crashed")
        metrics.nonfinite_update()
        metrics.checkpoint_saved(time.time() - 30.0)
        state["version"] = 4
        v = _scrape(port)
    finally:
        metrics.stop()
    p = "hpsjax_server_"
    assert v[p + "version"] == 4.0
    assert v[p + "live_workers"] == 2.0
    assert v[p + "pushes_total"] == 4.0
    assert v[p + "pulls_total"] == 1.0
    assert v[p + "received_bytes_total"] == 407.0
    assert v[p + "sent_bytes_total"] == 403.0
    assert v[p + "dropped_workers_total"] == 2.0  # crashed or dropped, not done
    assert v[p + 'worker_leaves_total{reason="done"}'] == 1.0
    assert v[p + 'worker_leaves_total{reason="replaced"}'] == 0.0
    assert v[p + "nonfinite_updates_total"] == 1.0
    assert v[p + 'staleness_bucket{le="0.0"}'] == 1.0
    assert v[p + 'staleness_bucket{le="1.0"}'] == 3.0
    assert v[p + 'staleness_bucket{le="4.0"}'] == 3.0
    assert v[p + 'staleness_bucket{le="8.0"}'] == 4.0
    assert v[p + 'staleness_bucket{le="+Inf"}'] == 4.0
    assert v[p + "staleness_sum"] == 7.0
    assert v[p + 'barrier_wait_seconds_bucket{le="0.005"}'] == 1.0
    assert v[p + 'barrier_wait_seconds_bucket{le="+Inf"}'] == 2.0
    assert v[p + "barrier_wait_seconds_count"] == 2.0
    assert v[p + 'apply_seconds_bucket{le="0.001"}'] == 1.0
    assert 30.0 <= v[p + "checkpoint_age_seconds"] < 60.0


def test_prometheus_stop_frees_the_port_and_state_is_optional():
    metrics = ServerMetrics()
    port = metrics.serve(0, host="127.0.0.1")
    with pytest.raises(ValueError, match="already serving"):
        metrics.serve(0)
    v = _scrape(port)
    assert "hpsjax_server_version" not in v
    assert "hpsjax_server_checkpoint_age_seconds" not in v
    assert v["hpsjax_server_pushes_total"] == 0.0
    metrics.stop()
    metrics.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"state": 3}, "state must be callable"),
        ({"staleness_buckets": ()}, "staleness_buckets must be finite numbers"),
        ({"seconds_buckets": (1, 0.5)}, "strictly increasing"),
        ({"seconds_buckets": (1, math.inf)}, "seconds_buckets must be a finite number"),
    ],
)
def test_server_metrics_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerMetrics(**kwargs)


def test_server_metrics_refuses_bad_port_and_count():
    metrics = ServerMetrics()
    with pytest.raises(ValueError, match="port must be an int"):
        metrics.serve(70000)
    with pytest.raises(ValueError, match="reason must be one of"):
        metrics.worker_left("left")
