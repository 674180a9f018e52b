"""Flag parsing shared by the command-line tools."""

from __future__ import annotations

import argparse
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = [
    "ArgumentParser",
    "HelpFormatter",
    "add_key_value_flag",
    "check_kwargs",
    "key_value",
]


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are one line on stderr, exit status 2:
    ``PROG: argument --port: invalid int value: 'abc' (see PROG --help)``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, but not ``None``: the help of a flag whose
    default is worked out at run time says what it is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def key_value(text: str) -> tuple[str, Any]:
    """Parses ``NAME=VALUE``, the value as JSON (a bare word stays a string).

    A comma outside JSON is refused, since ``hidden=128,128`` is not the
    list ``hidden=[128,128]``.
    """
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        if "," in raw:
            raise argparse.ArgumentTypeError(
                f"{text!r}: a list is written in JSON, {name}=[{raw}]"
            ) from None
        return name, raw


def add_key_value_flag(group: Any, flag: str, help: str) -> None:
    """Adds a repeatable ``NAME=VALUE`` flag to a parser or argument group.

    Its value is the list of :func:`key_value` pairs given, empty by default.
    """
    group.add_argument(
        flag,
        type=key_value,
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=help,
    )


def check_kwargs(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    flag: str,
    *,
    what: str,
    skip: Iterable[str] = (),
) -> None:
    """Raises a one-line ``ValueError`` for a key ``fn`` does not take.

    Args:
      fn: the callable the keyword arguments go to.
      kwargs: the arguments given with ``flag``.
      flag: the flag's name, for the message (``--model_arg``).
      what: what ``fn`` builds, for the message (``model 'mlp'``).
      skip: parameters the caller passes itself (not the flag's to give).
    """
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [
        name
        for name, p in params.items()
        if name not in set(skip) and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = [name for name in kwargs if name not in valid]
    if unknown:
        raise ValueError(
            f"{flag} {unknown[0]}: {what} has no such argument; valid names: "
            f"{', '.join(valid) or 'none'}"
        )
