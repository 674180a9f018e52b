"""The server against hostile input: probes of known defects and a frame fuzzer."""

import asyncio
import gc
import weakref

import numpy as np
import pytest
from test_server import Raw, _client, _run, _server, _update

from hpsjax.ps import _errors as errors
from hpsjax.ps import _frames, _treecodec
from hpsjax.ps._frames import MsgType
from hpsjax.transforms._quantize import Codec


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


def test_refused_compressed_push_compiles_nothing():
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
            assert ack.applied and len(server._decoders) == 1
            await c.close()

    _run(main)


def test_decoders_of_many_codecs_stay_bounded_and_pushes_keep_their_order():
    async def main():
        async with _server("asp") as server:
            c = _client(server, "many")
            await c.connect()
            _, v = await c.pull()
            # Sent back to back: each new block size is compiled while the
            # following pushes wait, and all are applied in order.
            acks = await asyncio.gather(
                *[_codec_push(c, 1 + i, v + i) for i in range(12)]
            )
            assert [a.version for a in acks] == list(range(v + 1, v + 13))
            assert len(server._decoders) <= 8
            for x in server.params.values():
                x = np.asarray(x)
                np.testing.assert_allclose(x, np.full(x.shape, -0.25 * 12), rtol=1e-6)
            await c.close()

    _run(main)


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


# ------------------------------------------------------------------ fuzzer


def _mutants(rng, count):
    meta, buffers, _ = _treecodec.tree_to_wire(_update(0.5))
    seeds = [
        b"".join(bytes(p) for p in _frames.encode_frame(t, 7, m, b))
        for t, m, b in [
            (MsgType.PULL, {}, ()),
            (MsgType.INFO, {}, ()),
            (MsgType.PUSH, {"version": 0, **meta}, buffers),
        ]
    ]
    for _ in range(count):
        frame = bytearray(seeds[rng.integers(len(seeds))])
        for _ in range(rng.integers(1, 4)):
            frame[rng.integers(len(frame))] = rng.integers(256)
        yield bytes(frame)


def test_mutated_frames_never_hurt_a_healthy_worker():
    rng = np.random.default_rng(11)

    async def main():
        async with _server("asp") as server:
            good = _client(server, "good")
            await good.connect()
            _, v = await good.pull()
            for i, data in enumerate(_mutants(rng, 200)):
                raw = await Raw.open(server.port, worker_id=f"fuzz-{i % 4}")
                raw.send_bytes(data)
                await asyncio.sleep(0)
                await raw.close()
                if i % 20 == 0:
                    async with asyncio.timeout(2.0):
                        _, v = await good.pull()
            # Mutated pushes may be applied only with the values they carry;
            # the good worker's view stays consistent with the server's.
            _, v = await good.pull()
            assert v == server.version
            for x in server.params.values():
                assert np.isfinite(np.asarray(x)).all()
            await good.close()

    _run(main, timeout=60.0)
