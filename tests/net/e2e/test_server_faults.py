"""The server against bad input, killed workers and a killed server."""

import asyncio
import logging
import math
import os
import pathlib
import re
import signal
import sys
import textwrap

import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from _servers import SECRET, Raw, _client, _run, _server, _server_params, _update

from hpsjax.models import save_params_npz
from hpsjax.wire import _errors as errors
from hpsjax.wire import _frames, _treecodec
from hpsjax.wire._codecs import _quantized
from hpsjax.wire._frames import MsgType

REPO = pathlib.Path(__file__).resolve().parents[3]


async def _assert_still_serving(server, before, version):
    """Parameters and version unchanged, and a good worker is served."""
    assert server.version == version
    for k, v in _server_params(server).items():
        np.testing.assert_array_equal(v, before[k])
    good = _client(server, f"good-{os.urandom(4).hex()}")
    await good.connect()
    _, v = await good.pull()
    ack = await good.push(_update(0.0), version=v)
    assert ack.applied and ack.version == version + 1
    await good.close()


def _push_frame(tree, request_id=5, **meta):
    tree_meta, buffers, _ = _treecodec.tree_to_wire(tree)
    meta = {"version": 0, **tree_meta, **meta}
    return b"".join(
        bytes(p) for p in _frames.encode_frame(MsgType.PUSH, request_id, meta, buffers)
    )


# Each case: (name, bytes to send after the handshake, expected code, whether
# the server closes the connection).
def _fatal_cases():
    good_pull = _frames.pack_header(MsgType.PULL, 3, 0, 0)
    return [
        ("garbage", b"\x00GARBAGE" * 8, errors.BadMagic.code),
        ("wrong_magic", b"HPSX" + good_pull[4:], errors.BadMagic.code),
        (
            "wrong_version",
            _frames.pack_header(MsgType.PULL, 3, 0, 0, version=9),
            errors.UnsupportedVersion.code,
        ),
        (
            "huge_length",
            _frames.pack_header(MsgType.PUSH, 3, 0, 2**60),
            errors.PayloadTooBig.code,
        ),
        (
            "unknown_type",
            _frames.pack_header(99, 3, 0, 0),
            errors.UnexpectedMessage.code,
        ),
        (
            "payload_on_pull",
            _frames.pack_header(MsgType.PULL, 3, 0, 16) + bytes(16),
            errors.ProtocolError.code,
        ),
    ]


@pytest.mark.parametrize("handshake", [True, False], ids=["after_auth", "before_auth"])
def test_broken_streams_get_an_error_and_are_closed(handshake):
    async def main():
        async with _server("asp") as server:
            before, version = _server_params(server), server.version
            for name, data, code in _fatal_cases():
                raw = await Raw.open(server.port, worker_id=name, handshake=handshake)
                if handshake:
                    raw.send(MsgType.PULL, 2)
                    assert (await raw.recv()).msg_type == MsgType.PARAMS
                raw.send_bytes(data)
                message = await raw.expect_error(code)
                assert "Traceback" not in message
                await raw.expect_closed()
                await raw.close()
            await asyncio.sleep(0.05)
            assert not server.core.live
            await _assert_still_serving(server, before, version)

    _run(main)


def _refused_cases():
    params = {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}
    nan = {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}
    nan["w"][1, 2] = np.nan
    inf = {"b": np.array([0, np.inf, 0], np.float32), "w": params["w"]}
    bad_dtype_meta, bufs, _ = _treecodec.tree_to_wire(params)
    bad_dtype_meta["leaves"][0][0] = "object"
    payload = b"".join(bytes(b) for b in bufs)
    packed = msgpack.packb({"version": 0, **bad_dtype_meta}, use_bin_type=True)
    bad_dtype = _frames.pack_header(MsgType.PUSH, 5, len(packed), len(payload)) + packed
    bad_dtype += payload
    return [
        (
            "shape",
            _push_frame(
                {"b": np.zeros(3, np.float32), "w": np.zeros((3, 4), np.float32)}
            ),
            errors.SpecMismatch.code,
        ),
        (
            "dtype",
            _push_frame({"b": np.zeros(3, np.float64), "w": params["w"]}),
            errors.SpecMismatch.code,
        ),
        ("structure", _push_frame({"w": params["w"]}), errors.SpecMismatch.code),
        (
            "extra_leaf",
            _push_frame({**params, "c": np.zeros(1, np.float32)}),
            errors.SpecMismatch.code,
        ),
        ("nan", _push_frame(nan), errors.NonFiniteUpdate.code),
        ("inf", _push_frame(inf), errors.NonFiniteUpdate.code),
        (
            "future_version",
            _push_frame(params, version=10**6),
            errors.InvalidUpdate.code,
        ),
        (
            "negative_version",
            _push_frame(params, version=-1),
            errors.MalformedMetadata.code,
        ),
        (
            "string_version",
            _push_frame(params, version="0"),
            errors.MalformedMetadata.code,
        ),
        ("bad_loss", _push_frame(params, loss="low"), errors.MalformedMetadata.code),
        (
            "nan_step_time",
            _push_frame(params, step_time=math.nan),
            errors.MalformedMetadata.code,
        ),
        ("bad_dtype_string", bad_dtype, errors.UnsupportedDtype.code),
        (
            "params_from_client",
            _push_frame(params)[:5] + bytes([MsgType.PARAMS]) + _push_frame(params)[6:],
            errors.UnexpectedMessage.code,
        ),
        (
            "subscribe_no_flag",
            b"".join(
                bytes(p)
                for p in _frames.encode_frame(MsgType.SUBSCRIBE, 5, {"on": "yes"})
            ),
            errors.MalformedMetadata.code,
        ),
        (
            "undecodable_metadata",
            _frames.pack_header(MsgType.PULL, 5, 3, 0) + b"\xc1\xc1\xc1",
            errors.MalformedMetadata.code,
        ),
    ]


def test_refused_requests_change_nothing_and_keep_the_connection():
    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, worker_id="raw")
            raw.send(MsgType.PULL, 2)
            assert (await raw.recv()).msg_type == MsgType.PARAMS
            before, version = _server_params(server), server.version
            for name, data, code in _refused_cases():
                raw.send_bytes(data)
                message = await raw.expect_error(code, request_id=5)
                assert message and "Traceback" not in message, name
                assert server.version == version, name
                # The same connection still works.
                raw.send(MsgType.PULL, 6)
                frame = await raw.recv()
                assert frame.msg_type == MsgType.PARAMS and frame.request_id == 6, name
            assert "raw" in server.core.live
            await _assert_still_serving(server, before, version)
            await raw.close()

    _run(main)


def test_push_before_joining_is_refused():
    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, worker_id="early")
            raw.send_bytes(_push_frame(_update(1.0)))
            await raw.expect_error(errors.UnexpectedMessage.code, request_id=5)
            assert server.version == 0
            await raw.close()

    _run(main)


def test_too_many_leaves_refused_before_reading_the_payload():
    async def main():
        limits = _frames.WireLimits(max_leaves=2)
        async with _server("asp", limits=limits) as server:
            raw = await Raw.open(server.port)
            raw.send(MsgType.PULL, 2)
            await raw.recv()
            tree = {f"x{i}": np.zeros(1, np.float32) for i in range(3)}
            raw.send_bytes(_push_frame(tree))
            await raw.expect_error(errors.TooManyLeaves.code, request_id=5)
            raw.send(MsgType.PULL, 6)
            assert (await raw.recv()).request_id == 6
            await raw.close()

    _run(main)


def test_truncated_push_is_never_applied():
    async def main():
        async with _server("asp") as server:
            before = _server_params(server)
            raw = await Raw.open(server.port, worker_id="cut")
            raw.send(MsgType.PULL, 2)
            await raw.recv()
            frame = _push_frame(_update(7.0))
            raw.send_bytes(frame[:-10])
            await asyncio.sleep(0.1)
            await raw.close()
            await asyncio.sleep(0.1)
            assert "cut" not in server.core.live
            await _assert_still_serving(server, before, 0)

    _run(main)


# A worker written with the standard library and msgpack only, from
# PROTOCOL.md: it joins, starts a push, sends half of it and waits to be killed.
_PARTIAL_PUSH_WORKER = textwrap.dedent(
    """
    import hashlib, hmac, os, socket, struct, sys, time
    import msgpack

    HEADER = struct.Struct("<4sBBHIIQ")
    port, secret = int(sys.argv[1]), sys.argv[2].encode()
    sock = socket.create_connection(("127.0.0.1", port))

    def send(mtype, rid, meta, payload=b""):
        m = msgpack.packb(meta, use_bin_type=True)
        sock.sendall(HEADER.pack(b"HPSJ", 1, mtype, 0, rid, len(m), len(payload)))
        sock.sendall(m + payload)

    def recv_exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise SystemExit("closed")
            buf += chunk
        return buf

    def recv():
        magic, ver, mtype, flags, rid, mlen, plen = HEADER.unpack(recv_exact(24))
        meta = msgpack.unpackb(recv_exact(mlen), raw=False)
        return mtype, rid, meta, recv_exact(plen)

    wid, nc = "doomed", os.urandom(32)
    send(1, 1, {"worker_id": wid, "nonce": nc})
    _, _, challenge, _ = recv()
    ns = challenge["nonce"]
    msg = b"hpsjax-v1 client proof" + ns + nc + msgpack.packb(wid)
    send(3, 2, {"proof": hmac.new(secret, msg, hashlib.sha256).digest()})
    mtype, _, ok, _ = recv()
    assert mtype == 4, ok
    send(7, 3, {})
    mtype, _, params, _ = recv()
    assert mtype == 8, params
    leaves = [[d, s, o, n] for d, s, o, n in params["leaves"]]
    size = sum(n for _, _, _, n in leaves)
    meta = {"version": params["version"], "tree": params["tree"],
            "leaves": leaves, "codec": None}
    m = msgpack.packb(meta, use_bin_type=True)
    payload = struct.pack("<f", 5.0) * (size // 4)
    sock.sendall(HEADER.pack(b"HPSJ", 1, 9, 0, 4, len(m), size) + m)
    sock.sendall(payload[: size // 2])
    print("partial", flush=True)
    time.sleep(60)
    """
)


def test_worker_killed_mid_push_changes_nothing():
    async def main():
        async with _server("asp") as server:
            before = _server_params(server)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _PARTIAL_PUSH_WORKER,
                str(server.port),
                SECRET.decode(),
                stdout=asyncio.subprocess.PIPE,
            )
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), 20)
                assert line.strip() == b"partial"
                # The server holds half a frame from it.
                async with asyncio.timeout(5):
                    while not any(
                        not s.protocol._decoder.idle for s in server._connections
                    ):
                        await asyncio.sleep(0.01)
                assert "doomed" in server.core.live
            finally:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
            async with asyncio.timeout(5):
                while "doomed" in server.core.live:
                    await asyncio.sleep(0.01)
            await _assert_still_serving(server, before, 0)

    # uvloop starts subprocesses with a plain fork(), which JAX warns against.
    _run(main, loop="asyncio")


# ------------------------------------------------------- killed server


async def _start_cli(args):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hpsjax.ps._cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    lines = []
    async with asyncio.timeout(60):
        while True:
            line = (await proc.stdout.readline()).decode()
            if not line:
                err = (await proc.stderr.read()).decode()
                raise AssertionError(f"server exited: {err[-2000:]}")
            lines.append(line)
            if "listening on" in line:
                port = int(line.rsplit(":", 1)[1])
                break
    # Read the rest of stdout as it comes, so the pipe never fills.
    drain = asyncio.create_task(_collect(proc.stdout, lines))
    return proc, port, lines, drain


async def _collect(stream, lines):
    while line := await stream.readline():
        lines.append(line.decode())


def test_server_killed_and_restarted_resumes_from_its_checkpoint(tmp_path):
    from hpsjax.storage._checkpoint import CheckpointManager

    init = tmp_path / "init.npz"
    save_params_npz(
        init,
        {"layer": {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}},
    )
    (tmp_path / "secret").write_bytes(SECRET + b"\n")
    ckpt = tmp_path / "ckpt"
    args = [
        "--init", str(init), "--secret_file", str(tmp_path / "secret"),
        "--checkpoint_dir", str(ckpt), "--checkpoint_every_updates", "2",
        "--optimizer", "sgd", "--learning_rate", "0.5", "--log_level", "WARNING",
    ]  # fmt: skip
    like = {"layer": {"b": np.zeros(3, np.float32), "w": np.zeros((4, 3), np.float32)}}

    async def first_life():
        proc, port, _, drain = await _start_cli(args)
        try:
            from hpsjax.net._client import Client

            c = Client("127.0.0.1", port, worker_id="w", secret=SECRET, timeout=20)
            await c.connect()
            _, v = await c.pull()
            for i in range(5):
                update = {"layer": _update(i + 1.0, like["layer"])}
                ack = await c.push(update, version=v)
                v = ack.version
            # Versions 2 and 4 are checkpointed; wait for the commit of 4.
            async with asyncio.timeout(30):
                while CheckpointManager(ckpt).latest_step() != 4:
                    await asyncio.sleep(0.05)
            await c.close()
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            drain.cancel()
        assert proc.returncode == -signal.SIGKILL

    _run(first_life, timeout=120, loop="asyncio")
    with CheckpointManager(ckpt) as manager:
        step, tree, _ = manager.restore_latest()
    assert step == 4
    params, _ = tree
    # sgd(0.5) of the updates 1, 2, 3 and 4; the fifth was never committed.
    np.testing.assert_allclose(params["layer"]["w"], -0.5 * (1 + 2 + 3 + 4))

    async def second_life():
        proc, port, lines, drain = await _start_cli(args)
        try:
            from hpsjax.net._client import Client

            c = Client("127.0.0.1", port, worker_id="w", secret=SECRET, timeout=20)
            info = await c.connect()
            assert info.version == 4
            params, version = await c.pull()
            assert version == 4
            np.testing.assert_allclose(params["layer"]["w"], -5.0)
            np.testing.assert_allclose(params["layer"]["b"], -5.0)
            await c.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 60)
            await drain
        assert proc.returncode == 0
        assert any("resumed from step 4" in line for line in lines)

    _run(second_life, timeout=120, loop="asyncio")


def test_compressed_push_to_an_integer_model_is_refused():
    from hpsjax.transforms._quantize import Codec

    params = {"count": jnp.zeros(4, jnp.int32), "w": jnp.zeros(4, jnp.float32)}
    codec = Codec("uniform", 8, stochastic=False)
    leaves, offset = [], 0
    for name in ("int32", "float32"):
        codes, scales = _quantized.compressed_sizes((4,), codec)
        leaves.append([name, [4], offset, codes + 4 * scales, codes])
        offset += codes + 4 * scales
    meta = {
        "version": 0,
        "tree": ["d", {"count": 0, "w": 1}],
        "leaves": leaves,
        "codec": codec.to_dict(),
    }
    packed = msgpack.packb(meta, use_bin_type=True)
    frame = _frames.pack_header(MsgType.PUSH, 5, len(packed), offset) + packed
    frame += bytes(offset)

    async def main():
        async with _server("asp", params=params) as server:
            raw = await Raw.open(server.port)
            raw.send(MsgType.PULL, 2)
            await raw.recv()
            raw.send_bytes(frame)
            message = await raw.expect_error(errors.MalformedMetadata.code, 5)
            assert "floating" in message
            assert server.version == 0
            await raw.close()

    _run(main)


def test_strangers_cannot_make_the_server_allocate():
    async def main():
        async with _server("asp") as server:
            raw = await Raw.open(server.port, handshake=False)
            # 100 KiB is fine once authenticated, not before.
            raw.send_bytes(_frames.pack_header(MsgType.PUSH, 1, 0, 100 * 1024))
            await raw.expect_error(errors.PayloadTooBig.code)
            await raw.expect_closed()
            await raw.close()
            raw = await Raw.open(server.port, handshake=False)
            raw.send(MsgType.PULL, 1)
            await raw.expect_error(errors.UnexpectedMessage.code, 1)
            await raw.expect_closed()
            await raw.close()

    _run(main)


def test_finite_pushes_that_would_overflow_the_parameters_are_refused():
    async def main():
        params = {"b": jnp.zeros(3, jnp.float16), "w": jnp.full(2, -1e38, jnp.float32)}
        async with _server("asp", params=params) as server:
            client = _client(server, "hostile")
            await client.connect()
            _, v = await client.pull()
            # A huge sample count weighs the update, never multiplies it.
            ones = {"b": np.ones(3, np.float16), "w": np.zeros(2, np.float32)}
            ack = await client.push(ones, version=v, num_samples=100_000)
            assert ack.applied
            assert np.asarray(server.params["b"]).tolist() == [-1.0] * 3
            before, version = _server_params(server), server.version
            huge = {"b": np.zeros(3, np.float16), "w": np.full(2, 3.3e38, np.float32)}
            with pytest.raises(errors.NonFiniteUpdate, match=r"\['w'\] non-finite"):
                await client.push(huge, version=version, num_samples=32)
            assert server.version == version
            for k, value in _server_params(server).items():
                np.testing.assert_array_equal(value, before[k])
            ack = await client.push(ones, version=version, num_samples=2**63 - 1)
            assert ack.applied and server.version == version + 1
            await client.close()

    _run(main)


def test_server_logs_joins_leaves_drops_checkpoints_status_and_resume(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="hpsjax.net._server")
    kwargs = {
        "checkpoint_dir": tmp_path,
        "status_interval": 0.05,
        "core_kwargs": {"min_timeout": 0.2, "initial_timeout": 0.3},
    }

    async def first():
        async with _server("bsp", **kwargs) as server:
            a, b = _client(server, "a"), _client(server, 7)
            await a.connect()
            await b.connect()
            _, v = await a.pull()
            await b.pull()
            await a.push(_update(0.0), version=v)
            await b.push(_update(0.0), version=v)
            await b.close()
            # "a" goes silent while nobody waits: no drop; "b" left.
            await asyncio.sleep(0.2)
            return server.version

    version = _run(first)
    text = caplog.text
    assert "worker 'a' joined from" in text and "worker 7 joined from" in text
    assert "worker 7 left: done (1 live)" in text
    assert re.search(
        r"server: version \d+, [\d.]+ versions/s, .*[\d.]+ pushes/s, \d live worker",
        text,
    )
    assert f"checkpoint written: {tmp_path / f'ckpt_{version}'}" in text
    caplog.clear()

    async def second():
        async with _server("bsp", **kwargs) as server:
            assert server.version == version
            a, b = _client(server, "a"), _client(server, "b")
            await a.connect()
            await b.connect()
            _, v = await a.pull()
            await b.pull()
            await a.push(_update(0.0), version=v)
            # "b" never pushes: "a" waits, "b" is dropped at its deadline.
            _, v2 = await a.pull()
            assert v2 == version + 1
            await a.close()
            await b.close()

    _run(second)
    text = caplog.text
    assert (
        f"resumed from checkpoint {tmp_path / f'ckpt_{version}'} at version {version}"
        in text
    )
    drop = re.search(r"dropped worker 'b': (.*) \(1 live\)", text)
    assert drop, text
    assert re.fullmatch(
        r"worker 'b' made no progress for [\d.]+ s \(deadline 0\.3 s\)", drop[1]
    )


def test_status_lines_can_be_turned_off(caplog):
    caplog.set_level(logging.INFO, logger="hpsjax.net._server")

    async def main(interval):
        async with _server("asp", status_interval=interval):
            await asyncio.sleep(0.2)

    _run(lambda: main(0.05))
    assert "server: version 0" in caplog.text  # what is turned off
    caplog.clear()
    _run(lambda: main(0))
    assert "server: version" not in caplog.text
    with pytest.raises(ValueError, match="status_interval must be >= 0"):
        _server("asp", status_interval=-1)
