"""Authentication: the HMAC proof of knowing the shared secret."""

from __future__ import annotations

import hashlib
import hmac

import msgpack

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
