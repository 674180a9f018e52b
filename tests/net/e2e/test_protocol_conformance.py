"""PROTOCOL.md checked against a real server by a client written from it alone.

The client below speaks to an in-process :class:`hpsjax.ps.Server` on loopback
through plain sockets, ``struct``, ``msgpack`` and ``numpy``: no hpsjax client,
frame or tree code. Each test names the section (or the point of the protocol)
it checks; every refusal is checked for its code, its request id, what it does
to the connection, and that the parameters (pulled raw, through a
subscription, which joins nobody) did not change.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from typing import Any, NamedTuple

import msgpack
import numpy as np
import optax
import pytest

from hpsjax.ps import Server, WireLimits

# ------------------------------------------------ the client, from the document

HEADER = struct.Struct("<4sBBHIIQ")  # section 1
MAGIC = b"HPSJ"
(
    HELLO, CHALLENGE, AUTH, AUTH_OK, INFO, NOTICE, PULL, PARAMS, PUSH, PUSH_ACK,
    PUSH_PULL, SUBSCRIBE, ERROR, BYE,
) = range(1, 15)  # fmt: skip
DTYPES = {  # section 2.3
    "bool": "|b1", "int8": "|i1", "uint8": "|u1", "int16": "<i2", "uint16": "<u2",
    "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8",
    "float16": "<f2", "float32": "<f4", "float64": "<f8",
}  # fmt: skip
SECRET = b"Y29uZm9ybWFuY2Ugc2VjcmV0"  # text that happens to be base64
CLIENT_LABEL = b"hpsjax-v1 client proof"
SERVER_LABEL = b"hpsjax-v1 server proof"


def pack(meta: Any) -> bytes:
    return msgpack.packb(meta, use_bin_type=True)


def header(msg_type, rid, meta_len, payload_len, *, magic=MAGIC, version=1, flags=0):
    return HEADER.pack(magic, version, msg_type, flags, rid, meta_len, payload_len)


def frame(msg_type: int, rid: int, meta: Any = None, payload: bytes = b"") -> bytes:
    body = b"" if meta is None else pack(meta)
    return header(msg_type, rid, len(body), len(payload)) + body + payload


class Frame(NamedTuple):
    type: int
    rid: int
    meta: dict
    payload: bytes


class Conn:
    """One connection; requests numbered 1, 2, 3, ... (section 5)."""

    def __init__(self, port: int, worker_id: Any = None, *, secret=SECRET):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.next_id = 1
        self.info = None
        if worker_id is not None:
            self.info = self.handshake(worker_id, secret)

    def rid(self) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        return rid

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, msg_type: int, meta: Any = None, payload: bytes = b"") -> int:
        rid = self.rid()
        self.sock.sendall(frame(msg_type, rid, meta, payload))
        return rid

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError(f"stream ended after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)

    def recv(self) -> Frame:
        magic, version, t, flags, rid, m, p = HEADER.unpack(self._exact(HEADER.size))
        assert (magic, version, flags) == (MAGIC, 1, 0)
        meta = msgpack.unpackb(self._exact(m), raw=False) if m else {}
        assert isinstance(meta, dict)
        return Frame(t, rid, meta, self._exact(p))

    def reply(self, rid: int, skip=(NOTICE,)) -> Frame:
        """The answer to ``rid``, passing unasked frames of the types in ``skip``."""
        while True:
            f = self.recv()
            if f.rid == rid:
                return f
            assert f.rid == 0 and f.type in skip, f

    def expect_error(self, code: int, rid: int) -> str:
        f = self.recv()
        assert (f.type, f.rid, f.meta.get("code")) == (ERROR, rid, code), f
        assert isinstance(f.meta["message"], str) and len(f.meta["message"]) <= 512
        assert "Traceback" not in f.meta["message"]
        return f.meta["message"]

    def expect_closed(self) -> None:
        self.sock.settimeout(10)
        assert self.sock.recv(1) == b""

    def handshake(self, worker_id: Any, secret: bytes, *, rid=1) -> dict:
        """Section 4: HELLO, CHALLENGE, AUTH (a request of its own), AUTH_OK."""
        n_c = os.urandom(32)
        self.send_bytes(frame(HELLO, rid, {"worker_id": worker_id, "nonce": n_c}))
        challenge = self.recv()
        assert (challenge.type, challenge.rid) == (CHALLENGE, rid), challenge
        assert challenge.meta["auth"] == "hmac-sha256"
        n_s = challenge.meta["nonce"]
        w = pack(worker_id)  # msgpack packs canonically (shortest form)
        proof = hmac.new(secret, CLIENT_LABEL + n_s + n_c + w, hashlib.sha256)
        self.next_id = rid + 1
        auth_rid = self.send(AUTH, {"proof": proof.digest()})
        ok = self.recv()
        assert (ok.type, ok.rid) == (AUTH_OK, auth_rid), ok
        want = hmac.new(secret, SERVER_LABEL + n_s + n_c + w, hashlib.sha256)
        assert hmac.compare_digest(ok.meta["proof"], want.digest())
        return ok.meta["info"]

    def bye(self) -> None:
        self.send_bytes(frame(BYE, 0, {"reason": "done"}))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


# Trees (section 2): a flat map model {"name": array}, leaves in key order.


def tree_of(names) -> list:
    return ["d", {k: i for i, k in enumerate(sorted(names))}]


def raw_tree(params: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    leaves, chunks, offset = [], [], 0
    for k in sorted(params):
        a = np.ascontiguousarray(params[k])
        name = next(n for n, d in DTYPES.items() if np.dtype(d) == a.dtype)
        leaves.append([name, list(a.shape), offset, a.nbytes])
        chunks.append(a.astype(a.dtype.newbyteorder("<")).tobytes())
        offset += a.nbytes
    return {"tree": tree_of(params), "leaves": leaves, "codec": None}, b"".join(chunks)


def read_tree(meta: dict, payload: bytes) -> dict[str, np.ndarray]:
    tag, body = meta["tree"]
    assert tag == "d" and meta["codec"] is None
    out = {}
    for key, index in body.items():
        name, shape, offset, nbytes = meta["leaves"][index]
        data = payload[offset : offset + nbytes]
        out[key] = np.frombuffer(data, DTYPES[name]).reshape(shape)
    return out


def encoded_push(version, entries, codec, parts) -> tuple[dict, bytes]:
    """A compressed push: entries ``(name, dtype, shape)`` in leaf order, and
    each leaf's buffer ``(first, second)`` (codes or indices or ``p``, then
    scales or values or ``q``)."""
    leaves, offset = [], 0
    for (_, dtype, shape), (first, second) in zip(entries, parts, strict=True):
        nbytes = len(first) + len(second)
        leaves.append([dtype, list(shape), offset, nbytes, len(first)])
        offset += nbytes
    meta = {
        "version": version,
        "tree": tree_of([name for name, _, _ in entries]),
        "leaves": leaves,
        "codec": codec,
    }
    return meta, b"".join(a + b for a, b in parts)


# ------------------------------------------------ a server on loopback


class Running:
    """An hpsjax server on 127.0.0.1, port 0, in a thread of its own."""

    def __init__(self, params, policy="asp", **kwargs):
        kwargs.setdefault("secret", SECRET)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = Server(params, optax.sgd(1.0), policy, **kwargs)
        self.call(self.server.start())
        self.port = self.server.port
        self._observers = 0

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn, *args):
        async def call():
            return fn(*args)

        return self.call(call())

    def snapshot(self) -> tuple[int, dict[str, np.ndarray]]:
        """The version and parameters, read raw by a subscriber (no join)."""
        self._observers += 1
        c = Conn(self.port, f"observer-{self._observers}")
        rid = c.send(SUBSCRIBE, {"on": True})
        reply = c.recv()  # the SUBSCRIBE reply comes before the first PARAMS
        assert (reply.type, reply.rid, reply.meta["on"]) == (SUBSCRIBE, rid, True)
        params = c.recv()
        assert (params.type, params.rid) == (PARAMS, 0)
        assert params.meta["version"] == reply.meta["version"]
        c.bye()
        return params.meta["version"], read_tree(params.meta, params.payload)

    def close(self):
        try:
            self.call(self.server.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def assert_unchanged(server: Running, before) -> None:
    version, params = server.snapshot()
    assert version == before[0]
    assert params.keys() == before[1].keys()
    for k, v in params.items():
        np.testing.assert_array_equal(v, before[1][k])


def float_params():
    rng = np.random.default_rng(0)
    return {
        "b": np.zeros(3, np.float32),
        "e": np.zeros(0, np.float32),
        "h": np.zeros((8, 6), np.float16),
        "w": rng.standard_normal((64, 48)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def asp():
    server = Running(float_params(), "asp")
    yield server
    server.close()


def pulled(c: Conn) -> tuple[int, dict[str, np.ndarray]]:
    f = c.reply(c.send(PULL, {}))
    assert f.type == PARAMS
    return f.meta["version"], read_tree(f.meta, f.payload)


def push_zero(c: Conn, version: int, params) -> Frame:
    meta, payload = raw_tree({k: np.zeros_like(v) for k, v in params.items()})
    ack = c.reply(c.send(PUSH, {"version": version, **meta}, payload))
    assert ack.type == PUSH_ACK, ack
    return ack


# ------------------------------------------------ the defect: section 6


def test_a_dropped_worker_push_gets_42_and_its_next_pull_rejoins():
    params = {"w": np.zeros(4, np.float32)}
    core_kwargs = {"initial_timeout": 0.5, "min_timeout": 0.2}
    server = Running(params, "bsp", core_kwargs=core_kwargs)
    try:
        a, b = Conn(server.port, "a"), Conn(server.port, "b")
        (va, _), (vb, _) = pulled(a), pulled(b)
        # One round together.
        for c, v in ((a, va), (b, vb)):
            push_zero(c, v, params)
        (va, _), (vb, _) = pulled(a), pulled(b)
        assert va == vb == 1
        # A pushes the next round and waits; B stays silent until dropped.
        push_zero(a, va, params)
        rid = a.send(PULL, {})
        notice = b.recv()
        assert (notice.type, notice.rid, notice.meta["code"]) == (ERROR, 0, 42)
        assert a.reply(rid).type == PARAMS  # the round went on without B
        before = server.snapshot()
        meta, payload = raw_tree({"w": np.ones(4, np.float32)})
        rid = b.send(PUSH, {"version": vb, **meta}, payload)
        assert "not live" in b.expect_error(42, rid)  # not 17: B had pulled
        assert_unchanged(server, before)
        # Its next PULL rejoins it.
        assert pulled(b)[0] == before[0]
        assert "b" in server.server.core.live
        a.bye()
        b.bye()
    finally:
        server.close()


def test_a_push_before_the_first_pull_gets_17(asp):
    before = asp.snapshot()
    c = Conn(asp.port, "no-pull")
    meta, payload = raw_tree(float_params())
    rid = c.send(PUSH, {"version": 0, **meta}, payload)
    c.expect_error(17, rid)
    assert pulled(c)[0] == before[0]  # kept
    assert_unchanged(asp, before)
    c.bye()


# ------------------------------------------------ point 1: PowerSGD decoding


def decode_powersgd(p: np.ndarray, q: np.ndarray, dtype: str) -> np.ndarray:
    """Section 2.6, to the letter: the terms added in order of j, each product
    and each sum a float32 operation (numpy's float32 ufuncs round each one,
    IEEE binary32, round to nearest even), then the cast."""
    p, q = p.astype(np.float32), q.astype(np.float32)
    m = np.multiply(p[:, 0][:, None], q[:, 0][None, :])
    for j in range(1, p.shape[1]):
        m = np.add(m, np.multiply(p[:, j][:, None], q[:, j][None, :]))
    return m.astype(DTYPES[dtype])


def test_powersgd_push_decodes_bit_for_bit_as_the_document_says():
    rng = np.random.default_rng(7)
    params = {"b": np.zeros(5, np.float32), "w": np.zeros((96, 80), np.float32)}
    params["h"] = np.zeros((12, 10), np.float16)
    server = Running(params, "asp")
    try:
        c = Conn(server.port, "psgd")
        version, _ = pulled(c)
        # Factors whose terms cancel: sums where the order of the rounding shows.
        r = 4
        p = rng.standard_normal((96, r)).astype(np.float32)
        q = rng.standard_normal((80, r)).astype(np.float32)
        q[:, 1] = -q[:, 0] * np.float32(1.0009765625) + q[:, 1] * np.float32(1e-3)
        ph = rng.standard_normal((12, 2)).astype(np.float16)
        qh = rng.standard_normal((10, 2)).astype(np.float16)
        b = rng.standard_normal(5).astype(np.float32)
        entries = [("b", "float32", (5,)), ("h", "float16", (12, 10))]
        entries.append(("w", "float32", (96, 80)))
        parts = [(b.tobytes(), b""), (ph.tobytes(), qh.tobytes())]
        parts.append((p.tobytes(), q.tobytes()))
        codec = {"scheme": "powersgd", "rank": [0, 2, r]}
        meta, payload = encoded_push(version, entries, codec, parts)
        ack = c.reply(c.send(PUSH, meta, payload))
        assert (ack.type, ack.meta["status"]) == (PUSH_ACK, "applied"), ack
        assert isinstance(ack.meta["weight"], float)  # a msgpack float
        _, got = server.snapshot()
        # Zero parameters, plain SGD at rate 1, one push of weight 1: the
        # parameters are exactly minus the decoded update.
        want_w = decode_powersgd(p, q, "float32")
        np.testing.assert_array_equal(got["w"], -want_w)
        # As a client without float32 arithmetic would (JavaScript's
        # Math.fround): each product and sum in float64, rounded at once.
        f64 = (p[:, 0][:, None].astype(np.float64) * q[:, 0]).astype(np.float32)
        for j in range(1, r):
            term = (p[:, j][:, None].astype(np.float64) * q[:, j]).astype(np.float32)
            f64 = (f64.astype(np.float64) + term).astype(np.float32)
        np.testing.assert_array_equal(got["w"], -f64)
        np.testing.assert_array_equal(got["h"], -decode_powersgd(ph, qh, "float16"))
        np.testing.assert_array_equal(got["b"], -b)
        # The order matters here: a decoder that adds the terms otherwise (or
        # fuses them) would not agree on every element.
        other = np.zeros_like(want_w)
        for j in reversed(range(r)):
            other = other + p[:, j][:, None] * q[:, j][None, :]
        assert (other != want_w).any()
        c.bye()
    finally:
        server.close()


# ------------------------------------------------ point 2: request ids of errors


def _pulled_then(port, worker_id) -> Conn:
    c = Conn(port, worker_id)
    pulled(c)
    return c


@pytest.mark.parametrize(
    "name, data, code, rid",
    [
        ("unknown type", header(99, 7, 0, 0), 17, 7),
        ("flags", header(PULL, 8, 0, 0, flags=1), 10, 8),
        ("payload on PULL", header(PULL, 9, 0, 4) + bytes(4), 10, 9),
        ("metadata over the limit", header(PULL, 10, 2**20 + 1, 0), 11, 10),
        ("message over the limit", header(PUSH, 11, 0, 2**31 + 1), 11, 11),
        ("bad magic", header(PULL, 12, 0, 0, magic=b"HPSX"), 13, 0),
        ("bad version", header(PULL, 13, 0, 0, version=2), 12, 0),
        ("request id 0", header(PULL, 0, 0, 0), 10, 0),
    ],
)
def test_header_errors_echo_the_request_id_and_close(asp, name, data, code, rid):
    before = asp.snapshot()
    c = _pulled_then(asp.port, f"header-{name}")
    c.send_bytes(data)
    c.expect_error(code, rid)
    c.expect_closed()
    c.close()
    assert_unchanged(asp, before)


def test_frames_before_the_handshake_are_answered_under_their_own_id(asp):
    c = Conn(asp.port)
    c.send_bytes(frame(PULL, 5, {}))
    c.expect_error(17, 5)
    c.expect_closed()
    c.close()


# ------------------------------------------------ point 3: shutdown


def test_shutdown_fails_held_requests_with_41_then_says_bye():
    params = {"w": np.zeros(4, np.float32)}
    server = Running(params, "bsp", core_kwargs={"initial_timeout": 30})
    closed = False
    try:
        a, b = Conn(server.port, "a"), Conn(server.port, "b")
        (va, _), _ = pulled(a), pulled(b)
        push_zero(a, va, params)
        held = a.send(PULL, {})  # held: b has not pushed
        time.sleep(0.1)
        server.call(server.server.close())
        closed = True
        a.expect_error(41, held)
        for c in (a, b):
            bye = c.recv()
            assert (bye.type, bye.rid) == (BYE, 0)
            assert bye.meta == {"reason": "server closing"}
            c.expect_closed()
            c.close()
    finally:
        if not closed:
            server.call(server.server.close())
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(10)
        server.loop.close()


# ------------------------------------------------ point 4: handshake errors close


@pytest.mark.parametrize("worker_id", ["", "x" * 257, 2**63, True, 1.5, None])
def test_a_bad_hello_is_14_under_its_id_and_closes(asp, worker_id):
    c = Conn(asp.port)
    c.send_bytes(frame(HELLO, 3, {"worker_id": worker_id, "nonce": os.urandom(32)}))
    c.expect_error(14, 3)
    c.expect_closed()
    c.close()


def test_a_short_proof_is_20_under_the_auth_id_and_closes(asp):
    c = Conn(asp.port)
    c.send_bytes(frame(HELLO, 1, {"worker_id": "short", "nonce": os.urandom(32)}))
    assert c.recv().type == CHALLENGE
    c.send_bytes(frame(AUTH, 2, {"proof": bytes(31)}))
    c.expect_error(20, 2)
    c.expect_closed()
    c.close()


def test_the_handshake_times_out_with_20_under_id_0():
    server = Running({"w": np.zeros(2, np.float32)}, handshake_timeout=0.3)
    try:
        silent = Conn(server.port)
        half = Conn(server.port)
        half.send_bytes(frame(HELLO, 1, {"worker_id": "half", "nonce": os.urandom(32)}))
        assert half.recv().type == CHALLENGE
        for c in (silent, half):
            c.expect_error(20, 0)
            c.expect_closed()
            c.close()
    finally:
        server.close()


def test_the_pre_auth_limit_of_4096_bytes_is_inclusive(asp):
    def hello(size, rid):
        meta = {"worker_id": f"pad-{size}", "nonce": os.urandom(32), "pad": ""}
        pad = size - len(pack(meta))
        meta["pad"] = "x" * (pad - (2 if pad - 2 >= 32 else 0))  # str8 header
        body = pack(meta)
        assert len(body) == size
        return header(HELLO, rid, len(body), 0) + body

    c = Conn(asp.port)
    c.send_bytes(hello(4096, 1))
    assert c.recv().type == CHALLENGE
    c.close()
    c = Conn(asp.port)
    c.send_bytes(hello(4097, 1))
    c.expect_error(11, 1)
    c.expect_closed()
    c.close()


def test_the_secret_is_the_stripped_text_of_its_file(tmp_path):
    from hpsjax.net._auth import read_secret

    path = tmp_path / "secret.txt"
    path.write_bytes(b"  " + SECRET + b"\n")
    assert read_secret(str(path)) == SECRET  # not its base64 decoding
    # ... and SECRET is the key the handshakes of this file use.


# ------------------------------------------------ point 5: one fault, one code


QUANTIZED = [
    {"scheme": s, "bits": b, "block_size": None, "stochastic": False, "levels": lv}
    for s, b, lv in [("uniform", 8, None), ("qsgd", 4, 7), ("sign", 1, None)]
] + [{"scheme": "none", "bits": 32, "block_size": None, "stochastic": False,
      "levels": None}]  # fmt: skip


def _int_model_push(version, codec) -> tuple[dict, bytes]:
    """A compressed push to {"n": int32[4, 4], "w": float32[4, 4]}."""
    entries = [("n", "int32", (4, 4)), ("w", "float32", (4, 4))]
    scheme = codec["scheme"]
    if scheme == "topk":
        part = (np.arange(2, dtype="<u2").tobytes(), bytes(8))
        return encoded_push(version, entries, {**codec, "k": [2, 2]}, [part, part])
    if scheme == "powersgd":
        part = (bytes(16), bytes(16))
        return encoded_push(version, entries, {**codec, "rank": [1, 1]}, [part, part])
    d = 16
    codes = -(-d * codec["bits"] // 8)
    scales = b"" if scheme == "none" else bytes(4)
    return encoded_push(version, entries, codec, [(bytes(codes), scales)] * 2)


def test_a_compressed_push_to_an_integer_leaf_is_14_for_every_codec():
    params = {"n": np.arange(16, dtype=np.int32).reshape(4, 4)}
    params["w"] = np.ones((4, 4), np.float32)
    server = Running(params, "asp")
    try:
        c = Conn(server.port, "int-model")
        version, _ = pulled(c)
        before = server.snapshot()
        for codec in [*QUANTIZED, {"scheme": "topk"}, {"scheme": "powersgd"}]:
            meta, payload = _int_model_push(version, codec)
            rid = c.send(PUSH, meta, payload)
            assert "floating" in c.expect_error(14, rid)
            assert_unchanged(server, before)
        # Point 7: a raw push to an integer leaf is applied, through the
        # optimizer, and cast back to the leaf's dtype.
        n = np.full((4, 4), 2, np.int32)
        meta, payload = raw_tree({"n": n, "w": np.zeros((4, 4), np.float32)})
        ack = c.reply(c.send(PUSH, {"version": version, **meta}, payload))
        assert ack.meta["status"] == "applied"
        _, after = server.snapshot()
        np.testing.assert_array_equal(after["n"], params["n"] - n)
        assert after["n"].dtype == np.int32
        c.bye()
    finally:
        server.close()


# ------------------------------------------------ point 6: limits (section 8)


def test_max_leaves_and_the_metadata_limit():
    limits = WireLimits(max_leaves=4)
    params = {k: np.zeros(2, np.float32) for k in "abcd"}
    server = Running(params, "asp", limits=limits)
    try:
        c = Conn(server.port, "leaves")
        assert c.info["limits"]["max_leaves"] == 4
        version, _ = pulled(c)
        before = server.snapshot()
        meta, payload = raw_tree({k: np.zeros(2, np.float32) for k in "abcde"})
        rid = c.send(PUSH, {"version": version, **meta}, payload)
        c.expect_error(15, rid)
        assert pulled(c)[0] == version  # kept
        assert_unchanged(server, before)
        c.bye()
    finally:
        server.close()

    # Section 8's figures: the most 0-d leaves of a list whose PUSH metadata
    # fits the default 1 MiB.
    def nbytes(dtype, n):
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        meta = {
            "version": 0,
            "tree": ["l", list(range(n))],
            "leaves": [[dtype, [], i * itemsize, itemsize] for i in range(n)],
            "codec": None,
        }
        return len(pack(meta))

    for dtype, most in (("float32", 56936), ("bool", 72858)):
        assert nbytes(dtype, most) <= WireLimits().max_metadata_bytes
        assert nbytes(dtype, most + 1) > WireLimits().max_metadata_bytes


# ------------------------------------------------ point 7: the silent points


def test_empty_metadata_and_map_order(asp):
    c = Conn(asp.port, "order")
    # M = 0 for the empty map: a PULL, an INFO.
    rid = c.rid()
    c.send_bytes(header(PULL, rid, 0, 0))
    f = c.reply(rid)
    assert f.type == PARAMS
    version, params = f.meta["version"], read_tree(f.meta, f.payload)
    rid = c.rid()
    c.send_bytes(header(INFO, rid, 0, 0))
    assert c.reply(rid).type == INFO
    # Map entries in any order: a PUSH whose keys come in reverse.
    meta, payload = raw_tree({k: np.zeros_like(v) for k, v in params.items()})
    meta = dict(reversed(list({"version": version, **meta}.items())))
    assert next(iter(meta)) == "codec"
    ack = c.reply(c.send(PUSH, meta, payload))
    assert ack.type == PUSH_ACK and ack.meta["status"] == "applied"
    c.bye()


def _refused_push(server, c, version, meta, payload, code):
    before = server.snapshot()
    rid = c.send(PUSH, {"version": version, **meta}, payload)
    message = c.expect_error(code, rid)
    assert pulled(c)[0] == before[0]  # the connection is kept
    assert_unchanged(server, before)
    return message


def test_tree_description_refusals(asp):
    c = Conn(asp.port, "trees")
    version, params = pulled(c)
    meta, payload = raw_tree(params)
    # Leaf indices out of key order.
    swapped = {**meta, "tree": ["d", {"b": 1, "e": 0, "h": 2, "w": 3}]}
    _refused_push(asp, c, version, swapped, payload, 14)
    # Depth: the root is at depth 0; a leaf at depth 64 passes the depth check
    # (then differs from the model: 31), one at 65 is refused with 15.
    for depth, code in ((64, 31), (65, 15)):
        node: Any = 0
        for _ in range(depth):
            node = ["l", [node]]
        one = {"tree": node, "leaves": [["float32", [3], 0, 12]], "codec": None}
        _refused_push(asp, c, version, one, bytes(12), code)
    # A shape of more than max_rank (32) dimensions.
    deep = [1] * 33
    leaves = [list(e) for e in meta["leaves"]]
    leaves[0] = ["float32", deep, 0, 4]
    offset = 4
    for e in leaves[1:]:
        e[2] = offset
        offset += e[3]
    bad = {**meta, "leaves": leaves}
    _refused_push(asp, c, version, bad, bytes(4) + payload[12:], 14)
    c.bye()


def test_scales_of_an_empty_leaf(asp):
    c = Conn(asp.port, "empty-leaf")
    version, params = pulled(c)
    names = sorted(params)
    entries = [(k, str(params[k].dtype), params[k].shape) for k in names]

    def push(block_size, empty_scales):
        codec = dict(QUANTIZED[0], block_size=block_size)
        parts = []
        for k in names:
            d = params[k].size
            if k == "e":
                parts.append((b"", bytes(4 * empty_scales)))
                continue
            n_s = 1 if block_size is None else -(-d // block_size)
            parts.append((np.full(d, 127, np.uint8).tobytes(), bytes(4 * n_s)))
        return encoded_push(version, entries, codec, parts)

    # Without block_size an empty leaf still has its one scale; with one it
    # has ceil(0 / block_size) = 0.
    for block_size, n_s in ((None, 1), (16, 0)):
        meta, payload = push(block_size, n_s)
        ack = c.reply(c.send(PUSH, meta, payload))
        assert ack.type == PUSH_ACK, ack
        meta, payload = push(block_size, 1 - n_s)
        _refused_push(asp, c, version, meta, payload, 14)
    c.bye()


def test_client_errors_are_ignored_and_auth_ids(asp):
    c = Conn(asp.port)
    c.handshake("ids", SECRET, rid=40)  # AUTH_OK answers AUTH's id, 41
    assert c.next_id == 42
    c.send_bytes(frame(ERROR, 0, {"code": 40, "message": "client notice"}))
    c.send_bytes(frame(ERROR, 42, {"code": 1, "message": "client failed"}))
    c.next_id = 43
    rid = c.send(PULL, {})
    f = c.recv()  # nothing answered the ERRORs
    assert (f.type, f.rid) == (PARAMS, rid)
    c.bye()


def test_lr_scale_of_a_plan_is_a_float(asp):
    c = Conn(asp.port, "planned")
    asp.run(asp.server.send_plan, "planned", {"revision": 1, "lr_scale": 2})
    f = c.recv()
    assert (f.type, f.rid, f.meta["notice"]) == (NOTICE, 0, "plan")
    assert isinstance(f.meta["lr_scale"], float) and f.meta["lr_scale"] == 2.0
    c.bye()


# ------------------------------------------------ outside PROTOCOL.md


def test_the_documented_hybrid_stages_form_is_what_the_server_takes():
    import pathlib
    import re

    from hpsjax.ps import Hybrid, get_policy
    from hpsjax.ps._cli import _policy_kwargs, parse_args, server_options

    launch = pathlib.Path(__file__).resolve().parents[3] / "LAUNCH.md"
    (value,) = re.findall(r"--policy hybrid --policy_arg '([^']*)'", launch.read_text())
    args = parse_args(
        ["--init", "init.npz", "--policy", "hybrid", "--policy_arg", value]
    )
    policy = get_policy("hybrid", **_policy_kwargs(server_options(args)))
    assert isinstance(policy, Hybrid)
    stages = [
        (s.mode, s.local_steps, s.max_staleness, s.until_version) for s in policy.stages
    ]
    assert stages == [("async", 8, 16, 100), ("semi_async", 1, 2, None)]
