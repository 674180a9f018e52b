"""Atomic orbax checkpoints of pytrees: parameters, optimizer state, metadata.

A checkpoint is one orbax-checkpoint directory: orbax saves and describes the
tree (tensorstore, OCDBT; ``hpsjax.storage._checkpoint_orbax``), and a small msgpack
file beside it holds the step, a msgpack-able metadata dict and a crc32 of
each array. Nothing is pickled, so restoring never executes code.

On disk::

    directory/
      ckpt_<step>/                          a committed checkpoint
        state/                              orbax's PyTree item
        meta/meta.msgpack                   magic + crc32 + msgpack body
      ckpt_<step>.orbax-checkpoint-tmp*/    a save in progress, or left by a crash
      .pruned-ckpt_<step>-<hex>/            an old checkpoint being deleted
      ckpt_<step>.damaged-<n>/              a damaged checkpoint moved aside, kept
      .hpsjax-checkpoint.lock               held by the manager that saves here

Commit protocol. Orbax writes both items into a temporary directory and
renames it to ``ckpt_<step>``; ``rename`` within a directory is atomic on
POSIX, so a crash leaves either the earlier checkpoints only or the new one
complete. Checkpoints beyond the newest ``keep`` are pruned: renamed out of
the step namespace first, then deleted, so a crash while deleting leaves only
whole checkpoints under ``ckpt_<step>`` names. Leftovers (temporary and pruned
directories) are removed only by a manager holding the directory's lock (an
``flock``, let go by the kernel when its process dies), so another live
process's save in progress is never mistaken for a crash's.

Saves that keep up. ``save_async`` writes on one thread of the manager, one
save at a time, and keeps at most one waiting: a save requested while another
is written replaces the waiting one (the newest state wins), so a writer slower
than the requests holds at most two snapshots and a stop writes at most one
more checkpoint; the log says (at most once a minute) when saves fall behind.

Errors: bad arguments raise ``ValueError``; a checkpoint that cannot be read
(missing or damaged meta file or array data, each array's crc32 checked)
raises ``CheckpointError``, a ``ValueError`` subclass. ``restore_latest`` logs
such a checkpoint, moves it aside (never deletes it) and falls back to the next
older one.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import math
import os
import pathlib
import shutil
import threading
import time
import uuid
import zlib
from typing import Any, NamedTuple

import jax
import msgpack
import numpy as np
import tensorstore as ts

from hpsjax._checks import check_int

__all__ = [
    "SERVER_CHECKPOINT_FORMAT",
    "SERVER_CHECKPOINT_FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
]

logger = logging.getLogger(__name__)

# The "format" of a parameter server's checkpoint metadata: the server writes it and
# resumes only from it, hpsjax.export reads only it.
SERVER_CHECKPOINT_FORMAT = "hpsjax-server"
SERVER_CHECKPOINT_FORMAT_VERSION = 1

_FORMAT = "hpsjax-checkpoint"
_MAGIC = b"HPSJCKP3"
_PREFIX = "ckpt_"
_PRUNED_PREFIX = ".pruned-ckpt_"
_DAMAGED_INFIX = ".damaged-"
_LOCK = ".hpsjax-checkpoint.lock"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's, as in _checkpoint_orbax
_INT64 = (-(2**63), 2**63)
# Least seconds between two "saves fall behind" lines.
_BEHIND_LOG_INTERVAL_S = 60.0


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or damaged and cannot be restored."""


class Checkpoint(NamedTuple):
    """A restored checkpoint.

    Attributes:
      step: the step it was saved at.
      tree: the restored pytree.
      metadata: the metadata given to ``save`` (``None`` if none was given).
    """

    step: int
    tree: Any
    metadata: Any


class _Save(NamedTuple):
    """A save checked and waiting to be written."""

    step: int
    tree: Any  # array leaves as given (by reference) or copied (a snapshot)
    metadata: Any


def _where(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "the root"


def _check_leaf(path: tuple, leaf: Any, *, copy: bool) -> Any:
    """``leaf`` if a checkpoint can store it (copied to host if ``copy``)."""
    for key in path:
        if isinstance(key, jax.tree_util.DictKey) and not isinstance(
            key.key, str | int
        ):
            raise ValueError(
                f"dict key {key.key!r} at {_where(path)} is not a str or int; a "
                "checkpoint stores only str and int keys"
            )
    if isinstance(leaf, bool | float | str):
        return leaf
    if isinstance(leaf, int):
        if not _INT64[0] <= leaf < _INT64[1]:
            raise ValueError(f"Python int at {_where(path)} does not fit in int64")
        return leaf
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise ValueError(
            f"leaf at {_where(path)} is a ShapeDtypeStruct, which has no data to save"
        )
    if not isinstance(leaf, jax.Array | np.ndarray | np.generic):
        raise ValueError(
            f"leaf at {_where(path)} has unsupported type {type(leaf).__name__}; "
            "leaves must be arrays or bool/int/float/str"
        )
    try:
        ts.dtype(np.dtype(leaf.dtype))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"leaf at {_where(path)} has dtype {leaf.dtype}, which tensorstore "
            "cannot store"
        ) from e
    if not copy:
        return leaf
    try:
        # A copy makes the snapshot independent of later in-place changes of
        # numpy leaves and of donated jax buffers.
        return np.array(leaf, copy=True)
    except RuntimeError as e:
        raise ValueError(f"cannot fetch leaf {_where(path)}: {e}") from e


def _pack_meta(body: dict) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return _MAGIC + zlib.crc32(payload).to_bytes(4, "little") + payload


def _unpack_meta(data: bytes, step: int) -> dict:
    header = len(_MAGIC) + 4
    if len(data) < header or not data.startswith(_MAGIC):
        raise CheckpointError("meta file does not start with the checkpoint magic")
    payload = data[header:]
    if zlib.crc32(payload).to_bytes(4, "little") != data[len(_MAGIC) : header]:
        raise CheckpointError("meta file fails its crc32 (file damaged)")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise CheckpointError(f"meta file is not valid msgpack: {e}") from e
    if not (
        isinstance(body, dict)
        and body.get("format") == _FORMAT
        and isinstance(body.get("crc32"), dict)
        and isinstance(body.get("empty"), dict)
        and "metadata" in body
    ):
        raise CheckpointError("meta file is not an hpsjax checkpoint's")
    if body.get("step") != step:
        raise CheckpointError(f"meta file is of step {body.get('step')!r}")
    return body


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _fill_empty(node: Any, empty: dict[str, Any], path: tuple = ()) -> Any:
    """Orbax's plain tree with its empty arrays (``None`` there) put back."""
    if isinstance(node, dict):
        return {k: _fill_empty(v, empty, (*path, str(k))) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill_empty(v, empty, (*path, str(i))) for i, v in enumerate(node)]
    return empty.get(".".join(path)) if node is None else node


def _convert_like(value: Any, like_leaf: Any, name: str) -> Any:
    """``value`` as the kind of ``like_leaf``, checking that it fits."""
    where = name or "the root"
    if isinstance(like_leaf, bool | int | float | str):
        if type(value) is not type(like_leaf):
            found = f"a Python {type(value).__name__}"
            if isinstance(value, np.ndarray):
                found = "an array"
            raise ValueError(
                f"like has a Python {type(like_leaf).__name__} at {where}, the "
                f"checkpoint has {found}"
            )
        return value
    if not isinstance(
        like_leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic
    ):
        raise ValueError(f"like has a {type(like_leaf).__name__} at {where}")
    dtype, shape = np.dtype(like_leaf.dtype), tuple(like_leaf.shape)
    if not isinstance(value, np.ndarray):
        # A saved Python (or numpy) scalar: jax.eval_shape makes Python scalars
        # 0-d ShapeDtypeStructs, so such a ``like`` takes one its dtype holds.
        if shape or isinstance(value, str):
            raise ValueError(
                f"like has an array of shape {list(shape)} at {where}, the "
                f"checkpoint has a Python {type(value).__name__}"
            )
        try:
            converted = np.asarray(value, dtype=dtype)
            exact = converted.item() == value or (
                isinstance(value, float) and math.isnan(value) and np.isnan(converted)
            )
        except (OverflowError, TypeError, ValueError):
            exact = False
        if not exact:
            raise ValueError(
                f"leaf at {where}: saved {value!r} does not fit like's dtype {dtype}"
            )
        value = converted
    elif (value.dtype, value.shape) != (dtype, shape):
        raise ValueError(
            f"leaf at {where}: checkpoint has {value.dtype}{list(value.shape)}, "
            f"like has {dtype}{list(shape)}"
        )
    if isinstance(like_leaf, jax.Array):
        return jax.device_put(value, like_leaf.sharding)
    if isinstance(like_leaf, jax.ShapeDtypeStruct):
        sharding = getattr(like_leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding else jax.device_put(value)
    if isinstance(like_leaf, np.generic):
        return value[()]
    return value


class CheckpointManager:
    """Saves and restores pytrees as atomic orbax checkpoints in a directory.

    Each ``save(step, tree, metadata)`` writes ``directory/ckpt_<step>`` by the
    commit protocol in the module docstring, then prunes the oldest
    checkpoints (moved aside, then deleted) so that at most ``keep`` remain.
    Steps must increase: a step at or below the latest saved one is refused,
    because it means the directory holds another run.

    Saving blocks on disk I/O. Code on an event loop should use ``save_async``,
    which checks the tree at once and writes it on the manager's thread. All
    methods are thread-safe. The first save takes the directory's lock until
    ``close``: while a manager holds it, another one (in this process or
    another) lists and restores only.

    The tree may hold jax or numpy arrays of any dtype tensorstore stores
    (bfloat16 included, 0-d and empty arrays too), Python ``bool``/``int``/
    ``float``/``str`` leaves and any pytree nodes (dicts with ``str``/``int``
    keys, lists, tuples, ``NamedTuple`` s, ``None``, registered custom nodes).

    Args:
      directory: where checkpoints live; created if missing.
      keep: how many of the newest checkpoints to keep; ``None`` keeps all.

    Examples:
      >>> import tempfile, jax.numpy as jnp, optax
      >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
      >>> opt_state = optax.adam(1e-3).init(params)
      >>> with tempfile.TemporaryDirectory() as d:
      ...     manager = CheckpointManager(d, keep=2)
      ...     _ = manager.save(10, (params, opt_state), {"workers": {0: 5}})
      ...     step, (p, s), meta = manager.restore_latest(like=(params, opt_state))
      ...     manager.close()
      >>> step, meta, type(s[0]).__name__, p["w"].shape
      (10, {'workers': {0: 5}}, 'ScaleByAdamState', (2, 3))
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = 3):
        keep = check_int("keep", keep, low=1, allow_none=True)
        self._directory = pathlib.Path(directory)
        if self._directory.exists() and not self._directory.is_dir():
            raise ValueError(f"{self._directory} exists and is not a directory")
        self._directory.mkdir(parents=True, exist_ok=True)
        from hpsjax.storage import _checkpoint_orbax  # about a second to import

        self._orbax = _checkpoint_orbax
        self._checkpointer = _checkpoint_orbax.new_checkpointer()
        self._keep = keep
        self._lock = threading.RLock()  # the directory: saves, prunes, restores
        self._lock_fd: int | None = None
        # save_async's queue (never held while taking self._lock): one save
        # written on the executor's thread, at most one waiting.
        self._queue_lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiting: tuple[_Save, concurrent.futures.Future] | None = None
        self._writing = False  # the thread takes saves from _waiting
        self._in_flight = False  # a save is being written
        self._pending: list[concurrent.futures.Future] = []
        # The newest step saved or asked for: refuses an old step at once.
        self._newest_requested: int | None = None
        self._folded_saves = 0
        self._last_save_s = 0.0
        self._behind_logged_at: float | None = None
        self._folded_at_log = 0
        self._background_error: BaseException | None = None
        with self._lock:
            self._cleanup()

    @property
    def directory(self) -> pathlib.Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def keep(self) -> int | None:
        """How many checkpoints are kept (``None``: all)."""
        return self._keep

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first (read from disk)."""
        steps = []
        for entry in self._directory.glob(f"{_PREFIX}*"):
            step = entry.name.removeprefix(_PREFIX)
            if step.isdigit() and entry.is_dir():
                steps.append(int(step))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is no checkpoint."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving --------------------------------------------------------------

    def save(self, step: int, tree: Any, metadata: Any = None) -> pathlib.Path:
        """Writes ``tree`` and ``metadata`` as checkpoint ``step`` and commits it.

        Blocks until the checkpoint is committed on disk. Invalid input raises
        before anything is written.

        Args:
          step: non-negative step, above the latest checkpoint's.
          tree: the pytree to save.
          metadata: a msgpack-serialisable value, typically a dict (msgpack
            turns tuples into lists; int dict keys are kept).

        Returns:
          The committed checkpoint's directory.

        Raises:
          ValueError: a bad step, an unsupported leaf or metadata, a step
            already saved, or another live manager saving into this directory.
        """
        save = self._check(step, tree, metadata, copy=False)
        with self._lock:
            self._check_order(save.step, self.latest_step())
            with self._queue_lock:
                self._note_requested(save.step)
            return self._write(save)

    def save_async(
        self, step: int, tree: Any, metadata: Any = None, *, snapshot: bool = True
    ) -> concurrent.futures.Future:
        """Writes ``tree`` as checkpoint ``step`` in a thread; keeps up by folding.

        The call checks the input, takes its snapshot and returns. At most one
        save is written at a time, on the manager's thread, and at most one
        waits: a save requested while another is written takes the waiting
        place, replacing a save already there (the newest state wins; the
        replaced request's future is the newer one's). So at most two
        snapshots are held and ``close`` writes at most one more checkpoint.
        From asyncio, ``await asyncio.wrap_future(future)`` waits without
        blocking the loop; cancelling that await does not stop the save. A
        failed background save is raised again by the next ``save_async``,
        ``wait_until_finished`` or ``close``.

        Args:
          step: as in ``save``; not older than a request it replaces.
          tree: as in ``save``.
          metadata: as in ``save``.
          snapshot: copy every array leaf to host memory now, so that later
            in-place changes or buffer donation cannot alter the saved values.
            ``False`` keeps the leaves by reference (for immutable jax arrays
            that are not donated later, such as the parameter server's).

        Returns:
          A ``concurrent.futures.Future`` resolving to the directory of the
          checkpoint that holds this request's state or a newer one.

        Raises:
          ValueError: invalid input (raised here, nothing is queued).
        """
        self._raise_background_error()
        save = self._check(step, tree, metadata, copy=snapshot)
        # The directory is read before the first save only: later the newest
        # step asked for is known, and a save being written does not block.
        on_disk = self.latest_step() if self._newest_requested is None else None
        with self._queue_lock:
            known = [s for s in (self._newest_requested, on_disk) if s is not None]
            self._check_order(save.step, max(known, default=None))
            self._note_requested(save.step)
            if self._waiting is not None:
                future = self._waiting[1]
                self._waiting = (save, future)
                self._folded_saves += 1
                self._log_behind()
                return future
            future = concurrent.futures.Future()
            future.add_done_callback(self._record_error)
            self._pending = [f for f in self._pending if not f.done()] + [future]
            self._waiting = (save, future)
            if not self._writing:
                self._writing = True
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="hpsjax-checkpoint"
                    )
                self._executor.submit(self._write_in_turn)
        return future

    @property
    def queued_saves(self) -> int:
        """Saves of ``save_async`` being written or waiting: 0, 1 or 2."""
        with self._queue_lock:
            return int(self._in_flight) + (self._waiting is not None)

    @property
    def folded_saves(self) -> int:
        """Requests of ``save_async`` replaced by a newer one before written."""
        with self._queue_lock:
            return self._folded_saves

    def wait_until_finished(self) -> None:
        """Blocks until every ``save_async`` so far has finished.

        Raises:
          RuntimeError: a background save failed (its error as the cause).
        """
        with self._queue_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        self._raise_background_error()

    def close(self) -> None:
        """Waits for pending saves, stops the thread, lets the lock go."""
        try:
            self.wait_until_finished()
        finally:
            with self._queue_lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            with self._lock:
                self._checkpointer.close()
                if self._lock_fd is not None:
                    os.close(self._lock_fd)  # lets the flock go
                    self._lock_fd = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- restoring -----------------------------------------------------------

    def restore(self, step: int, like: Any = None) -> Checkpoint:
        """Restores checkpoint ``step``.

        Args:
          step: a step listed by ``steps()``.
          like: optional tree of the saved structure (e.g. the initial params and
            optimizer state, or ``jax.ShapeDtypeStruct`` leaves). With it, the
            node types (``NamedTuple`` s, custom nodes) are rebuilt and leaves
            take the kind of the matching ``like`` leaf: jax arrays (on its
            sharding), numpy arrays or scalars, Python scalars. Without it, the
            tree comes in orbax's plain containers: dicts (for ``NamedTuple`` s
            and custom nodes too, keyed by field name) and lists, ``None`` for
            empty nodes, numpy arrays and Python scalars.

        Returns:
          ``Checkpoint(step, tree, metadata)``.

        Raises:
          ValueError: no such step, or ``like`` does not match the saved
            structure, shapes or dtypes (the message names the first mismatch).
          CheckpointError: the checkpoint is damaged or incomplete.
        """
        step = check_int("step", step, low=0)
        with self._lock:
            steps = self.steps()
            if step not in steps:
                raise ValueError(
                    f"no checkpoint for step {step} in {self._directory}; "
                    f"available: {steps}"
                )
            return self._restore(step, like)

    def restore_latest(self, like: Any = None) -> Checkpoint | None:
        """Restores the newest complete checkpoint.

        Leftovers of interrupted saves are cleaned up first. A damaged
        checkpoint is logged as a warning, moved aside to
        ``ckpt_<step>.damaged-<n>`` (kept, never deleted) and skipped for the
        next older one; later saves then follow the restored step.

        Args:
          like: as in ``restore``.

        Returns:
          ``Checkpoint(step, tree, metadata)``, or ``None`` when the directory
          holds no readable checkpoint.

        Raises:
          ValueError: ``like`` does not match the newest readable checkpoint.
        """
        with self._lock:
            self._cleanup()
            for step in reversed(self.steps()):
                try:
                    return self._restore(step, like)
                except CheckpointError as e:
                    root = self._step_dir(step)
                    logger.warning("skipping damaged checkpoint %s: %s", root, e)
                    self._move_aside(root)
            return None

    # -- internals -----------------------------------------------------------

    def _step_dir(self, step: int) -> pathlib.Path:
        return self._directory / f"{_PREFIX}{step}"

    def _check(self, step: Any, tree: Any, metadata: Any, *, copy: bool) -> _Save:
        """Checks a save's input (copying arrays if ``copy``); writes nothing."""
        step = check_int("step", step, low=0)
        tree = jax.tree_util.tree_map_with_path(
            lambda path, leaf: _check_leaf(path, leaf, copy=copy), tree
        )
        try:
            msgpack.packb(metadata, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise ValueError(
                "metadata must be msgpack-serialisable "
                f"(dict/list/str/int/float/bool/None/bytes): {e}"
            ) from e
        return _Save(step, tree, metadata)

    def _note_requested(self, step: int) -> None:
        if self._newest_requested is None or step > self._newest_requested:
            self._newest_requested = step

    def _check_order(self, step: int, newest: int | None) -> None:
        if newest is not None and step < newest:
            raise ValueError(
                f"step {step} is older than checkpoint step {newest} already in "
                f"{self._directory}; use a fresh directory for a new run"
            )
        if newest == step or self._step_dir(step).exists():
            raise ValueError(
                f"a checkpoint for step {step} already exists in {self._directory}"
            )

    def _write_in_turn(self) -> None:
        """Writes the waiting save, and the next, until none waits."""
        while True:
            with self._queue_lock:
                if self._waiting is None:
                    self._writing = False
                    return
                (save, future), self._waiting = self._waiting, None
                self._in_flight = True
            started = time.monotonic()
            try:
                with self._lock:
                    future.set_result(self._write(save))
            except BaseException as e:
                future.set_exception(e)
            # The written snapshot is let go before the waiting one is taken.
            save = future = None
            with self._queue_lock:
                self._in_flight = False
                self._last_save_s = time.monotonic() - started

    def _log_behind(self) -> None:
        """Says, at most once per ``_BEHIND_LOG_INTERVAL_S``, that saves fold."""
        now = time.monotonic()
        last = self._behind_logged_at
        if last is not None and now - last < _BEHIND_LOG_INTERVAL_S:
            return
        folded = self._folded_saves - self._folded_at_log
        self._behind_logged_at, self._folded_at_log = now, self._folded_saves
        took = f", the last save took {self._last_save_s:.2f} s"
        logger.warning(
            "checkpoint saves fall behind the requests: %d folded into newer "
            "ones%s%s; the newest state is written when the running save ends",
            folded,
            "" if last is None else f" in the last {now - last:.0f} s",
            took if self._last_save_s else "",
        )

    def _write(self, save: _Save) -> pathlib.Path:
        """Writes and commits ``save``, then prunes; under ``self._lock``."""
        if not self._take_lock():
            raise ValueError(
                f"another live checkpoint manager saves into {self._directory}; "
                "one directory takes one saving manager"
            )
        final = self._step_dir(save.step)
        try:
            tree = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, save.tree
            )
        except RuntimeError as e:  # a deleted (donated) jax buffer
            raise ValueError(f"cannot fetch a leaf of step {save.step}: {e}") from e
        arrays = {
            name: leaf
            for name, leaf in self._orbax.named_leaves(tree).items()
            if isinstance(leaf, np.ndarray)
        }
        empty = {
            n: [a.dtype.name, list(a.shape)] for n, a in arrays.items() if not a.size
        }
        if empty:  # orbax stores no empty array: the meta file holds them
            tree = jax.tree.map(
                lambda a: None if isinstance(a, np.ndarray) and not a.size else a, tree
            )
        tree = tree if jax.tree.leaves(tree) else None
        body = {
            "format": _FORMAT,
            "step": save.step,
            "metadata": save.metadata,
            "state": tree is not None,
            "crc32": {n: _crc32(a) for n, a in arrays.items() if a.size},
            "empty": empty,
        }
        try:
            self._orbax.save(
                self._checkpointer, final.absolute(), tree, _pack_meta(body)
            )
        except BaseException:
            self._remove_temporaries(f"{final.name}{_TMP_SUFFIX}")
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        """Deletes checkpoints beyond the newest ``keep``: moved aside, then deleted."""
        if self._keep is None:
            return
        steps = self.steps()
        aside = []
        for step in steps[: max(len(steps) - self._keep, 0)]:
            target = self._directory / f"{_PRUNED_PREFIX}{step}-{uuid.uuid4().hex}"
            try:
                os.rename(self._step_dir(step), target)
            except OSError as e:
                logger.warning("cannot prune checkpoint %s: %s", step, e)
                continue
            aside.append(target)
        for target in aside:
            shutil.rmtree(target, ignore_errors=True)

    def _restore(self, step: int, like: Any) -> Checkpoint:
        root = self._step_dir(step).absolute()
        try:
            body = _unpack_meta(self._orbax.read_meta(self._checkpointer, root), step)
        except CheckpointError as e:
            raise CheckpointError(f"{root}: {e}") from None
        except Exception as e:
            raise CheckpointError(f"cannot read the meta file of {root}: {e}") from e
        crcs, empty = body["crc32"], body["empty"]
        tree = {}
        if body.get("state"):
            try:
                tree = self._orbax.read_state(self._checkpointer, root)
            except Exception as e:
                raise CheckpointError(f"cannot read leaf data in {root}: {e}") from e
        values = self._orbax.named_leaves(tree)
        for name, crc in crcs.items():
            value = values.get(name)
            if not isinstance(value, np.ndarray) or _crc32(value) != crc:
                raise CheckpointError(
                    f"leaf {name} in {root} fails its crc32 (data damaged)"
                )
        for name, (dtype, shape) in empty.items():
            values[name] = np.zeros(shape, np.dtype(ts.dtype(dtype).numpy_dtype))
        if like is None:
            if empty:
                tree = _fill_empty(tree, {n: values[n] for n in empty})
            return Checkpoint(step, tree, body["metadata"])
        like_values = self._orbax.named_leaves(like)
        missing = sorted(values.keys() - like_values.keys())
        extra = sorted(like_values.keys() - values.keys())
        if missing or extra:
            raise ValueError(
                "like does not match the checkpoint's tree: "
                + "; ".join(
                    f"{who} has {names[:5]}"
                    for who, names in (
                        ("only the checkpoint", missing),
                        ("only like", extra),
                    )
                    if names
                )
            )
        converted = [_convert_like(values[n], v, n) for n, v in like_values.items()]
        treedef = jax.tree.structure(like)
        return Checkpoint(
            step, jax.tree.unflatten(treedef, converted), body["metadata"]
        )

    def _take_lock(self) -> bool:
        """Takes the directory's lock if free; ``True`` while this manager holds it."""
        if self._lock_fd is not None:
            return True
        fd = os.open(self._directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _remove_temporaries(self, prefix: str) -> None:
        for entry in self._directory.glob(f"{prefix}*"):
            logger.info("removing interrupted checkpoint save %s", entry)
            shutil.rmtree(entry, ignore_errors=True)

    def _cleanup(self) -> None:
        """Removes leftovers of interrupted saves and prunes, under the lock.

        Only while holding the directory's lock: another live manager's save in
        progress looks just like a crash's leftover. A manager that has not
        saved lets the lock go again, so that it stays free for the next saver.
        """
        held = self._lock_fd is not None
        if not self._take_lock():
            return
        try:
            for entry in sorted(self._directory.iterdir()):
                if entry.name.startswith(_PREFIX) and _TMP_SUFFIX in entry.name:
                    self._remove_temporaries(entry.name)
                elif entry.name.startswith(_PRUNED_PREFIX):
                    logger.info("removing interrupted prune %s", entry)
                    shutil.rmtree(entry, ignore_errors=True)
        finally:
            if not held:
                os.close(self._lock_fd)
                self._lock_fd = None

    def _move_aside(self, root: pathlib.Path) -> None:
        """Renames a damaged checkpoint out of the step namespace, kept for a look."""
        n = 1
        while (aside := root.with_name(f"{root.name}{_DAMAGED_INFIX}{n}")).exists():
            n += 1
        try:
            os.rename(root, aside)
        except OSError as e:
            logger.warning("cannot move damaged checkpoint %s aside: %s", root, e)
            return
        logger.warning("moved damaged checkpoint %s aside to %s", root, aside.name)

    def _record_error(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._queue_lock:
                if self._background_error is None:
                    self._background_error = future.exception()

    def _raise_background_error(self) -> None:
        with self._queue_lock:
            error, self._background_error = self._background_error, None
        if error is not None:
            raise RuntimeError("an earlier background checkpoint save failed") from (
                error
            )
