"""The orbax-checkpoint side of hpsjax checkpoints: the manifest item, the manager.

Imported by :class:`hpsjax.ps.CheckpointManager` on first use only: importing
orbax takes about a second, which processes that never checkpoint (workers,
the simulator) should not pay.

A checkpoint is one orbax step with two items: ``arrays``, a flat dict
``{"<leaf index>": array}`` saved by orbax's ``PyTreeCheckpointHandler``
(tensorstore, OCDBT), and ``manifest``, one msgpack file written by
:class:`ManifestHandler` below. Orbax writes both into a temporary directory
and renames it to ``ckpt_<step>`` once everything is written.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import orbax.checkpoint as ocp
from etils import epath

ARRAYS = "arrays"
MANIFEST = "manifest"
MANIFEST_FILE = "manifest.msgpack"
STEP_PREFIX = "ckpt"
# Orbax's temporary directories are ``<final name><TMP_SUFFIX>[-<timestamp>]``.
TMP_SUFFIX = ".orbax-checkpoint-tmp"


def write_manifest(path: pathlib.Path, data: bytes) -> None:
    """Writes and fsyncs the manifest file (before orbax's commit rename)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class ManifestHandler(ocp.AsyncCheckpointHandler):
    """Saves and restores the manifest: bytes, one file, written in orbax's commit."""

    async def _write(self, directory: epath.Path, data: bytes) -> None:
        write_manifest(pathlib.Path(directory) / MANIFEST_FILE, data)

    async def async_save(self, directory: epath.Path, args: ManifestSave):
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._write(directory, args.data), name="hpsjax_manifest_save"
            )
        ]

    def save(self, directory: epath.Path, args: ManifestSave) -> None:
        write_manifest(pathlib.Path(directory) / MANIFEST_FILE, args.data)

    def restore(self, directory: epath.Path, args: ManifestRestore | None = None):
        del args
        return (pathlib.Path(directory) / MANIFEST_FILE).read_bytes()


@ocp.args.register_with_handler(ManifestHandler, for_save=True)
@dataclasses.dataclass
class ManifestSave(ocp.args.CheckpointArgs):
    """The manifest file's bytes, checksum included."""

    data: bytes


@ocp.args.register_with_handler(ManifestHandler, for_restore=True)
@dataclasses.dataclass
class ManifestRestore(ocp.args.CheckpointArgs):
    """Restores the manifest file's bytes."""


def new_manager(directory: pathlib.Path) -> ocp.CheckpointManager:
    """An orbax manager of ``directory/ckpt_<step>`` steps.

    Saves block until committed (``save_async`` runs them on hpsjax's own
    thread, one at a time, without blocking the caller); orbax writes no root
    metadata, deletes no old step (hpsjax prunes by moving a step aside before
    deleting it, where orbax deletes in place) and leaves temporary directories
    to hpsjax, which removes only those of no live process.
    """
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,
        step_prefix=STEP_PREFIX,
        create=False,
        cleanup_tmp_directories=False,
        enable_async_checkpointing=False,
        save_root_metadata=False,
        lightweight_initialize=True,
    )
    return ocp.CheckpointManager(
        directory,
        options=options,
        item_handlers={
            ARRAYS: ocp.PyTreeCheckpointHandler(),
            MANIFEST: ManifestHandler(),
        },
    )


def save(
    manager: ocp.CheckpointManager, step: int, arrays: dict, manifest: bytes
) -> None:
    """Saves one step and returns once orbax committed it."""
    items = {MANIFEST: ManifestSave(manifest)}
    if arrays:
        items[ARRAYS] = ocp.args.PyTreeSave(arrays)
    manager.save(step, args=ocp.args.Composite(**items), force=True)


def read_manifest(manager: ocp.CheckpointManager, step: int) -> bytes:
    """The manifest bytes of ``step``."""
    restored = manager.restore(
        step, args=ocp.args.Composite(**{MANIFEST: ManifestRestore()})
    )
    return restored[MANIFEST]


def read_arrays(manager: ocp.CheckpointManager, step: int, keys: list[str]) -> dict:
    """The arrays of ``step`` named ``keys``, as numpy arrays."""
    if not keys:
        return {}
    restore_args = {key: ocp.RestoreArgs(restore_type=np.ndarray) for key in keys}
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            **{ARRAYS: ocp.args.PyTreeRestore(restore_args=restore_args)}
        ),
    )
    return dict(restored[ARRAYS])
