r"""Server shards: a model split by key range over several parameter servers.

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
* :class:`ShardedClient` has the interface of :class:`~hpsjax.ps.Client` that
  the worker runtime uses (``connect``, ``close``, ``pull``, ``push``,
  ``push_pull``, ``hints``, ``bytes_sent``, ...). It keeps one
  :class:`~hpsjax.ps.Client` per shard and sends each request to every shard
  concurrently, with each shard's part of the update.

**Keys.** Each leaf is one key by default, so a shard holds whole leaves. With
``split_leaves=True`` each *row* (index along the first axis) of a leaf is a key,
so a leaf bigger than a fair share (an embedding table) is cut across shards
along its first axis; its rows on each shard form one leaf of that shard's
sub-tree. Whole leaves keep every per-leaf computation of the server (a
quantizer's per-leaf scale, a per-leaf norm) exactly as on one server; cut leaves
balance the bytes of a model dominated by one leaf. Pushes that a worker encoded
itself (``encoded=``) need whole leaves.

**Versions.** Every shard runs its own :class:`~hpsjax.ps.ServerCore` and counts
its own version. Every push goes to every shard, so the counts move together,
but they need not be equal at any instant. A sharded pull returns a
:class:`ShardedVersion`: an ``int`` worth the *lowest* shard version (the version
every shard has reached, which is what ``until_version`` and the worker's
staleness estimate :math:`\hat\tau = V_\text{known} - v` then use), carrying the
per-shard versions in :attr:`ShardedVersion.shards`. Passing it back to
:meth:`ShardedClient.push` tells each shard the version *it* served. A plain
``int`` means that version on every shard.

**Acknowledgements.** A sharded push's :class:`ShardedPushResult` combines the
shards' answers: its staleness is the **maximum** over shards (the update is as
stale as its stalest part, the conservative choice for PS+ step-size
modulation), its weight the minimum; it is ``"dropped"`` when any shard dropped
its part, ``"applied"`` when every shard applied it, else ``"buffered"``; it
asks to pull fresh parameters when any shard does. The per-shard answers are in
``shards``. Hints (:attr:`ShardedClient.hints`) take the fewest local steps any
shard asks for and the plan and stage of shard 0, the *lead shard*: give a work
plan (``hpsjax-server --work_plan``) to shard 0 only.

**Failures.** A request fails as soon as one shard fails: the other shards'
requests are cancelled (so a dead shard never leaves the call hanging on the
others), and the error raised is the failing shard's, of the same class (so
``except WorkerDropped`` or ``except ShuttingDown`` still work), with its message
naming the shard and what the other shards did. It carries two attributes:
``shard_index`` (the failing shard) and ``shard_results`` (a dict from the index
of each shard that completed the request to its result: a push that failed on
shard 1 may have been applied on shard 0). Other shards' requests cancelled
after being sent may still have been applied, as with a cancelled
:meth:`Client.push <hpsjax.ps.Client.push>`.

References:
  Li, Andersen, Park, Smola, Ahmed, Josifovski, Long, Shekita, Su, "Scaling
  Distributed Machine Learning with the Parameter Server", OSDI 2014,
  https://www.usenix.org/conference/osdi14/technical-sessions/presentation/li_mu
  (ps-lite: key ranges over a server group).

  Luo, Nelson, Ceze, Phanishayee, Krishnamurthy, "Parameter Hub: a Rack-Scale
  Parameter Server for Distributed Deep Neural Network Training", SoCC 2018,
  https://arxiv.org/abs/1801.09805 (chunking the model over aggregators).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hpsjax.ps._client import Client, PushResult, ServerInfo
from hpsjax.ps._errors import HpsError, SpecMismatch
from hpsjax.ps._treecodec import unflatten_tree as _unflatten

__all__ = [
    "KeyRangePartition",
    "ShardedClient",
    "ShardedPushResult",
    "ShardedVersion",
]

_FORMAT = "hpsjax.key_range_partition"
_FORMAT_VERSION = 1


# ---------------------------------------------------------------- tree walks


def _flatten(node: Any, path: str, leaves: list, paths: list) -> Any:
    """The JSON structure of ``node``; appends its leaves and their key paths.

    The structure is the wire's (``hpsjax.ps._treecodec.flatten_tree``): a leaf is
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
        if isinstance(shard, bool) or not isinstance(shard, int | np.integer):
            raise ValueError(f"shard must be an int, got {shard!r}")
        if not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be in [0, {self.num_shards}), got {shard}")
        return int(shard)

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


class ShardedVersion(int):
    """The version of parameters pulled from several shards.

    Worth, as an ``int``, the lowest shard version: the version every shard
    has reached. :attr:`shards` holds each shard's own version, which
    :meth:`ShardedClient.push` sends back to each shard.

    Examples:
      >>> v = ShardedVersion((7, 6))
      >>> int(v), v.shards, v >= 6
      (6, (7, 6), True)
    """

    def __new__(cls, shards: Sequence[int]) -> ShardedVersion:
        versions = tuple(int(v) for v in shards)
        if not versions or any(v < 0 for v in versions):
            raise ValueError(f"shard versions must be >= 0, got {shards!r}")
        self = super().__new__(cls, min(versions))
        self.__dict__["_shards"] = versions
        return self

    @property
    def shards(self) -> tuple[int, ...]:
        """Each shard's version, in shard order."""
        return self.__dict__["_shards"]

    def __repr__(self) -> str:
        return f"ShardedVersion({self.shards})"

    def __reduce__(self):
        return ShardedVersion, (self.shards,)


class ShardedPushResult(NamedTuple):
    """The shards' answers to one push, combined (fields of ``PushResult``).

    Attributes:
      version: the shards' versions after the push, a :class:`ShardedVersion`.
      staleness: the maximum staleness over shards.
      status: ``"dropped"`` if any shard dropped its part, ``"applied"`` if
        every shard applied it, else ``"buffered"``.
      weight: the minimum damping weight over shards.
      local_steps: the fewest local steps any shard hinted, or ``None``.
      reason: the shards' reasons (``"shard i: ..."``), or ``None``.
      force_pull: whether any shard asks to discard local work and pull.
      shards: each shard's :class:`~hpsjax.ps.PushResult`.
    """

    version: ShardedVersion
    staleness: int
    status: str
    weight: float
    local_steps: int | None
    reason: str | None
    force_pull: bool
    shards: tuple[PushResult, ...]

    @property
    def applied(self) -> bool:
        """Whether every shard's new version includes its part of the update."""
        return self.status == "applied"


def _combine(results: Sequence[PushResult]) -> ShardedPushResult:
    statuses = {r.status for r in results}
    if "dropped" in statuses:
        status = "dropped"
    elif statuses == {"applied"}:
        status = "applied"
    else:
        status = "buffered"
    hinted = [r.local_steps for r in results if r.local_steps is not None]
    reasons = [f"shard {i}: {r.reason}" for i, r in enumerate(results) if r.reason]
    return ShardedPushResult(
        version=ShardedVersion([r.version for r in results]),
        staleness=max(r.staleness for r in results),
        status=status,
        weight=min(r.weight for r in results),
        local_steps=min(hinted) if hinted else None,
        reason="; ".join(reasons) if reasons else None,
        force_pull=any(r.force_pull for r in results),
        shards=tuple(results),
    )


# ------------------------------------------------------------------ client

_UNSET: Any = object()


def _tagged(error: BaseException, prefix: str, results: dict[int, Any]):
    """A copy of ``error`` (same class) whose message starts with ``prefix``."""
    # A copy, not the error itself: a client raises the same stored error
    # object on every call after its connection failed.
    try:
        tagged = copy.copy(error)
    except Exception:
        tagged = HpsError(f"{prefix}: {type(error).__name__}: {error}")
    else:
        if isinstance(tagged, HpsError):
            tagged.message = f"{prefix}: {tagged.message or type(tagged).__name__}"
            tagged.args = (tagged.message,)
        elif isinstance(tagged, OSError) and tagged.strerror is not None:
            tagged.strerror = f"{prefix}: {tagged.strerror}"
        else:
            tagged.args = (f"{prefix}: {error}",)
    tagged.shard_results = results
    return tagged


class ShardedClient:
    """A worker's connections to a model split over several server shards.

    The interface of :class:`~hpsjax.ps.Client` that
    :class:`hpsjax.worker.Worker` uses (pass it as ``Worker(client=...)``),
    over one :class:`~hpsjax.ps.Client` per shard. Every call goes to all
    shards at once (``asyncio``), each with its part of the update, and the
    answers are merged: parameters by :meth:`KeyRangePartition.merge`,
    versions into a :class:`ShardedVersion`, acknowledgements into a
    :class:`ShardedPushResult` (see the module docstring for how staleness,
    status and hints combine, and for how a failing shard is reported).

    Args:
      addresses: ``(host, port)`` of each shard's server, in shard order.
      partition: the :class:`KeyRangePartition` the servers were started with;
        ``connect`` checks each server's model against its shard.
      worker_id: this worker's id (the same on every shard).
      secret: the shared secret, or ``None``.
      seed: seed of the stochastic rounding of pushes the clients compress;
        shard ``i`` uses ``seed + i``.
      **client_kwargs: the other arguments of :class:`~hpsjax.ps.Client`
        (``ssl``, ``server_hostname``, ``timeout``, ``limits``), the same for
        every shard.

    Cancellation and timeouts are those of :class:`~hpsjax.ps.Client`: every
    call takes ``timeout`` (default: the clients'), which bounds each shard's
    request; cancelling a call cancels every shard's request.

    Examples:
      Two shards::

        partition = KeyRangePartition.from_tree(params, 2)
        servers = [Server(part, optax.sgd(0.1), "asp") for part in
                   partition.split(params)]
        ...
        async with ShardedClient([("hostA", 5555), ("hostB", 5555)],
                                 partition, worker_id="w0", secret=key) as c:
            params, version = await c.pull()
            ack = await c.push(grads, version=version)

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter
      Server", OSDI 2014,
      https://www.usenix.org/conference/osdi14/technical-sessions/presentation/li_mu

      Luo et al., "Parameter Hub: a Rack-Scale Parameter Server for Distributed
      Deep Neural Network Training", SoCC 2018, https://arxiv.org/abs/1801.09805
    """

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        partition: KeyRangePartition,
        *,
        worker_id: str | int,
        secret: bytes | str | None,
        seed: int | None = None,
        **client_kwargs: Any,
    ):
        if not isinstance(partition, KeyRangePartition):
            raise ValueError(
                f"partition must be a KeyRangePartition, got {type(partition).__name__}"
            )
        addresses = [tuple(a) for a in addresses]
        if len(addresses) != partition.num_shards:
            raise ValueError(
                f"{len(addresses)} server addresses for a partition of "
                f"{partition.num_shards} shards"
            )
        for address in addresses:
            if len(address) != 2:
                raise ValueError(f"an address is (host, port), got {address!r}")
        self._partition = partition
        self._addresses = [(str(h), int(p)) for h, p in addresses]
        self._clients = [
            Client(
                host,
                port,
                worker_id=worker_id,
                secret=secret,
                seed=None if seed is None else seed + i,
                **client_kwargs,
            )
            for i, (host, port) in enumerate(self._addresses)
        ]

    # ----------------------------------------------------------- properties

    @property
    def partition(self) -> KeyRangePartition:
        """The key-range partition."""
        return self._partition

    @property
    def clients(self) -> tuple[Client, ...]:
        """The per-shard clients, in shard order."""
        return tuple(self._clients)

    @property
    def worker_id(self) -> str | int:
        """This worker's id."""
        return self._clients[0].worker_id

    @property
    def info(self) -> tuple[ServerInfo, ...]:
        """Each shard's :class:`~hpsjax.ps.ServerInfo`, in shard order."""
        return tuple(c.info for c in self._clients)

    @property
    def closed(self) -> bool:
        """Whether any shard's connection is closed (or was never opened)."""
        return any(c.closed for c in self._clients)

    @property
    def hints(self) -> Mapping[str, Any]:
        """The shards' latest instructions, merged.

        ``plan`` and ``stage`` are shard 0's (the lead shard); ``local_steps``
        is the fewest any shard asks for; ``force_pull`` is there when any
        shard asks for it.
        """
        hints = [c.hints for c in self._clients]
        merged = {k: v for k, v in hints[0].items() if k not in ("force_pull",)}
        steps = [h["local_steps"] for h in hints if h.get("local_steps") is not None]
        if steps:
            merged["local_steps"] = min(steps)
        for i, h in enumerate(hints):
            if "force_pull" in h:
                merged["force_pull"] = f"shard {i}: {h['force_pull']}"
                break
        return merged

    @property
    def bytes_sent(self) -> int:
        """Bytes written to all shards on the current connections."""
        return sum(c.bytes_sent for c in self._clients)

    @property
    def bytes_received(self) -> int:
        """Bytes read from all shards on the current connections."""
        return sum(c.bytes_received for c in self._clients)

    # ----------------------------------------------------------- fan-out

    def _where(self, shard: int) -> str:
        host, port = self._addresses[shard]
        return f"shard {shard} of {len(self._clients)} ({host}:{port})"

    async def _fan_out(
        self, what: str, call: Callable[[int, Client], Awaitable[Any]]
    ) -> list[Any]:
        """Runs ``call`` on every shard at once; fails as soon as one fails."""
        # The tasks start in shard order on the next loop pass, each handing its
        # frame to its transport before it first waits: a push issued before a
        # pull reaches every shard first (the pipelined worker relies on it).
        tasks = [asyncio.ensure_future(call(i, c)) for i, c in enumerate(self._clients)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        completed = {
            i: t.result()
            for i, t in enumerate(tasks)
            if not t.cancelled() and t.exception() is None
        }
        if len(completed) == len(tasks):
            return [completed[i] for i in range(len(tasks))]
        failed = [i for i, t in enumerate(tasks) if not t.cancelled() and t.exception()]
        cancelled = [i for i, t in enumerate(tasks) if t.cancelled()]
        first = failed[0]
        error = tasks[first].exception()
        detail = [f"{self._where(first)} failed in {what}"]
        if completed:
            detail.append(f"shards {sorted(completed)} completed it")
        if cancelled:
            detail.append(f"shards {cancelled} were cancelled (outcome unknown)")
        for i in failed[1:]:
            other = tasks[i].exception()
            detail.append(f"shard {i} also failed ({type(other).__name__}: {other})")
        tagged = _tagged(error, "; ".join(detail), completed)
        tagged.shard_index = first
        raise tagged from error

    @staticmethod
    def _timeout_kw(timeout: Any) -> dict[str, Any]:
        return {} if timeout is _UNSET else {"timeout": timeout}

    async def _push_to_shards(
        self, method: str, update: Any, *, version, encoded, timeout, **fields
    ) -> list[Any]:
        """Calls ``Client.<method>`` on every shard with its part of an update."""
        versions = self._versions(version)
        updates, encodeds = self._split_update(update, encoded)
        kw = self._timeout_kw(timeout)
        return await self._fan_out(
            method,
            lambda i, c: getattr(c, method)(
                updates[i], version=versions[i], encoded=encodeds[i], **fields, **kw
            ),
        )

    def _versions(self, version: Any) -> tuple[int, ...]:
        n = len(self._clients)
        if isinstance(version, ShardedVersion):
            versions = version.shards
        elif isinstance(version, int) and not isinstance(version, bool):
            versions = (version,) * n
        elif isinstance(version, Sequence) and not isinstance(version, str | bytes):
            versions = tuple(version)
        else:
            raise ValueError(
                f"version must be a ShardedVersion, an int or one int per shard, "
                f"got {version!r}"
            )
        if len(versions) != n:
            raise ValueError(f"{len(versions)} versions for {n} shards")
        return versions

    def _split_update(self, update: Any, encoded: Any) -> tuple[list, list]:
        n = len(self._clients)
        updates = [None] * n if update is None else self._partition.split(update)
        encodeds = (
            [None] * n
            if encoded is None
            else self._partition.split_leaf_list(list(encoded))
        )
        return updates, encodeds

    # ----------------------------------------------------------- lifecycle

    async def connect(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[ServerInfo, ...]:
        """Connects to every shard not connected yet, and checks their models.

        Cancelling is safe. On any failure every shard's connection is closed.

        Returns:
          Each shard's :class:`~hpsjax.ps.ServerInfo`.

        Raises:
          SpecMismatch: a shard's server does not serve this partition's shard
            (started with another ``--server_shards``, ``--split_leaves`` or
            init file).
          AuthError, ConnectionClosed, OSError, TimeoutError: as
            :meth:`Client.connect <hpsjax.ps.Client.connect>`, for the first
            shard that failed.
        """
        if not self.closed:
            raise RuntimeError("already connected")
        kw = self._timeout_kw(timeout)

        async def connect_one(i: int, client: Client) -> ServerInfo:
            if not client.closed:
                return client.info
            return await client.connect(**kw)

        try:
            infos = await self._fan_out("connect", connect_one)
            for i, info in enumerate(infos):
                self._check_shard_spec(i, info)
        except BaseException:
            await self.close()
            raise
        return tuple(infos)

    def _check_shard_spec(self, shard: int, info: ServerInfo) -> None:
        want = self._partition.shard_spec(shard)
        got = info.spec
        want_leaves, got_leaves = jax.tree.leaves(want), jax.tree.leaves(got)
        same = jax.tree.structure(want) == jax.tree.structure(got) and all(
            (a.shape, a.dtype) == (b.shape, b.dtype)
            for a, b in zip(want_leaves, got_leaves, strict=True)
        )
        if not same:
            raise SpecMismatch(
                f"{self._where(shard)} serves {len(got_leaves)} leaves that are not "
                f"this partition's shard {shard} ({len(want_leaves)} leaves, "
                f"{', '.join(self._partition.shard_paths(shard)[:4])}, ...): start "
                f"every server with the same --init, --server_shards "
                f"{self._partition.num_shards} and split_leaves="
                f"{self._partition.split_leaves}, in the order of the addresses"
            )

    async def close(self, *, timeout: float | None = 5.0) -> None:
        """Closes every shard's connection; idempotent, never raises.

        Cancelling is safe (the connections are then aborted).
        """
        await asyncio.gather(*(c.close(timeout=timeout) for c in self._clients))

    async def __aenter__(self) -> ShardedClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()

    # ----------------------------------------------------------- requests

    async def pull(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[Any, ShardedVersion]:
        """Gets every shard's parameters, merged.

        As :meth:`Client.pull <hpsjax.ps.Client.pull>`: joins the worker to
        every shard, and waits until every shard's policy lets it proceed.
        Cancelling is safe.

        Returns:
          ``(params, version)``: the whole tree and a :class:`ShardedVersion`.
        """
        kw = self._timeout_kw(timeout)
        results = await self._fan_out("pull", lambda i, c: c.pull(**kw))
        params = self._partition.merge([p for p, _ in results])
        return params, ShardedVersion([v for _, v in results])

    async def push(
        self,
        update: Any = None,
        *,
        version: Any,
        codec: Any = None,
        encoded: Any = None,
        step_time: float | None = None,
        num_samples: int | None = None,
        local_steps: int | None = None,
        loss: float | None = None,
        timeout: float | None = _UNSET,
    ) -> ShardedPushResult:
        """Sends each shard its part of an update.

        Arguments are those of :meth:`Client.push <hpsjax.ps.Client.push>`,
        but ``version`` is the :class:`ShardedVersion` the update was computed
        on (or one int per shard, or one int for all), and ``encoded`` needs a
        partition of whole leaves. ``step_time``, ``num_samples``,
        ``local_steps`` and ``loss`` go to every shard. Cancelling is safe for
        the connections, but a shard may still apply a part already sent;
        ``timeout`` bounds each shard's wait.

        Returns:
          A :class:`ShardedPushResult`.

        Raises:
          ValueError: a bad ``version``, or an update not of the partitioned
            tree.
          InvalidUpdate, WorkerDropped, ...: as ``Client.push``, from the first
            shard that failed; ``shard_results`` on the error holds the
            acknowledgements of the shards that took their part.
        """
        results = await self._push_to_shards(
            "push",
            update,
            version=version,
            encoded=encoded,
            timeout=timeout,
            codec=codec,
            step_time=step_time,
            num_samples=num_samples,
            local_steps=local_steps,
            loss=loss,
        )
        return _combine(results)

    async def push_pull(
        self,
        update: Any = None,
        *,
        version: Any,
        codec: Any = None,
        encoded: Any = None,
        step_time: float | None = None,
        num_samples: int | None = None,
        local_steps: int | None = None,
        loss: float | None = None,
        timeout: float | None = _UNSET,
    ) -> tuple[ShardedPushResult, Any, ShardedVersion]:
        """Pushes each shard its part and pulls, one round trip per shard.

        Arguments, cancellation and errors are those of :meth:`push`; each
        shard answers when its policy lets this worker proceed.

        Returns:
          ``(result, params, version)``.
        """
        results = await self._push_to_shards(
            "push_pull",
            update,
            version=version,
            encoded=encoded,
            timeout=timeout,
            codec=codec,
            step_time=step_time,
            num_samples=num_samples,
            local_steps=local_steps,
            loss=loss,
        )
        params = self._partition.merge([p for _, p, _ in results])
        return (
            _combine([r for r, _, _ in results]),
            params,
            ShardedVersion([v for _, _, v in results]),
        )

    async def refresh_info(
        self, *, timeout: float | None = _UNSET
    ) -> tuple[ServerInfo, ...]:
        """Asks every shard for its current :class:`~hpsjax.ps.ServerInfo`.

        Cancelling is safe; ``timeout`` bounds each shard's wait.
        """
        kw = self._timeout_kw(timeout)
        return tuple(
            await self._fan_out("refresh_info", lambda i, c: c.refresh_info(**kw))
        )
