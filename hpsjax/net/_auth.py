"""Authentication: the HMAC challenge-response handshake, sans I/O, for both ends.

A connection starts with three exchanges (PROTOCOL.md)::

    client                                server
    HELLO {worker_id, nonce, client}  ->
                                      <-  CHALLENGE {nonce, auth}
    AUTH {proof}                      ->
                                      <-  AUTH_OK {proof, info[, worker_id]}

A HELLO without a ``worker_id`` asks the server for one: the AUTH_OK names
the id it assigned (the proofs are over the id HELLO sent, ``nil``).

Each side proves it knows the shared secret (:func:`auth_proof`); the secret
never crosses the wire. :class:`Handshake` holds the rules of both ends as one
state machine: the client and the server feed it the frames they receive and
send the frames it returns. It does no I/O.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import msgpack

from hpsjax.wire import (
    NONCE_BYTES,
    AuthError,
    Challenge,
    Hello,
    MalformedMetadata,
    MsgType,
    Proof,
    ProtocolError,
    UnexpectedMessage,
)

__all__ = [
    "AUTH_SCHEME",
    "NONCE_BYTES",
    "Handshake",
    "HandshakeState",
    "auth_proof",
    "check_worker_id",
    "read_secret",
    "secret_bytes",
]

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
    worker_id: str | int | None,
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
      worker_id: the worker id sent in HELLO (``None`` where it sent none).

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


def secret_bytes(secret: bytes | str | None) -> bytes | None:
    """The shared secret as bytes (a str is UTF-8 encoded), or ``None``.

    Raises:
      ValueError: an empty secret, or one of another type.
    """
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise ValueError("secret must be non-empty bytes or str")
    return secret


def check_worker_id(worker_id: Any) -> None:
    """Checks a worker id: a str of 1 to 256 UTF-8 bytes or a 64-bit int.

    Raises:
      ValueError: naming what is wrong.
    """
    if isinstance(worker_id, bool) or not isinstance(worker_id, (str, int)):
        raise ValueError(f"worker_id must be a str or int, got {worker_id!r}")
    if isinstance(worker_id, str) and not 0 < len(worker_id.encode()) <= 256:
        raise ValueError("worker_id must be 1 to 256 bytes of UTF-8")
    if isinstance(worker_id, int) and not -(2**63) <= worker_id < 2**63:
        raise ValueError("an int worker_id must fit in 64 bits")


class HandshakeState(enum.Enum):
    """Where a connection is in the handshake: the message it waits for.

    A client goes ``HELLO`` (nothing sent yet) -> ``CHALLENGE`` -> ``AUTH_OK``
    -> ``READY``; a server goes ``HELLO`` -> ``AUTH`` -> ``READY``. A refused
    handshake ends in ``FAILED``.
    """

    HELLO = "hello"
    CHALLENGE = "challenge"
    AUTH = "auth"
    AUTH_OK = "auth_ok"
    READY = "ready"
    FAILED = "failed"


_EXPECTS = {
    HandshakeState.CHALLENGE: MsgType.CHALLENGE,
    HandshakeState.AUTH: MsgType.AUTH,
    HandshakeState.AUTH_OK: MsgType.AUTH_OK,
}

Reply = tuple[MsgType, dict[str, Any]]


class Handshake:
    """One end of the handshake, as a state machine that does no I/O.

    The client calls :meth:`hello` and sends the frame it returns; each end
    then passes every frame it receives to :meth:`receive` and sends the frame
    that returns, if any, until :attr:`ready`. A frame out of order, malformed
    metadata or a wrong proof raises, and the connection should be closed.

    Build one with :meth:`client` or :meth:`server`.

    Examples:
      >>> client = Handshake.client(b"k", "w0")
      >>> server = Handshake.server(b"k")
      >>> msg_type, meta = client.hello()
      >>> msg_type, meta = server.receive(msg_type, meta)
      >>> msg_type.name, server.state.name
      ('CHALLENGE', 'AUTH')
      >>> msg_type, meta = client.receive(msg_type, meta)
      >>> msg_type, meta = server.receive(msg_type, meta)
      >>> client.receive(msg_type, meta), client.ready, server.worker_id
      (None, True, 'w0')
    """

    def __init__(
        self,
        role: str,
        secret: bytes | None,
        worker_id: Any = None,
        instance: bytes | None = None,
    ):
        if role not in _PROOF_LABELS:
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        self._role = role
        self._secret = secret
        self.worker_id = worker_id
        # The client's connections' common token (HELLO's ``instance``).
        self.instance = instance
        self.state = HandshakeState.HELLO
        self._client_nonce = b""
        self._server_nonce = b""

    @classmethod
    def client(
        cls, secret: bytes | None, worker_id: Any, instance: bytes | None = None
    ) -> Handshake:
        """The client's end: ``worker_id`` introduces itself (``None`` asks
        the server for an id, :attr:`worker_id` once ready), ``secret`` or
        none; ``instance`` is the token all of this client's connections send."""
        if worker_id is not None:
            check_worker_id(worker_id)
        return cls("client", secret, worker_id, instance)

    @classmethod
    def server(cls, secret: bytes | None) -> Handshake:
        """The server's end: it asks every client for ``secret`` (unless ``None``)."""
        return cls("server", secret)

    @property
    def ready(self) -> bool:
        """Whether both ends have authenticated."""
        return self.state is HandshakeState.READY

    @property
    def expects(self) -> MsgType | None:
        """The message this end waits for next, ``None`` when it waits for none."""
        if self._role == "server" and self.state is HandshakeState.HELLO:
            return MsgType.HELLO
        return _EXPECTS.get(self.state)

    def hello(self) -> Reply:
        """The client's HELLO, which opens the handshake."""
        if self._role != "client" or self.state is not HandshakeState.HELLO:
            raise RuntimeError("only a client that has not started sends HELLO")
        self._client_nonce = os.urandom(NONCE_BYTES)
        self.state = HandshakeState.CHALLENGE
        hello = Hello(
            self.worker_id, self._client_nonce, client="hpsjax", instance=self.instance
        )
        return MsgType.HELLO, hello.to_wire()

    def receive(self, msg_type: MsgType, metadata: Mapping[str, Any]) -> Reply | None:
        """Takes a received handshake frame; returns the frame to answer with.

        Args:
          msg_type: the received frame's type.
          metadata: its metadata.

        Returns:
          ``(message type, metadata)`` to send, or ``None`` (the client, once
          the server has proved itself). A server adds its ``info`` to the
          AUTH_OK it returns.

        Raises:
          UnexpectedMessage: not the message this state waits for.
          MalformedMetadata, ProtocolError: the metadata are unusable.
          AuthError: a wrong proof, or the ends disagree on authenticating.
        """
        step = self._STEPS.get((self._role, self.state))
        if step is None or msg_type != self.expects:
            self.state, state = HandshakeState.FAILED, self.state
            raise UnexpectedMessage(
                f"{msg_type.name} during the handshake (state {state.value})"
            )
        try:
            return step(self, metadata)
        except Exception:
            self.state = HandshakeState.FAILED
            raise

    def _proof(self, role: str) -> bytes:
        return auth_proof(
            self._secret, role, self._server_nonce, self._client_nonce, self.worker_id
        )

    def _server_hello(self, meta: Mapping[str, Any]) -> Reply:
        hello = Hello.from_wire(meta)
        try:
            if hello.worker_id is not None:  # else the server assigns one
                check_worker_id(hello.worker_id)
        except ValueError as e:
            raise MalformedMetadata(str(e)) from None
        self.worker_id = hello.worker_id
        self.instance = hello.instance
        self._client_nonce = hello.nonce
        self._server_nonce = os.urandom(NONCE_BYTES)
        self.state = HandshakeState.AUTH
        auth = AUTH_SCHEME if self._secret else None
        return MsgType.CHALLENGE, Challenge(self._server_nonce, auth).to_wire()

    def _client_challenge(self, meta: Mapping[str, Any]) -> Reply:
        challenge = Challenge.from_wire(meta, ProtocolError)
        server_nonce, scheme = challenge.nonce, challenge.auth
        if scheme is None and self._secret is not None:
            raise AuthError("server does not authenticate; refusing to trust it")
        if scheme is not None and scheme != AUTH_SCHEME:
            raise AuthError(f"unsupported auth scheme {scheme!r}")
        if scheme is not None and self._secret is None:
            raise AuthError("server requires a secret and none was given")
        self._server_nonce = server_nonce
        self.state = HandshakeState.AUTH_OK
        proof = b"" if self._secret is None else self._proof("client")
        return MsgType.AUTH, Proof(proof).to_wire()

    def _server_auth(self, meta: Mapping[str, Any]) -> Reply:
        proof = b""
        if self._secret is not None:
            got = Proof.from_wire(meta, AuthError).proof
            if not hmac.compare_digest(got, self._proof("client")):
                raise AuthError("authentication failed")
            proof = self._proof("server")
        self.state = HandshakeState.READY
        return MsgType.AUTH_OK, Proof(proof).to_wire()

    def _client_auth_ok(self, meta: Mapping[str, Any]) -> None:
        if self._secret is not None:
            got = Proof.from_wire(meta, AuthError).proof
            if not hmac.compare_digest(got, self._proof("server")):
                raise AuthError("server failed to prove it knows the secret")
        if self.worker_id is None:
            assigned = meta.get("worker_id")
            try:
                check_worker_id(assigned)
            except ValueError:
                raise ProtocolError(
                    f"asked the server for a worker id and got {assigned!r} "
                    "(a server that assigns none needs one given)"
                ) from None
            self.worker_id = assigned
        self.state = HandshakeState.READY

    _STEPS: ClassVar[dict[tuple[str, HandshakeState], Callable]] = {
        ("server", HandshakeState.HELLO): _server_hello,
        ("client", HandshakeState.CHALLENGE): _client_challenge,
        ("server", HandshakeState.AUTH): _server_auth,
        ("client", HandshakeState.AUTH_OK): _client_auth_ok,
    }


def read_secret(path: str | os.PathLike | None) -> bytes | None:
    """The shared secret in the file at ``path``: its text, stripped of
    surrounding whitespace (PROTOCOL.md: not a base64 decoding); ``None``
    for no file. An empty file is a ``ValueError`` in one line."""
    if path is None:
        return None
    secret = pathlib.Path(path).read_bytes().strip()
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret
