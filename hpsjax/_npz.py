"""The key format of parameter ``.npz`` files: ``/`` in a name nests."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["nest_named_arrays", "open_npz"]


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


def open_npz(path: str | os.PathLike) -> np.lib.npyio.NpzFile:
    """Opens an ``.npz`` archive without unpickling anything.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not a readable ``.npz`` archive, or a single ``.npy`` array.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no .npz file at {path!r}")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} is not a readable .npz archive: {e}") from e
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path!r} holds a single array, not an .npz archive")
    return archive
