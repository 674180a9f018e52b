"""Worker ids the server assigns: a HELLO without ``worker_id`` gets the lowest
free id in its AUTH_OK (PROTOCOL.md, HELLO and AUTH_OK), never one handed out
before, and the client keeps it for its reconnects; clients that send an id
are served as before."""

import os

import pytest
from _servers import SECRET, Raw, _client, _run, _server, _update

from hpsjax.decisions import free_worker_id
from hpsjax.net import _auth
from hpsjax.wire import Hello, MalformedMetadata, ProtocolError
from hpsjax.wire._frames import MsgType


def test_the_lowest_free_id_skips_seen_connected_and_assigned_ids():
    assert free_worker_id() == 0
    assert free_worker_id({0: None, 1: None}, [3], {2}) == 4
    assert free_worker_id({"w0": None, "0": None}) == 0  # other names than ints
    assert free_worker_id({1: None}) == 0


def test_a_hello_without_an_id_asks_for_one():
    hello = Hello.from_wire({"nonce": bytes(32), "client": "x"})
    assert hello.worker_id is None and "worker_id" not in hello.to_wire()
    with pytest.raises(MalformedMetadata, match="malformed HELLO"):
        Hello.from_wire({"worker_id": 1.5, "nonce": bytes(32)})
    with pytest.raises(MalformedMetadata, match="worker_id is nil"):
        Hello.from_wire({"worker_id": None, "nonce": bytes(32)})

    def auth_ok():
        """Both ends up to the server's AUTH_OK, which the client has not read."""
        client = _auth.Handshake.client(SECRET, None)
        server = _auth.Handshake.server(SECRET)
        step = server.receive(*client.hello())
        return client, server, server.receive(*client.receive(*step))

    # Both ends prove over the id HELLO sent (none); the AUTH_OK names the id.
    client, server, (msg_type, meta) = auth_ok()
    assert server.ready and server.worker_id is None
    assert client.receive(msg_type, {**meta, "worker_id": 7}) is None
    assert client.ready and client.worker_id == 7
    client, _, (msg_type, meta) = auth_ok()
    with pytest.raises(ProtocolError, match="asked the server for a worker id"):
        client.receive(msg_type, meta)  # a server that assigned none


def test_clients_without_ids_get_their_own_and_keep_them():
    async def main():
        async with _server("asp") as server:
            explicit = _client(server, 1)
            first, second = _client(server, None), _client(server, None)
            await explicit.connect()
            await first.connect()
            await second.connect()
            assert (first.worker_id, second.worker_id) == (0, 2)
            for c in (explicit, first, second):
                _, version = await c.pull()
                await c.push(_update(0.1), version=version)
            assert set(server.core.live) == {0, 1, 2}
            # A reconnect is the same worker: the same id, no new one.
            await first.close()
            await first.connect()
            assert first.worker_id == 0
            await first.pull()
            # An id once assigned is never handed out again, even once free.
            await second.close()
            third = _client(server, None)
            await third.connect()
            assert third.worker_id == 3
            for c in (explicit, first, third):
                await c.close()

    _run(main)


def test_an_assigned_id_is_refused_to_another_worker_while_live():
    async def main():
        async with _server("asp") as server:
            asked = _client(server, None)
            await asked.connect()
            await asked.pull()
            other = _client(server, 0)
            with pytest.raises(Exception, match="belongs to a live connected worker"):
                await other.connect()
            await asked.close()

    _run(main)


def test_a_raw_hello_without_an_id_is_answered_with_one():
    async def main():
        async with _server("asp") as server:
            # A HELLO without worker_id, by hand: the proofs are over nil.
            raw = await Raw.open(server.port, handshake=False)
            nonce = os.urandom(32)
            raw.send(MsgType.HELLO, 1, {"nonce": nonce})
            challenge = (await raw.recv()).metadata["nonce"]
            proof = _auth.auth_proof(SECRET, "client", challenge, nonce, None)
            raw.send(MsgType.AUTH, 2, {"proof": proof})
            ok = await raw.recv()
            assert ok.msg_type == MsgType.AUTH_OK and ok.metadata["worker_id"] == 0
            assert ok.metadata["proof"] == _auth.auth_proof(
                SECRET, "server", challenge, nonce, None
            )
            named = await Raw.open(server.port, handshake=False)
            ok = await named.handshake(5, SECRET)
            assert "worker_id" not in ok.metadata
            await raw.close()
            await named.close()

    _run(main)
