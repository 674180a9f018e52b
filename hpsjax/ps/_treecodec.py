"""The tree codec: pytrees as wire metadata and leaf buffers, and back.

Trees travel as metadata (structure, per-leaf dtype, shape, byte offset and
length, codec) plus the leaves' bytes concatenated in leaf order (see
:mod:`hpsjax.ps._frames` for the frame around them). Received descriptions are
validated from the metadata alone before anything is allocated, and received
leaves are views of one aligned block.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from hpsjax._checks import is_int
from hpsjax.ps._errors import (
    InvalidUpdate,
    MalformedMetadata,
    NonFiniteUpdate,
    SpecMismatch,
    TooManyLeaves,
    UnsupportedDtype,
)
from hpsjax.ps._frames import (
    ALIGNMENT,
    DEFAULT_LIMITS,
    DTYPES,
    Allocator,
    BufferPool,
    Header,
    WireLimits,
    aligned_empty,
)
from hpsjax.transforms import _quantize as q
from hpsjax.transforms import _topk
from hpsjax.transforms._powersgd import powersgd_matrix_shape

__all__ = [
    "LayoutCache",
    "POWERSGD_SCHEME",
    "TOPK_SCHEME",
    "LeafSpec",
    "PowerSGDCodec",
    "TopKCodec",
    "TreeLayout",
    "WireTree",
    "check_encoded_leaf",
    "check_same_spec",
    "check_topk_leaf",
    "compressed_sizes",
    "default_allocator",
    "encoded_tree_to_wire",
    "flatten_tree",
    "leaf_buffers",
    "powersgd_tree_to_wire",
    "tree_layout",
    "topk_index_dtype",
    "topk_tree_to_wire",
    "tree_to_wire",
    "unflatten_tree",
    "wire_codec",
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


def _as_leaf(x: Any) -> np.ndarray:
    array = np.asarray(x)
    if array.dtype.byteorder == ">" or (
        array.dtype.byteorder == "=" and sys.byteorder == "big"
    ):
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


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
      code_nbytes: for a compressed leaf, bytes of packed codes at the start of
        the buffer (float32 scales follow), for a top-k leaf bytes of its
        indices (its values follow), for a PowerSGD leaf bytes of its factor
        ``p`` (``q`` follows); ``None`` for a raw leaf.
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
    """

    structure: Any
    leaves: tuple[LeafSpec, ...]
    codec: dict[str, Any] | None
    nbytes: int

    def allocate(self, pool: BufferPool | None = None) -> list[Any]:
        """Allocates uninitialised leaves to receive this tree's payload.

        All leaves are views of one 64-byte aligned block (each leaf starting on
        a 64-byte boundary), taken from ``pool`` when one is given.

        Args:
          pool: where to take the block from; ``None`` allocates a new one.

        Returns:
          Per leaf, an array of its dtype and shape, or for a compressed leaf a
          ``(codes uint8[code_nbytes], scales float32[n])`` pair, for a top-k
          leaf an ``(indices uint16|uint32[k], values dtype[k])`` pair, for a
          PowerSGD leaf a ``(p dtype[n, r], q dtype[m, r])`` pair (``(p
          dtype[size], q dtype[0])`` for one sent whole).
        """
        if self.codec is None:
            return self._allocate_raw(pool, None)
        parts: list[tuple[tuple[int, ...], np.dtype]] = []
        for i, leaf in enumerate(self.leaves):
            parts.extend(_leaf_parts(self.codec, i, leaf))
        offsets, total = [], 0
        for shape, dtype in parts:
            offsets.append(total)
            total += -(-math.prod(shape) * dtype.itemsize // ALIGNMENT) * ALIGNMENT
        block = pool.take(total) if pool is not None else aligned_empty((total,))
        views = [
            block[o : o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
            for o, (shape, dtype) in zip(offsets, parts, strict=True)
        ]
        out: list[Any] = []
        it = iter(views)
        for leaf in self.leaves:
            out.append(next(it) if leaf.code_nbytes is None else (next(it), next(it)))
        return out

    def receive_buffers(
        self, pool: BufferPool | None = None
    ) -> tuple[list[Any], list[memoryview]]:
        """:meth:`allocate`, and the byte views the payload is received into.

        Returns:
          ``(arrays, buffers)``: the leaves as :meth:`allocate` returns them,
          and their bytes in payload order (as :func:`leaf_buffers`).
        """
        if self.codec is not None:
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


def _leaf_parts(
    codec: dict[str, Any], i: int, leaf: LeafSpec
) -> list[tuple[tuple[int, ...], np.dtype]]:
    """``(shape, dtype)`` of each array leaf ``i``'s buffer holds under ``codec``."""
    if leaf.code_nbytes is None:
        return [(leaf.shape, leaf.dtype)]
    scheme = codec["scheme"]
    if scheme == TOPK_SCHEME:
        index_dtype = topk_index_dtype(math.prod(leaf.shape))
        k = leaf.code_nbytes // index_dtype.itemsize
        return [((k,), index_dtype), ((k,), leaf.dtype)]
    if scheme == POWERSGD_SCHEME:
        p_shape, q_shape = _powersgd_shapes(i, leaf.shape, codec["rank"][i])
        return [(p_shape, leaf.dtype), (q_shape, leaf.dtype)]
    n_scales = (leaf.nbytes - leaf.code_nbytes) // 4
    return [((leaf.code_nbytes,), np.dtype(np.uint8)), ((n_scales,), DTYPES["float32"])]


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
    arrays = [_as_leaf(x) for x in raw]
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


_CODEC_KEYS = ("scheme", "bits", "block_size", "stochastic", "levels")


def _codec_from_dict(codec: Any):
    if not isinstance(codec, dict):
        raise MalformedMetadata("'codec' must be a map or nil")
    missing = [key for key in _CODEC_KEYS if key not in codec]
    if missing:
        # Every key is sent (nil where unused): no default is ever guessed.
        raise MalformedMetadata(f"codec misses {', '.join(map(repr, missing))}")
    try:
        return q.Codec.from_dict(codec)
    except (ValueError, TypeError, KeyError) as e:
        raise MalformedMetadata(f"bad codec {codec!r}: {e}") from None


def compressed_sizes(shape: Sequence[int], codec: Any) -> tuple[int, int]:
    """Bytes of packed codes and number of float32 scales of an encoded leaf.

    Follows the layout of ``hpsjax.transforms.Encoded``: no scale for the
    ``none`` scheme, one per leaf without ``block_size``, else one per block of
    ``block_size`` elements (the last one possibly partial).

    Args:
      shape: the decoded leaf's shape.
      codec: a ``Codec``, or its dict as in frame metadata.

    Returns:
      ``(code_nbytes, n_scales)``.

    Raises:
      MalformedMetadata: the codec dict is invalid.
    """
    if not isinstance(codec, q.Codec):
        codec = _codec_from_dict(codec)
    size = math.prod(shape)
    if codec.scheme == "none":
        n_scales = 0
    elif codec.block_size is None:
        n_scales = 1
    else:
        n_scales = -(-size // codec.block_size)
    return q.encoded_nbytes(tuple(shape), codec) - 4 * n_scales, n_scales


def check_encoded_leaf(codes: np.ndarray, scales: np.ndarray, size: int, codec) -> None:
    """Checks the values of one received compressed leaf before it is decoded.

    Every code must name a level (``0 .. 2L`` for ``uniform`` and ``qsgd``, so
    ``255`` at 8 bits is refused), the unused high bits of the last code byte
    must be zero, and scales must be finite and non-negative.

    Args:
      codes: the leaf's packed codes (``uint8``).
      scales: its float32 scales.
      size: elements of the decoded leaf.
      codec: the ``Codec``.

    Raises:
      InvalidUpdate: naming what is wrong.
    """
    if codec.scheme == "none":
        return  # float32 values: checked for NaN and infinity once decoded
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise InvalidUpdate("scales must be finite and >= 0")
    bits = codec.bits
    if bits < 8 and size * bits % 8 and codes.size and codes[-1] >> (size * bits % 8):
        raise InvalidUpdate("padding bits of the last code byte are not zero")
    if codec.scheme == "sign":
        return
    top = 2 * (codec.levels if codec.scheme == "qsgd" else 2 ** (bits - 1) - 1)
    if bits == 16:
        largest = int(codes.view("<u2").max(initial=0))
    elif bits == 8:
        largest = int(codes.max(initial=0))
    else:
        mask = (1 << bits) - 1
        largest = max(
            int(((codes >> shift) & mask).max(initial=0)) for shift in range(0, 8, bits)
        )
    if largest > top:
        raise InvalidUpdate(f"code {largest} is over the largest level code {top}")


TOPK_SCHEME = "topk"
"""The ``scheme`` of the top-k codec (``{"scheme": "topk", "k": [k per leaf]}``)."""

_FLOAT_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})


class TopKCodec(NamedTuple):
    """The top-k wire codec: leaf ``i`` sends ``ks[i]`` indices, then as many values.

    Hashable, so it keys decoders like a quantization ``Codec``.

    Examples:
      >>> TopKCodec((3, 0)).to_dict()
      {'scheme': 'topk', 'k': [3, 0]}
    """

    ks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The codec as frame metadata."""
        return {"scheme": TOPK_SCHEME, "k": list(self.ks)}


def topk_index_dtype(size: int) -> np.dtype:
    """The wire dtype of a top-k leaf's indices: ``uint16`` for leaves of at most
    65536 elements, ``uint32`` up to 2**32 (as ``hpsjax.transforms.topk_encode``).

    Raises:
      MalformedMetadata: the leaf has more than 2**32 elements.
    """
    try:
        dtype = _topk.topk_index_dtype(size)
    except ValueError:
        raise MalformedMetadata(
            f"top-k leaves hold at most 2**32 elements, not {size}"
        ) from None
    return np.dtype(dtype).newbyteorder("<")


POWERSGD_SCHEME = "powersgd"
"""The ``scheme`` of the PowerSGD codec (``{"scheme": "powersgd", "rank": [rank
per leaf]}``)."""


class PowerSGDCodec(NamedTuple):
    """The PowerSGD wire codec: leaf ``i`` sends its rank-``ranks[i]`` factors
    ``p`` then ``q``, or its values whole where ``ranks[i]`` is 0.

    One rank per leaf, as top-k's one ``k`` per leaf: the encoded leaves alone
    say it (a leaf too thin to gain from its factors is sent whole by
    ``hpsjax.transforms.power_sgd``), and it keys decoders like a quantization
    ``Codec``.

    Examples:
      >>> PowerSGDCodec((0, 4)).to_dict()
      {'scheme': 'powersgd', 'rank': [0, 4]}
    """

    ranks: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The codec as frame metadata."""
        return {"scheme": POWERSGD_SCHEME, "rank": list(self.ranks)}


# The codecs sending one int per leaf: scheme -> (its key, its name in
# messages, its class).
_PER_LEAF_CODECS = {
    TOPK_SCHEME: ("k", "top-k", TopKCodec),
    POWERSGD_SCHEME: ("rank", "PowerSGD", PowerSGDCodec),
}


def _per_leaf_codec_from_dict(codec: dict, count: int) -> TopKCodec | PowerSGDCodec:
    """The received codec of a scheme of :data:`_PER_LEAF_CODECS`, checked."""
    key, what, make = _PER_LEAF_CODECS[codec["scheme"]]
    if set(codec) != {"scheme", key}:
        keys = sorted(map(str, codec))[:8]
        raise MalformedMetadata(
            f"a {what} codec has only 'scheme' and {key!r}, not {keys}"
        )
    values = codec[key]
    if (
        not isinstance(values, list)
        or len(values) != count
        or not all(is_int(v) and v >= 0 for v in values)
    ):
        raise MalformedMetadata(f"{what} {key!r} must list {count} ints >= 0"[:200])
    return make(tuple(int(v) for v in values))


def wire_codec(codec: Any) -> Any:
    """The codec object of a (validated) layout's codec dict.

    Returns:
      ``None`` for a raw tree, a :class:`TopKCodec`, a :class:`PowerSGDCodec`,
      or a quantization ``hpsjax.transforms.Codec``.
    """
    if codec is None:
        return None
    per_leaf = _PER_LEAF_CODECS.get(codec.get("scheme"))
    if per_leaf is not None:
        key, _, make = per_leaf
        return make(tuple(codec[key]))
    return q.Codec.from_dict(codec)


def _topk_sizes(i: int, name: str, shape: Sequence[int], k: int) -> tuple[int, int]:
    """``(index bytes, buffer bytes)`` of top-k leaf ``i`` keeping ``k`` entries."""
    size = math.prod(shape)
    if k > size:
        raise MalformedMetadata(f"leaf {i}: top-k k={k} > {size} elements")
    index_nbytes = k * topk_index_dtype(size).itemsize
    return index_nbytes, index_nbytes + k * DTYPES[name].itemsize


def check_topk_leaf(
    indices: np.ndarray, values: np.ndarray, size: int, *, finite: bool = True
) -> None:
    """Checks one received top-k leaf before it is decoded.

    Indices must be strictly increasing (so unique) and below ``size``; with
    ``finite`` the values must hold no NaN or infinity.

    Raises:
      InvalidUpdate: a bad index.
      NonFiniteUpdate: a value is NaN or infinite.
    """
    if not indices.size:
        return
    if int(indices[-1]) >= size:
        raise InvalidUpdate(f"top-k index {int(indices[-1])} out of range [0, {size})")
    if indices.size > 1 and not (indices[1:] > indices[:-1]).all():
        raise InvalidUpdate("top-k indices must be strictly increasing")
    if finite and not np.isfinite(values).all():
        raise NonFiniteUpdate("top-k values hold NaN or infinity")


def _powersgd_shapes(
    i: int, shape: Sequence[int], rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of PowerSGD leaf ``i``'s factors ``p`` and ``q`` at ``rank``.

    Rank 0 sends the leaf whole: ``p`` holds its values, ``q`` none. A rank
    ``r >= 1`` sends ``p`` (``n x r``) and ``q`` (``m x r``) of the matrix
    ``hpsjax.transforms.powersgd_matrix_shape`` reads the leaf as.

    Raises:
      MalformedMetadata: rank-``r`` factors would be no smaller than the leaf.
    """
    if rank == 0:
        return (math.prod(shape),), (0,)
    matrix = powersgd_matrix_shape(shape, rank)
    if matrix is None:
        raise MalformedMetadata(
            f"leaf {i}: rank-{rank} factors are no smaller than shape "
            f"{list(shape)} (send it whole: rank 0)"
        )
    return (matrix[0], rank), (matrix[1], rank)


def _powersgd_sizes(
    i: int, name: str, shape: Sequence[int], rank: int
) -> tuple[int, int]:
    """``(p bytes, buffer bytes)`` of PowerSGD leaf ``i`` sent at ``rank``."""
    p_shape, q_shape = _powersgd_shapes(i, shape, rank)
    itemsize = DTYPES[name].itemsize
    p_nbytes = math.prod(p_shape) * itemsize
    return p_nbytes, p_nbytes + math.prod(q_shape) * itemsize


def _per_leaf_sizes(
    scheme: str, i: int, name: str, shape: Sequence[int], value: int
) -> tuple[int, int]:
    """``(code bytes, buffer bytes)`` of leaf ``i`` of dtype ``name`` under a
    scheme of :data:`_PER_LEAF_CODECS` sending it at ``value`` (its ``k`` or
    rank).

    Raises:
      MalformedMetadata: the leaf is not floating, or ``value`` does not fit it.
    """
    what = _PER_LEAF_CODECS[scheme][1]
    if name not in _FLOAT_NAMES:
        raise MalformedMetadata(f"leaf {i}: {what} leaves must be floating, not {name}")
    sizes = _topk_sizes if scheme == TOPK_SCHEME else _powersgd_sizes
    return sizes(i, name, shape, value)


def _encoded_against(encoded, like, limits) -> tuple[Any, list, list]:
    """``like``'s structure and leaves, and ``encoded`` as a list of one entry
    per leaf (refused where the counts differ)."""
    structure, like_leaves = flatten_tree(
        like, limits=limits, is_leaf=lambda x: hasattr(x, "shape")
    )
    encoded = list(encoded)
    if len(encoded) != len(like_leaves):
        raise SpecMismatch(
            f"{len(encoded)} encoded leaves for a tree of {len(like_leaves)}"
        )
    return structure, like_leaves, encoded


def _like_leaf(ref: Any, limits: WireLimits) -> tuple[np.dtype, str, tuple[int, ...]]:
    """``(dtype, wire name, shape)`` of a leaf of an encoded tree's ``like``."""
    dtype = np.dtype(getattr(ref, "dtype", None) or np.asarray(ref).dtype)
    return dtype, _wire_dtype_name(dtype, limits), tuple(int(d) for d in np.shape(ref))


def _encoded_tree(
    structure: Any, leaves: list[tuple[np.dtype, tuple[int, ...], tuple]], codec: dict
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """The metadata, buffers and layout of an encoded tree.

    Args:
      structure: the wire structure.
      leaves: per leaf ``(dtype, shape, (first, second))``: the decoded leaf's
        dtype and shape, and the two checked arrays its buffer sends in that
        order (the first's bytes are the leaf's ``code_nbytes``).
      codec: the codec dict.
    """
    specs, offset = [], 0
    for dtype, shape, (first, second) in leaves:
        nbytes = first.nbytes + second.nbytes
        specs.append(LeafSpec(dtype, shape, offset, nbytes, first.nbytes))
        offset += nbytes
    layout = TreeLayout(structure, tuple(specs), codec, offset)
    meta = {
        "tree": structure,
        "leaves": [_spec_to_wire(s) for s in specs],
        "codec": codec,
    }
    return meta, leaf_buffers([pair for _, _, pair in leaves]), layout


def topk_tree_to_wire(
    encoded: Sequence[Any],
    like: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """Describes a top-k sparsified tree for a PUSH or PUSH_PULL frame.

    Each leaf's buffer is its ``k`` indices (``uint16`` up to 65536 elements,
    else ``uint32``) followed by its ``k`` values in the leaf's dtype: the
    bytes of ``hpsjax.transforms.TopKEncoded``, sent as they are (no copy for
    host arrays).

    Args:
      encoded: the ``TopKEncoded(indices, values)`` of each leaf in leaf order,
        as ``topk_encode_tree`` or ``last_topk_encoded(opt_state)`` return them.
      like: a pytree giving the structure and each leaf's decoded shape and
        dtype (arrays or ``jax.ShapeDtypeStruct``).
      limits: bounds and allowed dtypes.

    Returns:
      ``(metadata, buffers, layout)`` as for :func:`tree_to_wire`; the codec is
      ``{"scheme": "topk", "k": [k per leaf]}``.

    Raises:
      SpecMismatch: ``encoded`` does not fit ``like``.
    """
    structure, like_leaves, encoded = _encoded_against(encoded, like, limits)
    leaves, ks = [], []
    for i, (enc, ref) in enumerate(zip(encoded, like_leaves, strict=True)):
        if not (isinstance(enc, tuple) and len(enc) == 2):
            raise SpecMismatch("every top-k leaf must be an (indices, values) pair")
        indices = _as_leaf(enc[0]).reshape(-1)
        values = _as_leaf(enc[1]).reshape(-1)
        dtype, name, shape = _like_leaf(ref, limits)
        size = math.prod(shape)
        want = topk_index_dtype(size)
        if indices.dtype != want or values.dtype != dtype:
            raise SpecMismatch(
                f"leaf {i}: top-k of shape {shape} sends {want.name} indices and "
                f"{dtype.name} values, got {indices.dtype.name} and "
                f"{values.dtype.name}"
            )
        k = indices.size
        if values.size != k:
            raise SpecMismatch(f"leaf {i}: {k} indices but {values.size} values")
        try:
            _per_leaf_sizes(TOPK_SCHEME, i, name, shape, k)
        except MalformedMetadata as e:
            raise SpecMismatch(e.message) from None
        leaves.append((dtype, shape, (indices, values)))
        ks.append(k)
    return _encoded_tree(structure, leaves, TopKCodec(tuple(ks)).to_dict())


def powersgd_tree_to_wire(
    encoded: Sequence[Any],
    like: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """Describes a PowerSGD compressed tree for a PUSH or PUSH_PULL frame.

    Each leaf's buffer is its factor ``p`` (``n x r``) followed by its factor
    ``q`` (``m x r``), both row-major in the leaf's dtype: the bytes of
    ``hpsjax.transforms.PowerSGDEncoded``, sent as they are (no copy for host
    arrays), ``powersgd_nbytes`` in all. A leaf sent whole (``p`` its
    flattened values, ``q`` empty) has rank 0.

    Args:
      encoded: the ``PowerSGDEncoded(p, q)`` of each leaf in leaf order, as
        ``last_powersgd_encoded(opt_state)`` returns them.
      like: a pytree giving the structure and each leaf's decoded shape and
        dtype (arrays or ``jax.ShapeDtypeStruct``).
      limits: bounds and allowed dtypes.

    Returns:
      ``(metadata, buffers, layout)`` as for :func:`tree_to_wire`; the codec is
      ``{"scheme": "powersgd", "rank": [rank per leaf]}``.

    Raises:
      SpecMismatch: ``encoded`` does not fit ``like``.
    """
    structure, like_leaves, encoded = _encoded_against(encoded, like, limits)
    leaves, ranks = [], []
    for i, (enc, ref) in enumerate(zip(encoded, like_leaves, strict=True)):
        if not (isinstance(enc, tuple) and len(enc) == 2):
            raise SpecMismatch("every PowerSGD leaf must be a (p, q) pair")
        p, q_ = _as_leaf(enc[0]), _as_leaf(enc[1])
        dtype, name, shape = _like_leaf(ref, limits)
        if p.dtype != dtype or q_.dtype != dtype:
            raise SpecMismatch(
                f"leaf {i}: PowerSGD factors of a {dtype.name} leaf are "
                f"{dtype.name}, got {p.dtype.name} and {q_.dtype.name}"
            )
        rank = p.shape[1] if p.ndim == 2 else 0
        try:
            _per_leaf_sizes(POWERSGD_SCHEME, i, name, shape, rank)
            want = _powersgd_shapes(i, shape, rank)
        except MalformedMetadata as e:
            raise SpecMismatch(e.message) from None
        if (p.shape, q_.shape) != want:
            raise SpecMismatch(
                f"leaf {i}: factors {p.shape} and {q_.shape} do not fit shape "
                f"{shape} (rank {rank}: {want[0]} and {want[1]})"
            )
        leaves.append((dtype, shape, (p, q_)))
        ranks.append(rank)
    return _encoded_tree(structure, leaves, PowerSGDCodec(tuple(ranks)).to_dict())


def _scheme(codec: Any) -> str | None:
    """The scheme of a per-leaf codec given by name or object, else ``None``."""
    if isinstance(codec, str):
        return codec
    if isinstance(codec, TopKCodec):
        return TOPK_SCHEME
    if isinstance(codec, PowerSGDCodec):
        return POWERSGD_SCHEME
    return None


def encoded_tree_to_wire(
    encoded: Sequence[Any],
    like: Any,
    codec: Any,
    *,
    limits: WireLimits = DEFAULT_LIMITS,
) -> tuple[dict[str, Any], list[memoryview], TreeLayout]:
    """Describes a compressed tree for a PUSH or PUSH_PULL frame.

    Each leaf's buffer is its packed codes followed by its float32 scales, the
    bytes of ``hpsjax.transforms.Encoded``; the receiver decodes them with
    ``decode(encoded, codec, shape, dtype)``.

    Args:
      encoded: the ``Encoded(codes, scales)`` of each leaf in leaf order, as
        returned by ``encode_tree`` or ``last_encoded(opt_state)``.
      like: a pytree giving the structure and each leaf's decoded shape and
        dtype (arrays or ``jax.ShapeDtypeStruct``).
      codec: the ``Codec`` used to encode.
      limits: bounds and allowed dtypes.

    Returns:
      ``(metadata, buffers, layout)`` as for :func:`tree_to_wire`.

    A ``codec`` of ``"topk"`` (or a :class:`TopKCodec`) sends top-k leaves
    instead (:func:`topk_tree_to_wire`), one of ``"powersgd"`` (or a
    :class:`PowerSGDCodec`) PowerSGD factors (:func:`powersgd_tree_to_wire`);
    the leaves say their ``k`` or rank.

    Raises:
      SpecMismatch: ``encoded`` does not fit ``like`` and ``codec``.
      ValueError: ``codec`` names no codec.
    """
    scheme = _scheme(codec)
    if scheme == TOPK_SCHEME:
        return topk_tree_to_wire(encoded, like, limits=limits)
    if scheme == POWERSGD_SCHEME:
        return powersgd_tree_to_wire(encoded, like, limits=limits)
    if scheme is not None:
        raise ValueError(
            f"unknown codec {codec!r}: a Codec, {TOPK_SCHEME!r} or {POWERSGD_SCHEME!r}"
        )
    structure, like_leaves, encoded = _encoded_against(encoded, like, limits)
    codec_dict = codec.to_dict()
    leaves = []
    for enc, ref in zip(encoded, like_leaves, strict=True):
        if not isinstance(enc, q.Encoded):
            raise SpecMismatch("every encoded leaf must be an Encoded")
        codes = _as_leaf(enc.codes).reshape(-1)
        scales = _as_leaf(enc.scales).reshape(-1)
        if codes.dtype != np.uint8 or scales.dtype != np.float32:
            raise SpecMismatch("Encoded needs uint8 codes and float32 scales")
        dtype, _, shape = _like_leaf(ref, limits)
        want_codes, want_scales = compressed_sizes(shape, codec)
        if codes.size != want_codes or scales.size != want_scales:
            raise SpecMismatch(
                f"Encoded sizes ({codes.size}, {scales.size}) do not match "
                f"shape {shape} under {codec_dict} ({want_codes}, {want_scales})"
            )
        leaves.append((dtype, shape, (codes, scales)))
    return _encoded_tree(structure, leaves, codec_dict)


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
    per_leaf = None  # the k or rank of each leaf under top-k or PowerSGD
    if isinstance(codec, dict) and codec.get("scheme") in _PER_LEAF_CODECS:
        (per_leaf,) = _per_leaf_codec_from_dict(codec, count)
    elif codec is not None:
        _codec_from_dict(codec)
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
            if per_leaf is not None:
                scheme = codec["scheme"]
                want_code, want_nbytes = _per_leaf_sizes(
                    scheme, i, name, shape, per_leaf[i]
                )
                if code_nbytes != want_code or nbytes != want_nbytes:
                    what = _PER_LEAF_CODECS[scheme][1]
                    raise MalformedMetadata(
                        f"leaf {i}: {what} sizes ({code_nbytes}, {nbytes}) != "
                        f"({want_code}, {want_nbytes})"
                    )
                leaves.append(LeafSpec(dtype, tuple(shape), off, nbytes, code_nbytes))
                offset += nbytes
                continue
            if name not in _FLOAT_NAMES:
                # As the per-leaf codecs' (_per_leaf_sizes): one fault, one code.
                raise MalformedMetadata(
                    f"leaf {i}: quantized leaves must be floating, not {name}"
                )
            want_codes, want_scales = compressed_sizes(shape, codec)
            if code_nbytes != want_codes or nbytes != want_codes + 4 * want_scales:
                raise MalformedMetadata(
                    f"leaf {i}: encoded sizes ({code_nbytes}, {nbytes}) != "
                    f"({want_codes}, {want_codes + 4 * want_scales})"
                )
        leaves.append(LeafSpec(dtype, tuple(shape), off, nbytes, code_nbytes))
        offset += nbytes
    return TreeLayout(structure, tuple(leaves), codec, offset)


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
