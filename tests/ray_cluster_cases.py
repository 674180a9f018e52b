"""The Ray launch backend on a local Ray cluster: real servers and workers as
actors, started on 127.0.0.1 (no dashboard); afterwards no hpsjax process is left.

Not collected by the suite itself: ``tests/test_ray_launch.py`` runs this file
in a pytest of its own, so that Ray's driver (its threads, its exit when the
cluster stops) never lives in a process that goes on to run other tests.
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

from hpsjax.launch import _prepare
from hpsjax.launch import _ray as _ray_launch

# Ray binds its own services to the node's address: on Linux the routed one,
# unless told to keep to loopback (read when ray is first imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# ray.init starts its head processes from this process with a fork; once JAX is
# loaded JAX warns at every fork, which the project's warnings-as-errors turns
# into a failure. The children exec Ray's own binaries at once and never touch
# JAX, so the warning does not apply here.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:os\.fork\(\) was called:RuntimeWarning"
)

SMALL_MODEL = [
    "--dataset_arg", "num_examples=600", "--model_arg", "hidden=[16]",
    "--batch_size", "16", "--log_level", "WARNING",
]  # fmt: skip

_ACTOR_SECRET = re.compile(r"/hpsjax-(profile-)?(server|worker|\d+)-[^ /]*/secret\.txt")


def _hpsjax_processes() -> dict[int, str]:
    """Live servers and workers of Ray launches on this machine, from /proc.

    They are told apart from other hpsjax processes by their secret files, in
    the actors' own directories (the profiling pass's too).
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


def _gone(pids, seconds: float = 20.0) -> set[int]:
    """The launch's processes still alive after ``seconds`` (a process whose
    actor was killed gets SIGTERM from the kernel and stops by itself)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = set(pids) & set(_hpsjax_processes())
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


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
def test_a_planned_run_survives_a_killed_worker(ray_cluster, tmp_path, monkeypatch):
    def on_the_launchers_host(*args, **kwargs):
        raise AssertionError("the Ray backend profiled on the launcher's host")

    # Each worker is profiled in an actor of its own resources, never here.
    monkeypatch.setattr(_prepare, "profile_in_place", on_the_launchers_host)
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
    # No deadline of its own: the launch ends by its timeout, and the server
    # holds the run until both workers joined (profiling on Ray takes 10 s
    # on an idle machine, 90 s beside two busy processes).
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert thread.is_alive(), log.getvalue()
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
    assert "[launch] profiled 2 worker(s) on their Ray nodes" in out, out
    for i in range(2):
        assert (tmp_path / f"profile_{i}.json").read_text().startswith("{")
    # Everything is gone, and the secret is in none of Ray's logs.
    assert not _gone(result.pids)
    logs = pathlib.Path(ray_cluster._private.worker._global_node.get_logs_dir_path())
    for path in logs.rglob("*"):
        if path.is_file():
            assert secret not in path.read_bytes(), path


@pytest.mark.slow
def test_a_worker_that_cannot_be_placed_stops_the_run(ray_cluster, tmp_path):
    # Each worker asks for both of the cluster's slots: feasible, but worker 1
    # waits for worker 0's, which waits (BSP's held start) for worker 1.
    log = io.StringIO()
    result = _ray_launch.launch_ray(
        2,
        steps=5,
        worker_args=SMALL_MODEL,
        worker_resources=[{"hpsjax_test_slot": 2}, {"hpsjax_test_slot": 2}],
        workdir=tmp_path,
        # The server too must be placed and listen within it: beside two busy
        # processes Ray took over 15 s to start the server's actor.
        start_timeout=40,
        timeout=120,
        progress=False,
        log=log,
    )
    assert result.returncode == 1
    assert result.reason.startswith("worker 1 was not placed within 40")
    assert "'hpsjax_test_slot': 2.0" in result.reason
    assert result.pids and not _gone(result.pids)


@pytest.mark.slow
def test_a_worker_is_profiled_with_its_own_resources(ray_cluster, tmp_path):
    # The profiling actor asks for the worker's resources: both of the
    # cluster's slots, held by worker 0's profiling actor until the pass ends,
    # leave it unplaced, and the launch ends before any run starts.
    log = io.StringIO()
    with pytest.raises(_ray_launch.LaunchError) as e:
        _ray_launch.launch_ray(
            2,
            steps=5,
            plan="hps",
            worker_args=SMALL_MODEL,
            worker_resources=[{"hpsjax_test_slot": 2}, {"hpsjax_test_slot": 2}],
            workdir=tmp_path,
            start_timeout=40,  # the profile server's actor, under load
            timeout=120,
            progress=False,
            log=log,
        )
    message = str(e.value)
    assert message.startswith("profiling worker 1 was not placed"), message
    assert "'hpsjax_test_slot': 2.0" in message and "\n" not in message
    assert not (tmp_path / "plan.json").exists()
    assert not (tmp_path / "metrics_0.jsonl").exists()
    assert not _gone(_hpsjax_processes())


@pytest.mark.slow
def test_a_request_no_node_could_hold_is_refused_at_once(ray_cluster, tmp_path):
    # More GPUs than the cluster's node has (none), a resource none offers:
    # refused before anything is prepared or placed, not after start_timeout.
    for resources, asked in [
        ({1: {"num_gpus": 1}}, "'num_gpus': 1.0"),
        ({0: {"accelerator_type:H100": 1}}, "'accelerator_type:H100': 1.0"),
    ]:
        start = time.monotonic()
        with pytest.raises(_ray_launch.LaunchError) as e:
            _ray_launch.launch_ray(
                2, steps=5, worker_args=SMALL_MODEL, worker_resources=resources,
                workdir=tmp_path, start_timeout=40, progress=False, log=io.StringIO(),
            )  # fmt: skip
        message = str(e.value)
        assert re.match(r"worker \d asks for .* more than any node of the Ray", message)
        assert asked in message and "\n" not in message, message
        assert time.monotonic() - start < 30
        assert not (tmp_path / "init.npz").exists()  # nothing prepared
    assert not _hpsjax_processes()
    assert ray_cluster.is_initialized()  # a cluster it did not start stays


@pytest.mark.slow
def test_a_ray_run_without_workdir_keeps_its_final_parameters(ray_cluster, capsys):
    # As with the local backend: the server exports its final parameters,
    # which come back from its actor to the file the last line names.
    import jax

    from hpsjax.launch import main
    from hpsjax.models import load_params_npz

    code = main(
        ["--backend", "ray", "--workers", "1", "--steps", "4", "--policy", "asp",
         "--no_progress", "--no_eval", "--", *SMALL_MODEL]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    found = re.search(r"hpsjax-launch: final parameters in (\S+\.npz)", out)
    assert found, out
    path = pathlib.Path(found.group(1))
    try:
        params = load_params_npz(path)
        assert params and all(leaf.size for leaf in jax.tree.leaves(params))
    finally:
        path.unlink(missing_ok=True)
