"""--help of every command: a help line for every flag, defaults, valid names."""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

import pytest

from hpsjax import data, launch, models
from hpsjax.cli import worker as worker_cli
from hpsjax.ps import POLICIES
from hpsjax.ps import _cli as server_cli

REPO = pathlib.Path(__file__).resolve().parents[1]


class _Parser(Exception):
    pass


def _parser(monkeypatch, build) -> argparse.ArgumentParser:
    """The parser a command builds, caught before it parses anything."""

    def catch(self, args=None, namespace=None):
        del args, namespace
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(_Parser) as caught:
        build()
    return caught.value.args[0]


COMMANDS = {
    "hpsjax-server": (lambda: server_cli.parse_args([]), sorted(POLICIES)),
    "hpsjax-worker": (
        lambda: worker_cli.parse_args([]),
        [*models.MODELS, *data.DATASETS],
    ),
    "hpsjax-launch": (lambda: launch.main([]), sorted(POLICIES)),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_has_help_and_the_valid_names_are_listed(command, monkeypatch):
    build, names = COMMANDS[command]
    parser = _parser(monkeypatch, build)
    assert parser.prog == command
    missing = [a.option_strings[0] for a in parser._actions if not a.help]
    assert not missing, f"{command}: flags without help: {missing}"
    text = parser.format_help()
    assert "(default: " in text
    for name in names:
        assert name in text, f"{command} --help does not name {name!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, names",
    [
        ("experiments.run", ["bsp", "hps", "demo", "quick", "sim8", "proc4"]),
        ("experiments.compare", ["demo", "quick", "sim8_slowlink", "proc4"]),
    ],
)
def test_experiment_commands_list_their_names_in_help(module, names):
    out = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = out.stdout + out.stderr
    flags = [line for line in text.splitlines() if line.lstrip().startswith("--")]
    assert flags, text
    for name in names:
        assert name in text, f"{module} --help does not name {name!r}"
    assert "(default:" in text
