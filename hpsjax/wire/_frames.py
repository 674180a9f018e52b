"""hpsjax frames: the fixed header, msgpack metadata, limits and receive buffers.

Everything here is pure: functions turn messages into lists of buffers and back.
No sockets, no event loop; :mod:`hpsjax.wire._treecodec` describes trees inside a
frame, :mod:`hpsjax.wire._stream` parses a byte stream into frames.

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

The sender writes the header and metadata followed by memoryviews of the payload
(a scatter list for ``writelines``), never joining it; the reader fills
preallocated memory (:class:`BufferPool`) in place. No pickle: nothing received
can execute code. See PROTOCOL.md for the normative description.
"""

from __future__ import annotations

import enum
import math
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import ml_dtypes
import msgpack
import numpy as np

from hpsjax.wire._errors import (
    BadMagic,
    HpsError,
    MalformedMetadata,
    PayloadTooBig,
    ProtocolError,
    UnexpectedMessage,
    UnsupportedVersion,
)

__all__ = [
    "ALIGNMENT",
    "DEFAULT_LIMITS",
    "DTYPES",
    "HEADER_SIZE",
    "JOIN_PAYLOAD_BYTES",
    "MAGIC",
    "PAYLOAD_TYPES",
    "PROTOCOL_VERSION",
    "Allocator",
    "BufferPool",
    "Frame",
    "FrameError",
    "Header",
    "MsgType",
    "PackedFields",
    "PreparedFrame",
    "WireLimits",
    "aligned_empty",
    "encode_frame",
    "encode_frame_packed",
    "pack_fields",
    "pack_header",
    "prepare_frame",
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
    NOTICE = 6
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
        Past the magic and version checks, the error's ``request_id`` is the
        header's.

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
    error: ProtocolError | None = None
    if msg_type is None:
        error = UnexpectedMessage(f"unknown message type {raw_type}")
    elif flags:
        error = ProtocolError(f"unknown header flags {flags:#06x}")
    elif meta_len > limits.max_metadata_bytes:
        error = PayloadTooBig(
            f"metadata of {meta_len} bytes exceeds the limit of "
            f"{limits.max_metadata_bytes}"
        )
    elif payload_len and msg_type not in PAYLOAD_TYPES:
        error = ProtocolError(f"{msg_type.name} frames carry no payload")
    elif meta_len + payload_len > limits.max_message_bytes:
        error = PayloadTooBig(
            f"message of {meta_len + payload_len} bytes exceeds the limit of "
            f"{limits.max_message_bytes}"
        )
    if error is not None:
        # Magic and version were right, so the id is the sender's: the ERROR
        # answers that request.
        error.request_id = request_id
        raise error
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
