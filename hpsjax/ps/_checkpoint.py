"""Atomic orbax checkpoints of pytrees: parameters, optimizer state, metadata.

A checkpoint is one orbax-checkpoint step. Its array leaves are saved by orbax
(tensorstore, OCDBT) as a flat dict keyed by leaf index; a small msgpack
manifest holds the tree structure, each leaf's shape, dtype and crc32, Python
scalar leaves, the step and a msgpack-able metadata dict. Nothing is pickled,
so restoring never executes code.

On disk::

    directory/
      ckpt_<step>/                          a committed checkpoint
        _CHECKPOINT_METADATA                orbax's step metadata
        manifest/manifest.msgpack           magic + sha256 + msgpack body
        arrays/                             orbax PyTree item (OCDBT)
      ckpt_<step>.orbax-checkpoint-tmp*/    a save in progress, or left by a crash
      .old-ckpt_<step>-<hex>/               a checkpoint being replaced (overwrite)
      .pruned-ckpt_<step>-<hex>/            an old checkpoint being deleted (keep)
      ckpt_<step>.damaged-<n>/              a damaged checkpoint moved aside, kept
      .hpsjax-checkpoint.lock               held by the manager that saves here

Commit protocol. Orbax's ``CheckpointManager`` writes both items into a
temporary directory (tensorstore and the manifest writer ``fsync`` their files)
and renames it to ``ckpt_<step>``. ``rename`` within a directory is atomic on
POSIX file systems, so a crash at any point leaves either the previous
checkpoints only or the new one complete. After a commit, checkpoints beyond
the newest ``keep`` are pruned: each is first renamed out of the step namespace
(``.pruned-ckpt_<step>-<hex>``, a name no reader lists), then deleted, so a
crash during the deletion leaves only whole checkpoints under ``ckpt_<step>``
names and a leftover that the next manager deletes. Temporary and pruned
directories are removed by the manager that holds the directory's lock (an
``flock``, released by the kernel when its process dies), so a save in
progress in another live process is never mistaken for a crash's leftover.

Saves that keep up. ``save_async`` keeps at most one save in flight and one
waiting: a save requested while another is written replaces the waiting one
(the newest state wins), so a writer slower than the requests holds at most
two snapshots, a stop writes at most one more checkpoint, and the log says (at
most once a minute) when requests are folded because saves take longer than
the interval between them.

Errors: bad arguments raise ``ValueError``; a checkpoint that cannot be read
(missing or damaged manifest or array data: every stored array's crc32 is
checked) raises ``CheckpointError``, a ``ValueError`` subclass.
``restore_latest`` logs such a checkpoint on the ``hpsjax.ps._checkpoint``
logger, moves it aside (renamed, never deleted) so that saving goes on, and
falls back to the next older one.

Checkpoints of the earlier format (``ckpt_<step>/manifest.msgpack`` and
``leaves/``, read by ``hpsjax.ps._checkpoint_legacy``) are refused with the
command that converts them: ``python -m hpsjax.ps.convert_checkpoint OLD NEW``.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import math
import operator
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

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager"]

logger = logging.getLogger(__name__)

_FORMAT = "hpsjax-checkpoint"
_FORMAT_VERSION = 2
_MAGIC = b"HPSJCKP2"
_DIGEST_BYTES = 32
_PREFIX = "ckpt_"
_OLD_PREFIX = ".old-ckpt_"
_PRUNED_PREFIX = ".pruned-ckpt_"
_DAMAGED_INFIX = ".damaged-"
_LOCK = ".hpsjax-checkpoint.lock"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's; checked in _checkpoint_orbax
_LEGACY_MANIFEST = "manifest.msgpack"
_PY_SCALARS = {"bool": bool, "int": int, "float": float, "str": str}
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


class _Plan(NamedTuple):
    """A tree prepared for writing: validated, described, its arrays on the host."""

    step: int
    arrays: dict[str, np.ndarray]  # leaf index -> host array (non-empty ones)
    body: dict  # the manifest body, without the arrays' checksums


# ---------------------------------------------------------------------------
# Tree description (no pickle): nested msgpack maps, one per node.
# ---------------------------------------------------------------------------


def _key_of(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return str(entry)


def _type_name(node: Any) -> str:
    cls = type(node)
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def _children(node: Any) -> tuple[list[tuple[Any, Any]], bool]:
    """Returns ``([(key, child), ...], is_leaf)`` for one level of ``node``."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(
        node, is_leaf=lambda x: x is not node
    )
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:
        return [], True
    return [(_key_of(path[0]), child) for path, child in pairs], False


def _describe(tree: Any, visit_leaf) -> Any:
    """Describes ``tree`` as msgpack-able maps; ``visit_leaf(path, leaf)`` -> map.

    Leaves are visited in ``jax.tree.leaves`` order, so a tree of the same
    structure can be rebuilt with ``jax.tree.unflatten``.
    """

    def visit(node: Any, path: str) -> Any:
        if node is None:
            return {"k": "none"}
        pairs, is_leaf = _children(node)
        if is_leaf:
            return visit_leaf(path, node)
        keys = [k for k, _ in pairs]
        if type(node) is dict:
            kind = "dict"
            for k in keys:
                if not isinstance(k, str | int):
                    raise ValueError(
                        f"dict key {k!r} at {path or 'the root'} is not a str or "
                        "int; a checkpoint stores only str and int keys"
                    )
        elif type(node) is list:
            kind = "list"
        elif type(node) is tuple:
            kind = "tuple"
        elif _is_namedtuple(node):
            kind = "namedtuple"
        else:
            kind = "node"
            keys = [k if isinstance(k, str | int) else str(k) for k in keys]
        desc = {
            "k": kind,
            "keys": keys,
            "c": [visit(child, f"{path}[{k!r}]") for k, child in pairs],
        }
        if kind in ("namedtuple", "node"):
            desc["type"] = _type_name(node)
        return desc

    try:
        return visit(tree, "")
    finally:
        # A recursive closure is a reference cycle: break it, so the leaves
        # that ``visit_leaf`` keeps are let go without waiting for the gc.
        visit = None


def _leaf_spec(path: str, leaf: Any) -> dict:
    """The manifest entry of one leaf (without its storage index)."""
    if isinstance(leaf, bool | int | float | str):
        return {"kind": "py", "type": type(leaf).__name__, "value": leaf, "path": path}
    if isinstance(leaf, jax.ShapeDtypeStruct):
        dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
    elif isinstance(leaf, jax.Array | np.ndarray | np.generic):
        dtype, shape = np.dtype(leaf.dtype), tuple(np.shape(leaf))
    else:
        raise ValueError(
            f"leaf at {path or 'the root'} has unsupported type "
            f"{_type_name(leaf)}; leaves must be arrays or bool/int/float/str"
        )
    try:
        name = ts.dtype(dtype).name
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"leaf at {path or 'the root'} has dtype {dtype}, which tensorstore "
            "cannot store"
        ) from e
    return {"kind": "array", "dtype": name, "shape": list(shape), "path": path}


def _structure_of(desc: Any) -> Any:
    """The part of a description that must match for ``like`` to apply."""
    kind = desc["k"]
    if kind == "leaf":
        return "leaf"
    if kind == "none":
        return "none"
    return (kind, tuple(desc["keys"]), tuple(_structure_of(c) for c in desc["c"]))


def _first_difference(saved: Any, like: Any, path: str = "") -> str:
    where = path or "the root"
    if saved == like:
        return ""
    if isinstance(saved, str) or isinstance(like, str):
        return f"at {where}: checkpoint has {_show(saved)}, like has {_show(like)}"
    s_kind, s_keys, s_children = saved
    l_kind, l_keys, l_children = like
    if s_kind != l_kind or s_keys != l_keys:
        return f"at {where}: checkpoint has {_show(saved)}, like has {_show(like)}"
    for key, s, lk in zip(s_keys, s_children, l_children, strict=True):
        found = _first_difference(s, lk, f"{path}[{key!r}]")
        if found:
            return found
    return ""


def _show(structure: Any) -> str:
    if isinstance(structure, str):
        return "a leaf" if structure == "leaf" else "None"
    kind, keys, _ = structure
    return f"a {kind} with keys {list(keys)}"


# ---------------------------------------------------------------------------
# Manifest: magic + sha256 + msgpack body.
# ---------------------------------------------------------------------------


def _pack_manifest(body: dict, magic: bytes = _MAGIC) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    return magic + hashlib.sha256(payload).digest() + payload


def unpack_manifest(
    data: bytes, *, magic: bytes = _MAGIC, format_version: int = _FORMAT_VERSION
) -> dict:
    """Checks and decodes a manifest file of the given format version.

    Raises:
      CheckpointError: the bytes are not a whole, valid manifest.
    """
    header = len(magic) + _DIGEST_BYTES
    if len(data) < header or not data.startswith(magic):
        raise CheckpointError("manifest does not start with the checkpoint magic")
    digest, payload = data[len(magic) : header], data[header:]
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError("manifest checksum mismatch (file damaged)")
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise CheckpointError(f"manifest is not valid msgpack: {e}") from e
    if (
        not isinstance(body, dict)
        or body.get("format") != _FORMAT
        or not {"step", "tree", "leaves", "metadata"} <= body.keys()
    ):
        raise CheckpointError("manifest is not an hpsjax checkpoint manifest")
    if body.get("format_version") != format_version:
        raise CheckpointError(
            f"manifest format version {body.get('format_version')!r} is not "
            f"supported (this reader reads {format_version})"
        )
    _check_leaf_specs(body["leaves"], checksums=format_version >= 2)
    _check_tree(body["tree"], len(body["leaves"]))
    return body


def _stored(spec: dict) -> bool:
    """Whether a leaf's data is in the arrays item (empty arrays are not)."""
    return spec["kind"] == "array" and math.prod(spec["shape"]) > 0


def _check_leaf_specs(leaves: Any, *, checksums: bool) -> None:
    if not isinstance(leaves, list):
        raise CheckpointError("manifest leaves are not a list")
    for i, spec in enumerate(leaves):
        ok = isinstance(spec, dict) and isinstance(spec.get("path"), str)
        if ok and spec.get("kind") == "array":
            shape = spec.get("shape")
            ok = (
                isinstance(spec.get("dtype"), str)
                and isinstance(shape, list)
                and all(isinstance(n, int) and n >= 0 for n in shape)
            )
            if ok and checksums and _stored(spec):
                ok = isinstance(spec.get("crc32"), int)
        elif ok and spec.get("kind") == "py":
            ok = spec.get("type") in _PY_SCALARS and "value" in spec
        else:
            ok = False
        if not ok:
            raise CheckpointError(f"manifest entry of leaf {i} is malformed")


def _check_tree(desc: Any, num_leaves: int) -> None:
    """Checks a tree description; every leaf index used exactly once, in order."""
    next_index = 0

    def visit(node: Any) -> None:
        nonlocal next_index
        if not isinstance(node, dict):
            raise CheckpointError("manifest tree node is not a map")
        kind = node.get("k")
        if kind == "leaf":
            if node.get("i") != next_index:
                raise CheckpointError("manifest tree leaf indices are out of order")
            next_index += 1
        elif kind in ("dict", "list", "tuple", "namedtuple", "node"):
            keys, children = node.get("keys"), node.get("c")
            if not (
                isinstance(keys, list)
                and isinstance(children, list)
                and len(keys) == len(children)
            ):
                raise CheckpointError(f"manifest tree {kind} node is malformed")
            for child in children:
                visit(child)
        elif kind != "none":
            raise CheckpointError(f"unknown node kind {kind!r} in manifest tree")

    visit(desc)
    if next_index != num_leaves:
        raise CheckpointError(
            f"manifest tree has {next_index} leaves, leaf table {num_leaves}"
        )


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1))


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ts.dtype(name).numpy_dtype)


def _host_arrays(plan: _Plan) -> dict[str, np.ndarray]:
    """``plan``'s arrays as numpy arrays (leaves kept by reference fetched now)."""
    arrays = {}
    for key, leaf in plan.arrays.items():
        try:
            arrays[key] = np.asarray(leaf)
        except RuntimeError as e:  # a deleted (donated) jax buffer
            path = plan.body["leaves"][int(key)]["path"]
            raise ValueError(f"cannot fetch leaf {path}: {e}") from e
    return arrays


def _manifest_with_checksums(plan: _Plan, arrays: dict[str, np.ndarray]) -> bytes:
    """The manifest file of ``plan``: each stored array's crc32 added."""
    leaves = [dict(spec) for spec in plan.body["leaves"]]
    for key, array in arrays.items():
        leaves[int(key)]["crc32"] = _crc32(array)
    return _pack_manifest({**plan.body, "leaves": leaves})


def _leaf_values(root: pathlib.Path, specs: list[dict], arrays: dict) -> list[Any]:
    """Every leaf's value from the stored arrays, checked against the manifest."""
    out: list[Any] = []
    for i, spec in enumerate(specs):
        if spec["kind"] == "py":
            try:
                out.append(_PY_SCALARS[spec["type"]](spec["value"]))
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"leaf {i}: bad scalar value") from e
            continue
        try:
            dtype = _numpy_dtype(spec["dtype"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"leaf {i}: unknown dtype {spec['dtype']}") from e
        if not _stored(spec):
            out.append(np.zeros(spec["shape"], dtype))
            continue
        value = np.asarray(arrays[str(i)])
        if value.dtype != dtype or list(value.shape) != spec["shape"]:
            raise CheckpointError(
                f"leaf {i} ({spec['path']}) holds {value.dtype}{list(value.shape)}, "
                f"manifest says {spec['dtype']}{spec['shape']}"
            )
        if _crc32(value) != spec["crc32"]:
            raise CheckpointError(
                f"leaf {i} ({spec['path']}) in {root} fails its crc32 (data damaged)"
            )
        out.append(value)
    return out


def _rebuild(desc: Any, leaves: list[Any]) -> Any:
    """Rebuilds a tree from its description without a ``like`` tree."""
    kind = desc["k"]
    if kind == "leaf":
        return leaves[desc["i"]]
    if kind == "none":
        return None
    children = [_rebuild(c, leaves) for c in desc["c"]]
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    return dict(zip(desc["keys"], children, strict=True))


def _convert_like(value: Any, spec: dict, like_leaf: Any, path: str) -> Any:
    """Converts a restored leaf to the type of ``like_leaf``, checking it fits."""
    where = path or "the root"
    if isinstance(like_leaf, bool | int | float | str):
        if spec["kind"] != "py" or spec["type"] != type(like_leaf).__name__:
            found = spec["type"] if spec["kind"] == "py" else "an array"
            raise ValueError(
                f"like has a Python {type(like_leaf).__name__} at {where}, the "
                f"checkpoint has {found}"
            )
        return value
    like_spec = _leaf_spec(path, like_leaf)
    if spec["kind"] == "py":
        # jax.eval_shape turns Python scalars into 0-d ShapeDtypeStructs, so an
        # abstract ``like`` takes a saved scalar that its dtype holds exactly.
        dtype = np.dtype(ts.dtype(like_spec["dtype"]).numpy_dtype)
        if like_spec["shape"] or spec["type"] == "str":
            raise ValueError(
                f"like has an array of shape {like_spec['shape']} at {where}, the "
                f"checkpoint has a Python {spec['type']}"
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
                f"leaf at {where}: saved Python {spec['type']} {value!r} does not "
                f"fit like's dtype {dtype}"
            )
        value = converted
    elif (like_spec["dtype"], like_spec["shape"]) != (spec["dtype"], spec["shape"]):
        raise ValueError(
            f"leaf at {where}: checkpoint has {spec['dtype']}{spec['shape']}, like "
            f"has {like_spec['dtype']}{like_spec['shape']}"
        )
    if isinstance(like_leaf, jax.Array):
        return jax.device_put(value, like_leaf.sharding)
    if isinstance(like_leaf, jax.ShapeDtypeStruct):
        sharding = getattr(like_leaf, "sharding", None)
        return jax.device_put(value, sharding) if sharding else jax.device_put(value)
    if isinstance(like_leaf, np.generic):
        return value[()]
    return value


def _check_step(step: Any) -> int:
    if isinstance(step, bool):
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise ValueError(f"step must be a non-negative int, got {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be a non-negative int, got {step}")
    return step


def _plan(step: int, tree: Any, metadata: Any, *, copy: bool) -> _Plan:
    """Validates ``tree`` and ``metadata`` and prepares them; writes nothing."""
    specs: list[dict] = []
    values: list[Any] = []

    def visit_leaf(path: str, leaf: Any) -> dict:
        spec = _leaf_spec(path, leaf)
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise ValueError(
                f"leaf at {path or 'the root'} is a ShapeDtypeStruct, which has no "
                "data to save"
            )
        specs.append(spec)
        values.append(leaf)
        return {"k": "leaf", "i": len(specs) - 1}

    desc = _describe(tree, visit_leaf)
    arrays = {}
    for i, (spec, leaf) in enumerate(zip(specs, values, strict=True)):
        if _stored(spec):
            if copy:
                try:
                    # A copy makes the snapshot independent of later in-place
                    # changes of numpy leaves and of donated jax buffers.
                    leaf = np.array(leaf, copy=True)
                except RuntimeError as e:
                    raise ValueError(f"cannot fetch leaf {spec['path']}: {e}") from e
            arrays[str(i)] = leaf
    return _plan_described(step, desc, specs, arrays, metadata)


def _plan_described(
    step: int, desc: Any, specs: list[dict], arrays: dict, metadata: Any
) -> _Plan:
    """A plan from a tree description, its leaf table and its stored arrays."""
    body = {
        "format": _FORMAT,
        "format_version": _FORMAT_VERSION,
        "step": step,
        "tree": desc,
        "leaves": specs,
        "metadata": metadata,
    }
    try:
        _pack_manifest(body)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(
            "metadata and Python scalar leaves must be msgpack-serialisable "
            f"(dict/list/str/int/float/bool/None/bytes): {e}"
        ) from e
    return _Plan(step, arrays, body)


def _legacy_error(directory: pathlib.Path) -> str | None:
    """The one-line refusal of a directory of earlier-format checkpoints."""
    for entry in sorted(directory.glob(f"{_PREFIX}*")):
        if (entry / _LEGACY_MANIFEST).is_file():
            return (
                f"{directory} holds checkpoints of the earlier hpsjax format "
                f"({entry.name}/{_LEGACY_MANIFEST}); convert them with: python -m "
                f"hpsjax.ps.convert_checkpoint {directory} NEW_DIRECTORY"
            )
    return None


class CheckpointManager:
    """Saves and restores pytrees as atomic orbax checkpoints in a directory.

    Each ``save(step, tree, metadata)`` writes ``directory/ckpt_<step>`` by the
    commit protocol in the module docstring, then prunes the oldest
    checkpoints (moved aside, then deleted) so that at most ``keep`` remain.
    Steps must not decrease: a step below the latest saved one is refused,
    because it means the directory holds another run; saving the latest step
    again needs ``overwrite=True``.

    Saving blocks on disk I/O. Code on an event loop should use ``save_async``,
    which snapshots the tree at once and writes it in a background thread, or
    call ``save`` through ``loop.run_in_executor``. All methods are thread-safe.
    The first save takes the directory's lock until ``close``: while a manager
    holds it, another one (in this process or another) lists and restores only.

    The tree may hold jax or numpy arrays of any dtype tensorstore stores
    (bfloat16 included, 0-d and empty arrays too), Python ``bool``/``int``/
    ``float``/``str`` leaves (kept in the manifest) and any pytree nodes: dicts
    with ``str``/``int`` keys, lists, tuples, ``NamedTuple`` s (optax states),
    ``None`` and registered custom nodes.

    Args:
      directory: where checkpoints live; created if missing.
      keep: how many of the newest checkpoints to keep; ``None`` keeps all.

    Raises:
      ValueError: bad arguments, or a directory of earlier-format checkpoints
        (the message gives the command that converts them).

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
        if keep is not None and (
            isinstance(keep, bool) or not isinstance(keep, int) or keep < 1
        ):
            raise ValueError(f"keep must be a positive int or None, got {keep!r}")
        self._directory = pathlib.Path(directory)
        if self._directory.exists() and not self._directory.is_dir():
            raise ValueError(f"{self._directory} exists and is not a directory")
        self._directory.mkdir(parents=True, exist_ok=True)
        if (error := _legacy_error(self._directory)) is not None:
            raise ValueError(error)
        from hpsjax.ps import _checkpoint_orbax  # about a second to import

        self._orbax_lib = _checkpoint_orbax
        self._keep = keep
        self._lock = threading.RLock()
        # Guards save_async's queue; never held while taking self._lock.
        self._queue_lock = threading.Lock()
        self._lock_fd: int | None = None
        # The newest step saved or queued; lets save_async refuse an old step at
        # once instead of failing later in the background.
        self._newest_requested: int | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future] = []
        # save_async's queue: one save written, at most one waiting.
        self._writing = False  # the thread is taking saves from _waiting
        self._in_flight = False  # a save is being written
        self._waiting: tuple[_Plan, bool, concurrent.futures.Future] | None = None
        self._folded_saves = 0
        self._last_save_s = 0.0
        self._behind_logged_at: float | None = None
        self._folded_at_log = 0
        self._background_error: BaseException | None = None
        with self._lock:
            self._cleanup()
            self._orbax = _checkpoint_orbax.new_manager(self._directory.absolute())

    @property
    def directory(self) -> pathlib.Path:
        """The checkpoint directory."""
        return self._directory

    @property
    def keep(self) -> int | None:
        """How many checkpoints are kept (``None``: all)."""
        return self._keep

    # -- listing -------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first (read from disk).

        Returns:
          Sorted steps of the ``ckpt_<step>`` directories (not yet verified;
          ``restore`` verifies).
        """
        with self._lock:
            self._orbax.reload()
            return sorted(self._orbax.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is no checkpoint."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving --------------------------------------------------------------

    def save(
        self,
        step: int,
        tree: Any,
        metadata: Any = None,
        *,
        overwrite: bool = False,
    ) -> pathlib.Path:
        """Writes ``tree`` and ``metadata`` as checkpoint ``step`` and commits it.

        Blocks until the checkpoint is committed on disk. Invalid input raises
        before anything is written.

        Args:
          step: non-negative step, not below the latest checkpoint's.
          tree: the pytree to save.
          metadata: a msgpack-serialisable value, typically a dict (msgpack
            turns tuples into lists; int dict keys are kept).
          overwrite: replace an existing checkpoint of the same step.

        Returns:
          The committed checkpoint's directory.

        Raises:
          ValueError: a bad step, an unsupported leaf or metadata, a step
            already saved without ``overwrite``, or another live manager
            saving into this directory.
        """
        step = _check_step(step)
        plan = _plan(step, tree, metadata, copy=False)
        with self._lock:
            self._check_order(step, overwrite, self.latest_step())
            with self._queue_lock:
                self._note_requested(step)
            return self._save_plan(plan, overwrite)

    def save_async(
        self,
        step: int,
        tree: Any,
        metadata: Any = None,
        *,
        overwrite: bool = False,
        snapshot: bool = True,
    ) -> concurrent.futures.Future:
        """Writes ``tree`` as checkpoint ``step`` in a thread; keeps up by folding.

        The call validates the input, takes its snapshot and returns. At most
        one save is written at a time, on one thread of this manager, and at
        most one waits: a save requested while another is written takes the
        waiting place, replacing a save already there (the newest state wins;
        the replaced request's future is the newer one's). So however often
        saves are asked for, at most two snapshots are held, the newest
        committed step trails the newest requested one by at most the requests
        of two save times, and ``close`` writes at most one more checkpoint.
        The log says, at most once a minute, when requests are folded.
        From asyncio, ``await asyncio.wrap_future(future)`` waits without
        blocking the loop; cancelling that await does not stop the save.

        A failed background save is also raised by the next call of
        ``save_async``, ``wait_until_finished`` or ``close``, so it never goes
        unnoticed.

        Args:
          step: as in ``save``; a folded request must not be older than the
            one it replaces.
          tree: as in ``save``.
          metadata: as in ``save``.
          overwrite: as in ``save``.
          snapshot: copy every array leaf to host memory now, so that later
            in-place changes or buffer donation cannot alter the saved values.
            ``False`` keeps the leaves by reference and fetches them in the
            background: for immutable jax arrays that are not donated later
            (the parameter server's), it costs the caller nothing.

        Returns:
          A ``concurrent.futures.Future`` resolving to the directory of the
          checkpoint that holds this request's state or a newer one.

        Raises:
          ValueError: invalid input (raised here, nothing is queued).
        """
        self._raise_background_error()
        step = _check_step(step)
        plan = _plan(step, tree, metadata, copy=snapshot)
        # The directory is read only before the first save: later, the newest
        # step asked for is known here, and the save being written (which holds
        # self._lock) does not block the caller.
        on_disk = self.latest_step() if self._newest_requested is None else None
        with self._queue_lock:
            known = [s for s in (self._newest_requested, on_disk) if s is not None]
            newest = max(known, default=None)
            self._check_order(step, overwrite, newest)
            self._note_requested(step)
            if self._waiting is not None:
                future = self._waiting[2]
                self._waiting = (plan, overwrite, future)
                self._folded_saves += 1
                self._log_behind()
                return future
            future = concurrent.futures.Future()
            future.add_done_callback(self._record_error)
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)
            self._waiting = (plan, overwrite, future)
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
          Exception: the error of a failed background save, if any.
        """
        with self._queue_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending)
        self._raise_background_error()

    def close(self) -> None:
        """Waits for pending saves, stops the background thread, frees the lock."""
        try:
            self.wait_until_finished()
        finally:
            with self._queue_lock:
                executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
            with self._lock:
                self._orbax.close()
                self._release_lock()

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
            exact node types (``NamedTuple`` s, custom nodes) are rebuilt and
            leaves take the kind of the matching ``like`` leaf: jax arrays (on
            its sharding), numpy arrays or scalars, Python scalars. Without it,
            ``NamedTuple`` s and custom nodes come back as dicts keyed by field
            name and array leaves as numpy arrays.

        Returns:
          ``Checkpoint(step, tree, metadata)``.

        Raises:
          ValueError: no such step, or ``like`` does not match the saved
            structure, shapes or dtypes (the message names the first mismatch).
          CheckpointError: the checkpoint is damaged or incomplete.
        """
        step = _check_step(step)
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

        Leftovers of interrupted saves are cleaned up first. A checkpoint whose
        manifest or data is damaged is logged as a warning, moved aside to
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

    def _note_requested(self, step: int) -> None:
        if self._newest_requested is None or step > self._newest_requested:
            self._newest_requested = step

    def _check_order(self, step: int, overwrite: bool, newest: int | None) -> None:
        if newest is not None and step < newest:
            raise ValueError(
                f"step {step} is older than checkpoint step {newest} already in "
                f"{self._directory}; use a fresh directory for a new run"
            )
        if self._step_dir(step).exists() and not overwrite:
            raise ValueError(
                f"a checkpoint for step {step} already exists in "
                f"{self._directory}; pass overwrite=True to replace it"
            )

    def _write_in_turn(self) -> None:
        """Writes the waiting save, and the next, until none waits."""
        while True:
            with self._queue_lock:
                if self._waiting is None:
                    self._writing = False
                    return
                (plan, overwrite, future), self._waiting = self._waiting, None
                self._in_flight = True
            started = time.monotonic()
            try:
                with self._lock:
                    self._check_order(plan.step, overwrite, self.latest_step())
                    path = self._save_plan(plan, overwrite)
            except BaseException as e:
                future.set_exception(e)
            else:
                future.set_result(path)
            # The written snapshot is let go before the waiting one is taken.
            plan = future = None
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

    def _save_plan(self, plan: _Plan, overwrite: bool) -> pathlib.Path:
        if not self._take_lock():
            raise ValueError(
                f"another live checkpoint manager saves into {self._directory}; "
                "one directory takes one saving manager"
            )
        final = self._step_dir(plan.step)
        old = None
        if overwrite and final.exists():
            # Out of orbax's step namespace first; a crash before the new one
            # is committed leaves it under its .old- name, and _cleanup puts
            # it back.
            old = self._directory / f"{_OLD_PREFIX}{plan.step}-{uuid.uuid4().hex}"
            os.rename(final, old)
            self._orbax.reload()
        try:
            arrays = _host_arrays(plan)
            manifest = _manifest_with_checksums(plan, arrays)
            self._orbax_lib.save(self._orbax, plan.step, arrays, manifest)
        except BaseException:
            self._remove_temporaries(f"{final.name}{_TMP_SUFFIX}")
            if old is not None:
                os.rename(old, final)
            self._orbax.reload()
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._prune()
        return final

    def _prune(self) -> None:
        """Deletes checkpoints beyond the newest ``keep``: moved aside, then deleted.

        Renamed out of the step namespace first (atomic), so a crash while
        deleting leaves a ``.pruned-`` leftover that no reader lists and the
        next manager removes, never a half-deleted ``ckpt_<step>``.
        """
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
        if aside:
            self._orbax.reload()
        for target in aside:
            shutil.rmtree(target, ignore_errors=True)

    def _restore(self, step: int, like: Any) -> Checkpoint:
        root = self._step_dir(step)
        try:
            data = self._orbax_lib.read_manifest(self._orbax, step)
        except Exception as e:
            raise CheckpointError(f"cannot read manifest of {root}: {e}") from e
        body = unpack_manifest(data)
        if body["step"] != step:
            raise CheckpointError(
                f"{root} holds a manifest for step {body['step']}, not {step}"
            )
        specs = body["leaves"]
        if like is not None:
            saved = _structure_of(body["tree"])
            like_desc = _describe(like, lambda path, leaf: {"k": "leaf"})
            if saved != _structure_of(like_desc):
                raise ValueError(
                    "like does not match the checkpoint's tree structure "
                    + _first_difference(saved, _structure_of(like_desc))
                )
        keys = [str(i) for i, spec in enumerate(specs) if _stored(spec)]
        try:
            arrays = self._orbax_lib.read_arrays(self._orbax, step, keys)
        except Exception as e:
            raise CheckpointError(f"cannot read leaf data in {root}: {e}") from e
        values = _leaf_values(root, specs, arrays)
        if like is None:
            try:
                tree = _rebuild(body["tree"], values)
            except TypeError as e:  # an unhashable dict key in a damaged manifest
                raise CheckpointError(f"manifest tree of {root} is invalid") from e
            return Checkpoint(step, tree, body["metadata"])
        like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
        converted = [
            _convert_like(value, spec, leaf, jax.tree_util.keystr(path))
            for value, spec, (path, leaf) in zip(
                values, specs, like_leaves, strict=True
            )
        ]
        return Checkpoint(
            step, jax.tree_util.tree_unflatten(treedef, converted), body["metadata"]
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
        """Removes leftovers of interrupted saves; puts back replaced ones.

        Only while holding the directory's lock: another live manager's save in
        progress looks just like a crash's leftover. A manager that has not
        saved lets the lock go again, so that it stays free for the next saver.
        """
        held = self._lock_fd is not None
        if not self._take_lock():
            return
        try:
            self._cleanup_locked()
        finally:
            if not held:
                self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _cleanup_locked(self) -> None:
        for entry in sorted(self._directory.iterdir()):
            name = entry.name
            if name.startswith(_PREFIX) and _TMP_SUFFIX in name:
                self._remove_temporaries(name)
            elif name.startswith(_PRUNED_PREFIX):
                logger.info("removing interrupted prune %s", entry)
                shutil.rmtree(entry, ignore_errors=True)
            elif name.startswith(_OLD_PREFIX):
                step = name.removeprefix(_OLD_PREFIX).split("-")[0]
                final = self._directory / f"{_PREFIX}{step}"
                if step.isdigit() and not final.exists():
                    logger.warning(
                        "putting back checkpoint %s from an interrupted overwrite",
                        final,
                    )
                    os.rename(entry, final)
                else:
                    shutil.rmtree(entry, ignore_errors=True)

    def _move_aside(self, root: pathlib.Path) -> None:
        """Renames a damaged checkpoint out of orbax's step namespace.

        Kept (never deleted) for a look, as ``<name>.damaged-<n>``; saving goes
        on as if it were not there, so the run's next steps are not refused as
        older than it.
        """
        n = 1
        while (aside := root.with_name(f"{root.name}{_DAMAGED_INFIX}{n}")).exists():
            n += 1
        try:
            os.rename(root, aside)
        except OSError as e:
            logger.warning("cannot move damaged checkpoint %s aside: %s", root, e)
            return
        finally:
            self._orbax.reload()
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
