"""Tests of the local launcher and the ``hpsjax-worker`` command line.

End-to-end launches start real processes (a server and workers on loopback) and
check that every process started is gone afterwards, whatever happened. They
share the session's compilation cache (``session_compile_cache``); the work
directory's own cache, the default, is tested in test_plan_link.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import signal
import sys
import textwrap
import time

import jax
import numpy as np
import pytest
from _models import SMALL_MODEL, alive

from hpsjax import launch as launch_module
from hpsjax import profiling
from hpsjax.cli import worker as _cli
from hpsjax.launch import LaunchError, _job, _local, launch
from hpsjax.launch import _cli as launch_cli
from hpsjax.models import save_params_npz


def _children() -> set[int]:
    """Live (non-zombie) child processes of this process, from /proc."""
    found = set()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def _rounds(path: pathlib.Path) -> list[dict]:
    lines = path.read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == "round"]


# ---------------------------------------------------------------- fast checks


def test_argument_errors_are_clear():
    with pytest.raises(LaunchError, match="num_workers"):
        launch(0, progress=False)
    with pytest.raises(LaunchError, match="steps"):
        launch(1, steps=0, progress=False)
    with pytest.raises(LaunchError, match="string"):
        launch(1, worker_args="--batch_size 8", progress=False)
    with pytest.raises(LaunchError, match="worker 5"):
        launch(2, per_worker_args={5: ["--slowdown", "2"]}, progress=False)
    with pytest.raises(LaunchError, match="plan scheme"):
        launch(2, plan="fastest", progress=False)
    with pytest.raises(LaunchError, match="replan"):
        launch(2, replan=0.2, progress=False)
    with pytest.raises(LaunchError, match="bad worker flags"):
        launch(1, worker_args=["--no_such_flag"], progress=False)
    with pytest.raises(LaunchError, match="server_shards"):
        launch(1, server_shards=0, progress=False)
    with pytest.raises(LaunchError, match="split_leaves needs server_shards"):
        launch(1, split_leaves=True, progress=False)


def test_main_splits_server_and_worker_flags():
    own, server, worker = launch_cli._split_argv(
        ["--workers", "2", "--server", "--optimizer", "adam", "--", "--bits", "8"]
    )
    assert own == ["--workers", "2"]
    assert server == ["--optimizer", "adam"]
    assert worker == ["--bits", "8"]
    assert launch_module.main(["--workers", "0", "--no_progress"]) == 2


_STUBBORN = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def test_shutdown_kills_process_groups_that_ignore_sigterm():
    lines = []
    process = _job.Process(
        "stubborn",
        [sys.executable, "-c", _STUBBORN],
        lines.append,
        dict(os.environ),
    )
    deadline = time.monotonic() + 30
    while not lines and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(lines[0].split()[-1])
    start = time.monotonic()
    _job.shutdown([process], timeout=0.5)
    assert time.monotonic() - start < 10
    assert process.poll() == -signal.SIGKILL
    assert not alive(process.pid)
    # The grandchild was in the same group; it got SIGKILL too (reaped by init).
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(grandchild, os.WNOHANG)
        time.sleep(0.05)
    state = pathlib.Path(f"/proc/{grandchild}/stat")
    assert not alive(grandchild) or (
        state.exists() and state.read_text().split()[2] == "Z"
    )


# ---------------------------------------------------------------- worker CLI


def test_write_init_matches_the_model(tmp_path):
    from hpsjax import data, models
    from hpsjax.ps._cli import load_npz_tree

    path = tmp_path / "init.npz"
    assert _cli.main([*SMALL_MODEL, "--write_init", str(path)]) == 0
    loaded = load_npz_tree(path)
    train, _ = data.synthetic_digits(600).split(0.2, seed=0)
    _, params = models.split_model(
        models.get_model(
            "mlp", input_shape=train.input_shape, num_classes=10, hidden=(16,)
        )
    )
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_profile_out_writes_a_profile_with_the_slowdown(tmp_path, monkeypatch):
    import hpsjax.profiling
    from hpsjax.profiling import WorkerProfile

    measured = tmp_path / "measured.json"
    flags = [*SMALL_MODEL, "--profile_batch_sizes", "8,64", "--worker_id", "3"]
    flags += ["--shard_count", "4"]
    assert _cli.main([*flags, "--profile_out", str(measured)]) == 0
    real = WorkerProfile.from_json(measured.read_text())
    assert real.worker_id == 3 and real.devices[0].batch_sizes == (8, 64)
    assert real.transfer is None

    # The slowdown and link cap in force at the start shape the profile.
    calls = []

    def fake_profile(step, params, make_batch, **kwargs):
        calls.append(kwargs)
        return WorkerProfile.synthetic(kwargs["worker_id"], 1000.0)

    monkeypatch.setattr(hpsjax.profiling, "profile", fake_profile)
    slow = tmp_path / "slow.json"
    args = ["--slowdown", "0:3,10:1", "--bandwidth", "1e6", "--latency", "0.01"]
    assert _cli.main([*flags, *args, "--profile_out", str(slow)]) == 0
    got = WorkerProfile.from_json(slow.read_text())
    base = WorkerProfile.synthetic(3, 1000.0)
    assert got.devices[0].step_time(64) == pytest.approx(
        3 * base.devices[0].step_time(64)
    )
    nbytes = real.param_bytes
    assert got.transfer.method == "estimated"
    assert got.transfer.push_bytes == got.transfer.pull_bytes == nbytes
    assert got.transfer.round_trip_seconds == pytest.approx(2 * 0.01 + 2 * nbytes / 1e6)
    assert calls[0]["batch_sizes"] == [8, 64]


@pytest.mark.parametrize(
    "flags",
    [
        ["--slowdown", "0.5"],
        ["--bandwidth", "-1"],
        ["--bits", "3"],
        ["--shard_index", "3", "--shard_count", "2"],
        ["--local_steps", "2"],
    ],
)
def test_worker_cli_refuses_bad_flags(flags, capsys):
    assert _cli.main([*SMALL_MODEL, "--port", "1", *flags]) == 2
    assert "hpsjax-worker:" in capsys.readouterr().err


def test_server_cli_refuses_a_bad_work_plan(tmp_path, capsys):
    from hpsjax.ps import _cli as server_cli

    init = tmp_path / "init.npz"
    save_params_npz(init, {"w": np.zeros(3, np.float32)})
    plan = tmp_path / "plan.json"
    plan.write_text('{"format": "something else"}')
    argv = ["--init", str(init), "--work_plan", str(plan), "--no-malloc_tuning"]
    assert server_cli.main(argv) == 2
    assert "WorkPlan" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_launch_runs_to_completion(tmp_path, session_compile_cache):
    log = io.StringIO()
    result = launch(
        2,
        policy="bsp",
        steps=4,
        worker_args=SMALL_MODEL,
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=log,
        timeout=240,
    )
    assert result.returncode == 0, log.getvalue()
    assert result.reason == "completed"
    assert result.worker_returncodes == (0, 0)
    assert result.server_returncode == 0
    assert len(result.pids) == 3
    assert not any(alive(pid) for pid in result.pids)
    for i in range(2):
        rounds = _rounds(tmp_path / f"metrics_{i}.jsonl")
        assert [r["step"] for r in rounds] == [0, 1, 2, 3]
    text = log.getvalue()
    assert "[server] hpsjax-server listening" in text
    assert "[worker 1] hpsjax-worker done" in text


@pytest.mark.slow
def test_the_run_starts_once_every_worker_joined(tmp_path, session_compile_cache):
    # Worker 1's interpreter starts 8 s late: without the launcher's hold,
    # worker 0 would train its four BSP rounds alone meanwhile.
    late = tmp_path / "python"
    late.write_text(
        "#!/bin/sh\n"
        'case "$*" in *"hpsjax.cli.worker"*"--worker_id 1 "*) sleep 8;; esac\n'
        f'exec {sys.executable} "$@"\n'
    )
    late.chmod(0o755)
    log = io.StringIO()
    result = launch(
        2, policy="bsp", steps=4, worker_args=SMALL_MODEL, python=str(late),
        compile_cache=session_compile_cache, workdir=tmp_path / "run",
        progress=False, log=log, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, log.getvalue()
    # Every version is a round of both workers: they saw the same versions
    # (alone, worker 0 would have made the first four).
    seen = [
        [r["pulled_version"] for r in _rounds(tmp_path / "run" / f"metrics_{i}.jsonl")]
        for i in range(2)
    ]
    assert seen[0] == seen[1] and len(seen[0]) == 4, seen


@pytest.mark.slow
def test_a_crashing_worker_stops_everything(tmp_path, session_compile_cache):
    log = io.StringIO()
    start = time.monotonic()
    result = launch(
        3,
        policy="asp",
        steps=100000,
        worker_args=SMALL_MODEL,
        per_worker_args={1: ["--fail_after_steps", "3"]},
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=log,
        timeout=240,
        shutdown_timeout=5.0,
    )
    assert result.returncode != 0
    assert result.reason == "worker 1 exited with status 1", log.getvalue()
    assert result.worker_returncodes[1] == 1
    assert len(result.pids) == 4
    assert not any(alive(pid) for pid in result.pids)
    assert time.monotonic() - start < 200
    assert "fault injected after 3 rounds" in log.getvalue()


@pytest.mark.slow
def test_launch_with_a_profiled_plan(tmp_path, session_compile_cache):
    result = launch(
        2,
        policy="bsp",
        steps=3,
        worker_args=SMALL_MODEL,
        per_worker_args={0: ["--slowdown", "3"]},
        plan="hps",
        replan=0.5,
        # Both workers join before either computes, so the re-planner has
        # reports from both before it may revise the plan.
        server_args=["--core_arg", "expected_workers=2"],
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=io.StringIO(),
        timeout=240,
    )
    assert result.returncode == 0
    assert result.profile_seconds > 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    batches = [w["batch_size"] for w in plan["workers"]]
    assert sum(batches) == 32
    # The plan is H-PS's plan of the profiles the pass measured. How those
    # profiles rank the two workers depends on the machine's load as much as
    # on worker 0's slowdown when a step takes a fraction of a millisecond:
    # under a parallel suite worker 1's bare step has been timed 15 times
    # worker 0's. That the slowdown multiplies a profile's step times is
    # tested in test_worker_cli.py, how a plan shares a batch in test_plan.py.
    profiles = [
        profiling.WorkerProfile.from_json((tmp_path / f"profile_{i}.json").read_text())
        for i in range(2)
    ]
    replanned = profiling.plan(profiles, "hps", global_batch=32)
    assert [w.batch_size for w in replanned.workers] == batches
    first = _rounds(tmp_path / "metrics_0.jsonl")[0]
    assert first["batch_size"] == batches[0]
    # The server holds the plan too, and sent it on joining.
    assert first["plan_revision"] == 0
    assert not any(alive(pid) for pid in result.pids)


@pytest.mark.slow
def test_launch_over_server_shards_with_a_plan(tmp_path, session_compile_cache):
    log = io.StringIO()
    result = launch(
        2,
        policy="bsp",
        steps=3,
        worker_args=SMALL_MODEL,
        per_worker_args={0: ["--slowdown", "3"]},
        plan="hps",
        replan=0.5,
        # Both workers join before either computes, so the re-planner has
        # reports from both before it may revise the plan.
        server_args=["--core_arg", "expected_workers=2"],
        server_shards=2,
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=log,
        timeout=240,
    )
    assert result.returncode == 0, log.getvalue()
    assert len(result.ports) == 2 and result.port == result.ports[0]
    assert result.server_returncodes == (0, 0)
    assert len(result.pids) == 4
    assert not any(alive(pid) for pid in result.pids)
    text = log.getvalue()
    for shard in range(2):
        assert f"[server {shard}] hpsjax-server listening" in text
    plan = json.loads((tmp_path / "plan.json").read_text())
    batches = [w["batch_size"] for w in plan["workers"]]
    for i in range(2):
        rounds = _rounds(tmp_path / f"metrics_{i}.jsonl")
        assert [r["step"] for r in rounds] == [0, 1, 2]
        # Shard 0 holds the plan and sent each worker its share on joining.
        assert rounds[0]["batch_size"] == batches[i]
        assert rounds[0]["plan_revision"] == 0


def test_server_that_cannot_start_is_reported(tmp_path):
    before = _children()
    with pytest.raises(LaunchError, match="the server exited with status 2"):
        launch(
            1,
            worker_args=SMALL_MODEL,
            server_args=["--optimizer", "nonsense"],
            workdir=tmp_path,
            progress=False,
            log=io.StringIO(),
            start_timeout=60,
        )
    assert _children() <= before


def test_a_temporary_workdir_is_removed_when_a_launch_fails(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(LaunchError, match="cannot build the model"):
        launch(1, worker_args=["--model", "nope"], progress=False, log=io.StringIO())
    assert list(tmp_path.glob("hpsjax-launch-*")) == []


@pytest.mark.slow
def test_a_launch_without_tqdm_removes_its_temporary_workdir(
    tmp_path, monkeypatch, session_compile_cache
):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # not installed
    log = io.StringIO()
    result = launch(
        1, steps=2, worker_args=SMALL_MODEL, log=log, timeout=240,
        compile_cache=session_compile_cache,
    )  # fmt: skip
    assert result.returncode == 0, log.getvalue()
    assert list(tmp_path.glob("hpsjax-launch-*")) == []
    # Nothing points at the removed directory.
    assert result.workdir is None
    last = log.getvalue().strip().splitlines()[-1]
    assert "no --workdir: metrics not kept" in last and str(tmp_path) not in last


# ---------------------------------------------------------------- restarts


def test_max_restarts_is_checked():
    for bad in (-1, 1.5, True):
        with pytest.raises(LaunchError, match="max_restarts must be an int >= 0"):
            launch(1, max_restarts=bad, progress=False)


def test_what_counts_as_a_crash():
    # A signal or a failure is restarted; a clean end and bad flags are not.
    assert _job.is_crash(-9) and _job.is_crash(1)
    assert not _job.is_crash(0)
    assert not _job.is_crash(2)
    assert not _job.is_crash(None)


def test_a_restartable_server_gets_checkpoint_flags(tmp_path):
    args = _local._restart_checkpoint_args([], tmp_path, 0, 1)
    assert args == ["--checkpoint_dir", str(tmp_path), "--checkpoint_every_s", "1.0"]
    # Shards keep their checkpoints apart.
    args = _local._restart_checkpoint_args([], tmp_path, 1, 2)
    assert args[:2] == ["--checkpoint_dir", str(tmp_path / "shard_1")]
    # The user's own flags win.
    mine = ["--checkpoint_dir=ckpt", "--checkpoint_every_updates", "5"]
    assert _local._restart_checkpoint_args(mine, tmp_path, 0, 1) == []


def test_max_restarts_reaches_the_local_launcher(monkeypatch):
    seen = {}

    def fake_launch(num_workers, **kwargs):
        seen.update(kwargs, num_workers=num_workers)
        return launch_module.LaunchResult(0, "completed", 0, (0,), (), None, None,
                                          None, 0.0)  # fmt: skip

    monkeypatch.setattr(launch_cli, "launch", fake_launch)
    assert launch_module.main(["--workers", "2", "--max_restarts", "4"]) == 0
    assert seen["max_restarts"] == 4 and seen["num_workers"] == 2
    # Locally the default is no restart.
    assert launch_module.main(["--workers", "2"]) == 0
    assert seen["max_restarts"] == 0


@pytest.mark.slow
def test_a_crashed_worker_is_restarted_until_its_restarts_are_used_up(
    tmp_path, session_compile_cache
):
    # Worker 1 fails after 3 rounds every time it runs: restarted once, with
    # the same flags, it fails again and that ends the run.
    log = io.StringIO()
    result = launch(
        2,
        policy="asp",
        steps=100000,
        worker_args=SMALL_MODEL,
        per_worker_args={1: ["--fail_after_steps", "3"]},
        max_restarts=1,
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=log,
        timeout=240,
        shutdown_timeout=5.0,
    )
    out = log.getvalue()
    assert result.reason == "worker 1 exited with status 1", out
    assert result.worker_restarts == (0, 1)
    assert result.server_restarts == (0,)
    assert "[launch] worker 1 crashed (status 1); restarting it (1 of 1)" in out
    assert out.count("fault injected after 3 rounds") == 2
    # The server ran with checkpoints it could be restarted from.
    assert list((tmp_path / "checkpoints").iterdir())
    assert len(result.pids) == 4
    assert not any(alive(pid) for pid in result.pids)


# ------------------------------------------------- beneath launch: LocalRun


def test_worker_places_must_match_the_workers(tmp_path):
    from hpsjax.launch import Console, Job, LocalRun, profile_in_place

    job = Job(2, "asp", 1, [], [], [[], []], [], 1, False)
    places = [([sys.executable], {})]
    with pytest.raises(LaunchError, match=r"^1 worker places for 2 workers$"):
        LocalRun(job, Console(io.StringIO()), sys.executable, 0, 1.0, {}, places)
    with pytest.raises(LaunchError, match=r"^1 worker places for 2 workers$"):
        profile_in_place(
            job, tmp_path, tmp_path / "secret.txt", tmp_path / "init.npz",
            Console(io.StringIO()), python=sys.executable, env={},
            start_timeout=1.0, shutdown_timeout=1.0, places=places,
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_local_run_trains_against_the_callers_server_in_its_places(
    tmp_path, session_compile_cache
):
    # As the experiments' processes backend runs: the caller serves the model
    # itself (any optax chain or policy object), the launcher starts, watches
    # and stops the workers, each in its place.
    import asyncio

    import optax

    from hpsjax.launch import Console, Job, LocalRun, run_env, write_secret
    from hpsjax.ps import Server
    from hpsjax.ps._cli import load_npz_tree

    init = tmp_path / "init.npz"
    # This process's own JAX stays off the cache the fixture names for the
    # workers.
    argv = [*SMALL_MODEL, "--compile_cache_dir", "none", "--write_init", str(init)]
    assert _cli.main(argv) == 0
    secret, secret_file = write_secret(tmp_path)
    # Each worker's head records its place's variable, then runs the worker.
    record = (
        "import os, sys; open(sys.argv[1], 'w').write(os.environ['PLACE']); "
        "os.execvp(sys.argv[2], sys.argv[2:])"
    )
    marks = [str(tmp_path / f"place_{i}") for i in range(2)]
    places = [
        ([sys.executable, "-c", record, mark, sys.executable], {"PLACE": f"p{i}"})
        for i, mark in enumerate(marks)
    ]
    job = Job(2, "bsp", 3, [], list(SMALL_MODEL), [[], []], [], 1, False)
    log = io.StringIO()
    env = run_env(tmp_path, session_compile_cache)

    async def serve_and_watch():
        server = Server(
            load_npz_tree(init), optax.sgd(0.05), "bsp", host="127.0.0.1",
            port=0, secret=secret, core_kwargs={"expected_workers": 2},
        )  # fmt: skip
        await server.start()
        run = LocalRun(job, Console(log), sys.executable, 0, 60.0, env, places)
        try:
            run.start_workers(str(secret_file), tmp_path, ports=[server.port])
            deadline = time.monotonic() + 240
            while (reason := run.poll()) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return reason, server.core.version, run
        finally:
            run.stop(5.0)
            await server.close()

    reason, version, run = asyncio.run(serve_and_watch())
    assert reason == "completed", log.getvalue()
    # BSP: a version a round (more where a loaded machine's deadline dropped a
    # worker and the other's push made one alone).
    assert version >= 3
    for i in range(2):
        assert (tmp_path / f"place_{i}").read_text() == f"p{i}"
        rounds = _rounds(tmp_path / f"metrics_{i}.jsonl")
        assert [r["step"] for r in rounds] == [0, 1, 2]
    assert len(run.processes) == 2
    assert not any(alive(p.pid) for p in run.processes)


def test_a_run_config_launches_as_it_is(tmp_path, session_compile_cache):
    from hpsjax.config import RunConfig, parse_server, parse_worker
    from hpsjax.launch import launch_run

    shared = [*SMALL_MODEL, "--steps", "3"]
    run = RunConfig(
        workers=(
            parse_worker([*shared, "--slowdown", "2"]),
            parse_worker([*shared, "--batch_size", "8", "--worker_id", "1"]),
        ),
        server=parse_server(["--init", "unused.npz", "--policy", "asp"]),
    )
    log = io.StringIO()
    result = launch_run(
        run,
        compile_cache=session_compile_cache,
        workdir=tmp_path,
        progress=False,
        log=log,
        timeout=240,
    )
    assert result.returncode == 0, log.getvalue()
    assert result.worker_returncodes == (0, 0)
    for i, batch in enumerate((16, 8)):
        rounds = _rounds(tmp_path / f"metrics_{i}.jsonl")
        assert [r["step"] for r in rounds] == [0, 1, 2]
        assert {r["batch_size"] for r in rounds} == {batch}
