"""The asyncio connection layer: hpsjax frames over a transport, both ends.

:class:`FrameProtocol` only moves bytes: received bytes go into the buffers of a
sans-I/O :class:`~hpsjax.wire._stream.FrameDecoder`, and frames are written whole.
What the frames mean is up to its owner (a :class:`~hpsjax.ps.Client`, or a
connection of the :class:`~hpsjax.ps.Server`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from hpsjax.wire import (
    DEFAULT_LIMITS,
    Allocator,
    BufferPool,
    ConnectionClosed,
    Frame,
    FrameDecoder,
    FrameError,
    HpsError,
    MsgType,
    ProtocolError,
    WireLimits,
    default_allocator,
    encode_frame,
    error_to_wire,
)

__all__ = ["FrameProtocol", "error_frame"]


class FrameProtocol(asyncio.BufferedProtocol):
    """An ``asyncio.BufferedProtocol`` that reads and writes hpsjax frames.

    Received bytes go straight into the buffers a
    :class:`~hpsjax.wire._stream.FrameDecoder` hands out (payloads land in
    preallocated arrays); complete frames are given to ``on_frame``. Writes are
    scatter lists passed to ``writelines`` whole, so frames from concurrent
    coroutines never interleave. Flow control follows the transport's
    ``pause_writing``/``resume_writing``.

    Args:
      on_frame: called with each :class:`Frame` or :class:`FrameError`.
      on_lost: called once with the error that ended the connection
        (:class:`ConnectionClosed` for a clean or abrupt close, a
        :class:`ProtocolError` for a broken stream).
      limits: frame limits.
      allocate: payload allocator for the decoder (default: validate tree
        metadata, and receive into blocks of a
        :class:`~hpsjax.wire._frames.BufferPool`).
      on_made: called once the connection is established (after the TLS
        handshake, with TLS); ``on_lost`` is only ever called after it.
      on_filled: the decoder's per-buffer hook (see
        :class:`~hpsjax.wire._stream.FrameDecoder`), or ``None``.
    """

    def __init__(
        self,
        on_frame: Callable[[Frame | FrameError], None],
        on_lost: Callable[[HpsError], None],
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        allocate: Allocator | None = None,
        on_made: Callable[[], None] | None = None,
        on_filled: Callable[[Any, int], None] | None = None,
    ):
        if allocate is None:
            allocate = default_allocator(limits, BufferPool())
        self._decoder = FrameDecoder(
            limits=limits, allocate=allocate, on_filled=on_filled
        )
        # The event loop asks for a buffer before every read: straight to the
        # decoder, without a call in between.
        self.get_buffer = self._decoder.get_buffer
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._on_made = on_made
        self.transport: asyncio.Transport | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._lost: HpsError | None = None
        self._lost_reported = False
        self.bytes_sent = 0
        self.bytes_received = 0

    # asyncio callbacks --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self._on_made is not None:
            self._on_made()

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced in __init__
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        try:
            events = self._decoder.buffer_updated(nbytes)
        except ProtocolError as e:
            # Without its traceback: the frames in it reach back to this
            # protocol, a cycle that would outlive the connection.
            # Answered under the header's request id when it could be read.
            self.fail(e.with_traceback(None), request_id=e.request_id)
            return
        for event in events:
            if self._lost is not None:
                return
            self._on_frame(event)

    def eof_received(self) -> bool:
        try:
            self._decoder.eof()
        except ConnectionClosed as e:
            self._lost = self._lost or e.with_traceback(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        if self._lost is None:
            detail = f" ({type(exc).__name__}: {exc})" if exc else ""
            self._lost = ConnectionClosed(f"connection closed{detail}")
        self._report_lost()
        # The callbacks reach back to whoever owns this protocol (a server's
        # session, a client): cutting them leaves no reference cycle, so the
        # buffers of a closed connection are freed now, not by the collector.
        self._decoder.release()
        self._on_frame = self._on_made = self._on_lost = None

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # API ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the connection has ended or is ending."""
        return (
            self._lost is not None
            or self.transport is None
            or self.transport.is_closing()
        )

    def send(self, parts: list[bytes | memoryview], nbytes: int | None = None) -> None:
        """Queues one frame (a scatter list) for writing.

        Args:
          parts: the frame's buffers.
          nbytes: their total length, if known.

        Raises:
          ConnectionClosed: the connection is closed.
        """
        transport = self.transport
        if self._lost is not None or transport is None or transport.is_closing():
            raise self._lost or ConnectionClosed("connection is closed")
        if len(parts) == 1:
            # One buffer is one write; writelines would go through a list.
            transport.write(parts[0])
        else:
            transport.writelines(parts)
        self.bytes_sent += sum(map(len, parts)) if nbytes is None else nbytes

    async def drain(self) -> None:
        """Waits until the transport's write buffer is below its high mark.

        Cancelling is safe: queued frames stay queued.

        Raises:
          ConnectionClosed: the connection ended.
        """
        await self._writable.wait()
        if self._lost is not None:
            raise self._lost

    @property
    def decoder(self) -> FrameDecoder:
        """The frame decoder (for instance to change its limits)."""
        return self._decoder

    @property
    def paused(self) -> bool:
        """Whether the transport asked to stop writing (its buffer is full)."""
        return not self._writable.is_set()

    @property
    def write_buffer_size(self) -> int:
        """Bytes queued in the transport."""
        if self.transport is None or self.transport.is_closing():
            return 0
        return self.transport.get_write_buffer_size()

    def fail(self, error: HpsError, *, request_id: int = 0) -> None:
        """Reports ``error`` to the peer in an ERROR frame and closes."""
        if self._lost is not None:
            return
        code, message = error_to_wire(error)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(
                encode_frame(
                    MsgType.ERROR, request_id, {"code": code, "message": message}
                )
            )
        self._lost = error
        self.close()

    def close(self, error: HpsError | None = None) -> None:
        """Closes the connection after the queued frames are written."""
        if self._lost is None:
            self._lost = error or ConnectionClosed("connection closed locally")
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Closes the connection at once, dropping queued frames."""
        if self._lost is None:
            self._lost = ConnectionClosed("connection aborted locally")
        if self.transport is not None:
            self.transport.abort()

    def _report_lost(self) -> None:
        if not self._lost_reported:
            self._lost_reported = True
            self._on_lost(self._lost)


def error_frame(request_id: int, error: BaseException) -> list[bytes | memoryview]:
    """An ERROR frame reporting ``error`` (code and short message only)."""
    code, message = error_to_wire(error)
    return encode_frame(MsgType.ERROR, request_id, {"code": code, "message": message})
