"""Every command's flag that turns something off is spelled ``--no_<name>``;
a former spelling is kept as a deprecated alias that names its successor once."""

from __future__ import annotations

import pytest

from hpsjax._config_flags import _turns_off, config_kwargs, flag_fields
from hpsjax.cli import worker as worker_cli
from hpsjax.export import ExportOptions
from hpsjax.launch._options import LaunchOptions
from hpsjax.ps import ServerOptions
from hpsjax.worker import WorkerCommand, WorkerConfig

CONFIGS = (WorkerConfig, WorkerCommand, ServerOptions, LaunchOptions, ExportOptions)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda cls: cls.__name__)
def test_flags_that_turn_a_field_off_are_no_underscore_flags(cls):
    off = [
        flag
        for field, flag, _ in flag_fields(cls)
        if _turns_off(field) and isinstance(field.default, bool)
    ]
    wrong = [flag for flag in off if not flag.startswith("--no_")]
    assert not wrong, f"{cls.__name__}: {wrong} (the project's style is --no_<name>)"


def test_ignore_hints_is_now_no_follow_hints(capsys):
    new = worker_cli.parse_args(["--no_follow_hints"])
    assert not WorkerConfig(**config_kwargs(WorkerConfig, new)).follow_hints
    assert "deprecated" not in capsys.readouterr().err
    old = worker_cli.parse_args(["--ignore_hints", "--ignore_hints"])
    assert config_kwargs(WorkerConfig, old) == config_kwargs(WorkerConfig, new)
    err = capsys.readouterr().err
    assert err == "hpsjax-worker: --ignore_hints is deprecated; use --no_follow_hints\n"
    default = worker_cli.parse_args([])
    assert WorkerConfig(**config_kwargs(WorkerConfig, default)).follow_hints


def test_the_help_names_the_new_spelling(capsys):
    with pytest.raises(SystemExit) as e:
        worker_cli.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--no_follow_hints" in text
