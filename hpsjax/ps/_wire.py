"""The hpsjax wire format: frames, tree metadata and an incremental frame reader.

Everything here is pure: functions turn messages into lists of buffers and back,
and :class:`FrameDecoder` is a sans-I/O parser that an ``asyncio.BufferedProtocol``
(or a test) feeds with bytes. No sockets, no event loop.

A frame is a fixed 24-byte little-endian header, msgpack metadata, and a raw
payload::

    offset  size  field
    0       4     magic            b"HPSJ"
    4       1     protocol version 1
    5       1     message type     MsgType
    6       2     flags            0 (reserved)
    8       4     request id       u32
    12      4     metadata length  u32, bytes of msgpack
    16      8     payload length   u64, bytes of raw buffers
    24      ...   metadata, then payload

Trees travel as metadata (structure, per-leaf dtype, shape, byte offset and
length, codec) plus the leaves' bytes concatenated in leaf order. The sender
writes the header and metadata followed by memoryviews of the leaves (a scatter
list for ``writelines``), never joining the payload; the reader fills
preallocated arrays in place. No pickle: nothing received can execute code.
See PROTOCOL.md for the normative description.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import msgpack
import numpy as np

from hpsjax.ps._errors import (
    BadMagic,
    ConnectionClosed,
    HpsError,
    InvalidUpdate,
    MalformedMetadata,
    PayloadTooBig,
    ProtocolError,
    ServerError,
    SpecMismatch,
    TooManyLeaves,
    UnexpectedMessage,
    UnsupportedDtype,
    UnsupportedVersion,
)

__all__ = [
    "DEFAULT_LIMITS",
    "BufferPool",
    "DTYPES",
    "HEADER_SIZE",
    "MAGIC",
    "PROTOCOL_VERSION",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "Header",
    "LayoutCache",
    "LeafSpec",
    "MsgType",
    "PackedFields",
    "PreparedFrame",
    "TreeLayout",
    "WireLimits",
    "WireTree",
    "aligned_empty",
    "auth_proof",
    "check_encoded_leaf",
    "check_same_spec",
    "encode_frame",
    "encode_frame_packed",
    "encoded_tree_to_wire",
    "flatten_tree",
    "pack_fields",
    "pack_header",
    "prepare_frame",
    "tree_layout",
    "tree_to_wire",
    "unflatten_tree",
    "unpack_header",
    "unpack_metadata",
]

MAGIC = b"HPSJ"
PROTOCOL_VERSION = 1
_HEADER = struct.Struct("<4sBBHIIQ")
HEADER_SIZE = _HEADER.size
_MAX_REQUEST_ID = 2**32 - 1


class MsgType(enum.IntEnum):
    """Message types; the value is the header's type byte."""

    HELLO = 1
    CHALLENGE = 2
    AUTH = 3
    AUTH_OK = 4
    INFO = 5
    STAGE = 6
    PULL = 7
    PARAMS = 8
    PUSH = 9
    PUSH_ACK = 10
    PUSH_PULL = 11
    SUBSCRIBE = 12
    ERROR = 13
    BYE = 14


# A dict lookup is several times cheaper than calling the enum.
_MSG_TYPES = {t.value: t for t in MsgType}


# Only these carry a payload; any other frame with a non-zero payload length is
# refused from its header alone.
PAYLOAD_TYPES = frozenset({MsgType.PARAMS, MsgType.PUSH, MsgType.PUSH_PULL})

# Names on the wire -> numpy dtypes. Data are little-endian on the wire.
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(t).newbyteorder("<")
    for name, t in [
        ("bool", np.bool_),
        ("int8", np.int8),
        ("uint8", np.uint8),
        ("int16", np.int16),
        ("uint16", np.uint16),
        ("int32", np.int32),
        ("uint32", np.uint32),
        ("int64", np.int64),
        ("uint64", np.uint64),
        ("float16", np.float16),
        ("bfloat16", ml_dtypes.bfloat16),
        ("float32", np.float32),
        ("float64", np.float64),
    ]
}


class WireLimits(NamedTuple):
    """Bounds checked on every frame before anything is allocated.

    Attributes:
      max_message_bytes: metadata plus payload bytes of one frame.
      max_metadata_bytes: msgpack metadata bytes of one frame.
      max_leaves: leaves of one tree.
      max_depth: nesting depth of a tree's structure.
      max_rank: dimensions of one leaf.
      dtypes: dtype names accepted (a subset of :data:`DTYPES`).
    """

    max_message_bytes: int = 2**31
    max_metadata_bytes: int = 2**20
    max_leaves: int = 65536
    max_depth: int = 64
    max_rank: int = 32
    dtypes: frozenset[str] = frozenset(DTYPES)


DEFAULT_LIMITS = WireLimits()


class Header(NamedTuple):
    """A decoded frame header (all fields already validated)."""

    msg_type: MsgType
    flags: int
    request_id: int
    metadata_length: int
    payload_length: int


def pack_header(
    msg_type: int,
    request_id: int,
    metadata_length: int,
    payload_length: int,
    *,
    flags: int = 0,
    version: int = PROTOCOL_VERSION,
    magic: bytes = MAGIC,
) -> bytes:
    """Packs a 24-byte frame header.

    ``version`` and ``magic`` exist so tests can forge bad frames.

    Examples:
      >>> pack_header(MsgType.PULL, 7, 0, 0).hex()
      '4850534a0107000007000000000000000000000000000000'
    """
    if not 0 <= request_id <= _MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} is outside [0, 2**32)")
    return _HEADER.pack(
        magic, version, int(msg_type), flags, request_id, metadata_length,
        payload_length,
    )  # fmt: skip


def unpack_header(data: bytes | memoryview, limits: WireLimits = DEFAULT_LIMITS):
    """Decodes and validates a frame header.

    Args:
      data: at least :data:`HEADER_SIZE` bytes.
      limits: the bounds to enforce.

    Returns:
      A :class:`Header`.

    Raises:
      BadMagic, UnsupportedVersion, UnexpectedMessage, ProtocolError,
      PayloadTooBig: the header is unusable and the stream cannot be resynced.

    Examples:
      >>> unpack_header(pack_header(MsgType.PARAMS, 3, 10, 400))
      Header(msg_type=<MsgType.PARAMS: 8>, flags=0, request_id=3, \
metadata_length=10, payload_length=400)
    """
    magic, version, raw_type, flags, request_id, meta_len, payload_len = (
        _HEADER.unpack_from(data)
    )
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {version} not supported (this side speaks "
            f"{PROTOCOL_VERSION})"
        )
    msg_type = _MSG_TYPES.get(raw_type)
    if msg_type is None:
        raise UnexpectedMessage(f"unknown message type {raw_type}")
    if flags:
        raise ProtocolError(f"unknown header flags {flags:#06x}")
    if meta_len > limits.max_metadata_bytes:
        raise PayloadTooBig(
            f"metadata of {meta_len} bytes exceeds the limit of "
            f"{limits.max_metadata_bytes}"
        )
    if payload_len and msg_type not in PAYLOAD_TYPES:
        raise ProtocolError(f"{msg_type.name} frames carry no payload")
    if meta_len + payload_len > limits.max_message_bytes:
        raise PayloadTooBig(
            f"message of {meta_len + payload_len} bytes exceeds the limit of "
            f"{limits.max_message_bytes}"
        )
    return Header(msg_type, flags, request_id, meta_len, payload_len)


def _header_at(buffer: bytearray, offset: int, limits: WireLimits) -> Header:
    """:func:`unpack_header` of the header at ``offset``, the valid case first."""
    magic, version, raw_type, flags, request_id, meta_len, payload_len = (
        _HEADER.unpack_from(buffer, offset)
    )
    msg_type = _MSG_TYPES.get(raw_type)
    if (
        magic == MAGIC
        and version == PROTOCOL_VERSION
        and msg_type is not None
        and not flags
        and meta_len <= limits.max_metadata_bytes
        and (not payload_len or msg_type in PAYLOAD_TYPES)
        and meta_len + payload_len <= limits.max_message_bytes
    ):
        return Header(msg_type, 0, request_id, meta_len, payload_len)
    # Some check fails: unpack_header raises the error it names.
    return unpack_header(memoryview(buffer)[offset : offset + HEADER_SIZE], limits)


def unpack_metadata(data: bytes | memoryview) -> dict[str, Any]:
    """Decodes msgpack metadata; it must be a map with string keys.

    Empty metadata decodes to ``{}``.

    Raises:
      MalformedMetadata: the bytes are not one msgpack map.
    """
    if not len(data):
        return {}
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise MalformedMetadata(f"undecodable metadata: {type(e).__name__}") from e
    if not isinstance(meta, dict):
        raise MalformedMetadata("metadata must be a msgpack map with string keys")
    for key in meta:  # a plain loop: this runs on every frame
        if type(key) is not str:
            raise MalformedMetadata("metadata must be a msgpack map with string keys")
    return meta


def encode_frame(
    msg_type: int,
    request_id: int,
    metadata: Mapping[str, Any] | None = None,
    buffers: Sequence[memoryview] = (),
) -> list[bytes | memoryview]:
    """Builds a frame as a scatter list for ``transport.writelines``.

    Args:
      msg_type: a :class:`MsgType`.
      request_id: u32 request id (0 for messages the server sends unasked).
      metadata: msgpack-able map, or ``None`` for no metadata.
      buffers: the payload, as byte memoryviews; they are referenced, not
        copied, so they must not change until written.

    Returns:
      ``[header + metadata, *buffers]``.

    Examples:
      >>> parts = encode_frame(MsgType.BYE, 1, {"reason": "done"})
      >>> len(parts), len(parts[0])
      (1, 37)
    """
    if metadata is None:
        meta = b""
    elif not metadata:
        meta = _EMPTY_MAP  # most requests: PULL, INFO
    else:
        meta = msgpack.packb(metadata, use_bin_type=True)
    if not buffers:
        return [pack_header(msg_type, request_id, len(meta), 0) + meta]
    payload_len = sum(b.nbytes for b in buffers)
    header = pack_header(msg_type, request_id, len(meta), payload_len)
    return [header + meta, *buffers]


_EMPTY_MAP = b"\x80"


class PackedFields(NamedTuple):
    """Metadata map entries packed once, to be sent in many frames.

    msgpack maps are a count followed by key/value pairs, so packed entries
    concatenate into a map; the server packs the description of its
    parameters once per version instead of once per reply.
    """

    count: int
    data: bytes


def pack_fields(fields: Mapping[str, Any]) -> PackedFields:
    """Packs map entries for :func:`encode_frame_packed`.

    Examples:
      >>> parts = encode_frame_packed(
      ...     MsgType.INFO, 1, [pack_fields({"a": 1}), pack_fields({"b": 2})])
      >>> unpack_metadata(parts[0][HEADER_SIZE:])
      {'a': 1, 'b': 2}
    """
    # One packb call for the whole map (far cheaper than one per key and
    # value), then its map header is cut off.
    data = msgpack.packb(
        fields if type(fields) is dict else dict(fields), use_bin_type=True
    )
    return PackedFields(len(fields), data[_MAP_HEADER_SIZES[data[0]] :])


# Bytes of a msgpack map header by its first byte: fixmap, map 16, map 32.
_MAP_HEADER_SIZES = {**{0x80 | n: 1 for n in range(16)}, 0xDE: 3, 0xDF: 5}


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x80 | count])
    if count < 2**16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def encode_frame_packed(
    msg_type: int,
    request_id: int,
    fields: Sequence[PackedFields],
    buffers: Sequence[memoryview] = (),
) -> list[bytes | memoryview]:
    """:func:`encode_frame` with metadata given as packed entries (no key twice)."""
    meta = _map_header(sum(f.count for f in fields)) + b"".join(f.data for f in fields)
    payload_len = sum(b.nbytes for b in buffers)
    return [pack_header(msg_type, request_id, len(meta), payload_len) + meta, *buffers]


# Payloads up to this size are copied behind their metadata when a frame is
# prepared, so that each send is one buffer (one write, no scatter list).
JOIN_PAYLOAD_BYTES = 1 << 16


class PreparedFrame(NamedTuple):
    """A frame encoded once, to be sent under many request ids.

    The server answers every pull of a version with the same PARAMS frame but
    for its request id: only the 24-byte header is packed per reply.

    Attributes:
      msg_type: the message type.
      body: the metadata, followed by the payload when that is small (at most
        :data:`JOIN_PAYLOAD_BYTES`).
      metadata_length: bytes of metadata at the start of ``body``.
      payload_length: bytes of payload.
      buffers: the payload when it is not in ``body``; referenced, not copied.
      nbytes: bytes of the whole frame on the wire.
    """

    msg_type: int
    body: bytes
    metadata_length: int
    payload_length: int
    buffers: tuple[memoryview, ...]
    nbytes: int

    def parts(self, request_id: int) -> list[bytes | memoryview]:
        """The frame for ``request_id``, as a scatter list for ``writelines``."""
        if not 0 <= request_id <= _MAX_REQUEST_ID:
            raise ValueError(f"request id {request_id} is outside [0, 2**32)")
        header = _HEADER.pack(
            MAGIC, PROTOCOL_VERSION, self.msg_type, 0, request_id,
            self.metadata_length, self.payload_length,
        )  # fmt: skip
        return [header + self.body, *self.buffers]


def prepare_frame(
    msg_type: int,
    fields: Sequence[PackedFields],
    buffers: Sequence[memoryview] = (),
) -> PreparedFrame:
    """Encodes a frame's metadata (given as packed entries) and payload once.

    The buffers must not change while the frame is in use.

    Examples:
      >>> f = prepare_frame(MsgType.INFO, [pack_fields({"a": 1})])
      >>> f.parts(3)[0] == encode_frame(MsgType.INFO, 3, {"a": 1})[0]
      True
    """
    meta = _map_header(sum(f.count for f in fields)) + b"".join(f.data for f in fields)
    payload_len = sum(b.nbytes for b in buffers)
    if payload_len <= JOIN_PAYLOAD_BYTES:
        body, buffers = b"".join([meta, *buffers]), ()
    else:
        body, buffers = meta, tuple(buffers)
    return PreparedFrame(
        int(msg_type), body, len(meta), payload_len, buffers,
        HEADER_SIZE + len(meta) + payload_len,
    )  # fmt: skip


# --------------------------------------------------------------------------
# Authentication
# --------------------------------------------------------------------------

NONCE_BYTES = 32
AUTH_SCHEME = "hmac-sha256"
_PROOF_LABELS = {
    "client": b"hpsjax-v1 client proof",
    "server": b"hpsjax-v1 server proof",
}


def auth_proof(
    secret: bytes,
    role: str,
    server_nonce: bytes,
    client_nonce: bytes,
    worker_id: str | int,
) -> bytes:
    r"""The handshake proof of knowing ``secret``.

    .. math::

       \text{proof} = \operatorname{HMAC-SHA256}(\text{secret},\
           \text{label} \,\|\, n_s \,\|\, n_c \,\|\,
           \operatorname{msgpack}(\text{worker\_id}))

    with the label ``b"hpsjax-v1 client proof"`` or ``b"hpsjax-v1 server
    proof"``, and the 32-byte server and client nonces. Distinct labels keep a
    proof from being reflected back to its sender; fresh nonces on both sides keep
    it from being replayed.

    Args:
      secret: the shared secret.
      role: ``"client"`` or ``"server"``: who proves.
      server_nonce: the server's nonce.
      client_nonce: the client's nonce.
      worker_id: the worker id sent in HELLO.

    Returns:
      The 32-byte proof.

    Examples:
      >>> proof = auth_proof(b"k", "client", bytes(32), bytes(32), "w0")
      >>> len(proof), proof == auth_proof(b"k", "server", bytes(32), bytes(32), "w0")
      (32, False)
    """
    if len(server_nonce) != NONCE_BYTES or len(client_nonce) != NONCE_BYTES:
        raise ValueError(f"nonces must be {NONCE_BYTES} bytes")
    message = (
        _PROOF_LABELS[role]
        + bytes(server_nonce)
        + bytes(client_nonce)
        + msgpack.packb(worker_id, use_bin_type=True)
    )
    return hmac.new(secret, message, hashlib.sha256).digest()


# --------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------


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


ALIGNMENT = 64


def _aligned_view(owner: np.ndarray, nbytes: int) -> np.ndarray:
    start = -owner.ctypes.data % ALIGNMENT
    return owner[start : start + nbytes]


def aligned_empty(shape: Sequence[int], dtype: Any = np.uint8) -> np.ndarray:
    """An uninitialised array whose data start on a 64-byte boundary.

    JAX on CPU can then take the array without copying it
    (``jax.device_put``), and vector loads need no split.

    Examples:
      >>> aligned_empty((3, 5), np.float32).ctypes.data % 64
      0
    """
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    owner = np.empty(nbytes + ALIGNMENT, np.uint8)
    return _aligned_view(owner, nbytes).view(dtype).reshape(shape)


def _free_refs() -> int:
    # References to a free block's memory owner as BufferPool.take sees it: its
    # entry in the pool, the aligned view kept beside it, the loop variable and
    # getrefcount's argument. Measured in the same code shape rather than
    # assumed, since interpreters differ in how they count them. Every view of
    # a block handed out (leaves, arrays JAX took without copying) adds one.
    probe = np.empty(1, np.uint8)
    blocks = [(probe, probe[:])]
    del probe
    owner, _ = blocks[0]
    return sys.getrefcount(owner)


_FREE_REFS = _free_refs()


class BufferPool:
    """Receive buffers that are reused once nothing references them any more.

    PHub registers its receive buffers once and reuses them; here a block handed
    out by :meth:`take` returns to service as soon as every array viewing it
    has been dropped (by the caller, and by JAX, which holds arrays it took
    without copying). Reuse skips the cost of fresh memory (page faults), which
    on some machines exceeds the cost of moving the bytes.

    Args:
      max_blocks: blocks kept per size; beyond that, blocks are allocated and
        not kept.

    Examples:
      >>> pool = BufferPool()
      >>> a = pool.take(1024)
      >>> pool.take(1024) is a  # still referenced by `a`
      False
      >>> address = a.ctypes.data
      >>> del a
      >>> pool.take(1024).ctypes.data == address
      True
    """

    def __init__(self, max_blocks: int = 4):
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self._max_blocks = max_blocks
        self._blocks: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def take(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned ``uint8`` block of ``nbytes`` nobody else uses."""
        blocks = self._blocks.setdefault(nbytes, [])
        for owner, block in blocks:
            if sys.getrefcount(owner) <= _FREE_REFS:
                return block[:]
        owner = np.empty(nbytes + ALIGNMENT, np.uint8)
        block = _aligned_view(owner, nbytes)
        if len(blocks) < self._max_blocks:
            blocks.append((owner, block))
        return block[:]

    def clear(self) -> None:
        """Forgets every block (blocks in use stay valid)."""
        self._blocks.clear()


class LeafSpec(NamedTuple):
    """Where one leaf lies in a tree payload.

    Attributes:
      dtype: the leaf's (decoded) dtype.
      shape: the leaf's (decoded) shape.
      offset: byte offset of its buffer in the payload.
      nbytes: byte length of its buffer.
      code_nbytes: for a compressed leaf, bytes of packed codes at the start of
        the buffer (float32 scales follow); ``None`` for a raw leaf.
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
          ``(codes uint8[code_nbytes], scales float32[n])`` pair.
        """
        if self.codec is None:
            return self._allocate_raw(pool, None)
        parts: list[tuple[tuple[int, ...], np.dtype]] = []
        for leaf in self.leaves:
            if leaf.code_nbytes is None:
                parts.append((leaf.shape, leaf.dtype))
            else:
                n_scales = (leaf.nbytes - leaf.code_nbytes) // 4
                parts.append(((leaf.code_nbytes,), np.dtype(np.uint8)))
                parts.append(((n_scales,), DTYPES["float32"]))
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


def _quantize_module():
    # The quantizer imports JAX; raw-tree users of this module need not pay that.
    from hpsjax.transforms import _quantize

    return _quantize


_CODEC_KEYS = ("scheme", "bits", "block_size", "stochastic", "levels")


def _codec_from_dict(codec: Any):
    q = _quantize_module()
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
    q = _quantize_module()
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

    Raises:
      SpecMismatch: ``encoded`` does not fit ``like`` and ``codec``.
    """
    q = _quantize_module()
    structure, like_leaves = flatten_tree(
        like, limits=limits, is_leaf=lambda x: hasattr(x, "shape")
    )
    encoded = list(encoded)
    if len(encoded) != len(like_leaves):
        raise SpecMismatch(
            f"{len(encoded)} encoded leaves for a tree of {len(like_leaves)}"
        )
    codec_dict = codec.to_dict()
    leaves = []
    arrays = []
    offset = 0
    for enc, ref in zip(encoded, like_leaves, strict=True):
        if not isinstance(enc, q.Encoded):
            raise SpecMismatch("every encoded leaf must be an Encoded")
        codes = _as_leaf(enc.codes).reshape(-1)
        scales = _as_leaf(enc.scales).reshape(-1)
        if codes.dtype != np.uint8 or scales.dtype != np.float32:
            raise SpecMismatch("Encoded needs uint8 codes and float32 scales")
        dtype = np.dtype(getattr(ref, "dtype", None) or np.asarray(ref).dtype)
        _wire_dtype_name(dtype, limits)
        shape = tuple(int(d) for d in np.shape(ref))
        want_codes, want_scales = compressed_sizes(shape, codec)
        if codes.size != want_codes or scales.size != want_scales:
            raise SpecMismatch(
                f"Encoded sizes ({codes.size}, {scales.size}) do not match "
                f"shape {shape} under {codec_dict} ({want_codes}, {want_scales})"
            )
        nbytes = codes.nbytes + scales.nbytes
        leaves.append(LeafSpec(dtype, shape, offset, nbytes, codes.nbytes))
        arrays.append((codes, scales))
        offset += nbytes
    layout = TreeLayout(structure, tuple(leaves), codec_dict, offset)
    meta = {
        "tree": structure,
        "leaves": [_spec_to_wire(s) for s in leaves],
        "codec": codec_dict,
    }
    return meta, leaf_buffers(arrays), layout


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


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
    if codec is not None:
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
            or not all(_is_int(d) and d >= 0 for d in shape)
        ):
            raise MalformedMetadata(f"leaf {i}: bad shape {shape!r}"[:200])
        if not (_is_int(off) and _is_int(nbytes)) or off != offset:
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


# --------------------------------------------------------------------------
# Incremental frame reader
# --------------------------------------------------------------------------


class Frame(NamedTuple):
    """A complete frame.

    Attributes:
      msg_type: the message type.
      request_id: the request id.
      metadata: decoded metadata map.
      payload: what the allocator returned for the payload (a
        :class:`WireTree` by default), ``None`` for frames without one.
      nbytes: bytes the frame took on the wire.
    """

    msg_type: MsgType
    request_id: int
    metadata: dict[str, Any]
    payload: Any
    nbytes: int


class FrameError(NamedTuple):
    """A well-delimited frame that was refused; its payload was skipped.

    The stream stays in sync, so the connection can answer ``error`` for
    ``request_id`` and carry on.
    """

    msg_type: MsgType
    request_id: int
    error: HpsError


Allocator = Callable[[Header, dict[str, Any]], tuple[list[memoryview], Any]]


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


_HEADER_STATE, _META_STATE, _PAYLOAD_STATE = range(3)


class FrameDecoder:
    """Sans-I/O incremental frame parser with zero-copy payload reads.

    It follows ``asyncio.BufferedProtocol``: :meth:`get_buffer` says where the
    next bytes go, :meth:`buffer_updated` says how many arrived and returns the
    frames completed. Headers and metadata go to a small scratch buffer; once a
    frame's metadata is known, ``allocate(header, metadata)`` returns the
    memoryviews its payload is read into, and large stretches of payload are
    received straight into them (only stretches shorter than the scratch buffer
    are copied, so a large tree is never copied whole).

    Limits are checked from the header before anything is allocated. A bad
    header raises (the stream cannot be resynced); a frame whose metadata or
    allocation is refused has its payload skipped and is reported as a
    :class:`FrameError`.

    ``on_filled(payload, index)`` is called as soon as the ``index``-th buffer
    the allocator returned is full, while the rest of the frame may still be
    arriving: a receiver checks each part (for example that it is finite)
    during the transfer instead of after it. An :class:`HpsError` it raises
    refuses the frame like a bad allocation (the rest is skipped).

    Args:
      limits: bounds checked on every frame.
      allocate: ``(header, metadata) -> (buffers, payload)`` for frames with a
        payload type; defaults to :func:`default_allocator`.
      scratch_bytes: size of the scratch buffer.
      on_filled: ``(payload, buffer index) -> None``, or ``None``.

    Examples:
      >>> dec = FrameDecoder()
      >>> parts = encode_frame(MsgType.PULL, 5, {"x": 1})
      >>> [(f.msg_type.name, f.request_id, f.metadata) for f in dec.feed(parts[0])]
      [('PULL', 5, {'x': 1})]
    """

    def __init__(
        self,
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        allocate: Allocator | None = None,
        scratch_bytes: int = 1 << 16,
        on_filled: Callable[[Any, int], None] | None = None,
    ):
        if scratch_bytes < HEADER_SIZE:
            raise ValueError(f"scratch_bytes must be >= {HEADER_SIZE}")
        self._limits = limits
        self._allocate = allocate or default_allocator(limits)
        self._on_filled = on_filled
        self._dest_ids: list[int] = []
        self._scratch = bytearray(scratch_bytes)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._state = _HEADER_STATE
        self._header: Header | None = None
        self._meta_buf: bytearray | None = None
        self._meta: dict[str, Any] = {}
        self._dest: list[memoryview] = []
        self._dest_index = 0
        self._dest_pos = 0
        self._left = 0
        self._payload: Any = None
        self._error: HpsError | None = None
        self._direct: str = ""
        self._failed: HpsError | None = None
        self._events: list[Frame | FrameError] = []

    @property
    def limits(self) -> WireLimits:
        """The limits the next frame headers are checked against."""
        return self._limits

    @limits.setter
    def limits(self, limits: WireLimits) -> None:
        if not isinstance(limits, WireLimits):
            raise ValueError("limits must be a WireLimits")
        self._limits = limits

    @property
    def idle(self) -> bool:
        """True between frames (no partial frame buffered)."""
        return self._state == _HEADER_STATE and self._start == self._end

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes must be written."""
        del sizehint
        if not self._end and self._state == _HEADER_STATE:
            # Between frames with nothing buffered (a reply is awaited).
            self._direct = ""
            return self._view
        if self._state == _PAYLOAD_STATE and self._error is None and self._left:
            dest = self._dest[self._dest_index]
            room = len(dest) - self._dest_pos
            if room >= len(self._scratch):
                self._direct = "payload"
                return dest[self._dest_pos :]
        self._direct = ""
        if self._start:
            n = self._end - self._start
            self._scratch[:n] = self._scratch[self._start : self._end]
            self._start, self._end = 0, n
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame | FrameError]:
        """Consumes ``nbytes`` written into the last buffer from get_buffer.

        Returns:
          The frames (and refused frames) completed by these bytes.

        Raises:
          ProtocolError (or a subclass): the stream is broken; close it.
        """
        if self._failed is not None:
            raise self._failed
        try:
            if self._direct == "payload":
                self._advance_dest(nbytes)
                self._left -= nbytes
                if not self._left:
                    self._finish()
            else:
                self._end += nbytes
                self._process()
        except ProtocolError as e:
            self._failed = e
            raise
        events, self._events = self._events, []
        return events

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame | FrameError]:
        """Consumes ``data`` (copying it); convenient outside a protocol."""
        data = memoryview(data).cast("B")
        events = []
        while len(data):
            buf = self.get_buffer(len(data))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            data = data[n:]
            events.extend(self.buffer_updated(n))
        return events

    def eof(self) -> None:
        """Signals the end of the stream.

        Raises:
          ConnectionClosed: the stream ended inside a frame.
        """
        if not self.idle:
            raise ConnectionClosed("connection closed in the middle of a frame")

    def release(self) -> None:
        """Lets go of every buffer and callback once the stream has ended.

        The callbacks usually reach back to the connection that owns this
        decoder: dropping them leaves no reference cycle, so a closed
        connection's memory is freed at once rather than by the garbage
        collector. Later bytes raise :class:`ConnectionClosed`.
        """
        self._failed = ConnectionClosed("the stream has ended")
        self._allocate = self._on_filled = None
        self._scratch = bytearray(HEADER_SIZE)
        self._view = memoryview(self._scratch)
        self._start = self._end = 0
        self._state = _HEADER_STATE
        self._header = self._meta_buf = self._payload = self._error = None
        self._meta, self._dest, self._dest_ids, self._events = {}, [], [], []

    def _process(self) -> None:
        while True:
            avail = self._end - self._start
            if self._state == _HEADER_STATE:
                if avail < HEADER_SIZE:
                    return
                header = _header_at(self._scratch, self._start, self._limits)
                end = (
                    self._start
                    + HEADER_SIZE
                    + header.metadata_length
                    + header.payload_length
                )
                if end <= self._end:
                    # The whole frame is here (a small one): no state to keep.
                    self._whole_frame(header, self._start + HEADER_SIZE)
                    self._start = end
                    if end == self._end:
                        self._start = self._end = 0
                        return
                    continue
                self._start += HEADER_SIZE
                self._header = header
                self._state = _META_STATE
                if header.metadata_length > len(self._scratch):
                    # Too large for scratch: collected in a buffer that grows
                    # as the bytes arrive, so a header declaring much metadata
                    # and sending little costs only what was sent.
                    self._meta_buf = bytearray()
            elif self._state == _META_STATE:
                n = self._header.metadata_length
                if self._meta_buf is not None:
                    k = min(avail, n - len(self._meta_buf))
                    self._meta_buf += self._view[self._start : self._start + k]
                    self._start += k
                    if len(self._meta_buf) < n:
                        return
                    self._got_metadata(memoryview(self._meta_buf))
                else:
                    if avail < n:
                        return
                    meta = self._view[self._start : self._start + n]
                    self._start += n
                    self._got_metadata(meta)
            else:
                if not avail:
                    return
                n = min(avail, self._left)
                if self._error is None:
                    self._copy_into_dest(self._view[self._start : self._start + n])
                self._start += n
                self._left -= n
                if self._left:
                    return
                self._finish()
            if self._start == self._end:
                self._start = self._end = 0
                if self._state == _HEADER_STATE:
                    return

    def _whole_frame(self, header: Header, meta_start: int) -> None:
        """Handles a frame lying whole in the scratch buffer, from ``meta_start``."""
        view = self._view
        pos = meta_start + header.metadata_length
        payload = None
        try:
            if pos - meta_start == 1 and view[meta_start] == 0x80:
                meta = {}  # an empty map: PULL, INFO
            else:
                meta = unpack_metadata(view[meta_start:pos])
            if header.msg_type in PAYLOAD_TYPES:
                buffers, payload = self._allocate(header, meta)
                if sum(map(len, buffers)) != header.payload_length:
                    raise MalformedMetadata(
                        "payload length does not match the tree metadata"
                    )
        except HpsError as e:
            self._events.append(FrameError(header.msg_type, header.request_id, e))
            return
        except Exception as e:  # an allocator bug must not kill the stream
            error = ServerError(f"cannot receive frame ({type(e).__name__})")
            self._events.append(FrameError(header.msg_type, header.request_id, error))
            return
        if payload is not None:
            on_filled = self._on_filled
            for index, buffer in enumerate(buffers):
                n = len(buffer)
                if not n:
                    continue
                buffer[:] = view[pos : pos + n]
                pos += n
                if on_filled is not None:
                    self._payload, self._error = payload, None
                    self._filled(index)
                    error, self._payload, self._error = self._error, None, None
                    if error is not None:
                        self._events.append(
                            FrameError(header.msg_type, header.request_id, error)
                        )
                        return
        self._events.append(
            Frame(
                header.msg_type,
                header.request_id,
                meta,
                payload,
                HEADER_SIZE + header.metadata_length + header.payload_length,
            )
        )

    def _got_metadata(self, data: memoryview) -> None:
        header = self._header
        self._meta_buf = None
        self._state = _PAYLOAD_STATE
        self._left = header.payload_length
        self._dest, self._dest_index, self._dest_pos = [], 0, 0
        self._payload, self._error = None, None
        try:
            self._meta = unpack_metadata(data)
            if header.msg_type in PAYLOAD_TYPES:
                buffers, self._payload = self._allocate(header, self._meta)
                if sum(map(len, buffers)) != header.payload_length:
                    raise MalformedMetadata(
                        "payload length does not match the tree metadata"
                    )
                if self._on_filled is None:
                    self._dest = [b for b in buffers if len(b)]
                else:
                    self._dest_ids = [i for i, b in enumerate(buffers) if len(b)]
                    self._dest = [buffers[i] for i in self._dest_ids]
        except HpsError as e:
            # The frame's extent is known from its header, so the stream stays
            # in sync: skip the payload and report the error for this request.
            self._error = e
        except Exception as e:  # an allocator bug must not kill the stream
            self._error = ServerError(f"cannot receive frame ({type(e).__name__})")
        if not self._left:
            self._finish()

    def _advance_dest(self, n: int) -> None:
        self._dest_pos += n
        while self._dest_index < len(self._dest) and self._dest_pos >= len(
            self._dest[self._dest_index]
        ):
            self._dest_pos -= len(self._dest[self._dest_index])
            if self._on_filled is not None and self._error is None:
                self._filled(self._dest_ids[self._dest_index])
            self._dest_index += 1

    def _filled(self, index: int) -> None:
        try:
            self._on_filled(self._payload, index)
        except HpsError as e:
            # Refused mid-frame: the rest of the payload is skipped, the
            # stream stays in sync.
            self._error = e
        except Exception as e:  # a checker bug must not kill the stream
            self._error = ServerError(f"cannot check frame ({type(e).__name__})")

    def _copy_into_dest(self, data: memoryview) -> None:
        while len(data):
            dest = self._dest[self._dest_index]
            k = min(len(dest) - self._dest_pos, len(data))
            dest[self._dest_pos : self._dest_pos + k] = data[:k]
            data = data[k:]
            self._advance_dest(k)

    def _finish(self) -> None:
        header = self._header
        if self._error is not None:
            self._events.append(
                FrameError(header.msg_type, header.request_id, self._error)
            )
        else:
            self._events.append(
                Frame(
                    header.msg_type,
                    header.request_id,
                    self._meta,
                    self._payload,
                    HEADER_SIZE + header.metadata_length + header.payload_length,
                )
            )
        self._state = _HEADER_STATE
        self._header = None
        self._meta = {}
        self._dest, self._payload, self._error = [], None, None
