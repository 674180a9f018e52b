"""The network: the asyncio parameter server, its clients, server shards and auth.

The asyncio :class:`Server` moves bytes and carries out what the server's decisions
(:mod:`hpsjax.decisions`) return; :class:`Client` is a worker's side of one
connection, and :class:`ShardedClient` talks to several server shards at once, a
model split by key range (:class:`KeyRangePartition`, ps-lite and PHub). Both
ends authenticate with a shared secret by challenge and response (a secret never
crosses the wire) and may use TLS; frames travel through one
:class:`FrameProtocol` in the wire's format (:mod:`hpsjax.wire`).
"""

from hpsjax.net._auth import (
    AUTH_SCHEME,
    NONCE_BYTES,
    Handshake,
    HandshakeState,
    auth_proof,
    check_worker_id,
    read_secret,
    secret_bytes,
)
from hpsjax.net._client import (
    Client,
    ServerInfo,
    Subscription,
)
from hpsjax.net._connection import (
    FrameProtocol,
    error_frame,
)
from hpsjax.net._partition import (
    KeyRangePartition,
)
from hpsjax.net._server import (
    Server,
    is_loopback,
)
from hpsjax.net._shards import (
    ShardedClient,
    ShardedVersion,
)

__all__ = [
    "AUTH_SCHEME",
    "NONCE_BYTES",
    "Client",
    "FrameProtocol",
    "Handshake",
    "HandshakeState",
    "KeyRangePartition",
    "Server",
    "ServerInfo",
    "ShardedClient",
    "ShardedVersion",
    "Subscription",
    "auth_proof",
    "check_worker_id",
    "error_frame",
    "is_loopback",
    "read_secret",
    "secret_bytes",
]
