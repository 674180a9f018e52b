"""End-to-end tests of the asyncio server and client over loopback."""

import asyncio
import shutil
import ssl
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _servers import (
    SECRET,
    Raw,
    _client,
    _params,
    _run,
    _server,
    _server_params,
    _update,
)

from hpsjax.decisions._policies import HybridStage
from hpsjax.net._client import Client
from hpsjax.net._server import Server
from hpsjax.ps import PlanNotice
from hpsjax.wire import _frames
from hpsjax.wire._errors import (
    AuthError,
    ConnectionClosed,
    InvalidUpdate,
    ServerError,
    ShuttingDown,
    SpecMismatch,
    WorkerDropped,
)
from hpsjax.wire._frames import MsgType
from hpsjax.wire._stream import FrameDecoder

# ------------------------------------------------------------------ basics


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_asp_several_clients(loop):
    async def main():
        async with _server("asp") as server:
            clients = [_client(server, f"w{i}") for i in range(3)]
            for c in clients:
                info = await c.connect()
                assert info.policy == "asp" and info.version == 0
                assert info.spec["w"].shape == (4, 3)

            async def work(c, value):
                _, version = await c.pull()
                acks = []
                for _ in range(4):
                    ack = await c.push(_update(value), version=version)
                    acks.append(ack)
                    _, version = await c.pull()
                    assert version >= ack.version
                return acks

            results = await asyncio.gather(
                *(work(c, i + 1) for i, c in enumerate(clients))
            )
            assert server.version == 12
            versions = sorted(a.version for acks in results for a in acks)
            assert versions == list(range(1, 13))
            assert all(a.applied for acks in results for a in acks)
            # sgd(1.0): every applied update u moves w by -u.
            want = -4.0 * (1 + 2 + 3)
            np.testing.assert_allclose(_server_params(server)["w"], want)
            params, version = await clients[0].pull()
            assert version == 12
            np.testing.assert_allclose(params["b"], want)
            assert params["w"].dtype == np.float32
            for c in clients:
                await c.close()

    _run(main, loop=loop)


@pytest.mark.parametrize("device", [None, "cpu:0"])
def test_a_stateful_optimizer_is_compiled_once(device):
    # Adam's count starts uncommitted; on a server placed on a device its
    # state is placed there too, or the second update compiles the step again.
    async def push(server, times):
        c = _client(server, "w0")
        await c.connect()
        for _ in range(times):
            _, version = await c.pull()
            await c.push(_update(1.0), version=version)
        await c.close()

    async def main():
        params = _params()
        server = Server(params, optax.adam(0.1), "asp", secret=SECRET, device=device)
        async with server:
            await push(server, 4)
            assert server.version == 4
            steps = server.core._agg._steps
            assert steps.checked_apply._cache_size() == 1
            # So is a state restored from numpy arrays (a checkpoint).
            state = jax.tree.map(np.asarray, server.core.opt_state)
            server.core._agg.restore(*server.core._agg.check_restore(None, state))
            await push(server, 2)
            assert server.version == 6
            assert steps.checked_apply._cache_size() == 1

    _run(main)


def test_bsp_rounds_wait_for_everyone():
    async def main():
        async with _server("bsp") as server:
            clients = [_client(server, f"w{i}") for i in range(3)]
            for c in clients:
                await c.connect()
            starts = await asyncio.gather(*(c.pull() for c in clients))
            assert {v for _, v in starts} == {0}

            for version in range(3):
                results = await asyncio.gather(
                    *(
                        c.push_pull(_update(i + 1), version=version)
                        for i, c in enumerate(clients)
                    )
                )
                versions = {v for _, _, v in results}
                assert versions == {version + 1}, versions
                statuses = sorted(a.status for a, _, _ in results)
                assert statuses == ["applied", "buffered", "buffered"]
                # BSP applies the average of the round's updates.
                for _, params, _ in results:
                    np.testing.assert_allclose(params["w"], -2.0 * (version + 1))
            for c in clients:
                await c.close()

    _run(main)


def test_ssp_bounds_the_clock_gap():
    async def main():
        async with _server("ssp", staleness_bound=1) as server:
            fast, slow = _client(server, "fast"), _client(server, "slow")
            await fast.connect()
            await slow.connect()
            _, v_slow = await slow.pull()
            _, v = await fast.pull()
            _, _, v = await fast.push_pull(_update(1), version=v)
            # A second push puts fast two clocks ahead of slow: its pull waits.
            blocked = asyncio.create_task(fast.push_pull(_update(1), version=v))
            await asyncio.sleep(0.3)
            assert not blocked.done()
            assert server.core.is_waiting("fast")
            await slow.push(_update(1), version=v_slow)
            ack, _, v = await asyncio.wait_for(blocked, 5)
            assert v == 3 and ack.applied
            await fast.close()
            await slow.close()

    _run(main)


POLICY_CASES = [
    ("saps", {}),
    ("adsp", {}),
    ("semi_async", {"max_staleness": 2}),
    ("hybrid", {"stages": [HybridStage("async", 2), HybridStage("sync")]}),
]


@pytest.mark.parametrize(
    "policy,kwargs", POLICY_CASES, ids=[p for p, _ in POLICY_CASES]
)
def test_other_policies_serve(policy, kwargs):
    async def main():
        async with _server(policy, **kwargs) as server:
            clients = [_client(server, f"w{i}") for i in range(2)]
            for c in clients:
                await c.connect()
            assert clients[0].info.policy == policy

            async def work(c):
                _, version = await c.pull()
                seen = [version]
                for _ in range(3):
                    ack, _, version = await c.push_pull(_update(0.5), version=version)
                    assert ack.status in ("applied", "buffered", "dropped")
                    seen.append(version)
                return seen

            seen = await asyncio.gather(*(work(c) for c in clients))
            for versions in seen:
                assert versions == sorted(versions)
            assert server.version >= 1
            if policy == "hybrid":
                server.set_stage(1)
                info = await clients[0].refresh_info()
                assert info.stage == 1
                await asyncio.sleep(0.05)
                assert clients[0].stage == 1
            for c in clients:
                await c.close()

    _run(main)


def test_eager_pull_while_push_in_flight():
    big = {"w": jnp.zeros((1024, 1024), jnp.float32)}  # 4 MiB each way

    async def main():
        async with _server("asp", params=big) as server:
            c = _client(server, "eager")
            await c.connect()
            _, version = await c.pull()
            update = {"w": np.ones((1024, 1024), np.float32)}
            push = asyncio.create_task(c.push(update, version=version))
            await asyncio.sleep(0)  # the push frame is queued first
            params, pulled = await c.pull()
            ack = await push
            assert ack.version == 1 and pulled in (0, 1)
            np.testing.assert_allclose(params["w"], -float(pulled))
            # Both requests really overlapped on one connection.
            assert len(c._pending) == 0
            await c.close()

    _run(main)


def test_subscribe_receives_params_after_each_update():
    async def main():
        async with _server("asp") as server:
            sub_client, pusher = _client(server, "sub"), _client(server, "pusher")
            await sub_client.connect()
            await pusher.connect()
            sub = await sub_client.subscribe()
            params, version = await sub.next(timeout=5)
            assert version == 0 and sub.latest[1] == 0
            _, v = await pusher.pull()
            for i in range(3):
                await pusher.push(_update(1.0), version=v + i)
                params, version = await sub.next(timeout=5)
                assert version == i + 1
                np.testing.assert_allclose(params["w"], -(i + 1.0))
            await sub.close()
            await pusher.push(_update(1.0), version=3)
            await asyncio.sleep(0.1)
            assert sub.latest[1] == 3
            await sub_client.close()
            await pusher.close()

    _run(main)


def test_subscription_iteration_ends_on_close():
    async def main():
        async with _server("asp") as server:
            c = _client(server, "sub")
            await c.connect()
            sub = await c.subscribe()
            got = []

            async def consume():
                async for _, version in sub:
                    got.append(version)

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.1)
            await c.close()
            await asyncio.wait_for(task, 5)
            assert got == [0]

    _run(main)


# ------------------------------------------------------------------ auth


def test_wrong_secret_is_refused_and_others_keep_working():
    async def main():
        async with _server("asp") as server:
            bad = _client(server, "intruder", secret=b"wrong")
            with pytest.raises(AuthError):
                await bad.connect()
            assert bad.closed
            none = _client(server, "nosecret", secret=None)
            with pytest.raises(AuthError, match="requires a secret"):
                await none.connect()
            raw = await Raw.open(server.port, handshake=False)
            raw.send(MsgType.HELLO, 1, {"worker_id": "raw", "nonce": bytes(32)})
            await raw.recv()
            raw.send(MsgType.AUTH, 2, {"proof": b"\0" * 32})
            assert "authentication failed" in await raw.expect_error(AuthError.code, 2)
            await raw.expect_closed()
            await raw.close()
            good = _client(server, "good")
            await good.connect()
            _, v = await good.pull()
            assert (await good.push(_update(1), version=v)).applied
            await good.close()
            assert "intruder" not in server.core.workers()

    _run(main)


def test_client_refuses_a_server_without_the_secret():
    async def fake_server(reader, writer):
        # Accepts any proof, but cannot prove the secret back.
        decoder = FrameDecoder()
        while True:
            data = await reader.read(4096)
            if not data:
                break
            for frame in decoder.feed(data):
                if frame.msg_type == MsgType.HELLO:
                    reply = (
                        MsgType.CHALLENGE,
                        {"nonce": bytes(32), "auth": "hmac-sha256"},
                    )
                else:
                    reply = (MsgType.AUTH_OK, {"proof": b"x" * 32, "info": {}})
                for part in _frames.encode_frame(reply[0], frame.request_id, reply[1]):
                    writer.write(bytes(part))
        writer.close()

    async def main():
        server = await asyncio.start_server(fake_server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = Client("127.0.0.1", port, worker_id="w", secret=SECRET, timeout=5)
        with pytest.raises(AuthError, match="failed to prove"):
            await client.connect()
        insecure = Client("127.0.0.1", port, worker_id="w", secret=SECRET, timeout=5)
        server.close()
        await server.wait_closed()
        del insecure

    _run(main)


def test_client_refuses_an_unauthenticated_server_when_it_has_a_secret():
    async def main():
        async with _server("asp", secret=None) as server:
            with pytest.raises(AuthError, match="does not authenticate"):
                await _client(server, "w").connect()
            open_client = _client(server, "w", secret=None)
            await open_client.connect()
            _, v = await open_client.pull()
            assert v == 0
            await open_client.close()

    _run(main)


def test_no_secret_only_on_loopback():
    with pytest.raises(ValueError, match="without a secret"):
        Server(_params(), optax.sgd(1.0), host="0.0.0.0", secret=None)
    Server(_params(), optax.sgd(1.0), host="0.0.0.0", secret=None, insecure=True)
    Server(_params(), optax.sgd(1.0), host="::1", secret=None)


def test_bad_arguments_are_refused():
    for kwargs in [
        {"port": -1},
        {"port": 70000},
        {"checkpoint_every_s": 5},
        {"handshake_timeout": 0},
        {"checkpoint_every_updates": 0, "checkpoint_dir": "/tmp/x"},
        {"ssl": "yes"},
    ]:
        with pytest.raises(ValueError):
            _server("asp", **kwargs)
    with pytest.raises(ValueError, match="policy"):
        _server("nope")
    for kwargs in [{"worker_id": 1.5}, {"worker_id": ""}, {"worker_id": True}]:
        with pytest.raises(ValueError):
            Client("127.0.0.1", 1, secret=SECRET, **kwargs)
    with pytest.raises(ValueError):
        Client("127.0.0.1", 0, worker_id="w", secret=SECRET)
    with pytest.raises(ValueError):
        Client("127.0.0.1", 1, worker_id="w", secret=b"")


def _self_signed_cert(tmp_path):
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=localhost",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


def test_tls_round_trip(tmp_path):
    cert, key = _self_signed_cert(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    untrusting = ssl.create_default_context()

    async def main():
        async with _server("asp", ssl=server_ctx) as server:
            c = _client(server, "tls", ssl=client_ctx)
            await c.connect()
            _, v = await c.pull()
            assert (await c.push(_update(2.0), version=v)).applied
            params, v = await c.pull()
            np.testing.assert_allclose(params["w"], -2.0)
            await c.close()
            with pytest.raises(ssl.SSLError):
                await _client(server, "x", ssl=untrusting).connect()

    _run(main)


# ------------------------------------------------------------------ faults


def test_bsp_barrier_proceeds_after_the_deadline_of_a_stalled_worker():
    async def main():
        core_kwargs = {"initial_timeout": 0.5, "min_timeout": 0.2}
        async with _server("bsp", core_kwargs=core_kwargs) as server:
            live, stalled = _client(server, "live"), _client(server, "stalled")
            await live.connect()
            await stalled.connect()
            await stalled.pull()
            _, v = await live.pull()
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            # "stalled" never pushes: the round waits for it until its deadline.
            ack, _, version = await live.push_pull(_update(1), version=v)
            waited = loop.time() - t0
            assert 0.3 < waited < 5, waited
            assert version == 1 and ack.status == "buffered"
            assert "stalled" not in server.core.live
            # The dropped worker hears of it on its next call, then may rejoin.
            with pytest.raises(WorkerDropped):
                await stalled.push(_update(1), version=0)
            _, v2 = await stalled.pull()
            assert v2 == 1 and "stalled" in server.core.live
            await live.close()
            await stalled.close()

    _run(main)


def test_cancelled_pull_leaves_the_connection_usable():
    async def main():
        async with _server("bsp") as server:
            a, b = _client(server, "a"), _client(server, "b")
            await a.connect()
            await b.connect()
            await a.pull()
            await b.pull()
            await a.push(_update(1), version=0)
            with pytest.raises(TimeoutError):
                await a.pull(timeout=0.2)  # waits for b's push
            await b.push(_update(1), version=0)
            # The late reply to the cancelled pull is discarded; a new one works.
            _, v = await a.pull()
            assert v == 1
            await a.close()
            await b.close()

    _run(main)


def test_graceful_close_fails_waiting_requests_and_checkpoints(tmp_path):
    async def main():
        # b idles on purpose: a loaded machine must not make the server drop
        # it for want of progress (1 s by default) before the close.
        server = _server(
            "bsp", checkpoint_dir=tmp_path / "ckpt", core_kwargs={"min_timeout": 120.0}
        )
        await server.start()
        a, b = _client(server, "a"), _client(server, "b")
        await a.connect()
        await b.connect()
        await a.pull()
        await b.pull()
        await a.push(_update(1), version=0)
        await b.push(_update(3), version=0)
        await a.push(_update(1), version=1)
        waiting = asyncio.create_task(a.pull())
        await asyncio.sleep(0.1)
        await server.close()
        with pytest.raises(ShuttingDown):
            await waiting
        with pytest.raises(ConnectionClosed):
            await b.pull()
        assert a.closed and b.closed
        return server.version

    version = _run(main)
    from hpsjax.storage._checkpoint import CheckpointManager

    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.latest_step() == version == 1

    async def resume():
        server = _server("bsp", checkpoint_dir=tmp_path / "ckpt")
        async with server:
            assert server.resumed_from == 1 and server.version == 1
            np.testing.assert_allclose(_server_params(server)["w"], -2.0)

    _run(resume)


def test_client_calls_fail_fast_after_the_server_is_gone():
    async def main():
        server = _server("asp")
        await server.start()
        c = _client(server, "w")
        await c.connect()
        await c.pull()
        await server.close()
        await asyncio.sleep(0.05)
        with pytest.raises(ConnectionClosed):
            await c.pull()
        with pytest.raises(ConnectionClosed):
            await c.push(_update(1), version=0)
        # A new connection to nowhere fails at once too.
        with pytest.raises(OSError):
            await c.connect(timeout=2)

    _run(main)


def test_a_new_connection_replaces_one_that_has_not_joined():
    async def main():
        async with _server("asp") as server:
            first = _client(server, "w")
            await first.connect()
            second = _client(server, "w")
            await second.connect()
            await asyncio.sleep(0.05)
            with pytest.raises(WorkerDropped, match="replaced"):
                await first.pull()
            _, v = await second.pull()
            assert (await second.push(_update(1), version=v)).applied
            await first.close()
            await second.close()

    _run(main)


def test_a_second_worker_claiming_a_live_workers_id_is_refused():
    async def main():
        async with _server("asp") as server:
            first = _client(server, "w")
            await first.connect()
            _, v = await first.pull()
            second = _client(server, "w")
            with pytest.raises(ServerError, match="live connected worker") as info:
                await second.connect()
            assert "\n" not in str(info.value)
            # The first goes on; once its connection is gone, the id is free.
            assert (await first.push(_update(1), version=v)).applied
            await first.close()
            await asyncio.sleep(0.05)
            third = _client(server, "w")
            await third.connect()
            _, v = await third.pull()
            assert (await third.push(_update(1), version=v)).applied
            await third.close()
            await second.close()

    _run(main)


def test_a_reconnect_is_taken_while_the_old_connection_still_looks_live():
    # A worker whose old connection the server has not yet seen close (no FIN
    # yet: a cable pulled, a crash of the host) comes back on a new one: the
    # same HELLO instance says it is the same worker, so the new connection
    # replaces the old, where another worker's would be refused.
    async def main():
        async with _server("asp") as server:
            first = _client(server, "w")
            await first.connect()
            await first.pull()
            again = _client(server, "w")
            again._instance = first._instance
            await again.connect()
            _, v = await again.pull()
            assert (await again.push(_update(1), version=v)).applied
            other = _client(server, "w")
            with pytest.raises(ServerError, match="live connected worker"):
                await other.connect()
            for c in (first, again, other):
                await c.close()

    _run(main)


def test_handshake_timeout_closes_silent_connections():
    async def main():
        async with _server("asp", handshake_timeout=0.2) as server:
            raw = await Raw.open(server.port, handshake=False)
            await raw.expect_error(AuthError.code)
            await raw.expect_closed()
            await raw.close()

    _run(main)


# ------------------------------------------------------------- compressed


def test_compressed_push_is_decoded_on_the_server_exactly():
    import jax

    from hpsjax.net._client import _encode_tree
    from hpsjax.transforms._quantize import Codec, decode_tree

    codec = Codec("uniform", 8, block_size=64)
    rng = np.random.default_rng(0)
    update = {
        "b": rng.normal(size=3).astype(np.float32),
        "w": rng.normal(size=(4, 3)).astype(np.float32),
    }
    encoded = _encode_tree(update, codec, jax.random.key(7))
    expected = decode_tree(encoded, codec, update)

    async def main():
        async with _server("asp") as server:
            c = _client(server, "q")
            await c.connect()
            _, v = await c.pull()
            sent = c.bytes_sent
            # The bytes kept by the transform (or encode_tree) go out as they are.
            ack = await c.push(encoded=encoded, codec=codec, version=v)
            assert ack.applied
            wire_bytes = c.bytes_sent - sent
            params = _server_params(server)
            for k in update:
                # sgd(1.0) from zero: the parameters are minus the decoded update.
                np.testing.assert_array_equal(params[k], -np.asarray(expected[k]))
            # The client can also encode itself; the result is within a step.
            ack = await c.push(update, codec=Codec("uniform", 8), version=ack.version)
            after = _server_params(server)
            for k in update:
                step = np.abs(update[k]).max() / 127
                np.testing.assert_allclose(
                    after[k] - params[k], -update[k], atol=1.01 * step
                )
            await c.close()
            return wire_bytes

    wire_bytes = _run(main)
    raw = sum(v.nbytes for v in update.values())
    assert wire_bytes < raw + 1024  # 8-bit codes + one scale per block + framing


def test_quantize_transform_bytes_are_pushed_as_they_are():
    import jax

    from hpsjax.transforms._quantize import Codec, last_encoded, quantize

    opt = optax.chain(quantize(4, error_feedback=True, seed=3))
    grads = {"b": jnp.arange(3.0), "w": jnp.ones((4, 3)) * 0.25}
    state = opt.init(grads)
    sent, state = jax.jit(opt.update)(grads, state)
    encoded = last_encoded(state)
    codec = Codec("uniform", 4)

    async def main():
        async with _server("asp") as server:
            c = _client(server, "transform")
            await c.connect()
            _, v = await c.pull()
            ack = await c.push(encoded=encoded, codec=codec, version=v)
            assert ack.applied
            params = _server_params(server)
            for k in grads:
                np.testing.assert_array_equal(params[k], -np.asarray(sent[k]))
            # A codec that does not match the bytes is refused locally.
            with pytest.raises(SpecMismatch):
                await c.push(encoded=encoded, codec=Codec("uniform", 8), version=1)
            await c.close()

    _run(main)


def test_periodic_checkpoints_and_a_mismatched_resume(tmp_path):
    async def main():
        server = _server("asp", checkpoint_dir=tmp_path, checkpoint_every_s=0.05)
        async with server:
            c = _client(server, "w")
            await c.connect()
            _, v = await c.pull()
            for _ in range(3):
                v = (await c.push(_update(1), version=v)).version
            # Polled on disk: a second manager in this process would treat the
            # server's save in progress as a crash leftover.
            async with asyncio.timeout(10):
                while not (tmp_path / "ckpt_3").is_dir():  # renamed when committed
                    await asyncio.sleep(0.02)
            await c.close()
        other = {"w": jnp.zeros((2, 2), jnp.float32)}
        with pytest.raises(ValueError):
            await _server("asp", params=other, checkpoint_dir=tmp_path).start()

    _run(main)


def test_work_plans_reach_workers_now_and_on_joining():
    async def main():
        async with _server("asp") as server:
            with pytest.raises(ValueError, match="revision"):
                server.send_plan("late", {"batch_size": 8})
            with pytest.raises(ValueError, match="batch_size"):
                server.send_plan("late", {"revision": 1, "batch_size": 0})
            server.send_plan("late", {"revision": 1, "batch_size": 8})
            c = _client(server, "late")
            await c.connect()
            await c.pull()  # the plan comes before the answer to the join
            assert c.plan == PlanNotice(revision=1, batch_size=8)
            server.send_plan("late", {"revision": 2, "batch_size": 16})
            await c.refresh_info()  # a round trip after the notice
            assert c.plan.batch_size == 16
            await c.close()

    _run(main)


def test_reused_receive_buffers_never_corrupt_updates():
    # Pushes follow each other faster than the server's steps finish, so a
    # receive buffer still read by a step must not take the next push.
    big = {"w": jnp.zeros((1024, 1024), jnp.float32)}

    async def main():
        async with _server("asp", params=big) as server:
            c = _client(server, "fast")
            await c.connect()
            _, v = await c.pull()
            for i in range(30):
                update = {"w": np.full((1024, 1024), i + 1.0, np.float32)}
                v = (await c.push(update, version=v)).version
            params, v = await c.pull()
            assert v == 30
            np.testing.assert_array_equal(params["w"], -465.0)
            await c.close()

    _run(main)


def test_a_pushed_stage_moves_a_hybrid_server_and_is_announced():
    """ASHL: a worker's staged optimizer moved on; its push's ``stage`` moves the
    server, its acknowledgement says so, the other workers get a stage NOTICE."""
    stages = [HybridStage("async", 4), HybridStage("semi_async", 1, 2)]

    async def main():
        async with _server("hybrid", stages=stages) as server:
            a, b = _client(server, "a"), _client(server, "b")
            for c in (a, b):
                await c.connect()
                await c.pull()
            ack = await a.push(_update(0.1), version=server.version, stage=0)
            assert ack.stage is None and ack.local_steps == 4
            ack = await a.push(_update(0.1), version=server.version, stage=1)
            assert ack.stage == 1 and ack.local_steps == 1 and a.stage == 1
            assert server.core.policy.stage == 1
            await b.refresh_info()  # a round trip after the notice
            assert b.stage == 1
            with pytest.raises(InvalidUpdate, match="last stage"):
                await a.push(_update(0.1), version=server.version, stage=2)
            with pytest.raises(ValueError, match="stage"):  # refused before sent
                await a.push(_update(0.1), version=server.version, stage=True)
            for c in (a, b):
                await c.close()

    _run(main)
