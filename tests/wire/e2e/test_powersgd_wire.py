"""PowerSGD pushes on the wire: sizes, round trips, refusals, worker, simulator.

The server decodes ``p q^T`` with numpy's float32 matmul, the transform with
XLA's: each decoded value is the same sum of ``r`` float32 products, added in
another order, so the two agree to a rounding (``rtol=1e-6``), not bit for
bit. Leaves sent whole are their bytes: those agree exactly.
"""

import asyncio
import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _servers import SECRET, Raw, _client, _run, _server, _server_params

from hpsjax import data
from hpsjax.net._client import Client
from hpsjax.sim import ComputeModel, SimConfig, WorkerSpec, simulate
from hpsjax.transforms import (
    PowerSGDEncoded,
    last_powersgd_encoded,
    power_sgd,
    powersgd_decode_tree,
    powersgd_encode,
    powersgd_nbytes,
)
from hpsjax.wire import _codecs, _frames, _treecodec
from hpsjax.wire import _errors as errors
from hpsjax.wire._decoders import DecoderCache
from hpsjax.wire._frames import MsgType
from hpsjax.wire._stream import FrameDecoder
from hpsjax.worker import Worker, WorkerConfig

RTOL = 1e-6


def _model():
    rng = np.random.default_rng(0)
    return {
        "bias": rng.normal(size=(100,)).astype(np.float32),  # 1-D: whole
        "conv": rng.normal(size=(64, 3, 3, 32)).astype(np.float32),  # 64 x 288
        "dense": rng.normal(size=(256, 100)).astype(np.float32),
        "thin": rng.normal(size=(2, 2)).astype(np.float32),  # too thin: whole
    }


def _encoded(tree, rank, seed=0):
    """The factors ``power_sgd`` keeps after one update of ``tree``."""
    opt = power_sgd(rank, seed=seed)
    out, state = jax.jit(opt.update)(tree, opt.init(tree))
    return jax.device_get(last_powersgd_encoded(state)), out


def _promised(tree, rank):
    return sum(powersgd_nbytes(x.shape, x.dtype, rank) for x in jax.tree.leaves(tree))


def _frame(encoded, tree, version=0, request_id=3):
    meta, bufs, layout = _treecodec.encoded_tree_to_wire(encoded, tree, "powersgd")
    parts = _frames.encode_frame(
        MsgType.PUSH, request_id, {"version": version, **meta}, bufs
    )
    return b"".join(bytes(p) for p in parts), meta, layout


@pytest.mark.parametrize("rank", [1, 4])
def test_frame_is_the_size_the_rank_promises(rank):
    tree = _model()
    encoded, _ = _encoded(tree, rank)
    frame, meta, layout = _frame(encoded, tree)
    promised = _promised(tree, rank)
    assert layout.nbytes == promised
    header = _frames.unpack_header(memoryview(frame)[: _frames.HEADER_SIZE])
    assert header.payload_length == promised
    # Exactly: the fixed header, the metadata, then the factors' bytes.
    assert len(frame) == _frames.HEADER_SIZE + header.metadata_length + promised
    assert header.metadata_length < 200
    assert meta["codec"] == {"scheme": "powersgd", "rank": [0, rank, rank, 0]}
    raw = sum(x.nbytes for x in tree.values())
    assert promised < raw / 10


def test_round_trip_decodes_to_powersgd_decode():
    tree = _model()
    encoded, out = _encoded(tree, 2)
    frame, *_ = _frame(encoded, tree)
    (received,) = FrameDecoder().feed(frame)
    layout = received.payload.layout
    for (p, q), enc in zip(received.payload.arrays, encoded, strict=True):
        np.testing.assert_array_equal(p, enc.p)
        np.testing.assert_array_equal(q, enc.q)
    codec = _codecs.wire_codec(layout.codec)
    assert codec == _codecs.PowerSGDCodec((0, 2, 2, 0))
    cache = DecoderCache([(s.shape, s.dtype.name) for s in layout.leaves])
    decoded = cache.get(codec)(received.payload.arrays)
    assert len(cache) == 0  # nothing compiled, nothing kept
    with pytest.raises(ValueError, match="not compiled"):
        cache.compile(codec)
    got = _treecodec.unflatten_tree(layout.structure, decoded)
    want = powersgd_decode_tree(encoded, tree)
    for key in tree:
        assert got[key].shape == tree[key].shape and got[key].dtype == np.float32
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, atol=1e-7)
        # What the transform output (and its error feedback assumed).
        np.testing.assert_allclose(got[key], out[key], rtol=RTOL, atol=1e-7)
    for key in ("bias", "thin"):
        np.testing.assert_array_equal(got[key], tree[key])


def test_bf16_factors_travel_in_the_leaf_dtype():
    tree = {"w": jnp.asarray(_model()["dense"], jnp.bfloat16)}
    enc = [powersgd_encode(tree["w"], 3, key=jax.random.key(0))]
    meta, _, layout = _treecodec.encoded_tree_to_wire(enc, tree, "powersgd")
    assert layout.nbytes == powersgd_nbytes((256, 100), jnp.bfloat16, 3)
    assert meta["leaves"] == [["bfloat16", [256, 100], 0, 356 * 3 * 2, 256 * 3 * 2]]


@functools.cache
def _good_meta():
    # Encoded once: the cases below are built when the module is collected.
    tree = {"w": np.ones((10, 8), np.float32)}
    enc, _ = _encoded(tree, 2)
    meta, _, _ = _treecodec.encoded_tree_to_wire(enc, tree, "powersgd")
    assert meta["leaves"] == [["float32", [10, 8], 0, 144, 80]]
    return meta


def _meta_with(leaf_entry=None, codec=None):
    meta = copy.deepcopy(_good_meta())
    if leaf_entry is not None:
        meta["leaves"] = [leaf_entry]
    if codec is not None:
        meta["codec"] = codec
    return meta


@pytest.mark.parametrize(
    "meta,message",
    [
        # Rank 3 needs 3 * (10 + 8) values, not the rank-2 factors' 2 * 18.
        (_meta_with(codec={"scheme": "powersgd", "rank": [3]}), "PowerSGD sizes"),
        (_meta_with(codec={"scheme": "powersgd", "rank": [5]}), "no smaller"),
        (_meta_with(codec={"scheme": "powersgd", "rank": [2, 2]}), "must list 1"),
        (_meta_with(codec={"scheme": "powersgd", "rank": [-1]}), "must list 1"),
        (_meta_with(codec={"scheme": "powersgd", "rank": 2}), "must list 1"),
        (_meta_with(codec={"scheme": "powersgd", "rank": [2], "k": 1}), "only"),
        # A factor of the wrong shape: p of 9 x 2 (q would follow at 72).
        (_meta_with(leaf_entry=["float32", [10, 8], 0, 144, 72]), "PowerSGD sizes"),
        (_meta_with(leaf_entry=["float32", [10, 8], 0, 140, 80]), "PowerSGD sizes"),
        (_meta_with(leaf_entry=["int32", [10, 8], 0, 144, 80]), "must be floating"),
    ],
)
def test_bad_descriptions_are_refused(meta, message):
    with pytest.raises(errors.MalformedMetadata, match=message):
        _treecodec.tree_layout(meta)


def test_sender_refuses_factors_that_do_not_fit():
    tree = {"w": np.ones((10, 8), np.float32), "b": np.ones(8, np.float32)}
    enc, _ = _encoded(tree, 2)  # leaf order: b, w
    b, w = enc

    def refused(encoded, match):
        with pytest.raises(errors.SpecMismatch, match=match):
            _treecodec.encoded_tree_to_wire(encoded, tree, "powersgd")

    refused([w], "1 encoded leaves for a tree of 2")
    refused([b, w._replace(q=w.q[:, :1])], "do not fit shape")  # ranks differ
    refused([b, w._replace(p=w.p[:9])], "do not fit shape")
    refused([b, w._replace(q=w.q.astype(np.float16))], "got float32 and float16")
    refused([b, w.p], "a \\(p, q\\) pair")
    refused([b._replace(p=b.p[:7]), w], "do not fit shape")
    wide = PowerSGDEncoded(np.ones((10, 5), np.float32), np.ones((8, 5), np.float32))
    refused([b, wide], "no smaller")


def test_server_applies_the_factors_as_a_raw_push_of_their_product():
    params = {"b": jnp.zeros(30, jnp.float32), "w": jnp.zeros((40, 30), jnp.float32)}
    grads = {
        "b": jnp.arange(30.0),
        "w": jax.random.normal(jax.random.key(0), (40, 30)),
    }
    encoded, out = _encoded(grads, 2, seed=4)
    decoded = jax.device_get(powersgd_decode_tree(encoded, params))

    async def main():
        async with _server("asp", params=params) as server:
            c = _client(server, "raw")
            await c.connect()
            _, v = await c.pull()
            await c.push(decoded, version=v)
            by_raw = _server_params(server)
            await c.close()
        async with _server("asp", params=params) as server:
            c = _client(server, "powersgd")
            await c.connect()
            _, v = await c.pull()
            before = c.bytes_sent
            ack = await c.push(encoded=encoded, codec="powersgd", version=v)
            assert ack.applied
            pushed = c.bytes_sent - before
            got = _server_params(server)
            for key in params:
                np.testing.assert_allclose(got[key], by_raw[key], rtol=RTOL, atol=1e-7)
                np.testing.assert_allclose(got[key], -out[key], rtol=RTOL, atol=1e-7)
            np.testing.assert_array_equal(got["b"], -np.arange(30.0))  # whole
            # push_pull takes them alike.
            ack, pulled, version = await c.push_pull(
                encoded=encoded, codec="powersgd", version=ack.version
            )
            assert ack.applied and version == 2
            np.testing.assert_allclose(pulled["w"], 2 * got["w"], rtol=RTOL)
            # Wrong input fails here, in one line, and sends nothing.
            sent = c.bytes_sent
            with pytest.raises(ValueError, match="encoded="):
                await c.push(grads, codec="powersgd", version=version)
            with pytest.raises(errors.SpecMismatch, match="1 encoded leaves"):
                await c.push(encoded=encoded[1:], codec="powersgd", version=version)
            thin = [encoded[0], encoded[1]._replace(q=encoded[1].q[:, :1])]
            with pytest.raises(errors.SpecMismatch, match="do not fit"):
                await c.push(encoded=thin, codec="powersgd", version=version)
            assert c.bytes_sent == sent
            await c.close()
            return pushed

    pushed = _run(main)
    _, _, layout = _treecodec.encoded_tree_to_wire(encoded, params, "powersgd")
    assert layout.nbytes == _promised(params, 2) == (30 + 2 * 70) * 4
    # The client's frame is the header, its metadata and the factors.
    assert _promised(params, 2) < pushed < _promised(params, 2) + 256


def test_server_refuses_bad_pushes_and_changes_nothing():
    params = {"b": jnp.zeros(30, jnp.float32), "w": jnp.zeros((40, 30), jnp.float32)}
    grads = {"b": jnp.ones(30), "w": jax.random.normal(jax.random.key(1), (40, 30))}
    encoded, _ = _encoded(grads, 2)

    async def main():
        async with _server("asp", params=params) as server:
            raw = await Raw.open(server.port, worker_id="raw")
            raw.send(MsgType.PULL, 3)
            version = (await raw.recv()).metadata["version"]
            meta, bufs, _ = _treecodec.encoded_tree_to_wire(encoded, params, "powersgd")
            head = {"version": version}

            def push(request_id, meta=meta, bufs=bufs):
                raw.send(MsgType.PUSH, request_id, {**head, **meta}, bufs)

            # Wrong rank: the codec says 3, the factors are rank 2.
            push(4, {**meta, "codec": {"scheme": "powersgd", "rank": [0, 3]}})
            assert "PowerSGD sizes" in await raw.expect_error(14, 4)
            # Wrong factor shape: p of 39 x 2 and q of 31 x 2 (same bytes).
            leaves = [meta["leaves"][0], ["float32", [40, 30], 120, 560, 312]]
            push(5, {**meta, "leaves": leaves})
            assert "PowerSGD sizes" in await raw.expect_error(14, 5)
            # Wrong leaf count.
            push(6, {**meta, "codec": {"scheme": "powersgd", "rank": [0, 2, 2]}})
            assert "must list 2" in await raw.expect_error(14, 6)
            one = _treecodec.encoded_tree_to_wire(
                encoded[1:], {"w": params["w"]}, "powersgd"
            )
            push(7, one[0], one[1])
            await raw.expect_error(31, 7)
            # A leaf the model has in another shape (its factors fit that one).
            other = _treecodec.encoded_tree_to_wire(
                [encoded[0], powersgd_encode(grads["w"].T, 2, key=jax.random.key(0))],
                {"b": params["b"], "w": params["w"].T},
                "powersgd",
            )
            push(8, other[0], other[1])
            assert "model has float32[40, 30]" in await raw.expect_error(31, 8)
            # A non-finite factor, p or q, or a leaf sent whole.
            for request_id, (leaf, part) in enumerate(((1, 0), (1, 1), (0, 0)), 9):
                factor = np.array(encoded[leaf][part])
                factor.flat[3] = np.nan if part else np.inf
                bad = list(bufs)
                bad[2 * leaf + part] = memoryview(factor.reshape(-1).view(np.uint8))
                push(request_id, bufs=bad)
                assert "NaN or infinity" in await raw.expect_error(32, request_id)
            # Finite factors whose product overflows float32.
            p, q = np.array(encoded[1].p), np.array(encoded[1].q)
            p[0, 0], q[0, 0] = 4.0, 3e38
            bad = [bufs[0], *(memoryview(x.reshape(-1).view(np.uint8)) for x in (p, q))]
            push(12, bufs=bad)
            assert "NaN or infinity" in await raw.expect_error(32, 12)
            # Still serving, and nothing refused changed the parameters.
            raw.send(MsgType.PULL, 13)
            assert (await raw.recv()).metadata["version"] == version
            for value in _server_params(server).values():
                np.testing.assert_array_equal(value, np.zeros_like(value))
            push(14)
            ack = await raw.recv()
            assert ack.msg_type == MsgType.PUSH_ACK, ack
            assert ack.metadata["version"] == version + 1
            await raw.close()

    _run(main)


class _RecordingClient(Client):
    """A client noting the metadata, payload and wire bytes of each push."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pushed = []

    async def _request(self, msg_type, meta, buffers=(), **kwargs):
        if msg_type not in (MsgType.PUSH, MsgType.PUSH_PULL):
            return await super()._request(msg_type, meta, buffers, **kwargs)
        before = self.bytes_sent
        frame_bytes = sum(
            len(p) for p in _frames.encode_frame(msg_type, 1, meta, buffers)
        )
        payload = sum(b.nbytes for b in buffers)
        frame = await super()._request(msg_type, meta, buffers, **kwargs)
        # Nothing else is sent meanwhile: without the pipeline a round pushes
        # and pulls in one push_pull.
        self.pushed.append(
            (meta["codec"], payload, frame_bytes, self.bytes_sent - before)
        )
        return frame


def test_a_worker_with_power_sgd_pushes_its_factors():
    train = data.synthetic_digits(256, seed=0)
    rng = np.random.default_rng(0)
    params = {
        "kernel": (rng.normal(size=(64, 32)) / 8).astype(np.float32),
        "bias": np.zeros(32, np.float32),
    }

    def loss_fn(p, batch):
        x = jnp.reshape(batch.x, (batch.x.shape[0], -1))
        logits = x @ p["kernel"] + p["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :10], batch.y)

    rank = 2

    async def main():
        async with _server("asp", params=params, lr=0.1) as server:
            client = _RecordingClient(
                "127.0.0.1", server.port, worker_id="w0", secret=SECRET, timeout=30.0
            )
            config = WorkerConfig(
                port=server.port,
                worker_id="w0",
                secret=SECRET,
                batch_size=16,
                powersgd_rank=rank,
                overlap="none",
                max_steps=3,
            )
            worker = Worker(
                config,
                loss_fn=loss_fn,
                batches=train.batches(16, seed=0).next,
                client=client,
            )
            summary = await worker.run()
            return summary, client.pushed, server.version

    summary, pushed, version = asyncio.run(asyncio.wait_for(main(), 60))
    assert summary.pushes == 3 and version == 3
    promised = _promised(params, rank)
    assert promised == 32 * 4 + rank * (64 + 32) * 4  # bias whole, kernel factors
    assert len(pushed) == 3
    for codec, payload, frame_bytes, on_wire in pushed:
        assert codec == {"scheme": "powersgd", "rank": [0, rank]}
        assert payload == promised
        assert on_wire == frame_bytes < promised + 256


def test_config_refuses_rank_with_bits():
    with pytest.raises(ValueError, match="powersgd_rank"):
        WorkerConfig(powersgd_rank=0)
    with pytest.raises(ValueError, match="not both"):
        WorkerConfig(powersgd_rank=2, bits=8)


def test_simulated_push_bytes_are_the_real_frames_payload():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(8, 16)) * 0.3, jnp.float32),
        "b1": jnp.zeros(16),
        "w2": jnp.asarray(rng.normal(size=(16, 4)) * 0.3, jnp.float32),
    }
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.integers(0, 4, 256).astype(np.int32)

    def loss_fn(p, batch):
        xb, yb = batch
        logits = jax.nn.relu(xb @ p["w1"] + p["b1"]) @ p["w2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    rank = 2
    encoded, _ = _encoded(params, rank)
    _, _, layout = _treecodec.encoded_tree_to_wire(encoded, params, "powersgd")
    # w1: 2 (8 + 16) < 128, w2: 2 (16 + 4) < 64 are factors, b1 whole.
    assert layout.codec["rank"] == [0, rank, rank]
    assert layout.nbytes == _promised(params, rank) == (16 + 48 + 40) * 4
    workers = [WorkerSpec(ComputeModel(step_time=0.1), batch_size=16)]
    result = simulate(
        loss_fn,
        params,
        (x, y),
        workers,
        SimConfig(
            policy="asp",
            learning_rate=0.1,
            max_updates=4,
            push_transform=power_sgd(rank),
        ),
    )
    assert len(result.pushes) >= 4
    assert result.bytes_sent[0] == layout.nbytes * len(result.pushes)


def test_an_overflowing_product_decodes_to_infinity_without_a_warning():
    # float16 factors, finite, whose product 300 * 300 is over float16's 65504.
    p = np.full((8, 1), 300.0, np.float16)
    q = np.full((6, 1), 300.0, np.float16)
    cache = DecoderCache([((8, 6), "float16")])
    (leaf,) = cache.get(_codecs.PowerSGDCodec((1,)))([(p, q)])
    assert leaf.dtype == np.float16 and np.isinf(leaf).all()
    assert cache.get(_codecs.PowerSGDCodec((1, 1))) is None
    with pytest.raises(ValueError, match="does not match"):
        cache.decoder(_codecs.PowerSGDCodec((1, 1)))


def test_protocol_example():
    tree = {"b": np.arange(3, dtype=np.float32), "w": np.ones((4, 3), np.float32)}
    encoded = [
        PowerSGDEncoded(tree["b"], np.zeros(0, np.float32)),
        PowerSGDEncoded(np.ones((4, 1), np.float32), np.ones((3, 1), np.float32)),
    ]
    meta, bufs, layout = _treecodec.encoded_tree_to_wire(encoded, tree, "powersgd")
    assert meta["codec"] == {"scheme": "powersgd", "rank": [0, 1]}
    assert meta["leaves"] == [
        ["float32", [3], 0, 12, 12],
        ["float32", [4, 3], 12, 28, 16],
    ]
    assert sum(b.nbytes for b in bufs) == layout.nbytes == 40
