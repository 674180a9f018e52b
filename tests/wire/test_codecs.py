"""The wire codecs' registry and protocol: one class per compressor, its byte
count the frame's, what the profiling pass counts and the transforms promise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hpsjax.profiling import tree_wire_nbytes
from hpsjax.transforms import (
    Codec,
    encode_tree,
    encoded_nbytes,
    power_sgd,
    powersgd_nbytes,
    top_k,
    topk_nbytes,
)
from hpsjax.wire import _codecs, _treecodec
from hpsjax.wire._errors import MalformedMetadata

TREE = {
    "b": np.linspace(-1.0, 1.0, 7, dtype=np.float32),
    "conv": np.linspace(-2.0, 2.0, 3 * 3 * 4 * 8, dtype=np.float32).reshape(3, 3, 4, 8),
    "w": np.linspace(0.5, -0.5, 64 * 40, dtype=np.float32).reshape(64, 40),
}
SHAPES = [x.shape for x in jax.tree.leaves(TREE)]


def _kept(tx):
    """What ``tx`` keeps of one update of TREE, as the worker sends it."""
    _, state = tx.update(jax.tree.map(jnp.asarray, TREE), tx.init(TREE))
    return state


def test_every_scheme_of_the_protocol_has_exactly_one_class():
    schemes = [s for cls in _codecs.CODECS for s in cls.schemes]
    assert sorted(schemes) == sorted(
        ["none", "uniform", "qsgd", "sign", "topk", "powersgd"]
    )
    assert len(set(schemes)) == len(schemes)
    protocol = _codecs.WireCodec
    members = {n for n in dir(protocol) if not n.startswith("_")}
    members |= set(protocol.__annotations__)
    assert {"schemes", "name", "leaf_nbytes", "encode", "decoder"} <= members
    for cls in _codecs.CODECS:
        missing = [m for m in sorted(members) if not hasattr(cls, m)]
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("which", ["quantized", "topk", "powersgd"])
def test_byte_count_is_the_frames_and_the_transforms(which):
    if which == "quantized":
        codec = Codec("uniform", 4, stochastic=False)
        encoded = encode_tree(TREE, codec)
        wire = _codecs.QuantizedCodec(codec)
        promised = sum(encoded_nbytes(s, codec) for s in SHAPES)
    elif which == "topk":
        encoded = _codecs.TopKCodec.last_encoded(_kept(top_k(0.05, seed=0)))
        codec = wire = _codecs.TopKCodec.at_ratio(SHAPES, 0.05)
        promised = sum(topk_nbytes(s, np.float32, 0.05) for s in SHAPES)
    else:
        encoded = _codecs.PowerSGDCodec.last_encoded(_kept(power_sgd(2, seed=0)))
        codec = wire = _codecs.PowerSGDCodec.at_rank(SHAPES, 2)
        promised = sum(powersgd_nbytes(s, np.float32, 2) for s in SHAPES)
    meta, buffers, layout = _treecodec.encoded_tree_to_wire(
        jax.device_get(encoded), TREE, codec
    )
    assert layout.wire == wire
    assert meta["codec"] == wire.to_wire()
    assert layout.nbytes == sum(b.nbytes for b in buffers) == promised
    assert tree_wire_nbytes(TREE, wire) == promised
    # The receiver reads the same codec object off the metadata alone.
    assert _treecodec.tree_layout(meta).wire == wire


def test_powersgd_rank_counts_as_its_codec():
    wire = _codecs.PowerSGDCodec.at_rank(SHAPES, 2)
    assert wire.ranks == (0, 2, 2)  # the bias is sent whole
    assert tree_wire_nbytes(TREE, wire) == tree_wire_nbytes(TREE, powersgd_rank=2)


@pytest.mark.parametrize(
    "codec, message",
    [
        ("gzip", "unknown codec 'gzip'"),
        ("uniform", "unknown codec 'uniform'"),  # a quantizer needs its Codec
        (_codecs.QuantizedCodec, "unknown codec"),
        (3, "unknown codec 3"),
    ],
)
def test_a_push_naming_no_codec_is_refused_in_one_line(codec, message):
    with pytest.raises(ValueError, match=message) as e:
        _treecodec.encoded_tree_to_wire([], {}, codec)
    assert "\n" not in str(e.value)


def test_a_received_codec_map_of_no_scheme_is_refused():
    meta = {"tree": 0, "leaves": [["float32", [4], 0, 4, 4]], "codec": {"k": [1]}}
    with pytest.raises(MalformedMetadata, match="codec misses"):
        _treecodec.tree_layout(meta)
    meta["codec"] = ["topk"]
    with pytest.raises(MalformedMetadata, match="'codec' must be a map or nil"):
        _treecodec.tree_layout(meta)
