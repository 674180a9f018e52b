"""Tests of the Ray launch backend (``hpsjax-launch --backend ray``).

The end-to-end tests start a local Ray cluster on 127.0.0.1 (no dashboard) and
run real servers and workers as actors; afterwards no hpsjax process is left.
"""

from __future__ import annotations

import io
import os
import pathlib
import re
import signal
import threading
import time

import pytest

from hpsjax import _ray_launch
from hpsjax._ray_launch import parse_resources, worker_resources_from_flags
from hpsjax.launch import LaunchError, main

# Ray binds its own services to the node's address: on Linux the routed one,
# unless told to keep to loopback (read when ray is first imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# ray.init starts its head processes from this process with a fork; once JAX is
# loaded (as it is when the whole suite runs) JAX warns at every fork, which the
# project's warnings-as-errors turns into a failure. The children exec Ray's own
# binaries at once and never touch JAX, so the warning does not apply here.
# The tests share one test process when the suite runs in several: one local
# Ray cluster at a time, and only its launches' processes counted as theirs.
pytestmark = [
    pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning"),
    pytest.mark.xdist_group("ray"),
]

SMALL_MODEL = [
    "--dataset_arg", "num_examples=600", "--model_arg", "hidden=[16]",
    "--batch_size", "16", "--log_level", "WARNING",
]  # fmt: skip

_ACTOR_SECRET = re.compile(r"/hpsjax-(server|worker)-[^ /]*/secret\.txt")


def _hpsjax_processes() -> dict[int, str]:
    """Live servers and workers of Ray launches on this machine, from /proc.

    They are told apart from other hpsjax processes by their secret files, in
    the actors' own directories.
    """
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if state != "Z" and _ACTOR_SECRET.search(text):
            found[int(entry.name)] = text
    return found


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
    from hpsjax import launch as local

    crashed = local._crashed

    def slow_decision(code):
        time.sleep(1.0)
        return crashed(code)

    exits = []

    def fake_exit(code):  # the actor's end, for Ray to restart it
        exits.append(code)

    monkeypatch.setattr(local, "_crashed", slow_decision)
    monkeypatch.setattr(_ray_launch.os, "_exit", fake_exit)
    monkeypatch.setattr(_ray_launch, "_DRAIN_SECONDS", 0.1)
    actor = _ray_launch._ProcessActor(
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
    actor._reader.join(5)
    assert exits == [1]


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(
        num_cpus=4,
        resources={"hpsjax_test_slot": 2},
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 10
    while _hpsjax_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _hpsjax_processes()


def _run_in_thread(**kwargs):
    box = {}

    def run():
        try:
            box["result"] = _ray_launch.launch_ray(**kwargs)
        except BaseException as e:  # surfaced by the test
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.mark.slow
def test_a_planned_run_survives_a_killed_worker(ray_cluster, tmp_path):
    log = io.StringIO()
    steps = 15
    thread, box = _run_in_thread(
        num_workers=2,
        policy="bsp",
        steps=steps,
        plan="hps",
        worker_args=SMALL_MODEL,
        per_worker_args={0: ["--slowdown", "2"]},
        worker_resources=[{"hpsjax_test_slot": 1}, {"hpsjax_test_slot": 1}],
        workdir=tmp_path,
        timeout=240,
        progress=False,
        log=log,
    )
    metrics = tmp_path / "metrics_0.jsonl"
    deadline = time.monotonic() + 200
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and thread.is_alive(), log.getvalue()
        time.sleep(0.2)
    secret = (tmp_path / "secret.txt").read_bytes()
    running = _hpsjax_processes()
    assert len(running) == 3, running
    assert not any(secret.decode() in argv for argv in running.values())
    (worker_0,) = [pid for pid, argv in running.items() if "--worker_id 0 " in argv]
    os.kill(worker_0, signal.SIGKILL)
    thread.join(240)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    result, out = box["result"], log.getvalue()
    assert result.returncode == 0, (result.reason, out)
    assert result.worker_returncodes == (0, 0)
    assert worker_0 in result.pids and len(result.pids) == 4
    assert "[launch] worker 0 restarted by Ray (restart 1" in out
    # It rejoined: the server saw worker 0 join twice, and its metrics hold
    # the rounds of both of its processes.
    assert out.count("worker 0 joined") == 2, out
    assert len(metrics.read_text().splitlines()) >= steps + 3
    assert "hps plan: batches" in out and result.profile_seconds > 0
    # Everything is gone, and the secret is in none of Ray's logs.
    assert not _hpsjax_processes()
    logs = pathlib.Path(ray_cluster._private.worker._global_node.get_logs_dir_path())
    for path in logs.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path


@pytest.mark.slow
def test_a_worker_that_cannot_be_placed_stops_the_run(ray_cluster, tmp_path):
    # An earlier launch's server may still be writing its last checkpoint.
    earlier = set(_hpsjax_processes())
    log = io.StringIO()
    result = _ray_launch.launch_ray(
        2,
        steps=5,
        worker_args=SMALL_MODEL,
        worker_resources={1: {"accelerator_type:H100": 1}},
        workdir=tmp_path,
        start_timeout=15,
        timeout=120,
        progress=False,
        log=log,
    )
    assert result.returncode == 1
    assert result.reason.startswith("worker 1 was not placed within 15")
    assert "'accelerator_type:H100': 1.0" in result.reason
    assert not set(_hpsjax_processes()) - earlier
