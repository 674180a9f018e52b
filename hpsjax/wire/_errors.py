"""Errors of the parameter server, its wire protocol, server and client.

One hierarchy serves every layer. Each class carries a stable numeric ``code``;
the code and a short message are what crosses the wire in an ``ERROR`` frame
(never a traceback), and the receiving side raises the class registered for that
code, so ``except InvalidUpdate`` catches a local check and a refusal from the
peer alike::

    HpsError (1)                      anything raised by hpsjax.ps
    +-- ConnectionClosed (2)          the peer went away; truncated frames
    +-- ProtocolError (10)            bytes that do not follow PROTOCOL.md
    |   +-- PayloadTooBig (11)        a length over a configured limit
    |   +-- UnsupportedVersion (12)   protocol version byte not understood
    |   +-- BadMagic (13)             the frame does not start with b"HPSJ"
    |   +-- MalformedMetadata (14)    msgpack metadata unreadable or incomplete
    |   +-- TooManyLeaves (15)        a tree with more leaves than allowed
    |   +-- UnsupportedDtype (16)     a dtype outside the allow-list
    |   +-- UnexpectedMessage (17)    a message type not valid here or now
    +-- AuthError (20)                handshake refused (wrong secret, no proof)
    +-- InvalidUpdate (30)            a push the model cannot take
    |   +-- SpecMismatch (31)         tree structure, shape or dtype differs
    |   +-- NonFiniteUpdate (32)      NaN or infinity in the update
    +-- ServerError (40)              the peer failed; also any unknown code
        +-- ShuttingDown (41)         the server is closing
        +-- WorkerDropped (42)        the server's policy dropped this worker

Codes are part of the protocol (see PROTOCOL.md): they never change meaning, and
new ones are only ever added.
"""

from __future__ import annotations

__all__ = [
    "AuthError",
    "BadMagic",
    "ConnectionClosed",
    "HpsError",
    "InvalidUpdate",
    "MalformedMetadata",
    "NonFiniteUpdate",
    "PayloadTooBig",
    "ProtocolError",
    "ServerError",
    "ShuttingDown",
    "SpecMismatch",
    "TooManyLeaves",
    "UnexpectedMessage",
    "UnsupportedDtype",
    "UnsupportedVersion",
    "WorkerDropped",
    "error_from_wire",
    "error_to_wire",
]

# A peer learns what went wrong, not the internals around it: messages sent in
# an ERROR frame are cut to this many characters.
MAX_ERROR_MESSAGE_CHARS = 512


class HpsError(Exception):
    """Base class of every error raised by ``hpsjax.ps``.

    Attributes:
      code: stable numeric code of the class, sent on the wire.
      remote: ``True`` when the error was reported by the peer in an ``ERROR``
        frame rather than detected locally.
    """

    code: int = 1

    def __init__(self, message: str = "", *, remote: bool = False):
        super().__init__(message)
        self.message = message
        self.remote = remote

    def __str__(self) -> str:
        prefix = "peer: " if self.remote else ""
        return f"{prefix}{self.message or type(self).__name__}"


class ConnectionClosed(HpsError):
    """The connection ended, before or in the middle of a frame."""

    code = 2


class ProtocolError(HpsError):
    """The bytes received do not follow the protocol.

    Attributes:
      request_id: for an error found in a frame's header, the request id that
        header carried once its magic and version were right (the ERROR
        reporting it echoes that id), else 0.
    """

    code = 10
    request_id: int = 0


class PayloadTooBig(ProtocolError):
    """A metadata or payload length exceeds a configured limit."""

    code = 11


class UnsupportedVersion(ProtocolError):
    """The frame's protocol version is not one this side speaks."""

    code = 12


class BadMagic(ProtocolError):
    """The frame does not start with the magic bytes ``b"HPSJ"``."""

    code = 13


class MalformedMetadata(ProtocolError):
    """The msgpack metadata cannot be decoded or misses required fields."""

    code = 14


class TooManyLeaves(ProtocolError):
    """A tree has more leaves (or nesting) than the configured limit."""

    code = 15


class UnsupportedDtype(ProtocolError):
    """A leaf's dtype is not in the allow-list."""

    code = 16


class UnexpectedMessage(ProtocolError):
    """A message type that is not valid in this direction or state."""

    code = 17


class AuthError(HpsError):
    """The handshake failed: wrong or missing secret, or a bad proof."""

    code = 20


class InvalidUpdate(HpsError):
    """A pushed update cannot be applied to the model."""

    code = 30


class SpecMismatch(InvalidUpdate):
    """The update's tree structure, a shape or a dtype differs from the model."""

    code = 31


class NonFiniteUpdate(InvalidUpdate):
    """The update holds NaN or infinite values."""

    code = 32


class ServerError(HpsError):
    """The peer failed to serve a request, or sent a code this side lacks.

    Attributes:
      code: the numeric code received (the class default when raised locally).
    """

    code = 40

    def __init__(self, message: str = "", *, remote: bool = False, code: int = 40):
        super().__init__(message, remote=remote)
        self.code = code


class ShuttingDown(ServerError):
    """The server is closing; the request was not served."""

    code = 41

    def __init__(self, message: str = "", *, remote: bool = False):
        super().__init__(message, remote=remote, code=41)


class WorkerDropped(ServerError):
    """The server's policy dropped this worker (for instance a missed deadline).

    The worker may connect again and rejoin.
    """

    code = 42

    def __init__(self, message: str = "", *, remote: bool = False):
        super().__init__(message, remote=remote, code=42)


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[int, type[HpsError]] = {
    c.code: c for c in [HpsError, *_all_subclasses(HpsError)]
}


def error_to_wire(error: BaseException) -> tuple[int, str]:
    """Returns the ``(code, message)`` pair that reports ``error`` to a peer.

    Errors outside the hierarchy become a generic ``ServerError`` whose message
    names only the exception type, so no internal detail leaks.

    Args:
      error: the exception to report.

    Returns:
      The numeric code and a message of at most 512 characters.

    Examples:
      >>> error_to_wire(SpecMismatch("leaf 'w': shape (3,) != (4,)"))
      (31, "leaf 'w': shape (3,) != (4,)")
      >>> error_to_wire(KeyError("x"))
      (40, 'internal error (KeyError)')
    """
    if isinstance(error, HpsError):
        message = error.message or type(error).__name__
        return error.code, message[:MAX_ERROR_MESSAGE_CHARS]
    return ServerError.code, f"internal error ({type(error).__name__})"


def error_from_wire(code: int, message: str) -> HpsError:
    """Builds the exception a peer reported with ``code`` and ``message``.

    Args:
      code: numeric error code from an ``ERROR`` frame.
      message: its message.

    Returns:
      An instance of the class registered for ``code`` with ``remote=True``; a
      ``ServerError`` keeping ``code`` when the code is unknown.

    Examples:
      >>> err = error_from_wire(20, "wrong secret")
      >>> type(err).__name__, err.remote, str(err)
      ('AuthError', True, 'peer: wrong secret')
      >>> error_from_wire(999, "new in a later version").code
      999
    """
    message = str(message)[:MAX_ERROR_MESSAGE_CHARS]
    cls = _BY_CODE.get(int(code))
    if cls is None:
        return ServerError(message, remote=True, code=int(code))
    return cls(message, remote=True)
