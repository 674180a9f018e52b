"""Command-line flags made from a configuration dataclass's fields.

A configuration (``WorkerConfig``, ``ServerConfig``) is the one source of its
flags: a field whose metadata has a ``help`` is a flag of that name, its type
read from the field's annotation (``int | None`` is an ``int`` flag), its
default the field's. The metadata may also give:

* ``flag``: the flag's name, where it is not ``--<field>``; a ``bool`` field
  whose default is ``True`` is turned off by its flag (``--ignore_hints``,
  ``--no_error_feedback``), and needs one;
* ``choices``, ``metavar``, ``type`` (a parser of the flag's text);
* ``group``: the key of the argument group the flag is listed under.

:func:`add_flags` adds the flags to a parser, :func:`config_kwargs` reads
the parsed values back as the dataclass's keyword arguments (its checks then
run once, in its ``__post_init__``), and :func:`to_argv` writes a
configuration as the flags that make it, for a launcher that starts the
command in another process.

Examples:
  >>> import argparse, dataclasses
  >>> @dataclasses.dataclass(frozen=True)
  ... class Config:
  ...     steps: int | None = dataclasses.field(
  ...         default=None, metadata={"help": "rounds to run"})
  ...     hints: bool = dataclasses.field(
  ...         default=True, metadata={"help": "ignore hints", "flag": "--ignore_hints"})
  >>> parser = argparse.ArgumentParser()
  >>> add_flags(parser, Config)
  >>> args = parser.parse_args(["--steps", "3", "--ignore_hints"])
  >>> Config(**config_kwargs(Config, args))
  Config(steps=3, hints=False)
  >>> to_argv(Config(steps=3, hints=False))
  ['--steps', '3', '--ignore_hints']
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["add_flags", "config_kwargs", "flag_fields", "to_argv"]

_SCALARS = (bool, int, float, str)


def _scalar(annotation: Any) -> type:
    """The flag's type: the annotation's first scalar (``int | None``: int)."""
    options = (
        typing.get_args(annotation)
        if isinstance(annotation, types.UnionType)
        or typing.get_origin(annotation) is typing.Union
        else (annotation,)
    )
    for option in options:
        if option in _SCALARS:
            return option
    raise TypeError(f"no flag type for {annotation!r}: give metadata 'type'")


def flag_fields(cls: type) -> Iterator[tuple[dataclasses.Field, str, str]]:
    """``(field, flag, dest)`` of each field of ``cls`` that is a flag."""
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            continue
        flag = field.metadata.get("flag", f"--{field.name}")
        yield field, flag, flag.removeprefix("--")


def add_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    groups: Mapping[str, argparse._ActionsContainer] | None = None,
) -> None:
    """Adds ``cls``'s flags to ``parser``, or to ``groups[metadata["group"]]``.

    The namespace holds each under its flag's name (``args.ignore_hints``).
    """
    hints = typing.get_type_hints(cls)
    for field, flag, dest in flag_fields(cls):
        meta = field.metadata
        target = parser if groups is None else groups.get(meta.get("group"), parser)
        kind = meta.get("type") or _scalar(hints[field.name])
        if kind is bool:
            if field.default is True and "flag" not in meta:
                raise TypeError(
                    f"{cls.__name__}.{field.name}: a flag that turns it off"
                )
            target.add_argument(flag, dest=dest, action="store_true", help=meta["help"])
            continue
        extra = {k: meta[k] for k in ("choices", "metavar") if k in meta}
        target.add_argument(
            flag,
            dest=dest,
            type=kind,
            default=field.default,
            help=meta["help"],
            **extra,
        )


def config_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags, by field name."""
    kwargs = {}
    for field, _, dest in flag_fields(cls):
        value = getattr(args, dest)
        if field.default is True and isinstance(value, bool):
            value = not value  # the flag turns the field off
        kwargs[field.name] = value
    return kwargs


def to_argv(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make ``config`` (fields at their defaults left out).

    Raises:
      ValueError: a field set away from its default has no flag (it cannot
        travel on a command line), unless named in ``skip``.
    """
    argv: list[str] = []
    flags = {field.name: flag for field, flag, _ in flag_fields(type(config))}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name in skip or value == _default(field):
            continue
        flag = flags.get(field.name)
        if flag is None:
            raise ValueError(
                f"{type(config).__name__}.{field.name} = {value!r} has no "
                "command-line flag"
            )
        if isinstance(value, bool):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
