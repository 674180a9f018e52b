"""Flags made from a configuration's fields: hpsjax-worker's from WorkerConfig."""

import dataclasses
import doctest

import pytest

from hpsjax import _config_flags
from hpsjax._config_flags import config_kwargs, flag_fields, to_argv
from hpsjax.worker import WorkerConfig, WorkerOptions
from hpsjax.worker import _cli as worker_cli


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
    assert "--ignore_hints" in argv and "--no_pull_with_push" in argv
    back = WorkerConfig(**config_kwargs(WorkerConfig, worker_cli.parse_args(argv)))
    assert back == config


def test_a_field_without_a_flag_cannot_travel_as_one():
    with pytest.raises(ValueError, match=r"WorkerConfig.compress_ratio = 0.5 has no"):
        to_argv(WorkerConfig(compress_ratio=0.5))
    assert to_argv(WorkerConfig(compress_ratio=0.5), skip=("compress_ratio",)) == []


def test_a_bad_flag_value_is_one_line_from_the_configuration(capsys):
    argv = ["--port", "1", "--reconnect_timeout", "-1"]
    assert worker_cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["hpsjax-worker: reconnect_timeout must be >= 0, got -1.0."]
