"""The key format of parameter ``.npz`` files: ``/`` in a name nests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["nest_named_arrays"]


def nest_named_arrays(named: Mapping[str, Any], source: Any = "the file") -> dict:
    """Nests ``{"a/b": x, "c": y}`` into ``{"a": {"b": x}, "c": y}``.

    The structure ``hpsjax-server --init`` serves from an ``.npz`` file's
    names, and the one ``hpsjax-worker`` partitions for server shards.

    Raises:
      ValueError: no names, an empty part (``a//b``), or two names that clash
        (``a`` and ``a/b``).

    Examples:
      >>> nest_named_arrays({"conv/w": 1, "b": 2})
      {'conv': {'w': 1}, 'b': 2}
    """
    if not named:
        raise ValueError(f"{source} holds no arrays")
    tree: dict[str, Any] = {}
    for name, value in named.items():
        parts = name.split("/")
        if not all(parts):
            raise ValueError(f"bad array name {name!r} in {source}")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"array name {name!r} clashes with another")
        if parts[-1] in node:
            raise ValueError(f"array name {name!r} clashes with another")
        node[parts[-1]] = value
    return tree
