"""Command-line flags made from a configuration dataclass's fields.

A configuration (``WorkerConfig``, ``ServerConfig``) is the one source of its
flags: a field whose metadata has a ``help`` is a flag of that name, its type
read from the field's annotation (``int | None`` is an ``int`` flag), its
default the field's. The metadata may also give:

* ``flag``: the flag's name, where it is not ``--<field>``; a ``bool`` field
  whose default is ``True`` is turned off by its flag (``--ignore_hints``,
  ``--no_error_feedback``), and needs one, unless its ``action`` is
  ``argparse.BooleanOptionalAction`` (``--malloc_tuning`` and
  ``--no-malloc_tuning``);
* ``choices``, ``metavar``, ``type`` (a parser of the flag's text), ``action``;
* ``group``: the key of the argument group the flag is listed under.

A ``Mapping`` field is a repeatable ``NAME=VALUE`` flag, the value JSON
(:func:`hpsjax._flags.add_key_value_flag`; ``--policy_arg
staleness_bound=2``).

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
import json
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from hpsjax._flags import add_key_value_flag

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
        if _is_mapping(hints[field.name]):
            add_key_value_flag(target, flag, meta["help"])
            continue
        if "action" in meta:
            target.add_argument(
                flag,
                dest=dest,
                action=meta["action"],
                default=field.default,
                help=meta["help"],
            )
            continue
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
        if _turns_off(field):
            value = not value
        elif isinstance(value, list):
            value = dict(value)  # NAME=VALUE pairs, the last of a name kept
        kwargs[field.name] = value
    return kwargs


def _turns_off(field: dataclasses.Field) -> bool:
    """Whether the field's flag turns it off (a ``True`` default)."""
    return field.default is True and "action" not in field.metadata


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
            # Away from its default: a BooleanOptionalAction's off form, or
            # the flag itself (on, or turning the field off).
            negated = "action" in field.metadata and not value
            argv.append("--no-" + flag.removeprefix("--") if negated else flag)
        elif isinstance(value, Mapping):
            for name, item in value.items():
                argv += [flag, f"{name}={json.dumps(item, default=_jsonable)}"]
        else:
            argv += [flag, str(value)]
    return argv


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (Mapping, dict)


def _jsonable(value: Any) -> Any:
    """A dataclass in a ``NAME=VALUE`` flag's value as the object of its
    fields (a hybrid policy's stages)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{value!r} cannot be written as JSON")


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default
