"""Every command line is written from the settings' one declaration.

A flag's name, type, default and help live in one field (:class:`WorkerCommand`,
:class:`WorkerConfig`, :class:`ServerOptions`); the commands' parsers are made
from the fields and the launchers' and experiments' command lines are written
from them (:func:`hpsjax._config_flags.argv_of`), so what is written parses
back to what was meant, and no module writes a flag by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import re

import pytest

from hpsjax._config_flags import add_flags, argv_of, config_kwargs
from hpsjax.launch._job import Job
from hpsjax.ps._cli import parse_args as server_parse_args
from hpsjax.ps._cli import server_options
from hpsjax.ps._options import ServerOptions
from hpsjax.worker import WorkerConfig
from hpsjax.worker import parse_worker_args as worker_parse_args
from hpsjax.worker._command import WorkerCommand, worker_argv

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FLAG = re.compile(r"^--[a-z]")


def hand_written_argv(root: pathlib.Path) -> list[str]:
    """List displays in ``root`` holding a flag followed by a computed value
    (``["--port", str(port)]``): a command line written by hand."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.List):
                continue
            for flag, value in zip(node.elts, node.elts[1:], strict=False):
                if (
                    isinstance(flag, ast.Constant)
                    and isinstance(flag.value, str)
                    and _FLAG.match(flag.value)
                    and not isinstance(value, ast.Constant | ast.Starred)
                ):
                    where = path.relative_to(root.parent).as_posix()
                    found.append(f"{where}:{node.lineno} {flag.value}")
                    break
    return found


def test_the_scan_finds_a_flag_written_by_hand(tmp_path):
    (tmp_path / "m.py").write_text(
        "argv = ['--port', str(port)]\nok = ['--ignore_hints', '--max_steps', '3']\n"
    )
    assert hand_written_argv(tmp_path) == [f"{tmp_path.name}/m.py:1 --port"]


@pytest.mark.parametrize("package", ["hpsjax", "experiments"])
def test_no_command_line_is_written_by_hand(package):
    assert hand_written_argv(ROOT / package) == []


def test_a_worker_command_line_parses_back_to_its_settings():
    command = WorkerCommand(
        servers=(("10.0.0.1", 5555), ("::1", 5556)),
        split_leaves=True,
        secret_file="s.txt",
        task="lm",
        model="transformer",
        model_arg={"d_model": 32, "hidden": [8, 8]},
        dataset="text",
        shard_index=1,
        shard_count=3,
        local_optimizer="adamw",
        local_optimizer_arg={"weight_decay": 0.01},
        slowdown="0:1,60:4",
        latency=0.002,
        eval_every=30.0,
        log_level="WARNING",
    )
    config = WorkerConfig(
        worker_id="gpu0",
        batch_size=16,
        local_steps=4,
        pull_with_push=False,
        follow_hints=False,
        error_feedback=False,
        bits=8,
        max_steps=7,
    )
    args = worker_parse_args(worker_argv(command, config))
    assert WorkerCommand(**config_kwargs(WorkerCommand, args)) == command
    assert WorkerConfig(**config_kwargs(WorkerConfig, args)) == config


def test_argv_of_writes_only_fields_away_from_their_defaults():
    assert argv_of(WorkerConfig, worker_id=None, max_steps=None) == []
    # --worker_id's default is none (the server assigns one): 0 is written.
    assert argv_of(WorkerConfig, worker_id=0) == ["--worker_id", "0"]
    assert argv_of(WorkerConfig, follow_hints=False) == ["--no_follow_hints"]
    with pytest.raises(ValueError, match="WorkerConfig has no field 'steps'"):
        argv_of(WorkerConfig, steps=3)
    with pytest.raises(ValueError, match="has no command-line flag"):
        argv_of(WorkerConfig, port=5555)


def _job(**fields) -> Job:
    base = dict(
        num_workers=2,
        policy="ssp",
        steps=5,
        server_args=["--learning_rate", "0.5"],
        shared=["--batch_size", "8"],
        flags=[[], ["--slowdown", "2"]],
        plan_server_args=argv_of(ServerOptions, work_plan="plan.json"),
        server_shards=1,
        split_leaves=False,
    )
    return Job(**{**base, **fields})


def test_a_launchers_server_command_line_parses_back():
    name, argv = _job(server_shards=2, split_leaves=True).server(
        0, ["python"], "init.npz", "secret.txt", "127.0.0.1"
    )
    assert name == "server 0" and argv[:3] == ["python", "-m", "hpsjax.ps._cli"]
    options = server_options(server_parse_args(argv[3:]))
    assert (options.init, options.secret_file, options.policy) == (
        "init.npz",
        "secret.txt",
        "ssp",
    )
    assert (options.learning_rate, options.work_plan) == (0.5, "plan.json")
    assert (options.server_shard, options.server_shards) == (0, 2)
    assert options.split_leaves


def test_a_launchers_worker_command_line_parses_back():
    job = _job()
    where = job.where([("127.0.0.1", 6000)])
    argv = job.worker(1, ["python"], where, "secret.txt", "m1.jsonl")
    args = worker_parse_args(argv[3:])
    assert (args.host, args.port, args.secret_file) == ("127.0.0.1", 6000, "secret.txt")
    assert (args.worker_id, args.shard_index, args.shard_count) == (1, 1, 2)
    assert (args.metrics, args.max_steps, args.batch_size) == ("m1.jsonl", 5, 8)
    assert args.slowdown == "2"
    sharded = _job(server_shards=2, split_leaves=True)
    args = worker_parse_args(sharded.where([("a", 1), ("b", 2)]))
    assert args.servers == (("a", 1), ("b", 2)) and args.split_leaves


def test_every_schemes_real_workers_get_flags_that_parse_back():
    from experiments import backends, registry
    from experiments.build import slowdown_schedule

    for scheme in registry.SCHEMES:
        config = registry.load_config(scheme)
        n = len(config.workers.slowdowns)
        for index in (0, n - 1):
            args = worker_parse_args(
                backends._worker_flags(config, index, plan_file=None)
            )
            assert (args.worker_id, args.shard_index, args.shard_count) == (
                index,
                index,
                n,
            )
            assert args.seed == int(config.seed) * 1000 + index, scheme
            assert args.batch_size == int(config.batch_size), scheme
            assert args.model == config.model.name, scheme
            schedule = slowdown_schedule(config, index)
            assert args.slowdown == ",".join(f"{t:g}:{k:g}" for t, k in schedule)


@dataclasses.dataclass(frozen=True)
class _Renamed:
    max_steps: int | None = dataclasses.field(
        default=None, metadata={"help": "rounds", "aliases": ("--steps",)}
    )


def test_a_renamed_flag_takes_its_old_name_and_says_the_new_one_once(capsys):
    parser = argparse.ArgumentParser(prog="cmd")
    add_flags(parser, _Renamed)
    args = parser.parse_args(["--steps", "3", "--steps", "4"])
    assert _Renamed(**config_kwargs(_Renamed, args)) == _Renamed(max_steps=4)
    assert capsys.readouterr().err == "cmd: --steps is deprecated; use --max_steps\n"
    assert argv_of(_Renamed, max_steps=4) == ["--max_steps", "4"]
    assert "--steps" in parser.format_help()


def test_a_run_refuses_workers_it_cannot_tell_apart():
    from hpsjax.config import RunConfig, WorkerSettings

    def worker(worker_id, shard_index=None, shard_count=1):
        return WorkerSettings(
            WorkerCommand(shard_index=shard_index, shard_count=shard_count),
            WorkerConfig(worker_id=worker_id),
        )

    run = RunConfig(workers=[worker(0, 0, 2), worker("b", 1, 2)])
    assert run.workers[1].config.worker_id == "b"
    bad = [
        ([worker(0), worker(0)], "workers 0 and 1 both have worker_id 0"),
        ([worker(0, 0, 2), worker(1, 0, 2)], "workers 0 and 1 both read shard 0"),
        ([worker(0, 0, 2), worker(1, 1, 3)], "different --shard_count values"),
        ([worker(0, 2, 2)], r"worker 0's --shard_index must be an int in \[0, 1\]"),
        ([], "non-empty sequence of WorkerSettings"),
    ]
    for workers, match in bad:
        with pytest.raises(ValueError, match=match) as e:
            RunConfig(workers=workers)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="no server configuration"):
        run.server_argv()


def test_parse_worker_and_parse_server_read_what_the_run_writes():
    from hpsjax.config import RunConfig, parse_server, parse_worker

    server = parse_server(["--init", "i.npz", "--policy", "asp", "--port", "7"])
    worker = parse_worker(["--worker_id", "2", "--bits", "4", "--model", "cnn"])
    run = RunConfig(workers=(worker,), server=server)
    assert parse_server(run.server_argv()) == server
    assert parse_worker(run.worker_argv(0)) == worker
    assert (worker.config.bits, worker.command.model) == (4, "cnn")


def test_the_experiments_workers_are_one_run_config():
    from experiments import backends, registry

    config = registry.load_config("hps")
    run = backends.run_config(config)
    assert [w.config.worker_id for w in run.workers] == list(
        range(len(config.workers.slowdowns))
    )
    assert backends._worker_flags(config, 1, plan_file=None) == run.worker_argv(1)


def test_a_launch_refuses_colliding_workers_and_bad_server_flags_before_starting(
    tmp_path,
):
    from hpsjax.launch import LaunchError, launch

    small = ["--model_arg", "hidden=[8]", "--batch_size", "8"]
    with pytest.raises(LaunchError, match="workers 0 and 1 both have worker_id 7"):
        launch(2, worker_args=[*small, "--worker_id", "7"], workdir=tmp_path)
    with pytest.raises(LaunchError, match="bad server flags: --keyfile needs"):
        launch(1, worker_args=small, server_args=["--keyfile", "k"], workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_launchers_own_command_line_parses_back():
    from hpsjax.launch._cli import parse_args as launch_parse_args
    from hpsjax.launch._options import LaunchOptions

    options = LaunchOptions(
        workers=3,
        model="cnn",
        worker_flags=(("0", "--slowdown 2"), ("2", "--slowdown 4")),
        plan="hps",
        replan=0.3,
        progress=False,
        backend="ray",
        worker_resources=(("all", "num_cpus=1"),),
    )
    argv = argv_of(LaunchOptions, **dataclasses.asdict(options))
    assert argv[:4] == ["--workers", "3", "--model", "cnn"]
    args = launch_parse_args(argv)
    assert LaunchOptions(**config_kwargs(LaunchOptions, args)) == options
    assert args.no_progress and args.worker_flags == [
        ["0", "--slowdown 2"],
        ["2", "--slowdown 4"],
    ]
