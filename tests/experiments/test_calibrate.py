"""experiments.calibrate: fits on synthetic round records, table, plot, end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments import calibrate, registry


def _round(**fields):
    base = {
        "event": "round",
        "batch_size": 32,
        "local_steps": 1,
        "compute_s": 0.01,
        "slowdown_s": 0.0,
        "compile_s": 0.0,
        "transfer_s": 0.05,
        "link_delay_s": 0.01,
        "pulls": 1,
        "status": "applied",
        "staleness": 0,
        "bytes_sent": 1000,
        "bytes_received": 1000,
    }
    return {**base, **fields}


def test_fit_compute_across_batches_recovers_intercept_and_slope():
    a, c = 0.004, 0.0005
    records = [
        _round(
            batch_size=b,
            compute_s=(a + c * b) * k / 2,
            slowdown_s=(a + c * b) * k / 2,
            local_steps=k,
        )
        for b in (16, 32, 64)
        for k in (1, 2)
    ]
    fit = calibrate.fit_compute(records)
    assert fit.method == "batches"
    assert fit.intercept == pytest.approx(a, rel=1e-6)
    assert fit.slope == pytest.approx(c, rel=1e-6)
    assert fit.sigma < 1e-9


def test_fit_compute_one_batch_takes_the_shape_and_skips_compiling_rounds():
    records = [_round(compute_s=5.0, compile_s=4.0)] + [
        _round(compute_s=0.01, slowdown_s=0.03) for _ in range(5)
    ]
    fit = calibrate.fit_compute(records, shape=0.25)
    assert fit.method == "profile shape"
    assert fit.rounds == 5
    assert fit.mean_step_time(32) == pytest.approx(0.04)
    assert fit.intercept == pytest.approx(0.01)
    with pytest.raises(ValueError, match="no round"):
        calibrate.fit_compute([_round(compile_s=1.0)])


def test_fit_compute_jitter_is_the_spread_of_log_step_times():
    rng = np.random.default_rng(0)
    times = 0.02 * np.exp(0.2 * rng.standard_normal(400))
    fit = calibrate.fit_compute([_round(compute_s=t) for t in times], shape=0.0)
    assert fit.sigma == pytest.approx(0.2, rel=0.1)


def test_round_gap_is_the_time_between_rounds():
    records = [
        _round(time=0.0, round_s=0.1),
        _round(time=0.103, round_s=0.2),
        _round(time=0.308, round_s=0.1),
    ]
    assert calibrate.round_gap(records) == pytest.approx(0.004)
    assert calibrate.round_gap(records[:1]) == 0.0
    steps = [{**r, "step": i} for i, r in enumerate(records)]
    assert calibrate.first_round_seconds(steps) == pytest.approx(0.1)


def test_fit_link_separates_latency_and_bandwidth_when_rounds_vary():
    latency, bandwidth = 0.002, 1e6
    records = []
    for pulls, nbytes in ((1, 2000), (2, 3000), (3, 9000), (1, 500)):
        n = pulls + 1
        records.append(
            _round(
                pulls=pulls,
                bytes_sent=nbytes // 2,
                bytes_received=nbytes - nbytes // 2,
                link_delay_s=n * latency + nbytes / bandwidth,
            )
        )
    fit = calibrate.fit_link(records, bandwidth=5e7)
    assert fit.method == "fitted"
    assert fit.latency == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)


def test_fit_link_keeps_the_cap_when_every_round_is_alike():
    records = [_round(link_delay_s=2 * 0.001 + 2000 / 5e5) for _ in range(4)]
    fit = calibrate.fit_link(records, bandwidth=5e5)
    assert fit.method == "latency only"
    assert fit.bandwidth == 5e5
    assert fit.latency == pytest.approx(0.001)
    assert calibrate.fit_link([], bandwidth=None).bandwidth == math.inf


def test_fit_service_is_the_least_mean_beyond_the_link_of_applied_pushes():
    records = {
        "0": [_round(transfer_s=t) for t in (0.30, 0.31, 0.92)],
        "1": [_round(transfer_s=t) for t in (0.06, 0.05, 0.07)]
        + [_round(transfer_s=5.0, status="buffered")],
    }
    service = calibrate.fit_service(records)
    assert service["per_worker"]["0"] == pytest.approx(0.5)
    assert service["round_s"] == pytest.approx(0.05)


def test_staleness_stats_count_acknowledged_pushes_only():
    records = [_round(staleness=s) for s in range(10)] + [
        _round(staleness=99, status=None)
    ]
    stats = calibrate.staleness_stats(records)
    assert stats["staleness_mean"] == pytest.approx(4.5)
    assert stats["staleness_p90"] == pytest.approx(8.1)
    assert calibrate.staleness_stats([]) == {
        "staleness_mean": None,
        "staleness_p90": None,
    }


def test_fit_startup_is_the_first_round_beyond_the_fitted_steps():
    fit = calibrate.ComputeFit(0.0, 0.01 / 32, 0.0, 32, 10, "x")
    records = [
        _round(step=0, compute_s=0.4, slowdown_s=2.8, compile_s=0.5),
        _round(step=1, compute_s=0.01),
    ]
    assert calibrate.fit_startup(records, fit) == pytest.approx(3.7 - 0.01)
    assert calibrate.fit_startup(records[1:], fit) == 0.0
    waits = [_round(step=0, transfer_s=2.05), _round(step=1), _round(step=2)]
    assert calibrate.first_round_wait(waits) == pytest.approx(2.0)


def test_simulated_config_takes_the_fits_service_and_start_up():
    config = registry.load_config("asp", "proc4")
    fits = {
        i: calibrate.ComputeFit(0.25 * t, 0.75 * t / 32, 0.05, 32, 10, "x")
        for i, t in enumerate((0.2, 0.2, 0.1, 0.05))
    }
    link = calibrate.LinkFit(0.001, 5e7, "latency only", 10)
    sim = calibrate.simulated_config(config, fits, link, 0.04, {0: 3.0, 3: 1.0})
    assert sim.backend == "sim"
    assert sim.workers.step_time == pytest.approx(0.05)
    assert sim.workers.step_overhead == pytest.approx(0.0125)
    assert sim.workers.slowdowns == pytest.approx((4.0, 4.0, 2.0, 1.0))
    assert sim.workers.latency == pytest.approx(0.001)
    assert sim.server.service_time == pytest.approx(0.04)
    assert sim.workers.startup_times == (3.0, 0.0, 0.0, 1.0)
    assert sim.workers.jitter == pytest.approx(0.05)
    assert not sim.plan.replan
    assert config.backend == "processes"


def _figures(rate, idle, ttt):
    return {
        "updates_per_s": rate,
        "worker_updates_per_s": {"0": rate / 2, "1": rate / 2},
        "versions_per_s": rate,
        "idle_fraction": idle,
        "staleness_mean": 1.0,
        "staleness_p90": 2.0,
        "time_to_target": ttt,
    }


def test_compare_table_ranking_and_plot(tmp_path):
    rows = []
    for scheme, m, p in (
        ("bsp", _figures(10, 0.4, 12.0), _figures(11, 0.6, 10.0)),
        ("asp", _figures(40, 0.2, 6.0), _figures(30, 0.21, None)),
    ):
        comparison = calibrate.compare_runs(m, p)
        rows.append(
            {"scheme": scheme, "measured": m, "predicted": p, "comparison": comparison}
        )
    bsp, asp = (r["comparison"] for r in rows)
    assert bsp["within_15pct"] == {
        "updates_per_s": True,
        "idle_fraction": False,
        "worker_updates_per_s": True,
    }
    assert asp["errors"]["updates_per_s"] == pytest.approx(-0.25)
    assert calibrate._ranking(rows, "measured") == ["asp", "bsp"]
    assert calibrate._ranking(rows, "predicted") == ["bsp", "asp"]
    table = calibrate.format_table(rows)
    assert "| bsp | 10.0 / 11.0 | +10% | 0.40 / 0.60 | +50% |" in table
    assert "6.0 / -" in table
    path = calibrate.plot_calibration(rows, tmp_path / "c.png", title="t")
    assert path.stat().st_size > 10_000


@pytest.mark.slow
def test_calibrate_end_to_end_on_processes(tmp_path, session_compile_cache):
    # 4 s of ASP's rounds of one step (tens of milliseconds each at a load of
    # 12) instead of the quick setting's 8 s.
    result = calibrate.calibrate(
        tmp_path,
        setting="quick",
        schemes=("asp",),
        seeds=(0,),
        label="smoke",
        budget_seconds=4.0,
    )
    for run in ("measured", "simulated"):
        config = json.loads(
            (tmp_path / run / "asp" / "seed_0" / "config.json").read_text()
        )
        assert config["budget_seconds"] == 4.0, run
    (row,) = result["rows"]
    assert row["measured"]["updates_per_s"] > 0
    assert row["predicted"]["updates_per_s"] > 0
    assert set(row["measured"]["worker_updates_per_s"]) == {"0", "1", "2"}
    for path in result["paths"].values():
        assert path.is_file()
    assert "| asp |" in result["table"]


@pytest.mark.parametrize("budget", [0, -1.0, True, "4"])
def test_a_bad_budget_is_one_line_before_anything_runs(tmp_path, budget):
    with pytest.raises(ValueError, match="budget_seconds must be > 0") as e:
        calibrate.calibrate(
            tmp_path / "out", setting="quick", schemes=("asp",), budget_seconds=budget
        )
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_finished_run_is_kept_across_fields_added_to_the_configs():
    saved = {"seed": 1, "workers": {"slowdowns": [8, 2]}}
    assert calibrate._same_run(saved, {**saved, "stages": {"switch_loss": 0.3}})
    assert not calibrate._same_run(saved, {**saved, "seed": 2})
