r"""Key ranges: a model split over several parameter servers, computed alike everywhere.

A model too big for one server is split across several server processes, each
holding one contiguous **key range** of the parameters (ps-lite's server groups;
PHub's chunking of the model over its aggregators):

* :class:`KeyRangePartition` orders the leaves of a pytree by key path (sorted
  dictionary keys, as JAX and the wire flatten them) and cuts that sequence into
  ``num_shards`` contiguous ranges balanced by bytes: the cut minimises the
  bytes of the biggest shard. It is plain data (:meth:`~KeyRangePartition.to_json`),
  and the same shapes always give the same partition, so every server and every
  worker can compute it for itself. ``split(tree)`` gives each shard its
  sub-tree, ``merge(sub_trees)`` joins them again.

**Keys.** Each leaf is one key by default, so a shard holds whole leaves. With
``split_leaves=True`` each *row* (index along the first axis) of a leaf is a key,
so a leaf bigger than a fair share (an embedding table) is cut across shards
along its first axis; its rows on each shard form one leaf of that shard's
sub-tree. Whole leaves keep every per-leaf computation of the server (a
quantizer's per-leaf scale, a per-leaf norm) exactly as on one server; cut leaves
balance the bytes of a model dominated by one leaf. Pushes that a worker encoded
itself (``encoded=``) need whole leaves.

  Distributed Machine Learning with the Parameter Server", OSDI 2014,
  https://www.usenix.org/conference/osdi14/technical-sessions/presentation/li_mu
  (ps-lite: key ranges over a server group).

  Luo, Nelson, Ceze, Phanishayee, Krishnamurthy, "Parameter Hub: a Rack-Scale
  Parameter Server for Distributed Deep Neural Network Training", SoCC 2018,
  https://arxiv.org/abs/1801.09805 (chunking the model over aggregators).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hpsjax._checks import check_int
from hpsjax.wire import unflatten_tree as _unflatten

__all__ = ["KeyRangePartition"]

_FORMAT = "hpsjax.key_range_partition"
_FORMAT_VERSION = 1


# ---------------------------------------------------------------- tree walks


def _flatten(node: Any, path: str, leaves: list, paths: list) -> Any:
    """The JSON structure of ``node``; appends its leaves and their key paths.

    The structure is the wire's (``hpsjax.wire._treecodec.flatten_tree``): a leaf is
    its index, ``None`` is ``None``, ``["d", {key: child}]`` a mapping (keys in
    sorted order, as JAX flattens them), ``["l", [...]]`` a list and
    ``["t", [...]]`` a tuple.
    """
    if node is None:
        return None
    if isinstance(node, Mapping):
        children = {}
        for key in node:
            if not isinstance(key, str):
                raise ValueError(
                    f"mapping keys must be str, got {key!r} at {path or 'the root'}"
                )
        for key in sorted(node):
            children[key] = _flatten(
                node[key], f"{path}/{key}" if path else key, leaves, paths
            )
        return ["d", children]
    if isinstance(node, list | tuple):
        tag = "l" if isinstance(node, list) else "t"
        return [
            tag,
            [
                _flatten(child, f"{path}/{i}" if path else str(i), leaves, paths)
                for i, child in enumerate(node)
            ],
        ]
    leaves.append(node)
    paths.append(path or "<root>")
    return len(leaves) - 1


_DROP: Any = object()


def _holds_leaves(structure: Any) -> bool:
    if structure is None:
        return False
    if isinstance(structure, int):
        return True
    tag, body = structure
    return any(map(_holds_leaves, body.values() if tag == "d" else body))


def _prune(structure: Any, keep: Mapping[int, int]) -> Any:
    """``structure`` holding only the leaves in ``keep`` (renumbered by it).

    A sub-structure whose leaves are all elsewhere is left out (``_DROP``);
    parts without leaves (``None``, empty containers) stay in a container that
    stays, so the one shard of a single-shard partition is the whole tree.
    """
    if structure is None:
        return None
    if isinstance(structure, int):
        return keep.get(structure, _DROP)
    tag, body = structure
    children = body.items() if tag == "d" else enumerate(body)
    pruned = [(key, _prune(child, keep)) for key, child in children]
    kept = [(key, p) for key, p in pruned if p is not _DROP]
    if len(kept) < len(pruned) and not any(_holds_leaves(p) for _, p in kept):
        return _DROP
    if tag == "d":
        return ["d", dict(kept)]
    return [tag, [p for _, p in kept]]


def _leaf_spec(leaf: Any, path: str) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(int(d) for d in leaf.shape), jnp.dtype(leaf.dtype)
    array = np.asarray(leaf)
    if array.dtype == object:
        raise ValueError(f"leaf {path} is not an array: {type(leaf).__name__}")
    return array.shape, array.dtype


def _slice_rows(leaf: Any, start: int, stop: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((stop - start, *leaf.shape[1:]), leaf.dtype)
    return leaf[start:stop]


def _concatenate(pieces: Sequence[Any]) -> Any:
    if all(isinstance(p, jax.ShapeDtypeStruct) for p in pieces):
        rows = sum(p.shape[0] for p in pieces)
        return jax.ShapeDtypeStruct((rows, *pieces[0].shape[1:]), pieces[0].dtype)
    if all(isinstance(p, np.ndarray) for p in pieces):
        return np.concatenate(pieces, axis=0)
    return jnp.concatenate([jnp.asarray(p) for p in pieces], axis=0)


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------ balance


def _pack(
    counts: Sequence[int], weights: Sequence[int], cap: int, num_shards: int
) -> list[int] | None:
    """Greedy contiguous packing of keys under ``cap`` bytes per shard.

    Leaf ``j`` holds ``counts[j]`` keys of ``weights[j]`` bytes each. Each shard
    takes keys in order while they fit, but leaves at least one key for each
    shard after it, so no shard is empty.

    Returns:
      The ``num_shards + 1`` key bounds, or ``None`` when ``num_shards`` shards
      of ``cap`` bytes cannot hold every key.
    """
    total = sum(counts)
    bounds = [0]
    key = load = 0
    for count, weight in zip(counts, weights, strict=True):
        left = count
        while left:
            reserve = num_shards - len(bounds)  # shards after the open one
            fit = left if weight == 0 else min(left, (cap - load) // weight)
            take = max(0, min(fit, total - reserve - key))
            key += take
            left -= take
            load += take * weight
            if left:
                # An empty open shard that cannot take a key: the key exceeds cap.
                if key == bounds[-1] or len(bounds) == num_shards:
                    return None
                bounds.append(key)
                load = 0
    bounds.append(key)
    return bounds


def _balanced_bounds(
    counts: Sequence[int], weights: Sequence[int], num_shards: int
) -> list[int]:
    """Key bounds minimising the bytes of the biggest shard (binary search)."""
    total = sum(c * w for c, w in zip(counts, weights, strict=True))
    low = max(max(weights), -(-total // num_shards))
    high = max(low, total)
    while low < high:
        mid = (low + high) // 2
        if _pack(counts, weights, mid, num_shards) is None:
            low = mid + 1
        else:
            high = mid
    bounds = _pack(counts, weights, low, num_shards)
    assert bounds is not None
    return bounds


# ---------------------------------------------------------------- partition


class _Piece(NamedTuple):
    leaf: int  # index of the leaf in the whole tree
    start: int  # first row (0 for a whole leaf)
    stop: int  # row after the last
    whole: bool  # the piece is the whole leaf


class KeyRangePartition:
    r"""A pytree's leaves cut into contiguous key ranges, one per server shard.

    Leaves are ordered by key path, the order JAX and the wire flatten a tree
    in. Leaf :math:`j` holds :math:`k_j` keys of :math:`b_j` bytes each (one key
    per leaf, or one per row with ``split_leaves``), and shard :math:`s` holds
    the keys :math:`[K_s, K_{s+1})` of that sequence, every shard at least one,
    with the bounds :math:`K` chosen to minimise the bytes of the biggest shard,

    .. math::

      \min_{0 = K_0 < K_1 < \dots < K_N = \textstyle\sum_j k_j}\;
      \max_s \sum_{\text{keys } i \in [K_s, K_{s+1})} \text{bytes}(i),

    which is at most :math:`\lceil B / N \rceil + \max_j b_j` for a model of
    :math:`B` bytes (a binary search on the bound with a greedy packing; of the
    cuts that reach it, the one filling earlier shards first). The
    biggest shard can be no smaller than the biggest key: with whole leaves, a
    leaf bigger than a fair share is a shard of its own; ``split_leaves=True``
    cuts it by rows instead.

    Build one with :meth:`from_tree` (from arrays or ``jax.ShapeDtypeStruct``),
    or read one back with :meth:`from_json`. Trees are nested ``dict`` (``str``
    keys), ``list``, ``tuple`` and ``None`` with array leaves: the trees the
    wire carries.

    Examples:
      >>> import numpy as np
      >>> params = {"dense": {"kernel": np.ones((64, 16), np.float32),
      ...                     "bias": np.zeros(16, np.float32)},
      ...           "head": {"kernel": np.ones((16, 10), np.float32)}}
      >>> p = KeyRangePartition.from_tree(params, 2)
      >>> p.paths
      ('dense/bias', 'dense/kernel', 'head/kernel')
      >>> [p.shard_paths(s) for s in range(2)]
      [('dense/bias', 'dense/kernel'), ('head/kernel',)]
      >>> parts = p.split(params)
      >>> sorted(parts[1])
      ['head']
      >>> merged = p.merge(parts)
      >>> merged["dense"]["kernel"].shape
      (64, 16)
      >>> KeyRangePartition.from_json(p.to_json()) == p
      True

      Cutting the big kernel by rows balances the bytes:

      >>> p = KeyRangePartition.from_tree(params, 2, split_leaves=True)
      >>> p.shard_nbytes()
      (2432, 2368)
      >>> p.split(params)[1]["dense"]["kernel"].shape
      (27, 16)

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter
      Server", OSDI 2014,
      https://www.usenix.org/conference/osdi14/technical-sessions/presentation/li_mu

      Luo et al., "Parameter Hub: a Rack-Scale Parameter Server for Distributed
      Deep Neural Network Training", SoCC 2018, https://arxiv.org/abs/1801.09805
    """

    __hash__ = None  # type: ignore[assignment]

    def __init__(
        self,
        structure: Any,
        paths: Sequence[str],
        shapes: Sequence[Sequence[int]],
        dtypes: Sequence[Any],
        bounds: Sequence[int],
        *,
        split_leaves: bool,
    ):
        """Use :meth:`from_tree` or :meth:`from_json`; this checks the fields."""
        self._structure = structure
        self._paths = tuple(str(p) for p in paths)
        self._shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self._dtypes = tuple(jnp.dtype(d) for d in dtypes)
        self._bounds = tuple(int(b) for b in bounds)
        self._split_leaves = bool(split_leaves)
        n = len(self._paths)
        if not n:
            raise ValueError("the tree has no leaves to partition")
        if not (len(self._shapes) == len(self._dtypes) == n):
            raise ValueError("paths, shapes and dtypes differ in length")
        leaves: list = []
        try:
            again = _flatten(_unflatten(structure, list(range(n))), "", leaves, [])
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            again = None
        if again != structure or leaves != list(range(n)):
            raise ValueError(f"the structure does not hold leaves 0..{n - 1} in order")
        for shape in self._shapes:
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in shape {shape}")
        self._counts = tuple(self._keys_of(s) for s in self._shapes)
        total = sum(self._counts)
        b = self._bounds
        if len(b) < 2 or b[0] != 0 or b[-1] != total:
            raise ValueError(
                f"bounds must run from 0 to {total} keys, got {list(self._bounds)}"
            )
        if any(x >= y for x, y in itertools.pairwise(b)):
            raise ValueError(f"bounds must increase strictly, got {list(b)}")
        self._pieces = tuple(self._pieces_of(s) for s in range(len(b) - 1))
        self._shard_structures = tuple(
            _prune(structure, {p.leaf: i for i, p in enumerate(pieces)})
            for pieces in self._pieces
        )

    # -------------------------------------------------------- construction

    @classmethod
    def from_tree(
        cls, tree: Any, num_shards: int, *, split_leaves: bool = False
    ) -> KeyRangePartition:
        """Partitions ``tree``'s leaves into ``num_shards`` key ranges.

        Args:
          tree: a pytree of arrays (or ``jax.ShapeDtypeStruct``); only the
            structure, shapes and dtypes are read.
          num_shards: the number of server shards, at least 1.
          split_leaves: make each row of a leaf a key, so that a big leaf may
            be cut across shards along its first axis.

        Returns:
          The :class:`KeyRangePartition`.

        Raises:
          ValueError: ``num_shards`` < 1, more shards than keys (leaves, or
            rows with ``split_leaves``), or a tree that is not made of
            mappings with ``str`` keys, lists, tuples and arrays.
        """
        if isinstance(num_shards, bool) or not isinstance(num_shards, int):
            raise ValueError(f"num_shards must be an int, got {num_shards!r}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        leaves: list = []
        paths: list = []
        structure = _flatten(tree, "", leaves, paths)
        if not leaves:
            raise ValueError("the tree has no leaves to partition")
        specs = [
            _leaf_spec(leaf, path) for leaf, path in zip(leaves, paths, strict=True)
        ]
        shapes = [s for s, _ in specs]
        counts = [cls._count(s, split_leaves) for s in shapes]
        if num_shards > sum(counts):
            unit = "rows" if split_leaves else "leaves"
            raise ValueError(
                f"{num_shards} shards for a tree of {sum(counts)} {unit}: give "
                f"at most {sum(counts)} shards"
                + ("" if split_leaves else " (or split_leaves=True)")
            )
        weights = [
            math.prod(s) * d.itemsize // c
            for (s, d), c in zip(specs, counts, strict=True)
        ]
        bounds = _balanced_bounds(counts, weights, num_shards)
        return cls(
            structure,
            paths,
            shapes,
            [d for _, d in specs],
            bounds,
            split_leaves=split_leaves,
        )

    @staticmethod
    def _count(shape: tuple[int, ...], split_leaves: bool) -> int:
        if split_leaves and shape and shape[0] > 1:
            return shape[0]
        return 1

    def _keys_of(self, shape: tuple[int, ...]) -> int:
        return self._count(shape, self._split_leaves)

    def _pieces_of(self, shard: int) -> tuple[_Piece, ...]:
        low, high = self._bounds[shard], self._bounds[shard + 1]
        pieces = []
        offset = 0
        for j, count in enumerate(self._counts):
            start, stop = max(low, offset), min(high, offset + count)
            if start < stop:
                whole = start == offset and stop == offset + count
                pieces.append(_Piece(j, start - offset, stop - offset, whole))
            offset += count
        return tuple(pieces)

    # ------------------------------------------------------------ JSON

    def to_json(self) -> str:
        """The partition as JSON (see :meth:`from_json`)."""
        return json.dumps(
            {
                "format": _FORMAT,
                "version": _FORMAT_VERSION,
                "split_leaves": self._split_leaves,
                "structure": self._structure,
                "leaves": [
                    {"path": p, "shape": list(s), "dtype": d.name}
                    for p, s, d in zip(
                        self._paths, self._shapes, self._dtypes, strict=True
                    )
                ],
                "bounds": list(self._bounds),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> KeyRangePartition:
        """Reads a partition written by :meth:`to_json`.

        Raises:
          ValueError: not a partition, or inconsistent fields.
        """
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT:
                raise ValueError(f"not a {_FORMAT} document")
            if data.get("version") != _FORMAT_VERSION:
                raise ValueError(f"unsupported version {data.get('version')!r}")
            leaves = data["leaves"]
            return cls(
                data["structure"],
                [leaf["path"] for leaf in leaves],
                [leaf["shape"] for leaf in leaves],
                [leaf["dtype"] for leaf in leaves],
                data["bounds"],
                split_leaves=data["split_leaves"],
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed partition JSON: {e!r}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"partition is not JSON: {e}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KeyRangePartition):
            return NotImplemented
        return self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (
            f"KeyRangePartition(num_shards={self.num_shards}, "
            f"leaves={len(self._paths)}, split_leaves={self._split_leaves}, "
            f"shard_nbytes={self.shard_nbytes()})"
        )

    # ------------------------------------------------------------ queries

    @property
    def num_shards(self) -> int:
        """The number of shards."""
        return len(self._bounds) - 1

    @property
    def split_leaves(self) -> bool:
        """Whether keys are rows (leaves may be cut) rather than whole leaves."""
        return self._split_leaves

    @property
    def paths(self) -> tuple[str, ...]:
        """The leaves' key paths (``/``-joined), in key order."""
        return self._paths

    @property
    def bounds(self) -> tuple[int, ...]:
        """The key bounds: shard ``s`` holds keys ``[bounds[s], bounds[s+1])``."""
        return self._bounds

    @property
    def cuts_leaves(self) -> bool:
        """Whether some leaf is cut across two or more shards."""
        return any(not p.whole for pieces in self._pieces for p in pieces)

    def spec(self) -> Any:
        """The whole tree as ``jax.ShapeDtypeStruct`` leaves."""
        return _unflatten(
            self._structure,
            [
                jax.ShapeDtypeStruct(s, d)
                for s, d in zip(self._shapes, self._dtypes, strict=True)
            ],
        )

    def shard_spec(self, shard: int) -> Any:
        """Shard ``shard``'s sub-tree as ``jax.ShapeDtypeStruct`` leaves."""
        return self.split(self.spec())[self._check_shard(shard)]

    def shard_paths(self, shard: int) -> tuple[str, ...]:
        """Key paths of the leaves (or leaf rows) shard ``shard`` holds."""
        pieces = self._pieces[self._check_shard(shard)]
        return tuple(
            self._paths[p.leaf]
            if p.whole
            else f"{self._paths[p.leaf]}[{p.start}:{p.stop}]"
            for p in pieces
        )

    def shard_nbytes(self) -> tuple[int, ...]:
        """Bytes of each shard."""
        return tuple(
            sum(self._piece_nbytes(p) for p in pieces) for pieces in self._pieces
        )

    def describe(self, shard: int) -> str:
        """One line on shard ``shard``: its leaves and bytes, for logs."""
        s = self._check_shard(shard)
        paths = self.shard_paths(s)
        first, last = paths[0], paths[-1]
        span = first if len(paths) == 1 else f"{first} .. {last}"
        return (
            f"shard {s} of {self.num_shards}: {len(paths)} "
            f"{'leaf' if len(paths) == 1 else 'leaves'} ({span}), "
            f"{_format_bytes(self.shard_nbytes()[s])} of "
            f"{_format_bytes(sum(self.shard_nbytes()))}"
        )

    def _piece_nbytes(self, piece: _Piece) -> int:
        shape, dtype = self._shapes[piece.leaf], self._dtypes[piece.leaf]
        nbytes = math.prod(shape) * dtype.itemsize
        if piece.whole:
            return nbytes
        return nbytes // shape[0] * (piece.stop - piece.start)

    def _check_shard(self, shard: int) -> int:
        return check_int("shard", shard, low=0, high=self.num_shards - 1)

    # ------------------------------------------------------- split, merge

    def _leaves_of(self, tree: Any, what: str) -> list[Any]:
        leaves: list = []
        paths: list = []
        structure = _flatten(tree, "", leaves, paths)
        if structure != self._structure:
            raise ValueError(
                f"{what} does not have the partitioned tree's structure: leaves "
                f"{paths[:8]}{' ...' if len(paths) > 8 else ''} against "
                f"{list(self._paths[:8])}{' ...' if len(self._paths) > 8 else ''}"
            )
        for leaf, path, shape in zip(leaves, paths, self._shapes, strict=True):
            got, _ = _leaf_spec(leaf, path)
            if got != shape:
                raise ValueError(
                    f"{what}'s leaf {path} has shape {got}, the partition's {shape}"
                )
        return leaves

    def split(self, tree: Any) -> list[Any]:
        """Each shard's sub-tree of ``tree``.

        A shard's sub-tree keeps the containers on the way to its leaves (a
        mapping keeps only the keys leading to them); a leaf cut by rows
        appears in each of its shards under its own key path, holding that
        shard's rows. Leaves are not copied (rows are slices).

        Args:
          tree: a tree of the partitioned structure and shapes (arrays or
            ``jax.ShapeDtypeStruct``).

        Returns:
          ``num_shards`` sub-trees.

        Raises:
          ValueError: ``tree`` differs from the partitioned tree in structure
            or shapes.
        """
        leaves = self._leaves_of(tree, "the tree")
        return [
            _unflatten(
                structure,
                [
                    leaves[p.leaf]
                    if p.whole
                    else _slice_rows(leaves[p.leaf], p.start, p.stop)
                    for p in pieces
                ],
            )
            for structure, pieces in zip(
                self._shard_structures, self._pieces, strict=True
            )
        ]

    def split_leaf_list(self, leaves: Sequence[Any]) -> list[list[Any]]:
        """Splits per-leaf values (in key order) into each shard's list.

        For values that cannot be cut by rows, such as the ``Encoded`` of each
        leaf that :func:`hpsjax.transforms.last_encoded` returns.

        Raises:
          ValueError: the wrong number of values, or a partition that cuts a
            leaf.
        """
        if len(leaves) != len(self._paths):
            raise ValueError(
                f"{len(leaves)} per-leaf values for a tree of {len(self._paths)} leaves"
            )
        if self.cuts_leaves:
            cut = next(
                self._paths[p.leaf] for ps in self._pieces for p in ps if not p.whole
            )
            raise ValueError(
                f"the partition cuts leaf {cut} across shards; per-leaf values "
                "(such as updates the worker encoded itself) need whole leaves: "
                "partition with split_leaves=False"
            )
        return [[leaves[p.leaf] for p in pieces] for pieces in self._pieces]

    def merge(self, sub_trees: Sequence[Any]) -> Any:
        """Joins the shards' sub-trees into one tree (the inverse of :meth:`split`).

        Rows of a cut leaf are concatenated (numpy arrays stay numpy).

        Args:
          sub_trees: one sub-tree per shard, in shard order.

        Returns:
          The whole tree.

        Raises:
          ValueError: the wrong number of sub-trees, or one that is not its
            shard's structure and shapes.
        """
        if len(sub_trees) != self.num_shards:
            raise ValueError(
                f"{len(sub_trees)} sub-trees for a partition of "
                f"{self.num_shards} shards"
            )
        parts: list[list[Any]] = [[] for _ in self._paths]
        for s, sub_tree in enumerate(sub_trees):
            leaves: list = []
            paths: list = []
            structure = _flatten(sub_tree, "", leaves, paths)
            if structure != self._shard_structures[s]:
                raise ValueError(
                    f"sub-tree {s} does not have shard {s}'s structure: leaves "
                    f"{paths[:8]} against {list(self.shard_paths(s)[:8])}"
                )
            for piece, leaf, path in zip(self._pieces[s], leaves, paths, strict=True):
                shape = self._shapes[piece.leaf]
                want = shape if piece.whole else (piece.stop - piece.start, *shape[1:])
                got, _ = _leaf_spec(leaf, path)
                if got != want:
                    raise ValueError(
                        f"sub-tree {s}'s leaf {path} has shape {got}, expected {want}"
                    )
                parts[piece.leaf].append(leaf)
        leaves = [p[0] if len(p) == 1 else _concatenate(p) for p in parts]
        return _unflatten(self._structure, leaves)


# --------------------------------------------------------------- versions
