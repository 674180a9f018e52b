"""What the loopback tests of the server and its clients share: a small server,
a client of it, a coroutine runner with a deadline, and a raw connection driven
frame by frame for malformed input."""

import asyncio
import contextlib
import os

import jax.numpy as jnp
import numpy as np
import optax

from hpsjax.net import _auth
from hpsjax.net._client import Client
from hpsjax.net._server import Server
from hpsjax.wire import _frames
from hpsjax.wire._errors import ConnectionClosed
from hpsjax.wire._frames import MsgType
from hpsjax.wire._stream import FrameDecoder

try:
    import uvloop
except ImportError:  # the plain loop is tested either way
    uvloop = None

SECRET = b"test secret"


def _params():
    return {
        "b": jnp.zeros(3, jnp.float32),
        "w": jnp.zeros((4, 3), jnp.float32),
    }


def _update(value, like=None):
    like = _params() if like is None else like
    return {k: np.full(v.shape, value, np.float32) for k, v in like.items()}


def _run(make_coro, *, timeout=30.0, loop="uvloop"):
    """Runs ``make_coro()`` on a fresh loop, failing after ``timeout`` s."""

    async def guarded():
        async with asyncio.timeout(timeout):
            return await make_coro()

    if loop == "uvloop" and uvloop is not None:
        return uvloop.run(guarded())
    return asyncio.run(guarded())


def _server(policy="asp", params=None, lr=1.0, **kwargs):
    kwargs.setdefault("secret", SECRET)
    return Server(params or _params(), optax.sgd(lr), policy, **kwargs)


def _client(server, worker_id, **kwargs):
    kwargs.setdefault("secret", SECRET)
    kwargs.setdefault("timeout", 10.0)
    return Client("127.0.0.1", server.port, worker_id=worker_id, **kwargs)


def held_start(workers):
    """A ``Server``'s ``core_kwargs`` that hold its start until ``workers``
    have joined: on a loaded machine in-process workers' compiles end seconds
    apart, and the first would otherwise train alone meanwhile."""
    return {"expected_workers": workers, "start_timeout": 600.0}


def _server_params(server):
    return {k: np.asarray(v) for k, v in server.params.items()}


class Raw:
    """A connection driven by hand, frame by frame, for malformed input."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()
        self.frames = []

    @classmethod
    async def open(cls, port, *, worker_id="raw", secret=SECRET, handshake=True):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        raw = cls(reader, writer)
        if handshake:
            await raw.handshake(worker_id, secret)
        return raw

    async def handshake(self, worker_id, secret):
        nonce = os.urandom(32)
        self.send(MsgType.HELLO, 1, {"worker_id": worker_id, "nonce": nonce})
        challenge = await self.recv()
        assert challenge.msg_type == MsgType.CHALLENGE
        proof = _auth.auth_proof(
            secret, "client", challenge.metadata["nonce"], nonce, worker_id
        )
        self.send(MsgType.AUTH, 2, {"proof": proof})
        ok = await self.recv()
        assert ok.msg_type == MsgType.AUTH_OK, ok
        return ok

    def send(self, msg_type, request_id, meta=None, buffers=()):
        for part in _frames.encode_frame(msg_type, request_id, meta, buffers):
            self.writer.write(bytes(part))

    def send_bytes(self, data):
        self.writer.write(data)

    async def recv(self, timeout=10.0):
        async with asyncio.timeout(timeout):
            while not self.frames:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise ConnectionClosed("raw connection closed")
                self.frames.extend(self.decoder.feed(data))
        return self.frames.pop(0)

    async def expect_error(self, code, request_id=None):
        frame = await self.recv()
        assert frame.msg_type == MsgType.ERROR, frame
        assert frame.metadata["code"] == code, frame.metadata
        if request_id is not None:
            assert frame.request_id == request_id
        return frame.metadata["message"]

    async def expect_closed(self, timeout=10.0):
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(1 << 16)
                except ConnectionResetError:
                    return
                if not data:
                    return

    async def close(self):
        self.writer.close()
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            await self.writer.wait_closed()
