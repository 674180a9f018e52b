"""Tests of benchmarks/bench_lm_devices.py: its rows and its plan on profiles
whose figures are checked by hand, and its one-line refusal of a bad platform."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from hpsjax.profiling import DeviceProfile, WorkerProfile

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "bench_lm_devices", REPO / "benchmarks" / "bench_lm_devices.py"
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _profile(samples_per_second: float, overhead: float) -> WorkerProfile:
    return WorkerProfile(
        worker_id=0,
        devices=(DeviceProfile.synthetic(samples_per_second, overhead=overhead),),
        param_count=1_000_000,
    )


def test_rows_give_tokens_and_the_6n_flop_rate():
    # 1,000 samples/s and no fixed cost: batch 1 in 1 ms, 1024 in 1.024 s.
    rows = bench._rows("cpu", _profile(1000.0, 0.0), seq_len=64)
    assert [r["batch"] for r in rows] == [1, 1024]
    for r in rows:
        assert r["tokens_per_s"] == pytest.approx(1000.0 * 64)
        assert r["tflops"] == pytest.approx(6 * 1e6 * 64_000 / 1e12)
    assert rows[0]["step_ms"] == pytest.approx(1.0)


def test_the_plan_gives_the_gpu_the_batch_and_the_cpus_their_least():
    # A GPU 100x the CPU per sample: H-PS finishes them together where it can,
    # and a CPU worker's smallest batch then sets the round.
    gpu, cpu = _profile(1e5, 1e-3), _profile(1e3, 1e-3)
    work, batches = bench.hps_plan(gpu, cpu, global_batch=128)
    assert [w.worker_id for w in work.workers] == [0, 1, 2]
    assert sum(batches) == 128 and batches[0] > 100
    assert batches[1] == batches[2] == work.min_batch
    assert work.round_time == pytest.approx(1e-3 + batches[1] / 1e3)


def test_a_bad_platform_is_one_line():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_lm_devices.py"),
         "--platforms", "tpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--platforms: cuda and/or cpu, got 'tpu'" in out.stderr
    assert "Traceback" not in out.stderr
