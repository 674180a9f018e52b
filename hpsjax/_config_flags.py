"""Command-line flags made from a configuration dataclass's fields.

A configuration (``WorkerConfig``, ``ServerConfig``) is the one source of its
flags: a field whose metadata has a ``help`` is a flag of that name, its type
read from the field's annotation (``int | None`` is an ``int`` flag), its
default the field's. The metadata may also give:

* ``flag``: the flag's name, where it is not ``--<field>`` (a name without
  dashes is a positional argument, required); a ``bool`` field
  whose default is ``True`` is turned off by its flag, and needs one:
  ``--no_<field>`` (``--no_follow_hints``, ``--no_error_feedback``), the one
  negation style of hpsjax's commands, unless its ``action`` is
  ``argparse.BooleanOptionalAction``;
* ``choices``, ``metavar``, ``type`` (a parser of the flag's text), ``action``,
  ``nargs`` and ``required`` (argparse's); a field whose ``action`` is
  ``"append"`` holds one entry per use of its flag (with ``nargs``, each a
  tuple of the values);
* ``format``: the inverse of ``type``, a value as the flag's text (a list of
  addresses as ``host:port,host:port``), where ``str`` is not;
* ``group``: the key of the argument group the flag is listed under;
* ``flag_default``: the flag's default where the command line's is not the
  field's (``--worker_id``: none, for the server to assign one, while a
  ``WorkerConfig`` made in Python is worker 0); :func:`argv_of` then leaves a
  value out only where it is the flag's default, and :func:`config_kwargs`
  gives a flag left at it the field's own default (the command decides what
  a flag not given means before it makes its configuration);
* ``aliases``: former names of the flag, still taken: the first use of one
  says once, on stderr, which name replaced it (a rename is one edit);
* ``dest``: the name the parsed value has in the namespace, where it is not
  the flag's (a renamed flag keeps the attribute its readers use).

A ``Mapping`` field is a repeatable ``NAME=VALUE`` flag, the value JSON
(:func:`hpsjax._flags.add_key_value_flag`; ``--policy_arg
staleness_bound=2``).

:func:`add_flags` adds the flags to a parser, :func:`config_kwargs` reads
the parsed values back as the dataclass's keyword arguments (its checks then
run once, in its ``__post_init__``), and :func:`to_argv` writes a
configuration as the flags that make it, for a launcher that starts the
command in another process; :func:`argv_of` writes some of a configuration's
fields (a launcher's own: the address, the secret file) the same way. These
two are the only writers of a command line in hpsjax.

Examples:
  >>> import argparse, dataclasses
  >>> @dataclasses.dataclass(frozen=True)
  ... class Config:
  ...     steps: int | None = dataclasses.field(
  ...         default=None, metadata={"help": "rounds to run"})
  ...     hints: bool = dataclasses.field(
  ...         default=True, metadata={"help": "ignore hints", "flag": "--no_hints"})
  >>> parser = argparse.ArgumentParser()
  >>> add_flags(parser, Config)
  >>> args = parser.parse_args(["--steps", "3", "--no_hints"])
  >>> Config(**config_kwargs(Config, args))
  Config(steps=3, hints=False)
  >>> to_argv(Config(steps=3, hints=False))
  ['--steps', '3', '--no_hints']
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hpsjax._flags import add_key_value_flag

__all__ = [
    "add_flags",
    "argv_of",
    "config_kwargs",
    "flag_fields",
    "flag_message",
    "to_argv",
]

_SCALARS = (bool, int, float, str)

# Field metadata handed to argparse as it is.
_PASSED = ("action", "choices", "metavar", "nargs", "required")


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
        yield field, flag, field.metadata.get("dest", flag.removeprefix("--"))


def add_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    groups: Mapping[str, argparse._ActionsContainer] | None = None,
) -> None:
    """Adds ``cls``'s flags to ``parser``, or to ``groups[metadata["group"]]``.

    The namespace holds each under its flag's name (``args.no_follow_hints``).
    """
    hints = typing.get_type_hints(cls)
    for field, flag, dest in flag_fields(cls):
        meta = field.metadata
        target = parser if groups is None else groups.get(meta.get("group"), parser)
        before = len(target._actions)
        _add_flag(target, cls, field, flag, dest, hints[field.name])
        if meta.get("aliases"):
            _deprecate(target._actions[before], flag, meta["aliases"], parser)


def _add_flag(
    target: argparse._ActionsContainer,
    cls: type,
    field: dataclasses.Field,
    flag: str,
    dest: str,
    annotation: Any,
) -> None:
    """Adds one field's flag (see :func:`add_flags`)."""
    meta = field.metadata
    if _is_mapping(annotation):
        add_key_value_flag(target, flag, meta["help"])
        return
    default = _flag_default(field)
    if meta.get("action") == "append":
        default = list(default)  # argparse appends to it
    extra = {k: meta[k] for k in _PASSED if k in meta}
    if "action" in meta:
        kind = {"type": meta["type"]} if "type" in meta else {}
        target.add_argument(
            flag, dest=dest, default=default, help=meta["help"], **kind, **extra
        )
        return
    kind = meta.get("type") or _scalar(annotation)
    if not flag.startswith("-"):
        target.add_argument(flag, type=kind, help=meta["help"], **extra)
        return
    if kind is bool:
        if field.default is True and "flag" not in meta:
            raise TypeError(f"{cls.__name__}.{field.name}: a flag that turns it off")
        target.add_argument(flag, dest=dest, action="store_true", help=meta["help"])
        return
    if "dest" in meta:
        # The flag's name, not the attribute's, in the help.
        extra.setdefault("metavar", flag.removeprefix("--").upper())
    target.add_argument(
        flag, dest=dest, type=kind, default=default, help=meta["help"], **extra
    )


def _deprecate(
    action: argparse.Action,
    flag: str,
    aliases: tuple[str, ...],
    parser: argparse.ArgumentParser,
) -> None:
    """Lets ``action`` take ``aliases`` too, the first use of one saying once
    which name replaced it."""
    for alias in aliases:
        parser._option_string_actions[alias] = action
    action.option_strings = [*action.option_strings, *aliases]
    said: set[str] = set()
    call = action.__call__
    prog = parser.prog

    def deprecated_call(parser, namespace, values, option_string=None):
        if option_string in aliases and option_string not in said:
            said.add(option_string)
            print(f"{prog}: {option_string} is deprecated; use {flag}", file=sys.stderr)
        call(parser, namespace, values, option_string)

    # argparse calls the action's __call__ through its class: give the one
    # action a class of its own.
    action.__class__ = type(
        type(action).__name__,
        (type(action),),
        {"__call__": lambda self, *a, **k: deprecated_call(*a, **k)},
    )


def config_kwargs(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of ``cls``'s flags, by field name."""
    kwargs = {}
    for field, _, dest in flag_fields(cls):
        value = getattr(args, dest)
        if "flag_default" in field.metadata and value == _flag_default(field):
            value = _default(field)  # not given
        elif _turns_off(field):
            value = not value
        elif field.metadata.get("action") == "append":
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        elif isinstance(value, list):
            value = dict(value)  # NAME=VALUE pairs, the last of a name kept
        kwargs[field.name] = value
    return kwargs


# A check's message names a field where a clause opens: "bits must be ...".
_FIELD_NAMED = re.compile(r"(^|: |; )([a-z_][a-z0-9_]*)(?= must | needs |: )")


def flag_message(
    message: str, *classes: type, names: Mapping[str, str] | None = None
) -> str:
    """A configuration check's ``message`` as a command's user reads it: each
    field it names (``bits must be ...``) written as its flag (``--bits``),
    ``names`` adding others (``{"num_workers": "--workers"}``), and Python's
    ``None`` left out of the valid values.

    Examples:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     max_steps: int | None = dataclasses.field(
      ...         default=None, metadata={"help": "rounds", "flag": "--steps"})
      >>> flag_message("max_steps must be an int >= 1 or None, got 0.", Config)
      '--steps must be an int >= 1, got 0.'
    """
    flags = {}
    for cls in classes:
        for field, flag, _ in flag_fields(cls):
            flags.setdefault(field.name, flag)
    flags.update(names or {})

    def named(match: re.Match) -> str:
        return match.group(1) + flags.get(match.group(2), match.group(2))

    return _FIELD_NAMED.sub(named, message).replace(" or None", "")


def _turns_off(field: dataclasses.Field) -> bool:
    """Whether the field's flag turns it off (a ``True`` default)."""
    return field.default is True and "action" not in field.metadata


def to_argv(config: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that make ``config`` (fields at their defaults left out).

    Raises:
      ValueError: a field set away from its default has no flag (it cannot
        travel on a command line), unless named in ``skip``.
    """
    values = {
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(config)
        if field.name not in skip
    }
    return argv_of(type(config), **values)


def argv_of(cls: type, /, *, always: Sequence[str] = (), **values: Any) -> list[str]:
    """The flags that set ``cls``'s fields to ``values`` (values at the
    field's default left out, but for the fields named in ``always``), in the
    order of the fields.

    Examples:
      >>> import dataclasses
      >>> @dataclasses.dataclass(frozen=True)
      ... class Config:
      ...     port: int = dataclasses.field(default=0, metadata={"help": "port"})
      >>> argv_of(Config, port=5555)
      ['--port', '5555']
      >>> argv_of(Config, port=0), argv_of(Config, always=("port",), port=0)
      ([], ['--port', '0'])

    Raises:
      ValueError: a name that is not a field of ``cls``, or a value away from
        its default for a field without a flag.
    """
    fields = {field.name: field for field in dataclasses.fields(cls)}
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise ValueError(f"{cls.__name__} has no field {unknown[0]!r}")
    flags = {field.name: flag for field, flag, _ in flag_fields(cls)}
    argv: list[str] = []
    for name, field in fields.items():
        at_default = name not in always and values.get(name) == _flag_default(field)
        if name not in values or at_default:
            continue
        if name not in flags:
            raise ValueError(
                f"{cls.__name__}.{name} = {values[name]!r} has no command-line flag"
            )
        argv += _field_argv(field, flags[name], values[name])
    return argv


def _field_argv(field: dataclasses.Field, flag: str, value: Any) -> list[str]:
    """One field's flags for ``value``, a value away from its default."""
    if isinstance(value, bool):
        # A BooleanOptionalAction's off form, or the flag itself (on, or
        # turning the field off).
        negated = "action" in field.metadata and not value
        return ["--no-" + flag.removeprefix("--") if negated else flag]
    if not flag.startswith("-"):
        return [field.metadata.get("format", str)(value)]  # positional
    if field.metadata.get("action") == "append":
        argv = []
        for item in value:
            argv += [flag, *map(str, item if isinstance(item, tuple) else [item])]
        return argv
    if isinstance(value, Mapping):
        argv = []
        for name, item in value.items():
            argv += [flag, f"{name}={json.dumps(item, default=_jsonable)}"]
        return argv
    if value is None:
        raise ValueError(f"{flag} cannot be set back to None on a command line")
    return [flag, field.metadata.get("format", str)(value)]


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


def _flag_default(field: dataclasses.Field) -> Any:
    """The default of the field's flag (``flag_default``, else the field's)."""
    if "flag_default" in field.metadata:
        return field.metadata["flag_default"]
    return _default(field)
