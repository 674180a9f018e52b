"""Tests of the wire format: frames, tree metadata, limits and the frame reader."""

import doctest
import random
import struct

import ml_dtypes
import msgpack
import numpy as np
import pytest

from hpsjax.net import _auth
from hpsjax.wire import (
    Challenge,
    Hello,
    InfoMessage,
    ParamsMeta,
    Proof,
    Subscribe,
    Subscribed,
    _codecs,
    _decoders,
    _frames,
    _stream,
    _treecodec,
)
from hpsjax.wire import _errors as errors
from hpsjax.wire._codecs import _powersgd, _quantized, _topk
from hpsjax.wire._frames import MsgType
from hpsjax.wire._stream import FrameDecoder

# Representative metadata of every message type (PROTOCOL.md).
_TREE = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
_TREE_META, _TREE_BUFS, _ = _treecodec.tree_to_wire(_TREE)
MESSAGES = {
    MsgType.HELLO: ({"worker_id": "w0", "nonce": b"\x01" * 32, "client": "x"}, []),
    MsgType.CHALLENGE: ({"nonce": b"\x02" * 32, "auth": "hmac-sha256"}, []),
    MsgType.AUTH: ({"proof": b"\x03" * 32}, []),
    MsgType.AUTH_OK: ({"proof": b"\x04" * 32, "info": {"version": 3}}, []),
    MsgType.INFO: ({"policy": "asp", "version": 3}, []),
    MsgType.NOTICE: ({"notice": "stage", "stage": 1}, []),
    MsgType.PULL: ({}, []),
    MsgType.PARAMS: ({"version": 3, **_TREE_META}, _TREE_BUFS),
    MsgType.PUSH: ({"version": 2, **_TREE_META}, _TREE_BUFS),
    MsgType.PUSH_ACK: ({"version": 4, "staleness": 1, "status": "applied"}, []),
    MsgType.PUSH_PULL: ({"version": 2, **_TREE_META}, _TREE_BUFS),
    MsgType.SUBSCRIBE: ({"on": True}, []),
    MsgType.ERROR: ({"code": 31, "message": "shape"}, []),
    MsgType.BYE: ({"reason": "done"}, []),
}


def _join(parts):
    return b"".join(bytes(p) for p in parts)


def _feed_chunked(decoder, data, rng, max_chunk=97):
    events = []
    i = 0
    while i < len(data):
        n = rng.randint(1, max_chunk)
        events.extend(decoder.feed(data[i : i + n]))
        i += n
    return events


def _assert_trees_equal(got, want):
    assert type(got) is type(want) or (want is None and got is None)
    if isinstance(want, dict):
        assert sorted(got) == sorted(want)
        for k in want:
            _assert_trees_equal(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_trees_equal(g, w)
    elif want is not None:
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_every_message_type_round_trips():
    assert set(MESSAGES) == set(MsgType)
    stream = b""
    for rid, (t, (meta, bufs)) in enumerate(MESSAGES.items(), start=1):
        stream += _join(_frames.encode_frame(t, rid, meta, bufs))
    frames = _feed_chunked(FrameDecoder(), stream, random.Random(0))
    assert [f.msg_type for f in frames] == list(MESSAGES)
    assert [f.request_id for f in frames] == list(range(1, len(MESSAGES) + 1))
    for f in frames:
        meta, bufs = MESSAGES[f.msg_type]
        assert f.metadata == meta
        if bufs:
            _assert_trees_equal(f.payload.tree(), _TREE)
        else:
            assert f.payload is None


def test_header_layout_is_little_endian_24_bytes():
    header = _frames.pack_header(MsgType.PUSH, 0x01020304, 0x10, 0x0102030405)
    assert len(header) == _frames.HEADER_SIZE == 24
    assert header[:4] == b"HPSJ" and header[4] == 1 and header[5] == 9
    assert header[6:8] == b"\0\0"
    assert header[8:12] == bytes([4, 3, 2, 1])
    assert struct.unpack("<IQ", header[12:24]) == (0x10, 0x0102030405)


@pytest.mark.parametrize(
    "tree",
    [
        {"conv": {"kernel": np.ones((3, 3, 2, 4), np.float32), "bias": np.zeros(4)}},
        [np.arange(5, dtype=np.int32), (np.float16(1.5), None), {"z": []}],
        (np.array(True), np.zeros((0, 3), np.uint8), {"a": {"b": {"c": ()}}}),
        {"bf": np.arange(4).astype(ml_dtypes.bfloat16), "i8": np.int8(-3)},
        np.ones((2, 2), np.float64),
    ],
)
def test_tree_round_trip(tree):
    meta, bufs, layout = _treecodec.tree_to_wire(tree)
    packed = msgpack.packb(meta, use_bin_type=True)
    received = _treecodec.tree_layout(msgpack.unpackb(packed))
    assert received.leaves == layout.leaves
    frame_bytes = _join(_frames.encode_frame(MsgType.PARAMS, 9, meta, bufs))
    for scratch in (32, 1 << 16):
        (frame,) = _feed_chunked(
            FrameDecoder(scratch_bytes=scratch), frame_bytes, random.Random(1)
        )
        want = tree
        if not isinstance(tree, (dict, list, tuple)):
            want = np.asarray(tree)
        _assert_trees_equal(frame.payload.tree(), _normalise(want))


def _normalise(tree):
    # Scalars become 0-d arrays on the wire; containers keep their type.
    if isinstance(tree, dict):
        return {k: _normalise(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_normalise(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_normalise(v) for v in tree)
    return None if tree is None else np.asarray(tree)


def test_flatten_order_matches_jax():
    import jax

    tree = {"b": [1.0, 2.0], "a": {"y": 3.0, "x": (4.0, 5.0)}, "c": None}
    _, leaves = _treecodec.flatten_tree(tree)
    assert leaves == jax.tree.leaves(tree)


def test_large_leaf_is_received_in_place():
    big = np.arange(1 << 18, dtype=np.float32)
    meta, bufs, _ = _treecodec.tree_to_wire({"big": big, "small": np.ones(3)})
    data = _join(_frames.encode_frame(MsgType.PARAMS, 1, meta, bufs))
    dec = FrameDecoder(scratch_bytes=4096)
    header_len = _frames.HEADER_SIZE + len(msgpack.packb(meta, use_bin_type=True))
    assert dec.feed(data[:header_len]) == []
    buf = dec.get_buffer()
    # The reader hands out a view of the destination leaf, not of scratch.
    assert len(buf) == big.nbytes
    assert dec._direct == "payload"
    buf[: big.nbytes] = data[header_len : header_len + big.nbytes]
    assert dec.buffer_updated(big.nbytes) == []
    (frame,) = dec.feed(data[header_len + big.nbytes :])
    dest = frame.payload.arrays[0]
    assert np.shares_memory(dest, np.frombuffer(buf, np.uint8))
    np.testing.assert_array_equal(dest, big)


def test_large_metadata_gets_its_own_buffer():
    tree = {f"leaf_{i:05d}": np.float32(i) for i in range(3000)}
    meta, bufs, _ = _treecodec.tree_to_wire(tree)
    data = _join(_frames.encode_frame(MsgType.PARAMS, 1, meta, bufs))
    (frame,) = _feed_chunked(
        FrameDecoder(scratch_bytes=1024), data, random.Random(2), 5000
    )
    _assert_trees_equal(frame.payload.tree(), _normalise(tree))


# ---------------------------------------------------------------- malformed


def test_garbage_bytes_are_bad_magic():
    dec = FrameDecoder()
    with pytest.raises(errors.BadMagic):
        dec.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    # A broken stream stays broken.
    with pytest.raises(errors.BadMagic):
        dec.buffer_updated(0)


def test_wrong_version():
    data = _frames.pack_header(MsgType.PULL, 1, 0, 0, version=2)
    with pytest.raises(errors.UnsupportedVersion, match="version 2"):
        FrameDecoder().feed(data)


def test_unknown_type_and_flags():
    with pytest.raises(errors.UnexpectedMessage):
        FrameDecoder().feed(_frames.pack_header(200, 1, 0, 0))
    with pytest.raises(errors.ProtocolError, match="flags"):
        FrameDecoder().feed(_frames.pack_header(MsgType.PULL, 1, 0, 0, flags=1))


def test_payload_on_a_control_message():
    with pytest.raises(errors.ProtocolError, match="no payload"):
        FrameDecoder().feed(_frames.pack_header(MsgType.PULL, 1, 0, 8))


def test_huge_payload_length_refused_before_allocation():
    calls = []

    def allocate(header, meta):
        calls.append(header)
        raise AssertionError("must not be called")

    dec = FrameDecoder(allocate=allocate)
    with pytest.raises(errors.PayloadTooBig, match="exceeds"):
        dec.feed(_frames.pack_header(MsgType.PUSH, 1, 0, 2**60))
    assert calls == []
    limits = _frames.WireLimits(max_metadata_bytes=100)
    with pytest.raises(errors.PayloadTooBig, match="metadata"):
        FrameDecoder(limits=limits).feed(_frames.pack_header(MsgType.PUSH, 1, 101, 0))


@pytest.mark.parametrize("cut", [3, 24, 30, 60])
def test_truncated_frame_is_connection_closed(cut):
    meta, bufs, _ = _treecodec.tree_to_wire({"w": np.ones(8, np.float32)})
    data = _join(_frames.encode_frame(MsgType.PUSH, 1, meta, bufs))
    assert cut < len(data)
    dec = FrameDecoder()
    assert dec.feed(data[:cut]) == []
    with pytest.raises(errors.ConnectionClosed):
        dec.eof()


def test_eof_between_frames_is_clean():
    dec = FrameDecoder()
    dec.feed(_join(_frames.encode_frame(MsgType.PULL, 1)))
    dec.eof()


def _tree_frame(meta, payload=b"", msg_type=MsgType.PUSH):
    packed = msgpack.packb(meta, use_bin_type=True)
    return (
        _frames.pack_header(msg_type, 7, len(packed), len(payload)) + packed + payload
    )


def _refusal(data, limits=_frames.DEFAULT_LIMITS):
    """Feeds a bad frame then a good one; returns the refusal's error."""
    good = _join(_frames.encode_frame(MsgType.PULL, 8))
    events = FrameDecoder(limits=limits).feed(data + good)
    assert len(events) == 2
    assert isinstance(events[0], _frames.FrameError) and events[0].request_id == 7
    assert isinstance(events[1], _frames.Frame) and events[1].request_id == 8
    return events[0].error


def test_too_many_leaves():
    tree = [np.float32(0)] * 10
    meta, bufs, _ = _treecodec.tree_to_wire(tree)
    payload = _join(bufs)
    limits = _frames.WireLimits(max_leaves=9)
    err = _refusal(_tree_frame(meta, payload), limits)
    assert isinstance(err, errors.TooManyLeaves)
    with pytest.raises(errors.TooManyLeaves):
        _treecodec.tree_to_wire(tree, limits=limits)


def test_deep_nesting_refused():
    structure = 0
    for _ in range(100):
        structure = ["l", [structure]]
    meta = {"tree": structure, "leaves": [["float32", [], 0, 4]], "codec": None}
    assert isinstance(_refusal(_tree_frame(meta, b"\0" * 4)), errors.TooManyLeaves)


@pytest.mark.parametrize("dtype", ["object", "float128", "<f4", "complex64", 5, ""])
def test_bad_dtype_strings(dtype):
    meta = {"tree": ["d", {"w": 0}], "leaves": [[dtype, [1], 0, 4]], "codec": None}
    assert isinstance(_refusal(_tree_frame(meta, b"\0" * 4)), errors.UnsupportedDtype)


def test_dtype_outside_configured_allow_list():
    meta, bufs, _ = _treecodec.tree_to_wire({"w": np.ones(2, np.float64)})
    limits = _frames.WireLimits(dtypes=frozenset({"float32"}))
    err = _refusal(_tree_frame(meta, _join(bufs)), limits)
    assert isinstance(err, errors.UnsupportedDtype)
    with pytest.raises(errors.UnsupportedDtype):
        _treecodec.tree_to_wire({"w": np.array(["a"])})


@pytest.mark.parametrize(
    "meta",
    [
        {"leaves": []},
        {"tree": ["d", {"w": 0}], "leaves": []},
        {"tree": ["x", []], "leaves": []},
        {"tree": ["d", {"w": 1}], "leaves": [["float32", [1], 0, 4]]},
        {"tree": ["d", {"w": True}], "leaves": [["float32", [1], 0, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [2], 0, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [1], 4, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [-1], 0, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [True], 0, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [1], 0, 4, 9]]},
        {"tree": ["d", {"w": 0}], "leaves": [["float32", [2**40, 2**40], 0, 4]]},
        {"tree": ["d", {"w": 0}], "leaves": "nope"},
    ],
)
def test_bad_tree_metadata(meta):
    err = _refusal(_tree_frame(meta, b"\0" * 4))
    assert isinstance(err, errors.MalformedMetadata)


def test_payload_length_must_match_tree():
    meta, bufs, _ = _treecodec.tree_to_wire({"w": np.ones(2, np.float32)})
    err = _refusal(_tree_frame(meta, _join(bufs) + b"\0" * 4))
    assert isinstance(err, errors.MalformedMetadata)


def test_undecodable_metadata():
    bad = b"\xc1\xff\x00"
    data = _frames.pack_header(MsgType.PULL, 7, len(bad), 0) + bad
    assert isinstance(_refusal(data), errors.MalformedMetadata)
    not_a_map = msgpack.packb([1, 2])
    data = _frames.pack_header(MsgType.PULL, 7, len(not_a_map), 0) + not_a_map
    assert isinstance(_refusal(data), errors.MalformedMetadata)


# 64 bytes of scratch receive a frame in pieces; 64 KiB holds small frames whole.
@pytest.mark.parametrize("scratch_bytes", [64, 1 << 16])
def test_allocator_errors_are_reported_per_frame(scratch_bytes):
    def allocate(header, meta):
        raise errors.SpecMismatch("leaf ['w']: shape differs")

    meta, bufs, _ = _treecodec.tree_to_wire({"w": np.ones(1000, np.float32)})
    data = _join(_frames.encode_frame(MsgType.PUSH, 7, meta, bufs))
    good = _join(_frames.encode_frame(MsgType.PULL, 8))
    events = FrameDecoder(allocate=allocate, scratch_bytes=scratch_bytes).feed(
        data + good
    )
    assert isinstance(events[0].error, errors.SpecMismatch)
    assert events[1].msg_type == MsgType.PULL


@pytest.mark.parametrize("scratch_bytes", [64, 4096, 1 << 16])
def test_on_filled_sees_each_leaf_as_it_arrives(scratch_bytes):
    tree = {
        "a": np.arange(5000, dtype=np.float32),
        "b": np.zeros(0, np.float32),
        "c": np.ones(3, np.int32),
    }
    meta, bufs, _ = _treecodec.tree_to_wire(tree)
    data = _join(_frames.encode_frame(MsgType.PUSH, 3, meta, bufs))
    seen = []

    def on_filled(payload, index):
        # The leaf is complete when announced, though the frame is not.
        seen.append((index, payload.arrays[index].copy()))

    dec = FrameDecoder(scratch_bytes=scratch_bytes, on_filled=on_filled)
    events = []
    for i in range(0, len(data), 1000):
        events += dec.feed(data[i : i + 1000])
    (frame,) = events
    assert [i for i, _ in seen] == [0, 2]  # the empty leaf has no bytes
    np.testing.assert_array_equal(seen[0][1], tree["a"])
    np.testing.assert_array_equal(seen[1][1], tree["c"])
    assert frame.request_id == 3


@pytest.mark.parametrize("scratch_bytes", [64, 1 << 16])
def test_on_filled_refusal_skips_the_rest_of_the_frame(scratch_bytes):
    calls = []

    def on_filled(payload, index):
        calls.append(index)
        raise errors.NonFiniteUpdate(f"leaf {index} holds NaN")

    meta, bufs, _ = _treecodec.tree_to_wire(
        {"a": np.ones(100, np.float32), "b": np.ones(100, np.float32)}
    )
    data = _join(_frames.encode_frame(MsgType.PUSH, 4, meta, bufs))
    good = _join(_frames.encode_frame(MsgType.PULL, 5))
    events = FrameDecoder(scratch_bytes=scratch_bytes, on_filled=on_filled).feed(
        data + good
    )
    assert calls == [0]
    assert isinstance(events[0], _frames.FrameError)
    assert isinstance(events[0].error, errors.NonFiniteUpdate)
    assert events[0].request_id == 4
    assert events[1].msg_type == MsgType.PULL


def test_whole_and_piecewise_frames_decode_alike():
    """Frames lying whole in the scratch buffer take a shorter path."""
    tree = {"a": np.arange(300, dtype=np.float32), "b": np.zeros(0, np.int8)}
    meta, bufs, _ = _treecodec.tree_to_wire(tree)
    stream = b"".join(
        [
            _join(_frames.encode_frame(MsgType.PUSH, 1, meta, bufs)),
            _join(_frames.encode_frame(MsgType.PULL, 2)),
            _join(
                _frames.encode_frame(MsgType.PUSH_PULL, 3, {**meta, "version": 4}, bufs)
            ),
            _join(_frames.encode_frame(MsgType.PUSH, 5, {"tree": 0}, bufs)),  # refused
            _join(_frames.encode_frame(MsgType.BYE, 6, {"reason": "done"})),
        ]
    )
    whole = FrameDecoder().feed(stream)
    piecewise = []
    dec = FrameDecoder(scratch_bytes=64)
    for i in range(0, len(stream), 7):
        piecewise += dec.feed(stream[i : i + 7])
    assert dec.idle
    assert len(whole) == len(piecewise) == 5
    for a, b in zip(whole, piecewise, strict=True):
        assert type(a) is type(b) and a.request_id == b.request_id
        if isinstance(a, _frames.FrameError):
            assert type(a.error) is type(b.error)
            continue
        assert a.metadata == b.metadata and a.nbytes == b.nbytes
        if a.payload is not None:
            for x, y in zip(a.payload.arrays, b.payload.arrays, strict=True):
                np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(whole[0].payload.tree()["a"], tree["a"])


@pytest.mark.parametrize("size", [16, _frames.JOIN_PAYLOAD_BYTES // 4 + 1])
def test_prepared_frame_is_the_encoded_frame(size):
    tree = {"w": np.arange(size, dtype=np.float32), "b": np.ones(3, np.int32)}
    meta, bufs, _ = _treecodec.tree_to_wire(tree)
    fields = [_frames.pack_fields(meta), _frames.pack_fields({"version": 7})]
    prepared = _frames.prepare_frame(MsgType.PARAMS, fields, bufs)
    for rid in (1, 2**32 - 1):
        want = _join(_frames.encode_frame_packed(MsgType.PARAMS, rid, fields, bufs))
        parts = prepared.parts(rid)
        assert _join(parts) == want and prepared.nbytes == len(want)
        # Small payloads travel in one buffer with the header and metadata.
        assert (len(parts) == 1) == (
            prepared.payload_length <= _frames.JOIN_PAYLOAD_BYTES
        )
    with pytest.raises(ValueError):
        prepared.parts(2**32)


@pytest.mark.parametrize("count", [0, 1, 15, 16, 70000])
def test_packed_fields_concatenate_into_one_map(count):
    # Map headers of each size class (fixmap, map 16, map 32) are cut off.
    fields = {f"k{i}": i for i in range(count)}
    extra = {"ack": {"version": 3, "reason": None}, "blob": b"\x00\x01"}
    parts = _frames.encode_frame_packed(
        MsgType.PARAMS, 9, [_frames.pack_fields(fields), _frames.pack_fields(extra)]
    )
    assert _frames.unpack_metadata(parts[0][_frames.HEADER_SIZE :]) == fields | extra


def test_metadata_keys_must_be_strings():
    for bad in ({b"k": 1}, {"a": 1, b"k": 2}):
        with pytest.raises(errors.MalformedMetadata, match="string keys"):
            _frames.unpack_metadata(msgpack.packb(bad, use_bin_type=True))
    with pytest.raises(errors.MalformedMetadata, match="string keys"):
        _frames.unpack_metadata(msgpack.packb([1, 2]))


def test_check_same_spec_names_the_leaf():
    model = _treecodec.tree_to_wire({"a": np.ones(3, np.float32), "b": np.ones(2)})[2]
    same = _treecodec.tree_to_wire({"a": np.zeros(3, np.float32), "b": np.zeros(2)})[2]
    _treecodec.check_same_spec(same, model)
    shape = _treecodec.tree_to_wire({"a": np.ones(4, np.float32), "b": np.ones(2)})[2]
    with pytest.raises(errors.SpecMismatch, match=r"\['a'\].*float32\[4\]"):
        _treecodec.check_same_spec(shape, model)
    dtype = _treecodec.tree_to_wire({"a": np.ones(3, np.float64), "b": np.ones(2)})[2]
    with pytest.raises(errors.SpecMismatch, match="float64"):
        _treecodec.check_same_spec(dtype, model)
    with pytest.raises(errors.SpecMismatch, match="structure"):
        _treecodec.check_same_spec(_treecodec.tree_to_wire({"a": np.ones(3)})[2], model)


def test_flatten_rejects_non_string_keys():
    with pytest.raises(ValueError, match="string"):
        _treecodec.tree_to_wire({1: np.ones(1)})


def test_request_id_range():
    with pytest.raises(ValueError):
        _frames.pack_header(MsgType.PULL, 2**32, 0, 0)


# ------------------------------------------------------------------ errors


def test_error_codes_are_unique_and_round_trip():
    classes = [errors.HpsError, *errors._all_subclasses(errors.HpsError)]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        code, message = errors.error_to_wire(cls("boom"))
        back = errors.error_from_wire(code, message)
        assert type(back) is cls and back.remote and back.message == "boom"


def test_foreign_exceptions_leak_nothing():
    code, message = errors.error_to_wire(RuntimeError("/secret/path line 3"))
    assert code == errors.ServerError.code and "secret" not in message
    long = errors.error_from_wire(31, "x" * 10_000)
    assert len(long.message) == errors.MAX_ERROR_MESSAGE_CHARS


# -------------------------------------------------------------- compressed


def _cnn_like():
    rng = np.random.default_rng(0)
    return {
        "conv": {"kernel": rng.normal(size=(3, 3, 16, 32)).astype(np.float32)},
        "dense": [
            rng.normal(size=(512, 64)).astype(np.float32),
            np.zeros(64, np.float32),
        ],
        "scalar": np.float32(0.5),
    }


@pytest.mark.parametrize(
    "codec_args,fraction",
    [
        ({"scheme": "uniform", "bits": 8}, 1 / 4),
        ({"scheme": "uniform", "bits": 4}, 1 / 8),
        ({"scheme": "sign", "block_size": 4096}, 1 / 32),
        ({"scheme": "qsgd", "levels": 127, "block_size": 256}, 1 / 4),
    ],
)
def test_compressed_payload_is_the_packed_size(codec_args, fraction):
    import jax

    from hpsjax.net._client import _encode_tree
    from hpsjax.transforms._quantize import Codec, encoded_nbytes

    codec = Codec(**codec_args)
    tree = _cnn_like()
    encoded = _encode_tree(tree, codec, jax.random.key(0))
    meta, bufs, layout = _treecodec.encoded_tree_to_wire(encoded, tree, codec)
    raw = sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))
    packed = sum(encoded_nbytes(np.shape(x), codec) for x in jax.tree.leaves(tree))
    assert layout.nbytes == sum(b.nbytes for b in bufs) == packed
    # Codes are exactly the fraction; scales add a little.
    assert fraction <= packed / raw < fraction * 1.05
    frame = _join(_frames.encode_frame(MsgType.PUSH, 3, {"version": 1, **meta}, bufs))
    assert len(frame) - packed < 1024  # header and metadata
    (received,) = _feed_chunked(FrameDecoder(), frame, random.Random(3), 4000)
    assert received.payload.layout.codec == codec.to_dict()
    for (codes, scales), enc in zip(received.payload.arrays, encoded, strict=True):
        np.testing.assert_array_equal(codes, np.asarray(enc.codes))
        np.testing.assert_array_equal(scales, np.asarray(enc.scales))


def test_compressed_metadata_is_validated():
    import jax

    from hpsjax.net._client import _encode_tree
    from hpsjax.transforms._quantize import Codec

    codec = Codec("uniform", 8, block_size=64)
    tree = {"w": np.ones(1000, np.float32)}
    encoded = _encode_tree(tree, codec, jax.random.key(0))
    meta, bufs, _ = _treecodec.encoded_tree_to_wire(encoded, tree, codec)
    payload = _join(bufs)
    bad_codes = {**meta, "leaves": [[*meta["leaves"][0][:4], 999]]}
    assert isinstance(
        _refusal(_tree_frame(bad_codes, payload)), errors.MalformedMetadata
    )
    bad_codec = {**meta, "codec": {"scheme": "zip", "bits": 8}}
    assert isinstance(
        _refusal(_tree_frame(bad_codec, payload)), errors.MalformedMetadata
    )
    not_a_map = {**meta, "codec": [1, 2]}
    assert isinstance(
        _refusal(_tree_frame(not_a_map, payload)), errors.MalformedMetadata
    )
    short_entry = {**meta, "leaves": [meta["leaves"][0][:4]]}
    assert isinstance(
        _refusal(_tree_frame(short_entry, payload)), errors.MalformedMetadata
    )
    with pytest.raises(errors.SpecMismatch):
        _treecodec.encoded_tree_to_wire(encoded, {"w": np.ones(999, np.float32)}, codec)
    with pytest.raises(errors.SpecMismatch):
        _treecodec.encoded_tree_to_wire(encoded + encoded, tree, codec)


def test_buffer_pool_reuses_only_released_blocks():
    pool = _frames.BufferPool(max_blocks=2)
    tree = {"a": np.ones(100, np.float32), "b": np.ones(3)}
    layout = _treecodec.tree_to_wire(tree)[2]
    first = layout.allocate(pool)
    second = layout.allocate(pool)
    assert not np.shares_memory(first[0], second[0])
    for leaf in first + second:
        assert leaf.ctypes.data % _frames.ALIGNMENT == 0
    address = first[0].ctypes.data
    del first
    third = layout.allocate(pool)
    assert third[0].ctypes.data == address
    # Over max_blocks in use: a fresh block, not kept.
    fourth = layout.allocate(pool)
    assert not any(np.shares_memory(fourth[0], x[0]) for x in (second, third))


def test_layout_cache_validates_once_and_never_remembers_refusals():
    checked = []

    def check(layout):
        checked.append(layout)
        if layout.leaves[0].shape == (5,):
            raise errors.SpecMismatch("wrong shape")

    cache = _treecodec.LayoutCache(check=check, size=2)
    meta = _treecodec.tree_to_wire({"w": np.ones(3, np.float32)})[0]
    first = cache.get({**meta, "version": 1})
    assert cache.get({**meta, "version": 2}) is first
    assert len(checked) == 1
    bad = _treecodec.tree_to_wire({"w": np.ones(5, np.float32)})[0]
    for _ in range(2):
        with pytest.raises(errors.SpecMismatch):
            cache.get(bad)
    assert len(checked) == 3
    for n in (6, 7, 8):
        cache.get(_treecodec.tree_to_wire({"w": np.ones(n, np.float32)})[0])
    assert cache.get(meta) is not first  # evicted, validated again
    with pytest.raises(errors.MalformedMetadata):
        cache.get({"tree": ["d", {"w": 0}], "leaves": []})


# ---------------------------------------------------------------- memory


def test_default_metadata_limit_is_small_and_configurable():
    assert _frames.DEFAULT_LIMITS.max_metadata_bytes == 2**20
    header = _frames.pack_header(MsgType.PUSH, 1, 2**20 + 1, 0)
    with pytest.raises(errors.PayloadTooBig):
        FrameDecoder().feed(header)
    limits = _frames.WireLimits(max_metadata_bytes=4 * 2**20)
    assert FrameDecoder(limits=limits).feed(header) == []


def test_metadata_memory_grows_only_as_bytes_arrive():
    import tracemalloc

    dec = FrameDecoder(scratch_bytes=1024)
    tracemalloc.start()
    try:
        dec.feed(_frames.pack_header(MsgType.PUSH, 1, 2**20, 0) + bytes(5000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**16  # not the 1 MiB declared
    assert not dec.idle


def test_released_decoder_holds_no_buffers():
    import weakref

    def allocate(header, meta):
        return _treecodec.default_allocator(_frames.DEFAULT_LIMITS)(header, meta)

    dec = FrameDecoder(allocate=allocate)
    dec.feed(_frames.pack_header(MsgType.PUSH, 1, 100_000, 0) + bytes(70_000))
    ref = weakref.ref(allocate)
    del allocate
    dec.release()
    assert ref() is None
    assert dec.idle
    with pytest.raises(errors.ConnectionClosed):
        dec.feed(b"HPSJ")


def _codec(*args, **kwargs):
    from hpsjax.transforms._quantize import Codec

    return Codec(*args, **kwargs)


@pytest.mark.parametrize(
    "codec_args, codes, scales, size, message",
    [
        (("uniform", 8), [0, 254, 255], [1.0], 3, "code 255"),
        (("uniform", 4), [0xE0, 0x0F], [1.0], 4, "code 15"),
        (("uniform", 4), [0xEE, 0x10], [1.0], 3, "padding"),
        (("sign",), [0b1000_0001], [1.0], 3, "padding"),
        (("uniform", 2), [0b11], [1.0], 1, "code 3"),
        (("qsgd", 8), [2 * 5 + 1], [1.0], 1, "code 11"),
        (("uniform", 8), [1], [-1.0], 1, "scales"),
        (("uniform", 8), [1], [np.nan], 1, "scales"),
    ],
)
def test_encoded_leaf_values_are_checked(codec_args, codes, scales, size, message):
    kwargs = {"levels": 5} if codec_args[0] == "qsgd" else {}
    codec = _codec(*codec_args, **kwargs)
    codes = np.array(codes, np.uint8)
    scales = np.array(scales, np.float32)
    with pytest.raises(errors.InvalidUpdate, match=message):
        _quantized.check_encoded_leaf(codes, scales, size, codec)


def test_valid_encoded_leaves_pass_the_check():
    import jax

    from hpsjax.transforms._quantize import encode

    x = np.linspace(-3, 3, 37, dtype=np.float32)
    codecs = (
        _codec("uniform", 8),
        _codec("uniform", 4, block_size=5),
        _codec("uniform", 2),
        _codec("uniform", 16),
        _codec("qsgd", 8, levels=5),
        _codec("sign"),
        _codec("none"),
    )
    # All the codecs' encodings in one compiled program.
    encoded = jax.jit(lambda x, key: [encode(x, codec, key=key) for codec in codecs])(
        x, jax.random.key(0)
    )
    for codec, enc in zip(codecs, encoded, strict=True):
        codes, scales = np.asarray(enc.codes), np.asarray(enc.scales)
        _quantized.check_encoded_leaf(codes, scales, x.size, codec)


def test_codec_must_list_every_key():
    meta, _, _ = _treecodec.encoded_tree_to_wire(
        [_encoded_ones()], {"w": np.zeros(4, np.float32)}, _codec("uniform", 8)
    )
    del meta["codec"]["levels"]
    with pytest.raises(errors.MalformedMetadata, match="levels"):
        _treecodec.tree_layout(meta)


def _encoded_ones():
    from hpsjax.transforms._quantize import Encoded

    return Encoded(np.ones(4, np.uint8), np.ones(1, np.float32))


_DOCTESTED = [_auth, _codecs, _decoders, _frames, _stream, _treecodec]
_DOCTESTED += [_powersgd, _quantized, _topk]


@pytest.mark.parametrize("module", _DOCTESTED)
def test_module_doctests(module):
    assert doctest.testmod(module).failed == 0


def test_handshake_state_machine_refuses_out_of_order_and_wrong_secrets():
    server = _auth.Handshake.server(b"k")
    with pytest.raises(errors.UnexpectedMessage, match="state hello"):
        server.receive(MsgType.AUTH, {"proof": b""})
    assert server.state is _auth.HandshakeState.FAILED
    client = _auth.Handshake.client(b"wrong", "w")
    server = _auth.Handshake.server(b"k")
    step = server.receive(*client.hello())
    assert server.state is _auth.HandshakeState.AUTH
    with pytest.raises(errors.AuthError, match="authentication failed"):
        server.receive(*client.receive(*step))
    client = _auth.Handshake.client(None, "w")
    with pytest.raises(errors.AuthError, match="requires a secret"):
        client.receive(*_auth.Handshake.server(b"k").receive(*client.hello()))
    server = _auth.Handshake.server(None)
    client = _auth.Handshake.client(None, 7)
    step = client.receive(*server.receive(*client.hello()))
    assert server.receive(*step) == (MsgType.AUTH_OK, {"proof": b""})
    assert server.ready and server.worker_id == 7


def test_hello_info_params_and_subscribe_are_typed_messages_checked_once():
    info = InfoMessage(
        policy="bsp", version=3, spec={"tree": 0, "leaves": []}, workers=2
    ).to_wire()
    assert InfoMessage.from_wire(info).workers == 2
    assert InfoMessage.from_wire({"policy": "asp", "version": 0, "spec": {}}) == (
        InfoMessage(policy="asp", version=0, spec={})
    )
    assert "workers" not in InfoMessage(policy="a", version=0, spec={}).to_wire()
    with pytest.raises(errors.MalformedMetadata, match=r"server info.*\$\.version"):
        InfoMessage.from_wire({**info, "version": -1})
    assert Subscribe.from_wire(Subscribe(on=True).to_wire()) == Subscribe(on=True)
    with pytest.raises(errors.MalformedMetadata, match=r"SUBSCRIBE.*\$\.on"):
        Subscribe.from_wire({"on": 1})
    params = ParamsMeta.from_wire({"version": 4, "held_s": 0.5, "ack": {"x": 1}})
    assert (params.version, params.held_s, params.barrier_s) == (4, 0.5, None)
    with pytest.raises(errors.ProtocolError, match=r"PARAMS.*\$\.local_steps"):
        ParamsMeta.from_wire({"version": 4, "local_steps": True}, errors.ProtocolError)
    hello = Hello("w0", b"n" * 32, client="hpsjax")
    assert Hello.from_wire(hello.to_wire()) == hello
    for bad in ({"worker_id": "w0", "nonce": b"n" * 31}, {"worker_id": True}):
        with pytest.raises(errors.MalformedMetadata, match="malformed HELLO"):
            Hello.from_wire({"nonce": b"n" * 32, **bad})
    challenge = Challenge(b"s" * 32, "hmac-sha256")
    assert Challenge.from_wire(challenge.to_wire()) == challenge
    with pytest.raises(errors.ProtocolError, match="malformed CHALLENGE"):
        Challenge.from_wire({"nonce": "not bytes"}, errors.ProtocolError)
    assert Proof.from_wire({"proof": b"p", "info": {}}) == Proof(b"p")
    with pytest.raises(errors.AuthError, match="malformed proof"):
        Proof.from_wire({"proof": "text"}, errors.AuthError)
    reply = Subscribed(on=False, version=7)
    assert Subscribed.from_wire(reply.to_wire()) == reply
    with pytest.raises(errors.ProtocolError, match="SUBSCRIBE reply"):
        Subscribed.from_wire({"on": True}, errors.ProtocolError)
