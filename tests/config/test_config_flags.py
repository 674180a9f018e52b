"""Flags made from a configuration's fields: hpsjax-worker's from WorkerConfig,
hpsjax-server's from ServerOptions."""

import dataclasses
import doctest

import pytest

from hpsjax import _config_flags
from hpsjax._config_flags import config_kwargs, flag_fields, to_argv
from hpsjax.cli import worker as worker_cli
from hpsjax.ps import HybridStage
from hpsjax.ps import _cli as server_cli
from hpsjax.ps._options import ServerOptions
from hpsjax.worker import WorkerConfig, WorkerOptions


def test_module_doctests():
    assert doctest.testmod(_config_flags).failed == 0


def test_every_core_option_but_the_plan_driven_ones_is_a_worker_flag():
    flagged = {field.name for field, _, _ in flag_fields(WorkerConfig)}
    core = {field.name for field in dataclasses.fields(WorkerOptions)}
    # device_batches and compress_ratio come from the batch and the work plan.
    assert core - flagged == {"device_batches", "compress_ratio"}
    args = worker_cli.parse_args([])
    assert WorkerConfig(**config_kwargs(WorkerConfig, args)) == WorkerConfig()


def test_a_configuration_travels_as_flags_and_back():
    config = WorkerConfig(
        worker_id="w3",
        batch_size=64,
        local_steps=4,
        lr_scale=0.5,
        overlap="eager",
        eager_pulls=3,
        pull_with_push=False,
        follow_hints=False,
        staleness_lr="inverse",
        max_steps=7,
        max_seconds=2.5,
        until_version=9,
        bits=8,
        error_feedback=False,
        timeout=30.0,
        seed=5,
        on_nonfinite="skip",
        reconnect_timeout=0.0,
    )
    argv = to_argv(config)
    assert "--no_follow_hints" in argv and "--no_pull_with_push" in argv
    back = WorkerConfig(**config_kwargs(WorkerConfig, worker_cli.parse_args(argv)))
    assert back == config


def test_a_field_without_a_flag_cannot_travel_as_one():
    with pytest.raises(ValueError, match=r"WorkerConfig.compress_ratio = 0.5 has no"):
        to_argv(WorkerConfig(compress_ratio=0.5))
    # Worker 0 is written: the command line's default is none (the server's).
    assert to_argv(WorkerConfig(compress_ratio=0.5), skip=("compress_ratio",)) == [
        "--worker_id",
        "0",
    ]


def test_a_bad_flag_value_is_one_line_from_the_configuration(capsys):
    argv = ["--port", "1", "--reconnect_timeout", "-1"]
    assert worker_cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hpsjax-worker: --reconnect_timeout must be >= 0, got -1.0."]


def test_every_server_flag_is_a_field_of_its_options():
    args = server_cli.parse_args(["--init", "init.npz"])
    flagged = {dest for _, _, dest in flag_fields(ServerOptions)}
    assert set(vars(args)) == flagged
    assert server_cli.server_options(args) == ServerOptions(init="init.npz")


def test_server_options_travel_as_flags_and_back():
    options = ServerOptions(
        init_from="mlp",
        model_arg={"hidden": [16, 8]},
        dataset_arg={"num_examples": 64, "name": "text"},
        server_shard=1,
        server_shards=2,
        split_leaves=True,
        host="0.0.0.0",
        secret_file="secret.txt",
        policy="hybrid",
        policy_arg={"stages": [HybridStage("async", local_steps=4)]},
        core_arg={"expected_workers": 3},
        optimizer="adamw",
        optimizer_arg={"weight_decay": 0.01},
        momentum=0.5,
        allow_nonfinite=True,
        overlap_apply_bytes=-1,
        checkpoint_every_s=2.5,
        malloc_tuning=False,
        loop="asyncio",
        log_level="DEBUG",
    )
    argv = to_argv(options)
    assert "--no_malloc_tuning" in argv and "--split_leaves" in argv
    back = server_cli.server_options(server_cli.parse_args(argv))
    # JSON has no HybridStage: a stage travels as the object of its fields.
    stages = [dataclasses.asdict(HybridStage("async", local_steps=4))]
    assert back == dataclasses.replace(options, policy_arg={"stages": stages})
    assert to_argv(ServerOptions(init="i.npz")) == ["--init", "i.npz"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "give one of --init and --init_from"),
        ({"init": "a", "init_from": "mlp"}, "give one of --init and --init_from"),
        ({"init": "a", "server_shards": 0}, "--server_shards must be >= 1, got 0"),
        ({"init": "a", "server_shard": 2, "server_shards": 2}, r"in \[0, 2\), got 2"),
        ({"init": "a", "keyfile": "k.pem"}, "--keyfile needs --certfile"),
        ({"init": "a", "host": "0.0.0.0"}, "without a secret"),
        ({"init": "a", "core_arg": {"nope": 1}}, "--core_arg nope: ServerCore has"),
        (
            {"init": "a", "server_shard": 0, "server_shards": 2, "export_params": "p"},
            "each of the 2 shards holds a part",
        ),
    ],
)
def test_server_options_refuse_bad_settings_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as e:
        ServerOptions(**kwargs)
    assert "\n" not in str(e.value)


def test_a_bad_server_setting_is_one_line_and_exit_2(capsys):
    argv = ["--init", "init.npz", "--keyfile", "key.pem"]
    assert server_cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "hpsjax-server: --keyfile needs --certfile"
    ]
