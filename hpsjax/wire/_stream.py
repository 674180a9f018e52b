"""The incremental frame reader: bytes in, frames out, payloads read in place.

:class:`FrameDecoder` is a sans-I/O parser that an ``asyncio.BufferedProtocol``
(or a test) feeds with bytes (see :mod:`hpsjax.net._connection`). No sockets, no
event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hpsjax.wire._errors import (
    ConnectionClosed,
    HpsError,
    MalformedMetadata,
    ProtocolError,
    ServerError,
)
from hpsjax.wire._frames import (
    DEFAULT_LIMITS,
    HEADER_SIZE,
    PAYLOAD_TYPES,
    Allocator,
    Frame,
    FrameError,
    Header,
    WireLimits,
    _header_at,
    unpack_metadata,
)
from hpsjax.wire._treecodec import default_allocator

__all__ = ["FrameDecoder"]


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
      >>> from hpsjax.wire._frames import MsgType, encode_frame
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
