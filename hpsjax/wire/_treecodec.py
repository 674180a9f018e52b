"""The tree codec: pytrees as wire metadata and leaf buffers, and back.

Trees travel as metadata (structure, per-leaf dtype, shape, byte offset and
length, codec) plus the leaves' bytes concatenated in leaf order (see
:mod:`hpsjax.wire._frames` for the frame around them). Received descriptions are
validated from the metadata alone before anything is allocated, and received
leaves are views of one aligned block. Compressed trees name their codec, one
class per compressor (:mod:`hpsjax.wire._codecs`): this module asks it for each
leaf's bytes and never names a scheme itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from hpsjax._checks import is_int
from hpsjax.wire._codecs import LikeLeaf, WireCodec, as_leaf, codec_class, from_wire
from hpsjax.wire._errors import (
    MalformedMetadata,
    SpecMismatch,
    TooManyLeaves,
    UnsupportedDtype,
)
from hpsjax.wire._frames import (
    ALIGNMENT,
    DEFAULT_LIMITS,
    DTYPES,
    Allocator,
    BufferPool,
    Header,
    WireLimits,
    aligned_empty,
)

__all__ = [
    "LayoutCache",
    "LeafSpec",
    "TreeLayout",
    "WireTree",
    "check_same_spec",
    "default_allocator",
    "encoded_tree_to_wire",
    "flatten_tree",
    "leaf_buffers",
    "tree_layout",
    "tree_to_wire",
    "unflatten_tree",
]


def _byte_view(array: np.ndarray) -> memoryview:
    # A uint8 view sidesteps buffer formats numpy cannot export (bfloat16).
    return memoryview(array.reshape(-1).view(np.uint8))


# numpy computes ``dtype.name`` in Python on every access; a push looks up the
# name of every leaf.
_WIRE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _wire_dtype_name(dtype: np.dtype, limits: WireLimits) -> str:
    name = _WIRE_NAMES.get(dtype) or dtype.name
    if name not in DTYPES or name not in limits.dtypes:
        raise UnsupportedDtype(f"dtype {dtype} cannot be sent")
    return name


def flatten_tree(
    tree: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
    is_leaf: Callable[[Any], bool] | None = None,
) -> tuple[Any, list[Any]]:
    """Splits a pytree into its wire structure and its leaves.

    Containers are mappings with string keys (flattened in sorted key order, as
    JAX does), lists, tuples (named tuples become plain tuples) and ``None``;
    anything else is a leaf. The wire structure is msgpack-able:

    - a leaf is its index ``i`` in the leaf list (0, 1, 2, ... in order),
    - ``None`` is nil,
    - a list is ``["l", [children]]``, a tuple ``["t", [children]]``,
    - a mapping is ``["d", {key: child}]``.

    Args:
      tree: the pytree.
      limits: leaf count and depth bounds.
      is_leaf: optional predicate marking extra leaves (e.g. encoded pairs).

    Returns:
      ``(structure, leaves)``; leaves are returned unconverted.

    Examples:
      >>> flatten_tree({"b": [1.0, None], "a": (2.0,)})
      (['d', {'a': ['t', [0]], 'b': ['l', [1, None]]}], [2.0, 1.0])
    """
    leaves: list[Any] = []
    return _flatten(tree, 0, leaves, limits, is_leaf), leaves


# The tree walks are module-level functions, not nested closures: a closure that
# calls itself is a reference cycle, which would keep the arrays it saw (a
# received tree, a pushed update) alive until the garbage collector runs.


def _flatten(node, depth, leaves, limits, is_leaf):
    if depth > limits.max_depth:
        raise TooManyLeaves(f"tree nesting exceeds {limits.max_depth}")
    if is_leaf is not None and is_leaf(node):
        pass
    elif node is None:
        return None
    elif isinstance(node, Mapping):
        keys = list(node)
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("only string dictionary keys can be sent")
        return [
            "d",
            {
                k: _flatten(node[k], depth + 1, leaves, limits, is_leaf)
                for k in sorted(keys)
            },
        ]
    elif isinstance(node, list):
        return ["l", [_flatten(c, depth + 1, leaves, limits, is_leaf) for c in node]]
    elif isinstance(node, tuple):
        return ["t", [_flatten(c, depth + 1, leaves, limits, is_leaf) for c in node]]
    if len(leaves) >= limits.max_leaves:
        raise TooManyLeaves(f"tree has more than {limits.max_leaves} leaves")
    leaves.append(node)
    return len(leaves) - 1


def unflatten_tree(structure: Any, leaves: Sequence[Any]) -> Any:
    """Rebuilds a pytree from a (validated) wire structure and its leaves.

    Examples:
      >>> s, l = flatten_tree({"w": [1, 2], "b": None})
      >>> unflatten_tree(s, l)
      {'b': None, 'w': [1, 2]}
    """
    if structure is None:
        return None
    if isinstance(structure, int):
        return leaves[structure]
    tag, body = structure
    if tag == "d":
        return {k: unflatten_tree(v, leaves) for k, v in body.items()}
    children = [unflatten_tree(c, leaves) for c in body]
    return children if tag == "l" else tuple(children)


def _check_structure(structure: Any, limits: WireLimits) -> int:
    """Validates a received wire structure; returns its number of leaves."""
    return _check_node(structure, 0, 0, limits)


def _check_node(node: Any, depth: int, count: int, limits: WireLimits) -> int:
    """Checks ``node`` whose first leaf must be ``count``; returns the next."""
    if depth > limits.max_depth:
        raise TooManyLeaves(f"tree nesting exceeds {limits.max_depth}")
    if node is None:
        return count
    if isinstance(node, int) and not isinstance(node, bool):
        if node != count:
            raise MalformedMetadata(
                f"leaf index {node} out of order (expected {count})"
            )
        if count + 1 > limits.max_leaves:
            raise TooManyLeaves(f"tree has more than {limits.max_leaves} leaves")
        return count + 1
    if not (isinstance(node, list) and len(node) == 2):
        raise MalformedMetadata(f"bad tree node of type {type(node).__name__}")
    tag, body = node
    if tag == "d":
        if not isinstance(body, dict):
            raise MalformedMetadata("a 'd' node needs a map")
        children = [body[key] for key in sorted(body)]
    elif tag in ("l", "t"):
        if not isinstance(body, list):
            raise MalformedMetadata(f"a {tag!r} node needs an array")
        children = body
    else:
        raise MalformedMetadata(f"unknown tree node tag {tag!r}")
    for child in children:
        count = _check_node(child, depth + 1, count, limits)
    return count


def _leaf_paths(structure: Any, path: str = "") -> list[str]:
    if structure is None:
        return []
    if isinstance(structure, int):
        return [path or "<root>"]
    tag, body = structure
    if tag == "d":
        items = [(f"{path}[{key!r}]", body[key]) for key in sorted(body)]
    else:
        items = [(f"{path}[{i}]", child) for i, child in enumerate(body)]
    return [p for sub, child in items for p in _leaf_paths(child, sub)]


class LeafSpec(NamedTuple):
    """Where one leaf lies in a tree payload.

    Attributes:
      dtype: the leaf's (decoded) dtype.
      shape: the leaf's (decoded) shape.
      offset: byte offset of its buffer in the payload.
      nbytes: byte length of its buffer.
      code_nbytes: for a compressed leaf, bytes of the first of the two arrays
        its buffer holds (see :mod:`hpsjax.wire._codecs`); ``None`` for a raw leaf.
    """

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    code_nbytes: int | None = None


class TreeLayout(NamedTuple):
    """A validated tree description: structure, leaf layouts and codec.

    Attributes:
      structure: the wire structure (see :func:`flatten_tree`).
      leaves: one :class:`LeafSpec` per leaf, in leaf order.
      codec: the codec dict of a compressed tree, else ``None``.
      nbytes: total payload bytes.
      wire: the codec object of a compressed tree (see
        :mod:`hpsjax.wire._codecs`), else ``None``.
    """

    structure: Any
    leaves: tuple[LeafSpec, ...]
    codec: dict[str, Any] | None
    nbytes: int
    wire: WireCodec | None = None

    def allocate(self, pool: BufferPool | None = None) -> list[Any]:
        """Allocates uninitialised leaves to receive this tree's payload.

        All leaves are views of one 64-byte aligned block (each leaf starting on
        a 64-byte boundary), taken from ``pool`` when one is given.

        Args:
          pool: where to take the block from; ``None`` allocates a new one.

        Returns:
          Per leaf, an array of its dtype and shape, or for a compressed leaf
          the pair of arrays its codec sends (``leaf_parts`` of
          :class:`~hpsjax.wire._codecs.WireCodec`).
        """
        if self.wire is None:
            return self._allocate_raw(pool, None)
        parts: list[tuple[tuple[int, ...], np.dtype]] = []
        for i, leaf in enumerate(self.leaves):
            parts.extend(
                self.wire.leaf_parts(
                    i, leaf.shape, leaf.dtype, leaf.code_nbytes, leaf.nbytes
                )
            )
        offsets, total = [], 0
        for shape, dtype in parts:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // ALIGNMENT) * ALIGNMENT
        block = pool.take(total) if pool is not None else aligned_empty((total,))
        views = [
            block[o : o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            for o, (shape, dtype) in zip(offsets, parts, strict=True)
        ]
        it = iter(views)
        return [(next(it), next(it)) for _ in self.leaves]

    def receive_buffers(
        self, pool: BufferPool | None = None
    ) -> tuple[list[Any], list[memoryview]]:
        """:meth:`allocate`, and the byte views the payload is received into.

        Returns:
          ``(arrays, buffers)``: the leaves as :meth:`allocate` returns them,
          and their bytes in payload order (as :func:`leaf_buffers`).
        """
        if self.wire is not None:
            arrays = self.allocate(pool)
            return arrays, leaf_buffers(arrays)
        buffers: list[memoryview] = []
        return self._allocate_raw(pool, buffers), buffers

    def _allocate_raw(self, pool, buffers: list[memoryview] | None) -> list[Any]:
        # Raw leaves (every pull): one view per leaf, each 64-byte aligned.
        total = 0
        for leaf in self.leaves:
            total += -(-leaf.nbytes // ALIGNMENT) * ALIGNMENT
        block = pool.take(total) if pool is not None else aligned_empty((total,))
        raw, start = [], 0
        for leaf in self.leaves:
            part = block[start : start + leaf.nbytes]
            if buffers is not None:
                buffers.append(memoryview(part))
            raw.append(part.view(leaf.dtype).reshape(leaf.shape))
            start += -(-leaf.nbytes // ALIGNMENT) * ALIGNMENT
        return raw

    def paths(self) -> list[str]:
        """Readable paths of the leaves, for error messages."""
        return _leaf_paths(self.structure)


def leaf_buffers(arrays: Sequence[Any]) -> list[memoryview]:
    """Byte views of allocated (or encoded) leaves, in payload order."""
    out: list[memoryview] = []
    for a in arrays:
        if isinstance(a, tuple):
            out.extend(_byte_view(part) for part in a)
        else:
            out.append(_byte_view(a))
    return out


def _spec_to_wire(leaf: LeafSpec) -> list[Any]:
    entry = [leaf.dtype.name, list(leaf.shape), leaf.offset, leaf.nbytes]
    if leaf.code_nbytes is not None:
        entry.append(leaf.code_nbytes)
    return entry


def tree_to_wire(
    tree: Any, *, limits: WireLimits = DEFAULT_LIMITS
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """Describes an uncompressed tree for a PARAMS, PUSH or PUSH_PULL frame.

    Args:
      tree: a pytree of arrays (numpy, JAX on CPU, Python scalars).
      limits: bounds and allowed dtypes.

    Returns:
      ``(metadata, buffers, layout)``: the tree fields of the metadata
      (``tree``, ``leaves``, ``codec``), the leaves' bytes as memoryviews (no
      copy for C-contiguous little-endian arrays), and the layout.

    Examples:
      >>> meta, bufs, _ = tree_to_wire({"w": np.ones((2, 3), np.float32)})
      >>> meta["leaves"], [b.nbytes for b in bufs]
      ([['float32', [2, 3], 0, 24]], [24])
    """
    structure, raw = flatten_tree(tree, limits=limits)
    arrays = [as_leaf(x) for x in raw]
    leaves = []
    entries = []
    offset = 0
    for a in arrays:
        name = _wire_dtype_name(a.dtype, limits)
        leaves.append(LeafSpec(a.dtype, a.shape, offset, a.nbytes))
        entries.append([name, list(a.shape), offset, a.nbytes])
        offset += a.nbytes
    layout = TreeLayout(structure, tuple(leaves), None, offset)
    meta = {"tree": structure, "leaves": entries, "codec": None}
    return meta, leaf_buffers(arrays), layout


def _like_leaf(ref: Any, limits: WireLimits) -> LikeLeaf:
    """A leaf of an encoded tree's ``like``: dtype, wire name and shape."""
    dtype = np.dtype(getattr(ref, "dtype", None) or np.asarray(ref).dtype)
    shape = tuple(int(d) for d in np.shape(ref))
    return LikeLeaf(dtype, _wire_dtype_name(dtype, limits), shape)


def encoded_tree_to_wire(
    encoded: Sequence[Any],
    like: Any,
    codec: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """Describes a compressed tree for a PUSH or PUSH_PULL frame.

    Each leaf's buffer is the two arrays its codec sends, one after the other:
    the bytes the compressing transform kept, sent as they are (no copy for
    host arrays).

    Args:
      encoded: what the transform kept of each leaf in leaf order, as the
        codec's ``last_encoded(opt_state)`` (or ``encode_tree``) returns it.
      like: a pytree giving the structure and each leaf's decoded shape and
        dtype (arrays or ``jax.ShapeDtypeStruct``).
      codec: the codec, as a push names it: a quantization ``Codec``, or the
        scheme, class or object of a codec whose leaves say their parameters
        (see ``codec_class`` of :mod:`hpsjax.wire._codecs`).
      limits: bounds and allowed dtypes.

    Returns:
      ``(metadata, buffers, layout)`` as for :func:`tree_to_wire`.

    Raises:
      SpecMismatch: ``encoded`` does not fit ``like`` and ``codec``.
      ValueError: ``codec`` names no codec.
    """
    cls = codec_class(codec)
    structure, like_leaves = flatten_tree(
        like, limits=limits, is_leaf=lambda x: hasattr(x, "shape")
    )
    encoded = list(encoded)
    if len(encoded) != len(like_leaves):
        raise SpecMismatch(
            f"{len(encoded)} encoded leaves for a tree of {len(like_leaves)}"
        )
    likes = [_like_leaf(ref, limits) for ref in like_leaves]
    wire, pairs = cls.encode(codec, encoded, likes)
    specs, offset = [], 0
    for like_leaf, (first, second) in zip(likes, pairs, strict=True):
        nbytes = first.nbytes + second.nbytes
        specs.append(
            LeafSpec(like_leaf.dtype, like_leaf.shape, offset, nbytes, first.nbytes)
        )
        offset += nbytes
    codec_dict = wire.to_wire()
    layout = TreeLayout(structure, tuple(specs), codec_dict, offset, wire)
    meta = {
        "tree": structure,
        "leaves": [_spec_to_wire(s) for s in specs],
        "codec": codec_dict,
    }
    return meta, leaf_buffers(pairs), layout


def tree_layout(meta: Mapping[str, Any], limits: WireLimits = DEFAULT_LIMITS):
    """Validates the tree fields of received metadata.

    Nothing is allocated: every size is checked from the metadata alone.

    Args:
      meta: decoded metadata holding ``tree``, ``leaves`` and ``codec``.
      limits: bounds and allowed dtypes.

    Returns:
      A :class:`TreeLayout`.

    Raises:
      MalformedMetadata, TooManyLeaves, UnsupportedDtype: the description is
      invalid.
    """
    for field in ("tree", "leaves"):
        if field not in meta:
            raise MalformedMetadata(f"tree metadata misses {field!r}")
    structure = meta["tree"]
    count = _check_structure(structure, limits)
    entries = meta["leaves"]
    if not isinstance(entries, list) or len(entries) != count:
        raise MalformedMetadata(f"'leaves' must list {count} entries")
    codec = meta.get("codec")
    wire = from_wire(codec, count)
    leaves = []
    offset = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != (4 if codec is None else 5):
            raise MalformedMetadata(f"leaf {i}: bad entry {entry!r}"[:200])
        name, shape, off, nbytes = entry[:4]
        if not isinstance(name, str) or name not in DTYPES:
            raise UnsupportedDtype(f"leaf {i}: unknown dtype {name!r}"[:200])
        if name not in limits.dtypes:
            raise UnsupportedDtype(f"leaf {i}: dtype {name} not allowed")
        if (
            not isinstance(shape, list)
            or len(shape) > limits.max_rank
            or not all(is_int(d) and d >= 0 for d in shape)
        ):
            raise MalformedMetadata(f"leaf {i}: bad shape {shape!r}"[:200])
        if not (is_int(off) and is_int(nbytes)) or off != offset:
            raise MalformedMetadata(f"leaf {i}: offset {off!r} != {offset}")
        dtype = DTYPES[name]
        if codec is None:
            code_nbytes = None
            if nbytes != math.prod(shape) * dtype.itemsize:
                raise MalformedMetadata(
                    f"leaf {i}: {nbytes} bytes for shape {shape} of {name}"
                )
        else:
            code_nbytes = entry[4]
            want = wire.leaf_nbytes(i, name, tuple(shape))
            if (code_nbytes, nbytes) != want:
                raise MalformedMetadata(
                    f"leaf {i}: {wire.name} sizes ({code_nbytes}, {nbytes}) != "
                    f"({want[0]}, {want[1]})"
                )
        leaves.append(LeafSpec(dtype, tuple(shape), off, nbytes, code_nbytes))
        offset += nbytes
    return TreeLayout(structure, tuple(leaves), codec, offset, wire)


class LayoutCache:
    """Remembers the validated layouts of recently received tree descriptions.

    A worker sends the same description with every push and a server with every
    reply, so validating it once per distinct description (keyed by its exact
    msgpack bytes) takes that cost off the round trip.

    Args:
      limits: bounds descriptions are validated against.
      check: extra validation of a layout (for example against the model); a
        layout it rejects is not remembered.
      size: descriptions remembered (least recently used ones are forgotten).
    """

    def __init__(
        self,
        limits: WireLimits = DEFAULT_LIMITS,
        *,
        check: Callable[[TreeLayout], None] | None = None,
        size: int = 16,
    ):
        self._limits = limits
        self._check = check
        self._size = size
        self._layouts: dict[bytes, TreeLayout] = {}

    def get(self, meta: Mapping[str, Any]) -> TreeLayout:
        """The validated layout of ``meta``'s tree fields (see :func:`tree_layout`)."""
        try:
            key = msgpack.packb(
                [meta.get("tree"), meta.get("leaves"), meta.get("codec")],
                use_bin_type=True,
            )
        except (ValueError, TypeError):  # too deep to pack: tree_layout says why
            key = None
        layout = self._layouts.pop(key, None) if key is not None else None
        if layout is None:
            layout = tree_layout(meta, self._limits)
            if self._check is not None:
                self._check(layout)
            if key is None:
                return layout
            if len(self._layouts) >= self._size:
                del self._layouts[next(iter(self._layouts))]
        self._layouts[key] = layout
        return layout


def check_same_spec(layout: TreeLayout, model: TreeLayout) -> None:
    """Checks that a received tree has the model's structure, shapes and dtypes.

    Args:
      layout: the received tree's layout.
      model: the model's layout.

    Raises:
      SpecMismatch: naming the first leaf that differs.
    """
    if layout.structure != model.structure:
        raise SpecMismatch("tree structure differs from the model's")
    paths = None
    for i, (got, want) in enumerate(zip(layout.leaves, model.leaves, strict=True)):
        if got.shape != want.shape or got.dtype != want.dtype:
            paths = paths or model.paths()
            raise SpecMismatch(
                f"leaf {paths[i]}: got {got.dtype.name}{list(got.shape)}, "
                f"model has {want.dtype.name}{list(want.shape)}"
            )


class WireTree(NamedTuple):
    """A received tree: its layout and the arrays its payload was read into.

    Attributes:
      layout: the validated :class:`TreeLayout`.
      arrays: per leaf an array, or a ``(codes, scales)`` pair if compressed.
    """

    layout: TreeLayout
    arrays: list[Any]

    def tree(self) -> Any:
        """The pytree of received (raw) leaves."""
        return unflatten_tree(self.layout.structure, self.arrays)


def default_allocator(limits: WireLimits, pool: BufferPool | None = None) -> Allocator:
    """An allocator that validates tree metadata and allocates its leaves.

    Args:
      limits: bounds the metadata is checked against.
      pool: where leaf memory comes from (``None``: fresh memory each time).
    """

    layouts = LayoutCache(limits)

    def allocate(header: Header, meta: dict[str, Any]):
        layout = layouts.get(meta)
        if layout.nbytes != header.payload_length:
            raise MalformedMetadata(
                f"leaves hold {layout.nbytes} bytes, header says "
                f"{header.payload_length}"
            )
        arrays, buffers = layout.receive_buffers(pool)
        return buffers, WireTree(layout, arrays)

    return allocate
