"""The server against hostile input: probes of known defects and a frame fuzzer."""

import asyncio
import collections
import contextlib
import gc
import os
import struct
import time
import weakref

import numpy as np
import optax
import pytest
from _servers import SECRET, Raw, _client, _params, _run, _server, _update

from hpsjax.decisions._core import ServerCore
from hpsjax.net import _auth
from hpsjax.transforms import _quantize as quantize
from hpsjax.transforms._quantize import Codec
from hpsjax.wire import _errors as errors
from hpsjax.wire import _frames, _treecodec
from hpsjax.wire._frames import Frame, MsgType
from hpsjax.wire._stream import FrameDecoder


async def _until(predicate, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------------ probes


@pytest.mark.parametrize("msg_type", [MsgType.PULL, MsgType.INFO, MsgType.PUSH])
def test_requests_under_request_id_zero_are_refused(msg_type):
    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, worker_id="zero")
            if msg_type == MsgType.PUSH:
                raw.send(MsgType.PULL, 3)
                assert (await raw.recv()).msg_type == MsgType.PARAMS
                meta, buffers, _ = _treecodec.tree_to_wire(_update(1.0))
                raw.send(msg_type, 0, {"version": 0, **meta}, buffers)
            else:
                raw.send(msg_type, 0, {})
            await raw.expect_error(errors.ProtocolError.code, request_id=0)
            await raw.expect_closed()
            await raw.close()
            assert server.version == 0

    _run(main)


def test_notices_under_request_id_zero_are_accepted():
    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, worker_id="notice")
            raw.send(MsgType.ERROR, 0, {"code": 1, "message": "client note"})
            raw.send(MsgType.PULL, 3)
            frame = await raw.recv()
            assert frame.msg_type == MsgType.PARAMS and frame.request_id == 3
            await raw.close()

    _run(main)


def test_closed_connections_are_freed_without_the_garbage_collector():
    async def main():
        async with _server("asp") as server:
            refs = []
            for i in range(3):
                raw = await Raw.open(server.port, worker_id=f"big-{i}")
                # Much metadata declared, little sent: the connection ends
                # inside the frame.
                raw.send_bytes(
                    _frames.pack_header(MsgType.PUSH, 4, 2**20, 0) + bytes(99)
                )
                await _until(lambda: len(server._connections) == 1)
                (session,) = server._connections
                refs += [weakref.ref(session), weakref.ref(session.protocol)]
                refs.append(weakref.ref(session.protocol.decoder))
                del session
                await raw.close()
                await _until(lambda: not server._connections)
            await _until(lambda: all(r() is None for r in refs), timeout=2.0)

    gc.collect()
    gc.disable()
    try:
        _run(main)
    finally:
        gc.enable()


def _codec_push(client, block_size, version):
    update = _update(0.25)
    codec = Codec("uniform", 8, block_size=block_size, stochastic=False)
    return client.push(update, codec=codec, version=version)


@pytest.fixture
def compile_decoders(monkeypatch):
    """Servers compile the decoders of even these small models."""
    from hpsjax.wire import _decoders

    monkeypatch.setattr(_decoders, "COMPILE_MIN_ELEMENTS", 0)


async def _compiled_decoders(server, n):
    # Compiles take seconds each on a loaded machine: a minute, then fail.
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        if len(server._decoders) >= n and not server._compiling:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{len(server._decoders)} decoders compiled, not {n}")


def test_compressed_push_of_a_small_model_is_decoded_without_compiling():
    async def main():
        async with _server("asp") as server:
            c = _client(server, "small")
            await c.connect()
            _, v = await c.pull()
            ack = await _codec_push(c, 5, v)
            assert ack.applied and len(server._decoders) == 0
            assert not server._compiling
            await c.close()

    _run(main)


def test_refused_compressed_push_compiles_nothing(compile_decoders):
    async def main():
        async with _server("asp") as server:
            c = _client(server, "early")
            await c.connect()
            # Before joining (code 17), then from the future (code 30).
            with pytest.raises(errors.UnexpectedMessage):
                await _codec_push(c, 5, 0)
            _, v = await c.pull()
            with pytest.raises(errors.InvalidUpdate):
                await _codec_push(c, 5, v + 1)
            assert len(server._decoders) == 0
            ack = await _codec_push(c, 5, v)
            # Applied at once (numpy decoded it); the compile runs meanwhile.
            assert ack.applied
            await _compiled_decoders(server, 1)
            await c.close()

    _run(main)


def test_decoders_of_many_codecs_stay_bounded_and_pushes_keep_their_order(
    compile_decoders,
):
    async def main():
        async with _server("asp") as server:
            # Replies queue behind the pushes before them and the compiles
            # beside: a minute, not 10 s, before one counts as lost.
            c = _client(server, "many", timeout=60.0)
            await c.connect()
            _, v = await c.pull()
            # Sent back to back: each new block size is decoded with numpy
            # while its decoder compiles, and all are applied in order.
            acks = await asyncio.gather(
                *[_codec_push(c, 1 + i, v + i) for i in range(12)]
            )
            assert [a.version for a in acks] == list(range(v + 1, v + 13))
            await _compiled_decoders(server, 8)
            assert len(server._decoders) <= 8
            for x in server.params.values():
                x = np.asarray(x)
                np.testing.assert_allclose(x, np.full(x.shape, -0.25 * 12), rtol=1e-6)
            await c.close()

    _run(main, timeout=120.0)  # eight decoders compile one after another


def test_compressed_push_with_an_invalid_code_is_refused_before_compiling():
    from hpsjax.transforms._quantize import Encoded

    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, worker_id="bad-code")
            raw.send(MsgType.PULL, 3)
            assert (await raw.recv()).msg_type == MsgType.PARAMS
            like = _update(0.0)
            encoded = [
                Encoded(np.full(x.size, 255, np.uint8), np.ones(1, np.float32))
                for x in (like["b"], like["w"])
            ]
            meta, buffers, _ = _treecodec.encoded_tree_to_wire(
                encoded, like, Codec("uniform", 8)
            )
            raw.send(MsgType.PUSH, 4, {"version": 0, **meta}, buffers)
            message = await raw.expect_error(errors.InvalidUpdate.code, request_id=4)
            assert "255" in message
            assert server.version == 0 and len(server._decoders) == 0
            await raw.close()

    _run(main)


# ------------------------------------------------------------------ probe 7


@pytest.mark.parametrize(
    "dtype, init, value, num_samples, applied",
    [
        # A sample count weighs an update, never multiplies it.
        (np.float16, 0.0, 1.0, 100_000, True),
        (np.float32, 0.0, 1e20, 2**64 - 1, True),
        (np.float32, 0.0, 3.3e38, 32, True),
        # Finite updates whose apply leaves the dtype's range.
        (np.float16, -65_000.0, 1_000.0, 100_000, False),
        (np.float32, -3e38, 1e38, 2**64 - 1, False),
        (np.float32, -1e38, 3.3e38, 32, False),
    ],
)
def test_finite_push_never_makes_the_parameters_non_finite(
    dtype, init, value, num_samples, applied
):
    async def main():
        params = {"w": np.full(3, init, dtype)}
        async with _server("asp", params=params) as server:
            c = _client(server, "hostile")
            await c.connect()
            _, v = await c.pull()
            update = {"w": np.full(3, value, dtype)}
            if applied:
                ack = await c.push(update, version=v, num_samples=num_samples)
                assert ack.applied and server.version == v + 1
                want = np.full(3, dtype(init) - dtype(value), dtype)
            else:
                with pytest.raises(errors.NonFiniteUpdate, match="non-finite"):
                    await c.push(update, version=v, num_samples=num_samples)
                assert server.version == v
                want = params["w"]
            got = np.asarray(server.params["w"])
            assert got.dtype == dtype and np.isfinite(got).all()
            np.testing.assert_array_equal(got, want)
            # The connection carries on.
            _, v = await c.pull()
            assert v == server.version
            await c.close()

    _run(main)


# ------------------------------------------------------------------ fuzzer

_NOTICES = (MsgType.ERROR, MsgType.BYE)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _codecs():
    return [
        Codec("uniform", 8, block_size=4, stochastic=False),
        Codec("uniform", 4, stochastic=False),
        Codec("sign", 1, stochastic=False),
        Codec("qsgd", 8, levels=5, stochastic=False),
        Codec("none", 32),
    ]


def _request_seeds(rng):
    """Valid frames of every request a joined worker sends: (type, meta, buffers)."""
    like = _update(0.0)
    update = {k: rng.normal(size=x.shape).astype(np.float32) for k, x in like.items()}
    meta, buffers, _ = _treecodec.tree_to_wire(update)
    extra = {"num_samples": int(rng.integers(1, 2**63)), "step_time": 0.01}
    seeds = [
        (MsgType.PULL, {}, ()),
        (MsgType.INFO, {}, ()),
        (MsgType.SUBSCRIBE, {"on": bool(rng.integers(2))}, ()),
        (MsgType.PUSH, {"version": 0, **meta}, buffers),
        (MsgType.PUSH, {"version": 0, **extra, **meta}, buffers),
        (MsgType.PUSH_PULL, {"version": 0, **meta}, buffers),
        (MsgType.ERROR, {"code": 1, "message": "note"}, ()),
        (MsgType.BYE, {"reason": "done"}, ()),
    ]
    for codec in _codecs():
        encoded = quantize.encode_tree(update, codec)
        meta, buffers, _ = _treecodec.encoded_tree_to_wire(encoded, like, codec)
        seeds.append((MsgType.PUSH, {"version": 0, **meta}, buffers))
    return seeds


def _odd_value(rng):
    choices = [
        None,
        -1,
        0,
        2**64 - 1,
        -(2**63),
        1.5,
        float("nan"),
        float("inf"),
        True,
        "x" * int(rng.integers(0, 300)),
        b"\x00" * int(rng.integers(0, 40)),
        [],
        ["d", {}],
        {"a": [1, 2]},
        [[["x"]]],
    ]
    return choices[rng.integers(len(choices))]


def _mutate_meta(rng, meta):
    """A structural mutation of a metadata map, re-encoded with valid lengths."""
    meta = dict(meta)
    op = rng.integers(4)
    key = list(meta)[rng.integers(len(meta))] if meta else "version"
    if op == 0:
        meta.pop(key, None)
    elif op == 1:
        meta[key] = _odd_value(rng)
    elif op == 2 and isinstance(meta.get("codec"), dict):
        codec = dict(meta["codec"])
        name = list(codec)[rng.integers(len(codec))]
        # Few values, so that few new codecs are compiled: most are refused.
        values = [_odd_value(rng), 0, 1, 3, 7, 8, 2**31, "uniform", "qsgd", False]
        codec[name] = values[rng.integers(len(values))]
        meta["codec"] = codec
    elif op == 2 and isinstance(meta.get("leaves"), list) and meta["leaves"]:
        leaves = [list(x) for x in meta["leaves"]]
        leaf = leaves[rng.integers(len(leaves))]
        leaf[rng.integers(len(leaf))] = _odd_value(rng)
        meta["leaves"] = leaves
    else:
        meta[f"extra{rng.integers(3)}"] = _odd_value(rng)
    return meta


def _frame_bytes(msg_type, request_id, meta, buffers):
    parts = _frames.encode_frame(msg_type, request_id, meta, buffers)
    return b"".join(bytes(p) for p in parts)


def _mutate_bytes(rng, data):
    """A byte-level mutation of an encoded frame."""
    data = bytearray(data)
    op = rng.integers(6)
    if op == 0:  # bit flips
        for _ in range(rng.integers(1, 4)):
            i = rng.integers(len(data) * 8)
            data[i // 8] ^= 1 << (i % 8)
    elif op == 1:  # random bytes, anywhere
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(len(data))] = rng.integers(256)
    elif op == 2:  # truncation
        del data[rng.integers(len(data)) :]
    elif op == 3:  # metadata length: huge, zero, off by one
        (m,) = struct.unpack_from("<I", data, 12)
        new = [2**32 - 1, 2**24, 0, m - 1, m + 1][rng.integers(5)]
        struct.pack_into("<I", data, 12, new % 2**32)
    elif op == 4:  # payload length: huge, zero, off by one
        (p,) = struct.unpack_from("<Q", data, 16)
        new = [2**64 - 1, 2**63, 2**30, 0, p - 1, p + 1][rng.integers(6)]
        struct.pack_into("<Q", data, 16, new % 2**64)
    else:  # the type byte
        data[5] = rng.integers(16)
    return bytes(data)


def _fuzzed_frame(rng, seed, request_id):
    msg_type, meta, buffers = seed
    kind = rng.integers(10)
    if kind < 3:  # valid
        return _frame_bytes(msg_type, request_id, meta, buffers)
    if kind < 5:
        return _frame_bytes(msg_type, request_id, _mutate_meta(rng, meta), buffers)
    if kind == 5:  # a wrong request id: zero, reused or random
        rid = [0, 1, request_id - 1, int(rng.integers(2**32))][rng.integers(4)]
        return _frame_bytes(msg_type, rid, meta, buffers)
    return _mutate_bytes(rng, _frame_bytes(msg_type, request_id, meta, buffers))


class _Tally:
    def __init__(self):
        self.frames = 0
        self.connections = 0
        self.acked = []  # (version, update tree)
        self.refused = 0
        self.fuzz_applied = 0


def _capped_allocator():
    allocate = _treecodec.default_allocator(_frames.DEFAULT_LIMITS)

    def capped(header, meta):
        if header.payload_length > 1 << 20:
            raise errors.PayloadTooBig("not sent whole by this test")
        return allocate(header, meta)

    return capped


def _sent_requests(chunks):
    """The requests the server reads from ``chunks``, by request id, in order."""
    decoder = FrameDecoder(allocate=_capped_allocator())
    events = []
    with contextlib.suppress(errors.HpsError):  # a bad header ends the stream
        for chunk in chunks:
            events += decoder.feed(chunk)
    requests = collections.defaultdict(collections.deque)
    for event in events:
        if isinstance(event, Frame) and event.msg_type in _NOTICES:
            continue
        if not event.request_id:
            break  # a request under id 0: the server closes the connection
        requests[event.request_id].append(event)
    return requests


def _pushed_update(frame):
    layout = frame.payload.layout
    if layout.codec is None:
        return frame.payload.tree()
    codec = Codec.from_dict(layout.codec)
    encoded = [quantize.Encoded(c, s) for c, s in frame.payload.arrays]
    return quantize.decode_tree(encoded, codec, _update(0.0))


def _record_acks(tally, sent, replies):
    """Matches the server's replies with the pushes sent and keeps the applied."""
    requests = _sent_requests(sent)
    for reply in replies:
        if not reply.request_id:
            continue
        queue = requests.get(reply.request_id)
        request = queue.popleft() if queue else None
        ack = None
        if reply.msg_type == MsgType.PUSH_ACK:
            ack = reply.metadata
        elif reply.msg_type == MsgType.PARAMS and "ack" in reply.metadata:
            ack = reply.metadata["ack"]
        if reply.msg_type == MsgType.ERROR:
            tally.refused += 1
        if ack is None:
            continue
        assert isinstance(request, Frame), (reply, request)
        assert request.msg_type in (MsgType.PUSH, MsgType.PUSH_PULL), request
        assert ack["status"] in ("applied", "dropped"), ack
        if ack["status"] == "applied":
            assert ack["weight"] == 1.0, ack
            tally.acked.append((ack["version"], _pushed_update(request)))
            tally.fuzz_applied += 1


async def _read_all(reader, timeout=60.0):
    decoder = FrameDecoder()
    frames = []
    async with asyncio.timeout(timeout):
        while True:
            try:
                data = await reader.read(1 << 16)
            except OSError:  # reset, or not connected any more
                break
            if not data:
                break
            with contextlib.suppress(errors.HpsError):
                frames.extend(decoder.feed(data))
    return frames


async def _close(raw):
    raw.writer.close()
    with contextlib.suppress(OSError):
        await raw.writer.wait_closed()


async def _send_all(raw, data):
    """Sends ``data`` then the end of the stream; returns every frame received."""
    raw.send_bytes(data)
    with contextlib.suppress(OSError):
        raw.writer.write_eof()
    replies = raw.frames + await _read_all(raw.reader)
    await _close(raw)
    return replies


async def _fuzz_handshake(rng, port, worker_id):
    """A connection whose HELLO or AUTH is mutated."""
    raw = await Raw.open(port, handshake=False)
    nonce = os.urandom(32)
    hello = (MsgType.HELLO, {"worker_id": worker_id, "nonce": nonce}, ())
    frames = 1
    if rng.integers(2):
        data = _fuzzed_frame(rng, hello, 1)
    else:
        raw.send(MsgType.HELLO, 1, hello[1])
        challenge = await raw.recv()
        proof = _auth.auth_proof(
            SECRET, "client", challenge.metadata["nonce"], nonce, worker_id
        )
        data = _fuzzed_frame(rng, (MsgType.AUTH, {"proof": proof}, ()), 2)
        frames = 2
    await _send_all(raw, data)
    return frames


async def _fuzz_session(rng, port, worker_id, seeds, tally):
    """An authenticated connection that sends a few fuzzed requests."""
    raw = await Raw.open(port, worker_id=worker_id)
    sent = []
    if rng.random() < 0.8:  # joined: pushes get past the push-before-pull check
        sent.append(_frame_bytes(MsgType.PULL, 3, {}, ()))
    for i in range(int(rng.integers(1, 13))):
        frame = _fuzzed_frame(rng, seeds[rng.integers(len(seeds))], 4 + i)
        sent.append(frame)
        if rng.random() < 0.1:  # duplicated
            sent.append(frame)
    data = b"".join(sent)
    replies = await _send_all(raw, data)
    _record_acks(tally, sent, replies)
    return len(sent)


# A healthy worker's round (a pull and a push) beside the fuzzing lanes: at most
# this much of the test process's CPU time, and answered within HANG_S.
HEALTHY_CPU_S = 2.0
HANG_S = 120.0


async def _fuzz(server, rng, connections, tally, *, lanes=4, check_every=50):
    seeds = _request_seeds(rng)
    good = _client(server, "good", timeout=HANG_S)
    await good.connect()
    await good.pull()
    lane_rngs = rng.spawn(lanes)
    done = asyncio.Event()
    latencies = []

    async def lane(k):
        r = lane_rngs[k]
        for n in range(connections // lanes):
            worker_id = f"fuzz-{r.integers(6)}"
            if r.random() < 0.1:
                frames = await _fuzz_handshake(r, server.port, worker_id)
            else:
                frames = await _fuzz_session(r, server.port, worker_id, seeds, tally)
            tally.frames += frames
            tally.connections += 1
            if n % check_every == 0:
                await asyncio.sleep(0)

    async def healthy():
        # A healthy worker pulls and pushes throughout, each round answered
        # within HEALTHY_CPU_S of this process's CPU time: the server, the
        # fuzzing lanes and this worker share one loop, so the wall time of a
        # round stretches with the machine's load while its CPU time does not.
        # HANG_S on the wall clock catches a request that is never answered.
        i = 0
        while not done.is_set():
            t0, cpu0 = time.perf_counter(), time.process_time()
            async with asyncio.timeout(HANG_S):
                _, v = await good.pull()
                update = _update(float(i % 7 - 3) / 8)
                ack = await good.push(update, version=v)
            latencies.append(time.perf_counter() - t0)
            cpu = time.process_time() - cpu0
            assert cpu < HEALTHY_CPU_S, f"a healthy round took {cpu:.2f} s of CPU"
            assert ack.applied
            tally.acked.append((ack.version, update))
            i += 1
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await done.wait()

    checker = asyncio.create_task(healthy())
    try:
        await asyncio.gather(*(lane(k) for k in range(lanes)))
    finally:
        done.set()
        await checker
    async with asyncio.timeout(HANG_S):
        _, v = await good.pull()
    assert v == server.version
    await good.close()
    return latencies


def _check_replay(server, tally):
    """The parameters are those of the acknowledged pushes, applied in order."""
    versions = sorted(v for v, _ in tally.acked)
    # Every applied push was acknowledged once: no version is missing.
    assert versions == list(range(1, server.version + 1))
    replay = ServerCore(_params(), optax.sgd(1.0), "asp")
    replay.join("replay", now=0.0)
    for _, update in sorted(tally.acked, key=lambda x: x[0]):
        replay.push("replay", update, version=replay.version, now=0.0)
    for k, x in server.params.items():
        x = np.asarray(x)
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, np.asarray(replay.params[k]), rtol=1e-5)


def _fuzz_run(connections, seed, *, warmup=0):
    rng = np.random.default_rng(seed)
    tally = _Tally()
    figures = {}

    async def main():
        async with _server("asp") as server:
            if warmup:
                await _fuzz(server, rng, warmup, tally)
                gc.collect()
            figures["rss0"] = _rss()
            figures["frames0"] = tally.frames
            t0 = time.perf_counter()
            latencies = await _fuzz(server, rng, connections, tally)
            figures["seconds"] = time.perf_counter() - t0
            figures["frames"] = tally.frames - figures["frames0"]
            figures["rss1"] = _rss()
            figures["max_latency"] = max(latencies)
            assert server._server is not None and server._server.is_serving()
            assert len(server._decoders) <= 8
            _check_replay(server, tally)
            figures["version"] = server.version

    _run(main, timeout=600.0)
    return tally, figures


def test_mutated_frames_never_hurt_a_healthy_worker():
    tally, _ = _fuzz_run(120, seed=11)
    assert tally.frames >= 300 and tally.refused > 0
    # Fuzzed pushes were applied too, not only the healthy worker's.
    assert tally.fuzz_applied > 0


@pytest.mark.slow
def test_frame_fuzzer():
    tally, figures = _fuzz_run(4000, seed=12, warmup=400)
    growth = (figures["rss1"] - figures["rss0"]) / 2**20
    print(
        f"\nfuzz: {figures['frames']} frames over {tally.connections} connections in "
        f"{figures['seconds']:.1f} s ({figures['frames'] / figures['seconds']:.0f} "
        f"frames/s), {tally.refused} refused, {len(tally.acked)} pushes applied, "
        f"RSS {figures['rss0'] / 2**20:.0f} -> {figures['rss1'] / 2**20:.0f} MiB "
        f"({growth:+.1f}), slowest healthy round {figures['max_latency']:.3f} s"
    )
    assert tally.frames >= 20_000
    assert growth < 200
