"""What ``experiments.run`` and ``experiments.compare`` share on the command line.

A mistake on the command line (an unknown flag, config file, setting, config
field, scheme or suite) ends the program with one line on stderr and exit
status 2, never a traceback: :func:`parse_flags` for what absl parses,
:func:`usage_errors` around the checks a ``main`` makes before it runs.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence

import ml_collections
from absl import flags

from experiments import registry

__all__ = [
    "config_value",
    "diagnose_config_flag",
    "fail",
    "flags_parser",
    "usage_errors",
]

CONFIGS = pathlib.Path(__file__).parent / "configs"
"""Where the schemes' config files are."""


def fail(prog: str, message: str) -> None:
    """Prints ``prog: error: message`` (one line) to stderr and exits with 2."""
    line = " ".join(str(message).split())
    print(f"{prog}: error: {line}", file=sys.stderr)
    raise SystemExit(2)


@contextlib.contextmanager
def usage_errors(prog: str) -> Iterator[None]:
    """Turns a ``ValueError`` or ``OSError`` raised inside into :func:`fail`."""
    try:
        yield
    except (ValueError, OSError) as e:
        fail(prog, str(e))


def _config_files() -> str:
    schemes = ", ".join(sorted(registry.SCHEMES))
    return f"experiments/configs/<scheme>.py for a scheme of {schemes}"


def _load(value: str) -> ml_collections.ConfigDict:
    """The config of ``--config=PATH[:ARG]``; a one-line error if it cannot be."""
    path, _, arg = value.partition(":")
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(
            f"--config: no config file {path!r}; the schemes' configs: "
            f"{_config_files()}"
        )
    spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        return module.get_config(*([arg] if arg else []))
    except (ValueError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ValueError(f"--config={value}: {message}") from None


def _check_override(config: ml_collections.ConfigDict, path: str) -> None:
    node, walked = config, "config"
    for key in path.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            raise ValueError(
                f"--config.{path}: {walked} is a {type(node).__name__}, "
                "not a group of fields"
            )
        if key not in node:
            fields = sorted(node.keys())
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(
                f"--config.{path}: {walked} has no field {key!r}; {hint}"
                f"its fields: {', '.join(fields)}"
            )
        node, walked = node[key], f"{walked}.{key}"


def diagnose_config_flag(argv: Sequence[str]) -> str | None:
    """The first mistake in ``--config=...`` and its ``--config.*`` overrides.

    Returns:
      One line naming it (a missing file, an unknown setting, a field the
      config does not have with the closest one and the valid ones), or
      ``None`` when none is found.
    """
    values = [a.split("=", 1)[1] for a in argv if re.match(r"--?config=", a)]
    if not values:
        return None
    try:
        config = _load(values[-1])
        for arg in argv:
            match = re.match(r"--?(?:no)?config\.([^=]+)", arg)
            if match:
                _check_override(config, match.group(1))
    except ValueError as e:
        return str(e)
    return None


def config_value(prog: str, holder: flags.FlagHolder) -> ml_collections.ConfigDict:
    """The value of a config flag; a config file that failed to load fails."""
    try:
        value = holder.value
        value.keys()  # a file that failed to load raises on first use
        return value
    except OSError as e:  # config_flags defers a file's load error to here
        fail(prog, diagnose_config_flag(sys.argv[1:]) or str(e))


def flags_parser(prog: str):
    """An ``app.run(flags_parser=...)`` that fails in one line (exit 2)."""

    def parse(argv: list[str]) -> list[str]:
        try:
            return flags.FLAGS(argv)
        except Exception as e:  # a config file may raise anything
            message = diagnose_config_flag(argv[1:])
            if message is None:
                text = str(e) if isinstance(e, flags.Error) else f"{e!r}"
                message = text.split("\n", 1)[0]
            fail(prog, message)

    return parse
