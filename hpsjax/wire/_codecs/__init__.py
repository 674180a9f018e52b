"""Wire codecs: one class per compressor, found by the ``scheme`` of a codec map.

==========================  ==================================  ===================
class                       ``scheme`` values                   a leaf's two arrays
==========================  ==================================  ===================
:class:`QuantizedCodec`     ``none``, ``uniform``, ``qsgd``,    packed codes,
                            ``sign``                            float32 scales
:class:`TopKCodec`          ``topk``                            indices, values
:class:`PowerSGDCodec`      ``powersgd``                        factors ``p``, ``q``
==========================  ==================================  ===================

Each follows :class:`WireCodec`: the tree codec (``hpsjax.wire._treecodec``)
asks it for a leaf's byte count and buffers, the server for its checks and
decoder, the worker and the profiling pass for what the compressing transform
kept and what it weighs. Nothing outside this package names a scheme.

Adding a compressor: a module here with a class following :class:`WireCodec`
(see ``_topk.py``), and its line in :data:`CODECS`.
"""

from __future__ import annotations

from typing import Any

from hpsjax import transforms
from hpsjax.wire._codecs._base import FLOAT_NAMES, LikeLeaf, WireCodec, as_leaf
from hpsjax.wire._codecs._powersgd import PowerSGDCodec
from hpsjax.wire._codecs._quantized import QuantizedCodec
from hpsjax.wire._codecs._topk import TopKCodec
from hpsjax.wire._errors import MalformedMetadata

__all__ = [
    "CODECS",
    "FLOAT_NAMES",
    "LikeLeaf",
    "PowerSGDCodec",
    "QuantizedCodec",
    "TopKCodec",
    "WireCodec",
    "as_leaf",
    "as_wire_codec",
    "codec_class",
    "from_wire",
    "wire_codec",
]

CODECS: tuple[type[WireCodec], ...] = (
    QuantizedCodec,
    TopKCodec,
    PowerSGDCodec,
)
"""The wire codecs, one line each."""

_BY_SCHEME: dict[str, type[WireCodec]] = {
    scheme: cls for cls in CODECS for scheme in cls.schemes
}


def codec_class(codec: Any) -> type[WireCodec]:
    """The class of a codec named by its object or scheme (as a push names it).

    Args:
      codec: a wire codec object, a ``hpsjax.transforms.Codec``, or the class
        or scheme of a codec whose leaves say their own parameters
        (:class:`TopKCodec` or ``"topk"``, :class:`PowerSGDCodec` or
        ``"powersgd"``).

    Raises:
      ValueError: ``codec`` names no codec.
    """
    if isinstance(codec, str):
        cls = _BY_SCHEME.get(codec)
        if cls is not None and cls is not QuantizedCodec:
            return cls
    elif isinstance(codec, transforms.Codec):
        return QuantizedCodec
    elif type(codec) in CODECS:
        return type(codec)
    elif isinstance(codec, type) and codec in CODECS and codec is not QuantizedCodec:
        return codec
    named = [s for s in _BY_SCHEME if _BY_SCHEME[s] is not QuantizedCodec]
    raise ValueError(
        f"unknown codec {codec!r}: a Codec, " + " or ".join(repr(s) for s in named)
    )


def as_wire_codec(codec: Any) -> WireCodec:
    """``codec`` as a wire codec object (a ``Codec`` wrapped in its class)."""
    return QuantizedCodec(codec) if isinstance(codec, transforms.Codec) else codec


def from_wire(codec: Any, count: int) -> WireCodec | None:
    """The checked codec of a received ``codec`` field of a ``count``-leaf tree.

    Raises:
      MalformedMetadata: the field is neither nil nor a valid codec map.
    """
    if codec is None:
        return None
    if not isinstance(codec, dict):
        raise MalformedMetadata("'codec' must be a map or nil")
    cls = _BY_SCHEME.get(codec.get("scheme"), QuantizedCodec)
    return cls.from_wire(codec, count)


def wire_codec(codec: dict[str, Any] | None) -> WireCodec | None:
    """The codec object of a (validated) layout's codec dict, ``None`` for a raw
    tree."""
    if codec is None:
        return None
    return _BY_SCHEME.get(codec.get("scheme"), QuantizedCodec).from_wire(codec, None)
