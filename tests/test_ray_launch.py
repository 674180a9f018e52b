"""Tests of the Ray launch backend (``hpsjax-launch --backend ray``).

The end-to-end cases, on a local Ray cluster, are in ``ray_cluster_cases.py``;
one test here runs them in a pytest of their own.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from hpsjax.launch import LaunchError, _actor, main
from hpsjax.launch import _ray as _ray_launch
from hpsjax.launch._ray import parse_resources, worker_resources_from_flags


def test_parse_resources():
    assert parse_resources("num_cpus=2, num_gpus=0.5,accelerator_type:A100=1") == {
        "num_cpus": 2.0,
        "num_gpus": 0.5,
        "accelerator_type:A100": 1.0,
    }
    assert worker_resources_from_flags(
        [("all", "num_cpus=2"), ("1", "num_gpus=1"), ("1", "num_cpus=4")], 3
    ) == [{"num_cpus": 2.0}, {"num_cpus": 4.0, "num_gpus": 1.0}, {"num_cpus": 2.0}]
    assert _ray_launch._actor_options(
        {"num_cpus": 1.0, "memory": 2e9, "accelerator_type:A100": 0.5}
    ) == {"num_cpus": 1.0, "memory": 2_000_000_000, "resources": {
        "accelerator_type:A100": 0.5}}  # fmt: skip


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("num_gpus", "expected NAME=AMOUNT in resources, got 'num_gpus'"),
        ("=1", "expected NAME=AMOUNT"),
        ("num_gpus=-1", "resource num_gpus needs an amount >= 0, got '-1'"),
        ("num_gpus=lots", "resource num_gpus needs an amount >= 0, got 'lots'"),
        ("num_gpus=inf", "needs an amount >= 0"),
        ("num_cpus=1,num_cpus=2", "resource num_cpus given twice"),
        ("bad name=1", "expected NAME=AMOUNT"),
    ],
)
def test_bad_resources_get_a_one_line_error(text, message):
    with pytest.raises(ValueError, match=r"^[^\n]*$") as e:
        parse_resources(text)
    assert message in str(e.value)


def test_bad_worker_resources_get_a_one_line_error(capsys):
    with pytest.raises(ValueError, match=r"index must be 'all' or 0\.\.1, got '2'"):
        worker_resources_from_flags([("2", "num_cpus=1")], 2)
    with pytest.raises(LaunchError, match=r"resources for worker 3, not in 0\.\.1"):
        _ray_launch.launch_ray(2, worker_resources={3: {"num_cpus": 1}})
    with pytest.raises(
        LaunchError, match="worker 0's resources: num_gpus must be >= 0"
    ):
        _ray_launch.launch_ray(2, worker_resources=[{"num_gpus": -1}])
    with pytest.raises(LaunchError, match="max_restarts must be an int >= 0"):
        _ray_launch.launch_ray(2, max_restarts=-1)
    # From the command line: one line, exit status 2, and nothing started.
    for argv, message in [
        (["--workers", "2", "--worker_resources", "0", "num_gpus=1"],
         "--worker_resources needs --backend ray"),
        (["--workers", "2", "--ray_address", "auto"],
         "--ray_address needs --backend ray"),
        (["--workers", "2", "--backend", "ray",
          "--worker_resources", "x", "num_gpus=1"],
         "index must be 'all' or 0..1, got 'x'"),
        (["--workers", "2", "--backend", "ray", "--server_resources", "num_cpus"],
         "expected NAME=AMOUNT"),
    ]:  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


def test_an_actor_reports_a_crash_with_its_exit_status(monkeypatch, tmp_path):
    # The exit status and whether Ray restarts the process are one fact: a
    # poll between the process's death and the reader's decision once read
    # "exited with status -9" and ended a run that Ray was about to restart.
    pytest.importorskip("ray")  # the actor asks Ray for its node's address
    crashed = _actor.is_crash

    def slow_decision(code):
        time.sleep(1.0)
        return crashed(code)

    exits = []

    def fake_end():  # the actor's end, for Ray to restart it
        exits.append(1)

    monkeypatch.setattr(_actor, "is_crash", slow_decision)
    monkeypatch.setattr(_actor, "_end_actor", fake_end)
    monkeypatch.setattr(_actor, "_DRAIN_SECONDS", 0.1)
    actor = _actor.ProcessActor(
        "worker 0", ["-c", "import time; time.sleep(60)"], {}, True, str(tmp_path)
    )
    os.kill(actor._popen.pid, signal.SIGKILL)
    seen = []
    deadline = time.monotonic() + 10
    while not (seen and seen[-1]["crashed"]) and time.monotonic() < deadline:
        state = actor.poll()
        seen.append(state)
        assert state["returncode"] is None or state["crashed"], state
        time.sleep(0.02)
    assert seen[-1]["crashed"] and seen[-1]["returncode"] == -signal.SIGKILL
    # The reader must be done before the real end is put back.
    actor._reader.join(30)
    assert not actor._reader.is_alive()
    assert exits == [1]


@pytest.mark.slow
def test_the_ray_backend_on_a_local_ray_cluster(tmp_path):
    # The cases start a Ray cluster and run launches on it; they run in a
    # pytest of their own, so that Ray's driver never lives in this process.
    pytest.importorskip("ray")
    cases = pathlib.Path(__file__).with_name("ray_cluster_cases.py")
    try:
        child = subprocess.run(
            [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:xdist",
             "-p", "no:cacheprovider", "-o", "addopts=",
             "--basetemp", str(tmp_path / "cases")],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the Ray cases did not end in 900 s:\n{e.stdout}")
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert re.search(r"^5 passed", child.stdout, re.M), child.stdout[-3000:]
