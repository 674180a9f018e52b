"""The experiments' command line: one parser class, one way to fail, config flags.

Every ``python -m experiments.<command>`` parses its flags with :class:`Parser`
(argparse): ``--help`` prints the flags and exits 0; a mistake (an unknown
flag, a value of the wrong type or outside its choices, a missing config file,
an unknown setting or config field) ends the program with one line on stderr,
``<command>: error: ...`` naming the flag and the valid values, and exit status
2, never a traceback, before anything runs. :func:`usage_errors` does the same
for the checks a ``main`` makes after parsing. :func:`add_config_flag` adds
``--config=PATH[:SETTING]`` and :func:`config_of` reads it back with its
``--config.KEY=VALUE`` overrides, each checked against the config's typed
fields (:mod:`experiments.configs.schema`). Flags whose meaning several commands
share are made here once (:func:`add_budget_flag`), old names kept as
deprecated aliases that say their new name once.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from experiments import registry
from experiments.configs.schema import ExperimentConfig, UnknownField

__all__ = [
    "Parser",
    "Renamed",
    "add_budget_flag",
    "add_config_flag",
    "add_setting_flag",
    "comma_list",
    "config_of",
    "diagnose_config_flag",
    "fail",
    "float_list",
    "int_list",
    "literal",
    "positive_budget",
    "scheme_list",
    "set_field",
    "usage_errors",
]

CONFIGS = pathlib.Path(__file__).parent / "configs"
"""Where the schemes' config files are."""


def fail(prog: str, message: str) -> NoReturn:
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


class _Formatter(
    argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter
):
    """The description as written, each flag's default after its help."""


class Parser(argparse.ArgumentParser):
    """An experiments command's parser: mistakes in one line, exit 2.

    Abbreviated flags are refused (``--budget`` never stands for another
    flag), and ``--config.KEY=VALUE`` overrides are left for
    :func:`config_of` where the command takes ``--config``.
    """

    def __init__(self, prog: str, description: str | None = None, **kwargs: Any):
        super().__init__(
            prog=prog,
            description=description,
            allow_abbrev=False,
            formatter_class=_Formatter,
            **kwargs,
        )

    def error(self, message: str) -> NoReturn:
        fail(self.prog, message)

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parses ``argv`` (``sys.argv[1:]`` by default); ``--config.KEY``
        overrides are kept in ``args.config_overrides``."""
        argv = list(sys.argv[1:] if argv is None else argv)
        takes_config = "config" in {a.dest for a in self._actions}
        overrides = [a for a in argv if takes_config and _is_override(a)]
        rest = [a for a in argv if not (takes_config and _is_override(a))]
        args = self.parse_args(rest)
        if takes_config:
            args.config_overrides = overrides
        return args


def _is_override(arg: str) -> bool:
    return re.match(r"--?(?:no)?config\.", arg) is not None


def add_budget_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--budget SECONDS`` (``--budget_seconds``, deprecated, says so once):
    each run's budget in seconds, virtual in the simulator and wall-clock on
    processes, instead of the setting's."""
    parser.add_argument(
        "--budget",
        "--budget_seconds",
        dest="budget",
        type=float,
        default=None,
        metavar="SECONDS",
        action=Renamed,
        help=f"{what} (virtual seconds in the simulator, wall seconds on "
        "processes), instead of the setting's; formerly --budget_seconds.",
    )


class Renamed(argparse.Action):
    """Stores a value; a use of a former name says once which name replaced
    it (the first option string is the current name)."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = self.option_strings[0]
        said = parser.__dict__.setdefault("_renamed_said", set())
        if option_string != current and option_string not in said:
            said.add(option_string)
            print(
                f"{parser.prog}: {option_string} is deprecated; use {current}",
                file=sys.stderr,
            )
        setattr(namespace, self.dest, values)


def comma_list(text: str) -> list[str]:
    """A comma-separated flag's items (blanks dropped)."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _numbers(kind: type, what: str):
    def parse(text: str) -> list:
        try:
            return [kind(item) for item in comma_list(text)]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {text!r}"
            ) from None

    parse.__name__ = f"{kind.__name__} list"
    return parse


int_list = _numbers(int, "ints")
"""A comma-separated flag's ints (``--seeds=1,2,3``)."""

float_list = _numbers(float, "numbers")
"""A comma-separated flag's numbers (``--factors=0.5,1,2``)."""


def scheme_list(text: str) -> list[str]:
    """``--schemes``: comma-separated names of :data:`registry.SCHEMES`."""
    names = comma_list(text)
    for name in names:
        if name not in registry.SCHEMES:
            raise argparse.ArgumentTypeError(
                f"unknown scheme {name!r}; valid names: {', '.join(registry.SCHEMES)}"
            )
    return names


def add_setting_flag(parser: argparse.ArgumentParser, default: str, help: str) -> None:
    """``--setting``: a name of ``experiments.configs.common.SETTINGS``."""
    from experiments.configs.common import SETTINGS

    parser.add_argument(
        "--setting", default=default, choices=list(SETTINGS), metavar="SETTING",
        help=f"{help} One of {', '.join(SETTINGS)} (default {default}).",
    )  # fmt: skip


def positive_budget(prog: str, budget: float | None) -> float | None:
    """``budget`` checked: ``None`` or > 0 (else :func:`fail`)."""
    if budget is not None and not budget > 0:
        fail(prog, f"--budget must be > 0 seconds, got {budget:g}")
    return budget


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config=experiments/configs/<scheme>.py[:SETTING]`` (required), whose
    fields ``--config.KEY=VALUE`` overrides (listed in ``--help``, from the
    fields' declarations)."""
    from experiments.configs.common import SETTINGS
    from experiments.configs.schema import field_help

    rows = field_help()
    width = max(len(name) for name, _, _ in rows) + 10
    parser.epilog = "config fields (--config.KEY=VALUE):\n" + "\n".join(
        f"  {'--config.' + name:<{width}} {kind}: {text}" for name, kind, text in rows
    ).replace("%", "%%")

    parser.add_argument(
        "--config",
        required=True,
        metavar="PATH[:SETTING]",
        help="A scheme's config file, experiments/configs/<scheme>.py[:setting]; "
        f"schemes: {', '.join(registry.SCHEMES)}; settings: {', '.join(SETTINGS)} "
        "(default sim8). Override any field with --config.<field>=VALUE, e.g. "
        "--config.server.learning_rate=0.2 (a Python literal, else a string).",
    )


def _config_files() -> str:
    schemes = ", ".join(sorted(registry.SCHEMES))
    return f"experiments/configs/<scheme>.py for a scheme of {schemes}"


def _load(value: str) -> ExperimentConfig:
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
        config = module.get_config(*([arg] if arg else []))
    except (ValueError, KeyError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        raise ValueError(f"--config={value}: {message}") from None
    if not isinstance(config, ExperimentConfig):
        raise ValueError(
            f"--config={value}: get_config() must return an ExperimentConfig, "
            f"got {type(config).__name__}"
        )
    return config


def literal(text: str) -> Any:
    """``text`` as a Python literal (``True``, ``0.05``, ``(1, 2)``), else the
    string itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def set_field(config: ExperimentConfig, path: str, text: Any) -> None:
    """Sets the dotted field ``path`` from its command-line ``text`` (a
    literal, or the text where the field takes a string).

    Raises:
      UnknownField: no such field.
      ValueError: a value of the wrong type.
    """
    value = literal(text) if isinstance(text, str) else text
    try:
        config.set_path(path, value)
    except UnknownField:
        raise
    except ValueError:
        if not isinstance(text, str) or value == text:
            raise
        config.set_path(path, text)  # a string field given "1e-3", "None"


def _overrides(argv: Sequence[str]) -> Iterator[tuple[str, str, Any]]:
    """``(flag, path, text)`` of each ``--config.KEY[=VALUE]`` in ``argv``
    (``--config.KEY`` alone: ``True``; ``--noconfig.KEY``: ``False``)."""
    for arg in argv:
        match = re.match(r"--?(no)?config\.([^=]+)(?:=(.*))?$", arg, re.S)
        if match is None:
            continue
        negated, path, text = match.groups()
        flag = arg.split("=", 1)[0]
        if negated:
            yield flag, path, False
        else:
            yield flag, path, True if text is None else text


def config_of(args: argparse.Namespace) -> ExperimentConfig:
    """The config of ``args.config`` with ``args.config_overrides`` set.

    Raises:
      ValueError: in one line, naming the flag: a missing file, an unknown
        setting, an unknown field (with the closest and the valid ones) or a
        value of the wrong type.
    """
    config = _load(args.config)
    for flag, path, text in _overrides(getattr(args, "config_overrides", ())):
        try:
            set_field(config, path, text)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
    return config


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
    args = argparse.Namespace(
        config=values[-1], config_overrides=[a for a in argv if _is_override(a)]
    )
    try:
        config_of(args)
    except ValueError as e:
        return str(e)
    return None
