"""Reader of the checkpoints of hpsjax 0.x before orbax (format version 1).

Such a checkpoint is a directory ``ckpt_<step>`` holding ``manifest.msgpack``
(``HPSJCKP1`` magic, sha256, msgpack body: tree description, leaf table,
metadata) and ``leaves/<i>/``, one zarr v3 array per array leaf. The tree
description and leaf table are those of the current format, so a legacy
checkpoint converts without loss: ``python -m hpsjax.ps.convert_checkpoint OLD
NEW``. Nothing here writes.
"""

from __future__ import annotations

import contextlib
import pathlib
import re
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from hpsjax.ps._checkpoint import CheckpointError, unpack_manifest

MAGIC = b"HPSJCKP1"
FORMAT_VERSION = 1
MANIFEST = "manifest.msgpack"
_STEP_RE = re.compile(r"ckpt_(\d+)")


class LegacyCheckpoint(NamedTuple):
    """A format-1 checkpoint as read: its manifest body and leaf values."""

    step: int
    body: dict  # format, step, tree, leaves, metadata
    values: list[Any]  # one per leaf table entry; None for Python scalars


def is_legacy(root: pathlib.Path) -> bool:
    """Whether ``root`` is a format-1 checkpoint directory."""
    return (root / MANIFEST).is_file()


def legacy_steps(directory: pathlib.Path) -> list[int]:
    """Steps of the format-1 checkpoints in ``directory``, oldest first."""
    out = []
    for entry in directory.iterdir():
        m = _STEP_RE.fullmatch(entry.name)
        if m and entry.is_dir() and is_legacy(entry):
            out.append(int(m.group(1)))
    return sorted(out)


def read(root: pathlib.Path) -> LegacyCheckpoint:
    """Reads the format-1 checkpoint in ``root``.

    Raises:
      CheckpointError: a missing or damaged manifest or leaf.
    """
    try:
        data = (root / MANIFEST).read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read manifest of {root}: {e}") from e
    body = unpack_manifest(data, magic=MAGIC, format_version=FORMAT_VERSION)
    return LegacyCheckpoint(body["step"], body, _read_leaves(root, body["leaves"]))


def _read_leaves(root: pathlib.Path, leaves: list[dict]) -> list[Any]:
    context = ts.Context({"file_io_sync": False})
    opens = {
        i: ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "file", "path": str(root / "leaves" / str(i))},
            },
            open=True,
            context=context,
        )
        for i, spec in enumerate(leaves)
        if spec["kind"] == "array"
    }
    out: list[Any] = [None] * len(leaves)
    reads = {}
    try:
        for i, f in opens.items():
            store = f.result()
            spec = leaves[i]
            if store.dtype.name != spec["dtype"] or list(store.shape) != spec["shape"]:
                raise CheckpointError(
                    f"leaf {i} ({spec['path']}) holds {store.dtype.name}"
                    f"{list(store.shape)}, manifest says "
                    f"{spec['dtype']}{spec['shape']}"
                )
            reads[i] = store.read()
        for i, f in reads.items():
            out[i] = np.asarray(f.result())
    except CheckpointError:
        raise
    except Exception as e:
        for f in reads.values():
            with contextlib.suppress(Exception):
                f.result()
        raise CheckpointError(f"cannot read leaf data in {root}: {e}") from e
    return out
