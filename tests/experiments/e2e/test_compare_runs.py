"""``experiments.compare`` over a long study: progress, resuming, --jobs, overwrite."""

from __future__ import annotations

import json
import logging
import os

import pytest
from _jax_cache import compiling_into

from experiments import compare
from experiments.configs.suites import Suite

SMALLEST = Suite("quick", schemes=("bsp", "asp"))
# These tests read tables and run directories, not figures: PNGs alone.
PNG = ("png",)


def _mtimes(workdir):
    return {
        p.parent.relative_to(workdir).as_posix(): p.stat().st_mtime_ns
        for p in workdir.glob("**/metrics.jsonl")
    }


@pytest.fixture
def shared_compiles(session_compile_cache):
    """This process compiles into the session's compilation cache, which the
    processes of ``--jobs`` read (``session_compile_cache``): a run here or in
    one of them loads the programs an earlier run of the same model compiled.
    The cache changes how long a compile takes, never a run's result."""
    with compiling_into(session_compile_cache):
        yield


def test_progress_then_resume_runs_only_what_is_missing(
    tmp_path, caplog, shared_compiles
):
    caplog.set_level(logging.INFO)
    # experiments.compare logs through absl's logger, which a command run
    # earlier in this process (hpsjax._logs.setup_logging) may have quieted.
    caplog.set_level(logging.INFO, logger="absl")
    suite = Suite("quick", schemes=("asp",))
    compare.run_suite(suite, tmp_path, seeds=[0, 1], progress=False, formats=PNG)
    log = caplog.text
    assert "scheme 1/1 (asp), seed 1/2 (0): done (1/2 runs)" in log
    assert "scheme 1/1 (asp), seed 2/2 (1): done (2/2 runs)" in log
    before = _mtimes(tmp_path)
    assert sorted(before) == ["asp/seed_0", "asp/seed_1"]

    # An interrupted study: one run never finished (no summary yet).
    metrics = tmp_path / "asp" / "seed_1" / "metrics.jsonl"
    metrics.write_text(
        "".join(
            line + "\n"
            for line in metrics.read_text().splitlines()
            if '"event": "summary"' not in line
        )
    )
    caplog.clear()
    result = compare.run_suite(
        suite, tmp_path, seeds=[0, 1], progress=False, formats=PNG
    )
    assert "1 of 2 runs already finished: kept" in caplog.text
    assert "scheme 1/1 (asp), seed 2/2 (1): done (1/1 runs)" in caplog.text
    after = _mtimes(tmp_path)
    assert {k for k in after if after[k] != before[k]} == {"asp/seed_1"}
    assert compare.run_finished(tmp_path / "asp" / "seed_1")
    assert len(result["summaries"]) == 2


def test_a_finished_run_of_another_config_is_never_overwritten_silently(
    tmp_path, shared_compiles
):
    compare.run_suite(
        Suite("quick", schemes=("bsp",)), tmp_path, progress=False, formats=PNG
    )
    before = _mtimes(tmp_path)
    other = Suite("demo", schemes=("bsp",))
    with pytest.raises(ValueError, match=r"finished run .* pass --overwrite"):
        compare.run_suite(other, tmp_path, progress=False, formats=PNG)
    assert _mtimes(tmp_path) == before
    config = json.loads((tmp_path / "bsp" / "config.json").read_text())
    assert config["setting"] == "quick"

    # --overwrite runs it again (here with the first suite, seconds long).
    compare.run_suite(
        Suite("quick", schemes=("bsp",)),
        tmp_path,
        progress=False,
        formats=PNG,
        overwrite=True,
    )
    assert _mtimes(tmp_path)["bsp"] != before["bsp"]


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_bad_jobs_are_refused_before_anything_runs(tmp_path, jobs):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        compare.run_suite(SMALLEST, tmp_path, jobs=jobs, progress=False, formats=PNG)
    assert not any(tmp_path.iterdir())


def test_progress_names_scheme_and_seed_positions():
    label = compare._progress_label("hps", 2, ["bsp", "asp", "hps"], [1, 2, 3])
    assert label == "scheme 3/3 (hps), seed 2/3 (2)"
    assert compare._progress_label("asp", None, ["bsp", "asp"], None) == (
        "scheme 2/2 (asp)"
    )


def test_jobs_are_bounded_by_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert compare._check_jobs(64) == 2
    assert compare._check_jobs(1) == 1


@pytest.mark.slow
def test_parallel_runs_match_serial_ones(tmp_path, caplog, shared_compiles):
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.INFO, logger="absl")  # see the resume test
    serial = compare.run_suite(
        SMALLEST, tmp_path / "serial", progress=False, formats=PNG
    )
    parallel = compare.run_suite(
        SMALLEST, tmp_path / "parallel", progress=False, formats=PNG, jobs=2
    )
    assert "2 simulated runs, 2 at a time" in caplog.text
    # The simulator is deterministic: the same runs in other processes give
    # the same table.
    assert parallel["table"] == serial["table"]


def test_settings_apply_to_their_scheme_only():
    from experiments import registry

    settings = compare.parse_settings(
        ["hps:plan.pilot=True", "hps:plan.pilot_tolerance=0.1", "budget_seconds=12"]
    )
    assert settings[0] == ("hps", "plan.pilot", True)
    for scheme in ("bsp", "hps"):
        config = registry.load_config(scheme, "proc4")
        compare._apply_settings(config, scheme, settings)
        registry.check_config(config)
        assert config.budget_seconds == 12.0
        assert bool(config.plan.pilot) == (scheme == "hps")
    assert config.plan.pilot_tolerance == 0.1


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("plan.pilot", "a setting is [SCHEME:]KEY=VALUE, got 'plan.pilot'"),
        ("hps:plan.nothing=1", "--set: hps's config has no field 'plan.nothing'"),
        ("hsp:plan.pilot=True", "--set: unknown scheme 'hsp' in hsp:plan.pilot"),
        ("hps:plan.pilot_tolerance=abc", "--set: plan.pilot_tolerance='abc'"),
        ("plan.pilot=True", "plan.pilot needs a plan.scheme"),
    ],
)
def test_bad_settings_are_one_line_and_start_nothing(tmp_path, setting, message):
    import subprocess
    import sys

    workdir = tmp_path / "cmp"
    done = subprocess.run(
        [sys.executable, "-m", "experiments.compare", "--suite=proc4",
         "--schemes=bsp,hps", f"--workdir={workdir}", f"--set={setting}"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not workdir.exists()
