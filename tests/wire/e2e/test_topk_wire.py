"""Top-k sparsified pushes on the wire: sizes, round trips, refusals."""

import copy
import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _servers import Raw, _client, _run, _server, _server_params

from hpsjax.transforms import (
    last_topk_encoded,
    top_k,
    topk_decode_tree,
    topk_encode_tree,
    topk_nbytes,
)
from hpsjax.wire import _codecs, _frames, _treecodec
from hpsjax.wire import _errors as errors
from hpsjax.wire._codecs import _topk as _codecs_topk
from hpsjax.wire._decoders import DecoderCache
from hpsjax.wire._frames import MsgType
from hpsjax.wire._stream import FrameDecoder


def _model():
    rng = np.random.default_rng(0)
    return {
        "conv": rng.normal(size=(3, 3, 64, 128)).astype(np.float32),  # uint32 index
        "dense": rng.normal(size=(256, 100)).astype(np.float32),  # uint16 index
        "bias": rng.normal(size=(100,)).astype(np.float32),
    }


def _frame(encoded, tree, version=0, request_id=3):
    meta, bufs, layout = _treecodec.encoded_tree_to_wire(encoded, tree, "topk")
    parts = _frames.encode_frame(
        MsgType.PUSH, request_id, {"version": version, **meta}, bufs
    )
    return b"".join(bytes(p) for p in parts), meta, bufs, layout


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_frame_is_the_size_the_ratio_promises(ratio):
    tree = _model()
    encoded = topk_encode_tree(tree, ratio, jax.random.key(0))
    frame, meta, _, layout = _frame(encoded, tree)
    promised = sum(topk_nbytes(x.shape, x.dtype, ratio) for x in tree.values())
    assert layout.nbytes == promised
    # The measured frame (header and metadata included) within 5% of the promise.
    assert promised <= len(frame) <= 1.05 * promised, (len(frame), promised)
    assert meta["codec"] == {"scheme": "topk", "k": [e.indices.size for e in encoded]}


def test_round_trip_equals_decode_of_encode():
    tree = _model()
    encoded = topk_encode_tree(tree, 0.01, jax.random.key(1))
    frame, *_ = _frame(encoded, tree)
    (received,) = FrameDecoder().feed(frame)
    layout = received.payload.layout
    for (indices, values), enc in zip(received.payload.arrays, encoded, strict=True):
        np.testing.assert_array_equal(indices, np.asarray(enc.indices))
        np.testing.assert_array_equal(values, np.asarray(enc.values))
        _codecs_topk.check_topk_leaf(indices, values, int(np.max(indices)) + 1)
    codec = _codecs.wire_codec(layout.codec)
    cache = DecoderCache([(s.shape, s.dtype.name) for s in layout.leaves])
    decoded = cache.get(codec)(received.payload.arrays)
    assert len(cache) == 0  # nothing compiled, nothing kept
    want = topk_decode_tree(encoded, tree)
    got = _treecodec.unflatten_tree(layout.structure, decoded)
    for key in tree:
        np.testing.assert_array_equal(got[key], np.asarray(want[key]))


def test_piecewise_frames_decode_alike():
    tree = _model()
    encoded = topk_encode_tree(tree, 0.05, jax.random.key(2))
    frame, *_ = _frame(encoded, tree)
    rng, decoder, events, i = random.Random(0), FrameDecoder(), [], 0
    while i < len(frame):
        n = rng.randint(1, 5000)
        events += decoder.feed(frame[i : i + n])
        i += n
    (received,) = events
    for (indices, _), enc in zip(received.payload.arrays, encoded, strict=True):
        np.testing.assert_array_equal(indices, np.asarray(enc.indices))


@functools.cache
def _good_meta():
    # Encoded once: the cases below are built when the module is collected.
    tree = {"w": np.zeros(10, np.float32)}
    enc = topk_encode_tree(tree, 0.3)
    meta, _, _ = _treecodec.encoded_tree_to_wire(enc, tree, "topk")
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
        (_meta_with(codec={"scheme": "topk", "k": [11]}), "k=11 > 10"),
        (_meta_with(codec={"scheme": "topk", "k": [3, 3]}), "must list 1"),
        (_meta_with(codec={"scheme": "topk", "k": [-1]}), "must list 1"),
        (_meta_with(codec={"scheme": "topk", "k": [3], "bits": 8}), "only 'scheme'"),
        (_meta_with(leaf_entry=["float32", [10], 0, 20, 6]), "top-k sizes"),
        (_meta_with(leaf_entry=["float32", [10], 0, 24, 12]), "top-k sizes"),
        (_meta_with(leaf_entry=["int32", [10], 0, 18, 6]), "must be floating"),
    ],
)
def test_bad_descriptions_are_refused(meta, message):
    with pytest.raises(errors.MalformedMetadata, match=message):
        _treecodec.tree_layout(meta)


@pytest.mark.parametrize(
    "indices,values,error,message",
    [
        ([1, 10], [1.0, 2.0], errors.InvalidUpdate, "out of range"),
        ([3, 3], [1.0, 2.0], errors.InvalidUpdate, "strictly increasing"),
        ([4, 2], [1.0, 2.0], errors.InvalidUpdate, "strictly increasing"),
        ([1, 2], [np.nan, 2.0], errors.NonFiniteUpdate, "NaN or infinity"),
        ([1, 2], [1.0, np.inf], errors.NonFiniteUpdate, "NaN or infinity"),
    ],
)
def test_bad_values_are_refused(indices, values, error, message):
    indices = np.array(indices, np.uint16)
    values = np.array(values, np.float32)
    with pytest.raises(error, match=message):
        _codecs_topk.check_topk_leaf(indices, values, 10)


def test_sender_refuses_leaves_that_do_not_fit():
    tree = {"w": np.zeros(10, np.float32)}
    enc = topk_encode_tree(tree, 0.3)
    bad = [enc[0]._replace(indices=enc[0].indices.astype(jnp.uint32))]
    with pytest.raises(errors.SpecMismatch, match="uint16 indices"):
        _treecodec.encoded_tree_to_wire(bad, tree, "topk")
    bad = [enc[0]._replace(values=enc[0].values[:2])]
    with pytest.raises(errors.SpecMismatch, match="values"):
        _treecodec.encoded_tree_to_wire(bad, tree, "topk")


def test_server_applies_the_transform_bytes_and_refuses_bad_frames():
    params = {"b": jnp.zeros(3, jnp.float32), "w": jnp.zeros((40, 30), jnp.float32)}
    opt = top_k(0.05, seed=4)
    grads = {
        "b": jnp.arange(3.0),
        "w": jax.random.normal(jax.random.key(0), (40, 30)),
    }
    state = opt.init(params)
    sent, state = jax.jit(opt.update)(grads, state)
    encoded = last_topk_encoded(state)

    async def main():
        async with _server("asp", params=params) as server:
            c = _client(server, "topk")
            await c.connect()
            _, v = await c.pull()
            before = c.bytes_sent
            ack = await c.push(encoded=encoded, codec="topk", version=v)
            assert ack.applied
            pushed = c.bytes_sent - before
            got = _server_params(server)
            for key in params:
                # sgd(1.0) from zero: minus exactly what the transform output.
                np.testing.assert_array_equal(got[key], -np.asarray(sent[key]))
            with pytest.raises(ValueError, match="encoded="):
                await c.push(grads, codec="topk", version=ack.version)
            await c.close()

            # Bad frames by hand: refused with their codes, the connection kept.
            raw = await Raw.open(server.port, worker_id="raw")
            raw.send(MsgType.PULL, 3)
            pulled = await raw.recv()
            version = pulled.metadata["version"]
            meta, bufs, _ = _treecodec.encoded_tree_to_wire(encoded, params, "topk")
            idx = np.asarray(encoded[1].indices).copy()
            idx[-1] = 1200  # out of range for 1200 elements
            bad = [bufs[0], bufs[1], memoryview(idx.view(np.uint8)), bufs[3]]
            raw.send(MsgType.PUSH, 4, {"version": version, **meta}, bad)
            assert "out of range" in await raw.expect_error(30, 4)
            idx[-1] = idx[-2]
            bad = [bufs[0], bufs[1], memoryview(idx.view(np.uint8)), bufs[3]]
            raw.send(MsgType.PUSH, 5, {"version": version, **meta}, bad)
            assert "increasing" in await raw.expect_error(30, 5)
            vals = np.asarray(encoded[1].values).copy()
            vals[0] = np.nan
            bad = [bufs[0], bufs[1], bufs[2], memoryview(vals.view(np.uint8))]
            raw.send(MsgType.PUSH, 6, {"version": version, **meta}, bad)
            assert "NaN" in await raw.expect_error(32, 6)
            too_many = {**meta, "codec": {"scheme": "topk", "k": [3, 1201]}}
            raw.send(MsgType.PUSH, 7, {"version": version, **too_many}, bufs)
            await raw.expect_error(14, 7)
            # Still serving, and nothing refused changed the parameters.
            raw.send(MsgType.PULL, 8)
            assert (await raw.recv()).metadata["version"] == version
            np.testing.assert_array_equal(_server_params(server)["w"], got["w"])
            await raw.close()
            return pushed

    pushed = _run(main)
    promised = sum(topk_nbytes(x.shape, x.dtype, 0.05) for x in params.values())
    assert promised < pushed < promised + 512  # header and metadata


def test_chained_transform_state_is_found():
    opt = optax.chain(top_k(0.5), optax.sgd(1.0))
    state = opt.init({"w": jnp.zeros(4)})
    _, state = opt.update({"w": jnp.arange(4.0)}, state)
    (enc,) = last_topk_encoded(state)
    meta, _, _ = _treecodec.encoded_tree_to_wire(
        [enc], {"w": jnp.zeros(4)}, _codecs.TopKCodec((2,))
    )
    assert meta["codec"]["k"] == [2]
