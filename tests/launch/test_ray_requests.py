"""The Ray backend's checks before anything is placed: a resource request no
node could hold, and the server's --export_params kept for the launcher's host."""

from __future__ import annotations

import pathlib

from hpsjax.launch import _ray as _ray_launch
from hpsjax.launch._actor import ACTOR_DIR
from hpsjax.launch._job import Job

NODES = [
    {"Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0, "memory": 3e10}},
    {"Alive": True, "Resources": {"CPU": 32.0, "accelerator_type:A100": 1.0}},
    {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},  # gone
]


def test_a_request_that_fits_some_live_node_is_feasible():
    fits = {
        "server shard 0": {"num_cpus": 1.0},
        "worker 0": {"num_cpus": 8.0, "num_gpus": 2.0},
        "worker 1": {"num_cpus": 16.0, "accelerator_type:A100": 1.0},
        "worker 2": {"num_cpus": 1.0, "num_gpus": 0.0, "TPU": 0.0},
    }
    assert _ray_launch._infeasible(fits, NODES) is None


def test_a_request_no_node_could_ever_hold_is_named_in_one_line():
    for request, most in [
        ({"num_cpus": 1.0, "num_gpus": 4.0}, "{'num_cpus': 32.0, 'num_gpus': 2.0}"),
        # Each fits a node, but no node has both.
        ({"num_gpus": 1.0, "accelerator_type:A100": 1.0}, "'num_gpus': 2.0"),
        ({"num_cpus": 33.0}, "{'num_cpus': 32.0}"),
        ({"accelerator_type:H100": 1.0}, "{'accelerator_type:H100': 0}"),
    ]:
        why = _ray_launch._infeasible(
            {"server shard 0": {"num_cpus": 1.0}, "worker 1": request}, NODES
        )
        assert why.startswith(f"worker 1 asks for {request}, more than any node")
        assert most in why and "\n" not in why, why
    assert _ray_launch._infeasible({"worker 0": {"num_cpus": 1.0}}, []).startswith(
        "worker 0 asks for"
    )


def _job(server_args):
    return Job(1, "asp", 3, server_args, [], [[]], [], 1, False)


def test_the_servers_export_goes_to_its_actor_and_comes_back_here():
    for args in (
        ["--optimizer", "adam", "--export_params", "out/p.npz", "--log_level", "INFO"],
        ["--optimizer", "adam", "--export_params=out/p.npz", "--log_level", "INFO"],
    ):
        job, path = _ray_launch._export_in_actor(_job(args))
        assert path == pathlib.Path("out/p.npz")
        assert job.server_args == [
            "--optimizer", "adam", "--export_params", f"{ACTOR_DIR}/params.npz",
            "--log_level", "INFO",
        ]  # fmt: skip
    job, path = _ray_launch._export_in_actor(_job(["--optimizer", "adam"]))
    assert path is None and job.server_args == ["--optimizer", "adam"]


def test_the_parameters_brought_back_are_written_whole(tmp_path):
    server = _ray_launch._Member("server", None, print)
    server.take({"lines": [], "metrics": b"", "pid": 1, "crashed": False,
                 "returncode": 0, "host": "h", "port": 1,
                 "files": {"params.npz": b"npz bytes"}})  # fmt: skip
    server.take({"lines": [], "metrics": b"", "pid": 1, "crashed": False,
                 "returncode": 0, "host": "h", "port": 1,
                 "files": {"params.npz": None}})  # a second stop: gone  # fmt: skip
    target = tmp_path / "deep" / "p.npz"
    _ray_launch._bring_back(server, target)
    assert target.read_bytes() == b"npz bytes"
    assert [p.name for p in target.parent.iterdir()] == ["p.npz"]
    _ray_launch._bring_back(
        _ray_launch._Member("server", None, print), tmp_path / "none.npz"
    )  # it wrote none
    _ray_launch._bring_back(None, tmp_path / "none.npz")
    assert not (tmp_path / "none.npz").exists()
