"""The plan counts the link, the run's processes share one compilation cache,
and a diverged worker ends a launch in one line.

The launches here start real processes (servers and workers on loopback); the
interpreter the launcher gives its children is a small shell script that
records each child's environment, or stands for a worker that diverges.
"""

from __future__ import annotations

import io
import json
import pathlib
import stat
import sys

import pytest
from _models import SMALL_MODEL, alive

from hpsjax import launch as launch_module
from hpsjax._compile_cache import CACHE_ENV, cache_dir_for
from hpsjax.launch import DIVERGED, _job, launch
from hpsjax.profiling import (
    Link,
    TransferProfile,
    WorkerProfile,
    plan,
)
from hpsjax.profiling.in_place import add_link


def _interpreter(tmp_path: pathlib.Path, body: str) -> str:
    """A shell script standing for the children's Python interpreter."""
    path = tmp_path / "python.sh"
    path.write_text(f'#!/bin/sh\n{body}\nexec {sys.executable} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_add_link_adds_the_injected_delay_to_each_message():
    measured = TransferProfile(0.003, 0.002, 0.001, 100, 200, "measured")
    injected = Link(bandwidth=1e4, latency=0.01).estimate(100, 200)
    both = add_link(measured, injected)
    assert both.method == "measured"
    assert both.push_seconds == pytest.approx(0.002 + 0.01 + 0.01)
    assert both.pull_seconds == pytest.approx(0.001 + 0.01 + 0.02)
    assert both.round_trip_seconds == pytest.approx(0.003 + 0.05)
    assert (both.push_bytes, both.pull_bytes) == (100, 200)
    assert add_link(measured, None) is measured


def test_the_plan_counts_each_workers_link():
    # Equal compute; worker 1's link takes 50 ms a round more.
    slow_link = WorkerProfile.synthetic(1, 1000.0, transfer_seconds=0.05)
    no_link = WorkerProfile.synthetic(0, 1000.0)
    p = plan([no_link, slow_link], "hps", global_batch=200)
    rounds = [w.round_time for w in p.workers]
    assert p.workers[1].transfer_seconds == pytest.approx(0.05)
    # The round includes the link, and the worker with the slow link gets less
    # work so that both finish together.
    assert p.workers[0].batch_size > p.workers[1].batch_size
    assert rounds[0] == pytest.approx(rounds[1], rel=0.02)
    assert p.round_time >= 0.05


def test_the_run_environment_carries_the_compile_cache(tmp_path):
    env = launch_module.run_env(tmp_path, None)
    assert env[CACHE_ENV] == str(cache_dir_for(tmp_path).resolve())
    assert env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    other = launch_module.run_env(tmp_path, tmp_path / "elsewhere")
    assert other[CACHE_ENV] == str((tmp_path / "elsewhere").resolve())


def test_plan_help_lists_the_schemes(capsys):
    from hpsjax.profiling import SCHEMES

    with pytest.raises(SystemExit):
        launch_module.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(s in out for s in SCHEMES)
    assert "--compile_cache" in out
    with pytest.raises(SystemExit) as e:
        launch_module.main(["--workers", "1", "--plan", "nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_diverged_status_is_not_a_crash_to_restart():
    assert not _job.is_crash(DIVERGED)
    assert _job.is_crash(1)
    assert _job.worker_ended(2, DIVERGED, 3.25) == ("worker 2 diverged at t = 3.2 s")
    assert _job.launch_returncode("worker 2 diverged at t = 3.2 s") == DIVERGED
    assert _job.launch_returncode("worker 2 exited with status 1") == 1


@pytest.mark.slow
def test_a_planned_launch_profiles_in_place_with_the_link_and_one_cache(tmp_path):
    seen = tmp_path / "seen"
    seen.mkdir()
    python = _interpreter(
        tmp_path,
        f'echo "$*|${CACHE_ENV}" > "{seen}/$$"',
    )
    work = tmp_path / "run"
    result = launch(
        2,
        policy="bsp",
        steps=3,
        worker_args=[*SMALL_MODEL, "--profile_batch_sizes", "8,32"],
        per_worker_args={0: ["--slowdown", "3"], 1: ["--latency", "0.02"]},
        plan="hps",
        workdir=work,
        progress=False,
        log=io.StringIO(),
        timeout=240,
        python=python,
    )
    assert result.returncode == 0, result.reason
    cache = str(cache_dir_for(work).resolve())
    children = [p.read_text().strip().rsplit("|", 1) for p in seen.iterdir()]
    words = [argv.split() for argv, _ in children]
    modules = sorted(w[w.index("-m") + 1] for w in words)
    # Profile server, two profilers, server, two workers: all with the cache.
    assert modules == [
        "hpsjax.cli.worker", "hpsjax.cli.worker",
        "hpsjax.profiling.in_place", "hpsjax.profiling.in_place",
        "hpsjax.ps._cli", "hpsjax.ps._cli",
    ]  # fmt: skip
    assert all(where == cache for _, where in children)
    # The profiling pass left its compiled programs there.
    assert len(list(pathlib.Path(cache).iterdir())) > 0
    profiles = [
        WorkerProfile.from_json((work / f"profile_{i}.json").read_text())
        for i in range(2)
    ]
    for p in profiles:
        assert p.transfer is not None and p.transfer.method == "measured"
        assert p.transfer.push_bytes == p.transfer.pull_bytes == p.param_bytes
        assert p.transfer.push_seconds > 0 and p.transfer.pull_seconds > 0
    # Worker 1's injected latency is on each of its two messages.
    assert profiles[1].transfer_seconds >= 2 * 0.02
    assert profiles[0].transfer_seconds < profiles[1].transfer_seconds
    work_plan = json.loads((work / "plan.json").read_text())
    assert work_plan["workers"][1]["transfer_seconds"] == pytest.approx(
        profiles[1].transfer_seconds
    )


@pytest.mark.slow
def test_a_diverged_worker_ends_the_launch_in_one_line(tmp_path):
    # Worker 1 stands for one whose loss became non-finite: it exits with the
    # diverged status after a moment; worker 0 would train on.
    python = _interpreter(
        tmp_path,
        'case "$*" in *"hpsjax.cli.worker"*"--worker_id 1 "*) '
        'echo "worker 1 diverged at step 4 (loss nan)"; sleep 1; exit 3;; esac',
    )
    log = io.StringIO()
    result = launch(
        2,
        policy="asp",
        steps=100000,
        worker_args=SMALL_MODEL,
        max_restarts=2,
        progress=False,
        log=log,
        timeout=240,
        python=python,
        workdir=tmp_path / "run",
    )
    assert result.returncode == DIVERGED
    assert result.reason.startswith("worker 1 diverged at t = ")
    t = float(result.reason.split("t = ")[1].split(" s")[0])
    assert 0.5 < t < 200
    assert result.worker_restarts == (0, 0)
    lines = log.getvalue().splitlines()
    launcher = [x for x in lines if x.startswith("[launch]") and "diverged" in x]
    assert len(launcher) == 1
    assert "Traceback" not in log.getvalue()
    assert not any(alive(pid) for pid in result.pids)


def test_pace_runs_after_each_step_outside_the_timing():
    import time

    import jax.numpy as jnp

    from hpsjax.profiling import profile

    seen = []

    def pace(seconds):
        seen.append(seconds)
        time.sleep(0.05)

    def step(w, batch):
        return w - 0.1 * jnp.mean(batch) * w

    prof = profile(
        step, jnp.ones(4), lambda b: jnp.ones((b, 4)),
        batch_sizes=(8, 16), repeats=3, warmup=1, time_budget=10.0, pace=pace,
    )  # fmt: skip
    # One warm-up and three timed steps per batch size.
    assert len(seen) == 8 and all(s > 0 for s in seen)
    assert max(prof.devices[0].step_times) < 0.05
    with pytest.raises(ValueError, match="pace must be callable"):
        profile(step, jnp.ones(4), lambda b: jnp.ones((b, 4)), pace=1.0)


def test_the_launcher_and_the_worker_agree_on_the_diverged_status():
    from hpsjax.cli import worker as _cli

    assert DIVERGED == _cli.DIVERGED == 3
