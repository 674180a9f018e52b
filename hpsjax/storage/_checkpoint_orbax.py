"""The orbax-checkpoint side of hpsjax checkpoints: one checkpointer, two items.

Imported by :class:`hpsjax.ps.CheckpointManager` on first use only: importing
orbax takes about a second, which processes that never checkpoint (workers,
the simulator) should not pay.

A checkpoint is one orbax checkpoint directory with two items: ``state``, the
pytree, saved and described by orbax's ``PyTreeCheckpointHandler``
(tensorstore, OCDBT), and ``meta``, one msgpack file written by
:class:`MetaHandler` below (the caller's metadata and the arrays' checksums).
Orbax writes both into ``<name>.orbax-checkpoint-tmp*`` and renames it to
``<name>`` once everything is written.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

STATE = "state"
META = "meta"
META_FILE = "meta.msgpack"
# Orbax's temporary directories are ``<final name><TMP_SUFFIX>[-<timestamp>]``.
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{orbax's name of the leaf: leaf}``, in ``jax.tree.leaves`` order."""
    names = ocp.tree.get_param_names(tree, include_empty_nodes=False)
    return dict(zip(jax.tree.leaves(names), jax.tree.leaves(tree), strict=True))


def write_meta(path: pathlib.Path, data: bytes) -> None:
    """Writes and fsyncs the meta file (before orbax's commit rename)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class MetaHandler(ocp.CheckpointHandler):
    """Saves and restores the meta item: bytes, one file."""

    def save(self, directory: epath.Path, args: MetaSave) -> None:
        write_meta(pathlib.Path(directory) / META_FILE, args.data)

    def restore(self, directory: epath.Path, args: MetaRestore | None = None):
        del args
        return (pathlib.Path(directory) / META_FILE).read_bytes()


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    """The meta file's bytes."""

    data: bytes


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    """Restores the meta file's bytes."""


def new_checkpointer() -> ocp.Checkpointer:
    """A blocking checkpointer of the state and meta items."""
    return ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(
            **{STATE: ocp.PyTreeCheckpointHandler(), META: MetaHandler()}
        )
    )


def save(checkpointer: ocp.Checkpointer, path: pathlib.Path, tree, meta: bytes):
    """Saves ``tree`` (``None``: no array) and ``meta`` as ``path``, committed."""
    items = {META: MetaSave(meta)}
    if tree is not None:
        items[STATE] = ocp.args.PyTreeSave(tree)
    checkpointer.save(path, args=ocp.args.Composite(**items))


def read_meta(checkpointer: ocp.Checkpointer, path: pathlib.Path) -> bytes:
    """The meta file's bytes of ``path``."""
    restored = checkpointer.restore(
        path, args=ocp.args.Composite(**{META: MetaRestore()})
    )
    return restored[META]


def read_state(checkpointer: ocp.Checkpointer, path: pathlib.Path) -> Any:
    """The tree of ``path`` in orbax's plain containers (dicts, lists).

    Arrays come back as saved: hpsjax saves numpy arrays, so numpy arrays.
    """
    args = ocp.args.Composite(**{STATE: ocp.args.PyTreeRestore()})
    return checkpointer.restore(path, args=args)[STATE]
