"""The scheme advisor's twin from a pilot's telemetry (experiments.advise
--telemetry): the fits, the seeds' spread, the launch command, bad input."""

import json
import math
import subprocess
import sys

import pytest

from experiments import advise, registry
from hpsjax.telemetry import RoundTelemetry

_MODEL_BYTES = 40_000


def _round(
    worker, step, *, batch=32, per_sample=1e-3, fixed=2e-3, wire=0.01,
    held=0.002, nbytes=_MODEL_BYTES, time=None, compile_s=0.0,
):  # fmt: skip
    """One round record: a push-pull of ``nbytes`` each way."""
    compute = fixed + per_sample * batch
    r = RoundTelemetry(
        worker=worker, round=step, version=step, time=step if time is None else time,
        batch_size=batch, samples=batch, local_steps=1, compute_s=compute,
        encode_s=0.0, decode_s=0.0, push_s=0.0, pull_s=wire + held, server_s=held,
        wait_s=wire + held, round_s=compute + wire + held, tokens_per_s=1.0,
        compile_s=compile_s,
    ).to_record()  # fmt: skip
    r.update(status="applied", pulls=1, bytes_sent=nbytes, bytes_received=nbytes)
    return r


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _back_to_back(records):
    """The rounds one after another, as a worker runs them."""
    now = 0.0
    for r in records:
        r["time"] = now
        now += r["round_s"]
    return records


def _pilot(tmp_path, speeds=(1.0, 2.0, 4.0), rounds=12, batches=(32,)):
    """A workdir: one metrics file per worker, its rounds copied into the
    run's metrics.jsonl, and warm-up rounds that must not count."""
    every = []
    for w, k in enumerate(speeds):
        records = _back_to_back(
            [
                _round(
                    w,
                    i,
                    batch=batches[i % len(batches)],
                    per_sample=1e-3 * k,
                    fixed=2e-3 * k,
                )
                for i in range(rounds)
            ]
        )
        _write(tmp_path / "workers" / f"metrics_{w}.jsonl", records)
        warm = _back_to_back([_round(w, i, per_sample=1.0) for i in range(3)])
        _write(tmp_path / "workers" / "warmup" / f"metrics_{w}.jsonl", warm)
        every += records
    _write(tmp_path / "metrics.jsonl", [*every, {"event": "summary"}])
    return tmp_path


def test_twin_fits_each_workers_fixed_and_per_sample_cost(tmp_path):
    twin = advise.twin_from_telemetry(str(_pilot(tmp_path, batches=(16, 64))))
    assert twin.workers == ("0", "1", "2")
    for i, k in enumerate((1.0, 2.0, 4.0)):
        fit = twin.fits[i]
        assert fit.method == "batches"
        assert fit.slope == pytest.approx(1e-3 * k, rel=1e-6)
        assert fit.intercept == pytest.approx(2e-3 * k, rel=1e-6)
        assert fit.rounds == 11  # the first round is the start-up, and once
    assert not any("one batch size" in n for n in twin.notes)


def test_twin_with_one_batch_size_says_so_and_keeps_it_per_sample(tmp_path):
    twin = advise.twin_from_telemetry(str(_pilot(tmp_path)))
    assert any("one batch size" in n for n in twin.notes)
    config = advise.cluster_config("asp", twin, setting="quick")
    # Step times 1, 2 and 4 times the fastest's (its per-sample level).
    assert list(config.workers.slowdowns) == pytest.approx([1.0, 2.0, 4.0], rel=0.02)
    assert config.backend == "sim"


def test_twin_link_and_server_share(tmp_path):
    twin = advise.twin_from_telemetry(str(_pilot(tmp_path)))
    # 0.01 s of wire per 80 kB round: charged by the byte.
    assert twin.link.method == "wire by the byte"
    assert twin.link.bandwidth == pytest.approx(2 * _MODEL_BYTES / 0.01)
    assert twin.service_s == pytest.approx(0.002)
    assert any("version records" in n for n in twin.notes)
    config = advise.cluster_config("bsp", twin, setting="quick")
    assert config.workers.bandwidth == pytest.approx(8e6)
    assert config.server.service_time == pytest.approx(0.002)
    given = advise.cluster_config(
        "bsp", twin, setting="quick", link=(0.001, 5e7), service_time=0.0
    )
    assert (given.workers.latency, given.workers.bandwidth) == (0.001, 5e7)
    assert given.server.service_time == 0.0


def test_link_with_two_message_sizes_fits_both_terms():
    rows = [
        _round(0, i, nbytes=n, wire=2 * (0.003 + n / 1e7))
        for i, n in enumerate((10_000, 200_000) * 4)
    ]
    fit = advise.fit_wire(rows)
    assert fit.method == "wire fitted"
    assert fit.latency == pytest.approx(0.003)
    assert fit.bandwidth == pytest.approx(1e7)


def test_server_version_records_give_the_share_per_push(tmp_path):
    pilot = _pilot(tmp_path)
    versions = [
        {
            "event": "version",
            "version": v,
            "time": float(v),
            "apply_s": 0.004,
            "serve_s": 0.002,
            "pulls": 3,
        }
        for v in range(12)
    ]
    _write(tmp_path / "server.jsonl", versions)
    twin = advise.twin_from_telemetry(str(pilot))
    # 12 versions of 6 ms over 36 pushes.
    assert twin.service_s == pytest.approx(12 * 0.006 / 36)
    assert not any("version records" in n for n in twin.notes)


def test_start_up_is_the_first_rounds_extra_compute(tmp_path):
    records = [_round(0, i) for i in range(6)]
    records[0]["compute_s"] += 0.5
    records[0]["round_s"] += 0.5
    _back_to_back(records)
    _write(tmp_path / "m.jsonl", records)
    twin = advise.twin_from_telemetry(str(tmp_path / "m.jsonl"))
    assert twin.startup[0] == pytest.approx(0.5, rel=0.05)
    config = advise.cluster_config("asp", twin, setting="quick")
    assert config.workers.startup_times == pytest.approx((twin.startup[0],))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no metrics file or directory"),
        ("{not json\n", "--telemetry: "),
        (json.dumps({"event": "eval", "accuracy": 0.5}) + "\n", "no workers' round"),
        (json.dumps(_round(0, 0)) + "\n", "worker 0 has no round to fit"),
    ],
)
def test_bad_telemetry_is_one_line(tmp_path, content, message):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        advise.twin_from_telemetry(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("text", ["1", "1,1", "a,b", "1,,2", ""])
def test_bad_seeds_are_one_line(text):
    with pytest.raises(ValueError, match="--seeds") as err:
        advise.parse_seeds(text)
    assert "\n" not in str(err.value)


def test_parse_seeds_and_spearman():
    assert advise.parse_seeds("3, 1,2") == [3, 1, 2]
    assert advise.spearman([1, 2, 3, 4], [1, 2, 3, 4]) == pytest.approx(1.0)
    assert advise.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ties take their mean rank.
    assert advise.spearman([1, 1, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    with pytest.raises(ValueError):
        advise.spearman([1], [1])


def test_launch_command_carries_the_optimizers_arguments(tmp_path):
    twin = advise.twin_from_telemetry(str(_pilot(tmp_path)))
    hps = advise.cluster_config("hps", twin, setting="quick")
    launch, _, not_carried = advise.launch_command(hps, twin)
    assert launch.startswith("hpsjax-launch --workers 3 ")
    assert "--optimizer lookahead_momentum" in launch
    assert "--optimizer_arg gamma=0.25" in launch
    assert not_carried == []
    schemes = [
        s
        for s in registry.SCHEMES
        if registry.load_config(s).server.optimizer == "delayed_nesterov"
    ]
    if schemes:
        config = advise.cluster_config(schemes[0], twin, setting="quick")
        delay = config.server.outer_delay or 3
        assert (
            f"--optimizer_arg delay={delay}" in advise.launch_command(config, twin)[0]
        )


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.advise", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--telemetry={missing}"], "--telemetry: no metrics file or directory"),
        (["--telemetry={pilot}", "--seeds=1"], "--seeds: at least two"),
        (["--telemetry={pilot}", "--seeds=x,2"], "--seeds: expected"),
        (["--telemetry={pilot}", "--profiles=p*.json"], "give one of --profiles"),
        ([], "give one of --profiles"),
        (["--telemetry={pilot}", "--service_time=-1"], "--service_time must be"),
        (["--telemetry={pilot}", "--link=0"], "--link: expected"),
    ],
)
def test_cli_bad_input_is_one_line_and_runs_nothing(tmp_path, args, message):
    pilot = _pilot(tmp_path / "pilot")
    args = [a.format(pilot=pilot, missing=tmp_path / "missing") for a in args] + [
        "--setting=quick",
        "--schemes=asp",
        f"--workdir={tmp_path}/runs",
    ]
    result = _cli(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_advise_from_telemetry_gives_mean_spread_and_ties(tmp_path):
    twin = advise.twin_from_telemetry(str(_pilot(tmp_path / "pilot")))
    rows = advise.advise(
        twin,
        schemes=["bsp", "asp"],
        factors=(1.0,),
        seeds=(1, 2),
        workdir=tmp_path / "runs",
        setting="quick",
        budget=2.0,
    )
    assert sorted(r["scheme"] for r in rows) == ["asp", "bsp"]
    for r in rows:
        assert len(r["times"]) == 2 and r["updates_per_s"] > 0
        reached = [t for t in r["times"] if t is not None]
        if reached:
            assert r["time_to_target"] == pytest.approx(sum(reached) / len(reached))
            assert r["spread"] >= 0
    assert rows[0]["tied"] is False
    text = advise.format_advice(rows, twin)
    assert "telemetry of" in text and "mean ± spread of 2 seeds" in text
    assert f"| 1 | {rows[0]['scheme']} |" in text
    assert "hpsjax-launch --workers 3" in text
    if rows[1]["tied"]:
        assert f"(tied with {rows[0]['scheme']})" in text
    # The seeds are separate runs, and a second call reuses them.
    assert {p.name for p in (tmp_path / "runs" / "asp").iterdir()} == {
        "lr_0.1_seed_1",
        "lr_0.1_seed_2",
    }
    again = advise.advise(
        twin, schemes=["bsp", "asp"], factors=(1.0,), seeds=(1, 2),
        workdir=tmp_path / "runs", setting="quick", budget=2.0,
    )  # fmt: skip
    assert [r["times"] for r in again] == [r["times"] for r in rows]


def _summary(t):
    return {
        "time_to_target": t,
        "best_accuracy": 0.95,
        "best_metric": 0.95,
        "target_metric": "accuracy",
        "target_value": 0.9,
        "higher_is_better": True,
        "bytes_sent": 1,
        "end_time": 10.0,
        "pushes": 10,
        "idle_fraction": 0.1,
    }


def test_ranked_by_mean_and_tied_within_the_winners_spread(tmp_path):
    config = registry.load_config("asp", "quick")

    def row(scheme, times):
        summaries = [_summary(t) for t in times]
        return advise._row(scheme, "server.learning_rate", 0.1, summaries, config)

    rows = advise._rank(
        [
            row("late", [12.0, 13.0]),
            row("never", [None, None]),
            row("close", [6.5, 7.5]),
            row("first", [5.0, 7.0]),
            row("once", [4.0, None]),
        ]
    )
    assert [r["scheme"] for r in rows] == ["first", "close", "late", "once", "never"]
    assert rows[0]["time_to_target"] == 6.0 and rows[0]["spread"] == 1.0
    assert [r["tied"] for r in rows] == [False, True, False, False, False]
    assert rows[0]["updates_per_s"] == pytest.approx(1.0)
    text = advise.format_advice(rows, advise.twin_from_telemetry(str(_pilot(tmp_path))))
    assert "| 2 | close | 7.0 ± 0.5 (tied with first) |" in text
    assert "| 4 | once | 4.0 ± 0.0 (1/2 reached) |" in text
    assert "predicted winner: first (tied within the seeds' spread with close)" in text
