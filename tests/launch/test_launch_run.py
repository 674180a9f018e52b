"""launch_run's refusals: a run that sets what the launcher gives, or an
option the run already gives, is one LaunchError before anything starts."""

from __future__ import annotations

import pytest

from hpsjax.config import RunConfig, parse_server, parse_worker
from hpsjax.launch import LaunchError, _local, launch_run


def _started(monkeypatch):
    calls = []
    monkeypatch.setattr(_local, "launch", lambda *a, **k: calls.append((a, k)))
    return calls


def test_a_run_goes_to_launch_as_its_settings(monkeypatch):
    calls = _started(monkeypatch)
    workers = (
        parse_worker(["--batch_size", "16", "--steps", "4", "--slowdown", "2"]),
        parse_worker(["--batch_size", "32", "--steps", "4", "--worker_id", "1"]),
    )
    server = parse_server(
        ["--init", "mine.npz", "--policy", "ssp", "--learning_rate", "0.2"]
    )
    launch_run(RunConfig(workers=workers, server=server), workdir="w")
    ((args, kwargs),) = calls
    assert args == (2,)
    assert kwargs["policy"] == "ssp" and kwargs["steps"] is None
    assert kwargs["workdir"] == "w"
    # Each process's flags parse back to exactly its settings.
    assert [parse_worker(f) for f in kwargs["per_worker_args"]] == list(workers)
    # The server's flags are its settings but its initial parameters, which
    # the launcher writes.
    assert "--init" not in kwargs["server_args"]
    assert parse_server(["--init", "mine.npz", *kwargs["server_args"]]) == server


@pytest.mark.parametrize(
    ("worker", "server", "options", "message"),
    [
        (["--worker_id", "3"], [], {},
         r"^worker 0 has worker_id 3: the launcher gives worker 0 worker_id 0$"),
        (["--shard_index", "1", "--shard_count", "2"], [], {},
         r"^worker 0 has shard_index 1"),
        (["--shard_index", "0", "--shard_count", "2"], [], {},
         r"^worker 0 has shard_count 2: the launcher gives worker 0 shard_count 1$"),
        (["--port", "5000"], [], {}, r"^worker 0 sets port, which the launcher"),
        ([], ["--init", "i.npz", "--port", "5000"], {},
         r"^the run's server sets port, which the"),
        ([], ["--init_from", "ckpt"], {}, r"^the run's server sets init_from"),
        ([], [], {"steps": 3}, r"^launch_run takes steps from the run"),
        ([], [], {"policy": "bsp", "num_workers": 2},
         r"^launch_run takes num_workers, policy from the run"),
    ],
)  # fmt: skip
def test_what_the_launcher_gives_is_refused_in_the_run(
    monkeypatch, worker, server, options, message
):
    calls = _started(monkeypatch)
    run = RunConfig(
        workers=(parse_worker(worker),),
        server=parse_server(server) if server else None,
    )
    with pytest.raises(LaunchError, match=message):
        launch_run(run, **options)
    assert calls == []


def test_a_run_must_be_a_run_config():
    with pytest.raises(LaunchError, match=r"^run must be a hpsjax.config.RunConfig"):
        launch_run(["--batch_size", "16"])
