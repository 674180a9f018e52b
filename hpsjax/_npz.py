"""The format of parameter ``.npz`` files: ``/`` in a name nests; a marker.

A parameter file (:func:`hpsjax.models.save_params_npz`, ``hpsjax-worker
--write_init``, ``hpsjax-server --export_params``) holds one array per leaf,
named by its key path joined with ``/``, and the member ``__hpsjax_params__``:
a 0-d int32 array holding the format's version (1). The marker tells a
parameter file from any other ``.npz`` (a data set's ``x`` and ``y``), which
``hpsjax-server --init`` refuses; readers leave it out of the tree.
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "PARAMS_FORMAT",
    "PARAMS_MARKER",
    "check_params_file",
    "nest_named_arrays",
    "open_npz",
    "params_marker",
]

PARAMS_MARKER = "__hpsjax_params__"
PARAMS_FORMAT = 1
_WRITE_HINT = (
    "write it with hpsjax.models.save_params_npz or hpsjax-worker --write_init"
)


def params_marker() -> np.ndarray:
    """The value of the ``__hpsjax_params__`` member: the format's version."""
    return np.asarray(PARAMS_FORMAT, np.int32)


def nest_named_arrays(named: Mapping[str, Any], source: Any = "the file") -> dict:
    """Nests ``{"a/b": x, "c": y}`` into ``{"a": {"b": x}, "c": y}``.

    The structure ``hpsjax-server --init`` serves from an ``.npz`` file's
    names, and the one ``hpsjax-worker`` partitions for server shards.

    The format marker (``__hpsjax_params__``) is left out.

    Raises:
      ValueError: no names, an empty part (``a//b``), or two names that clash
        (``a`` and ``a/b``).

    Examples:
      >>> nest_named_arrays({"conv/w": 1, "b": 2, "__hpsjax_params__": 1})
      {'conv': {'w': 1}, 'b': 2}
    """
    named = {name: value for name, value in named.items() if name != PARAMS_MARKER}
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
    # np.load takes any file that is neither a zip nor an .npy for a pickle and
    # says so, which would mislead: a file that is not a zip is named as such.
    is_npy = False
    with contextlib.suppress(OSError), open(path, "rb") as f:
        is_npy = f.read(6) == b"\x93NUMPY"
    if not is_npy and not zipfile.is_zipfile(path):
        raise ValueError(f"{path!r} is not a readable .npz archive: not a zip file")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r} is not a readable .npz archive: {e}") from e
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{path!r} holds a single array, not an .npz archive")
    return archive


def check_params_file(path: str | os.PathLike) -> None:
    """Refuses a file that was not written as hpsjax parameters, in one line.

    Reads only the archive's member names (and the marker), never the arrays,
    so a big data file is refused at once.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not an ``.npz`` archive; bad names (as
        :func:`nest_named_arrays`); no format marker (the message names the
        arrays the file holds); a marker of another format version.

    Examples:
      >>> import tempfile
      >>> with tempfile.TemporaryDirectory() as d:  # doctest: +ELLIPSIS
      ...     path = os.path.join(d, "digits.npz")
      ...     np.savez(path, x=np.zeros((4, 64)), y=np.zeros(4))
      ...     check_params_file(path)
      Traceback (most recent call last):
      ...
      ValueError: ...digits.npz holds arrays x, y, not hpsjax parameters (no ...
    """
    shown = os.fspath(path)
    if not os.path.isfile(shown):
        raise FileNotFoundError(f"no .npz file at {shown!r}")
    if not zipfile.is_zipfile(shown):
        raise ValueError(f"{shown} is not an .npz file of arrays ({_WRITE_HINT})")
    with zipfile.ZipFile(shown) as archive:
        names = [
            info.filename[: -len(".npy")]
            for info in archive.infolist()
            if info.filename.endswith(".npy")
        ]
        version = None
        if PARAMS_MARKER in names:
            with archive.open(f"{PARAMS_MARKER}.npy") as f:
                try:
                    marker = np.lib.format.read_array(f, allow_pickle=False)
                except ValueError as e:
                    raise ValueError(f"{shown}: unreadable format marker: {e}") from e
            if marker.shape == () and marker.dtype.kind in "iu":
                version = int(marker)
    nest_named_arrays(dict.fromkeys(names), shown)
    if PARAMS_MARKER not in names:
        held = [name for name in names if name != PARAMS_MARKER]
        listed = ", ".join(held[:8]) + (f" and {len(held) - 8} more" * (len(held) > 8))
        raise ValueError(
            f"{shown} holds arrays {listed}, not hpsjax parameters (no format "
            f"marker): {_WRITE_HINT}"
        )
    if version != PARAMS_FORMAT:
        raise ValueError(
            f"{shown} holds hpsjax parameters of format {version!r}; this hpsjax "
            f"reads format {PARAMS_FORMAT}"
        )
