"""Quantized pushes: packed codes then float32 scales per leaf (``none``,
``uniform``, ``qsgd``, ``sign``; PROTOCOL.md section 2.4).

A quantized push is decoded on the host with numpy (:meth:`QuantizedCodec.decoder`):
no compile, and results equal to the compiled program's bit for bit (one
float32 product per element, then the cast). For a big model the server also
compiles one program per codec (:meth:`QuantizedCodec.compile`) and keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from hpsjax import transforms
from hpsjax.wire._codecs._base import LikeLeaf, Shape, as_leaf, require_float
from hpsjax.wire._errors import InvalidUpdate, MalformedMetadata, SpecMismatch
from hpsjax.wire._frames import DTYPES

__all__ = ["QuantizedCodec", "check_encoded_leaf", "compressed_sizes"]

_CODEC_KEYS = ("scheme", "bits", "block_size", "stochastic", "levels")


def _codec_from_dict(codec: Any) -> transforms.Codec:
    if not isinstance(codec, dict):
        raise MalformedMetadata("'codec' must be a map or nil")
    missing = [key for key in _CODEC_KEYS if key not in codec]
    if missing:
        # Every key is sent (nil where unused): no default is ever guessed.
        raise MalformedMetadata(f"codec misses {', '.join(map(repr, missing))}")
    try:
        return transforms.Codec.from_dict(codec)
    except (ValueError, TypeError, KeyError) as e:
        raise MalformedMetadata(f"bad codec {codec!r}: {e}") from None


def compressed_sizes(shape: Sequence[int], codec: Any) -> tuple[int, int]:
    """Bytes of packed codes and number of float32 scales of an encoded leaf.

    Follows the layout of ``hpsjax.transforms.Encoded``: no scale for the
    ``none`` scheme, one per leaf without ``block_size``, else one per block of
    ``block_size`` elements (the last one possibly partial).

    Args:
      shape: the decoded leaf's shape.
      codec: a ``Codec``, or its dict as in frame metadata.

    Returns:
      ``(code_nbytes, n_scales)``.

    Raises:
      MalformedMetadata: the codec dict is invalid.
    """
    if not isinstance(codec, transforms.Codec):
        codec = _codec_from_dict(codec)
    size = math.prod(shape)
    if codec.scheme == "none":
        n_scales = 0
    elif codec.block_size is None:
        n_scales = 1
    else:
        n_scales = -(-size // codec.block_size)
    return transforms.encoded_nbytes(tuple(shape), codec) - 4 * n_scales, n_scales


def check_encoded_leaf(codes: np.ndarray, scales: np.ndarray, size: int, codec) -> None:
    """Checks the values of one received compressed leaf before it is decoded.

    Every code must name a level (``0 .. 2L`` for ``uniform`` and ``qsgd``, so
    ``255`` at 8 bits is refused), the unused high bits of the last code byte
    must be zero, and scales must be finite and non-negative.

    Args:
      codes: the leaf's packed codes (``uint8``).
      scales: its float32 scales.
      size: elements of the decoded leaf.
      codec: the ``Codec``.

    Raises:
      InvalidUpdate: naming what is wrong.
    """
    if codec.scheme == "none":
        return  # float32 values: checked for NaN and infinity once decoded
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise InvalidUpdate("scales must be finite and >= 0")
    bits = codec.bits
    if bits < 8 and size * bits % 8 and codes.size and codes[-1] >> (size * bits % 8):
        raise InvalidUpdate("padding bits of the last code byte are not zero")
    if codec.scheme == "sign":
        return
    top = 2 * (codec.levels if codec.scheme == "qsgd" else 2 ** (bits - 1) - 1)
    if bits == 16:
        largest = int(codes.view("<u2").max(initial=0))
    elif bits == 8:
        largest = int(codes.max(initial=0))
    else:
        mask = (1 << bits) - 1
        largest = max(
            int(((codes >> shift) & mask).max(initial=0)) for shift in range(0, 8, bits)
        )
    if largest > top:
        raise InvalidUpdate(f"code {largest} is over the largest level code {top}")


def _host_codes(codes: np.ndarray, bits: int, size: int) -> np.ndarray:
    """The quantizer's code unpacking in numpy (int32 codes)."""
    if bits == 8:
        return codes.astype(np.int32)
    if bits == 16:
        return codes[: size * 2].view("<u2").astype(np.int32)
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    q_ = (codes[:, None] >> shifts) & np.uint8(2**bits - 1)
    return q_.reshape(-1)[:size].astype(np.int32)


def _host_leaf(enc: Any, codec: transforms.Codec, shape: Shape, dtype: str):
    """:func:`~hpsjax.transforms.decode` in numpy, bit for bit.

    The codes and scales have the sizes the codec implies (the wire layout
    was checked against the model before the payload was read).
    """
    size = math.prod(shape)
    out_dtype = DTYPES[dtype]
    codes, scales = enc
    codes = np.asarray(codes)
    if size == 0:
        return np.zeros(shape, out_dtype)
    if codec.scheme == "none":
        flat = codes.view("<f4")
        return flat.astype(out_dtype).reshape(shape)
    q_ = _host_codes(codes, codec.bits, size)
    if codec.scheme == "sign":
        q_ = 2 * q_ - 1
    else:
        q_ -= codec.half_range
    values = q_.astype(np.float32)
    scales = np.asarray(scales, np.float32)
    if codec.block_size is None:
        values *= scales[0]
    else:
        block = codec.block_size
        n_full, rest = divmod(size, block)
        if n_full:
            main = values[: n_full * block].reshape(n_full, block)
            main *= scales[:n_full, None]
        if rest:
            values[n_full * block :] *= scales[n_full]
    return values.astype(out_dtype, copy=False).reshape(shape)


class QuantizedCodec(NamedTuple):
    """The quantized wire codec: every leaf's packed codes, then its scales.

    Wraps the ``hpsjax.transforms.Codec`` the quantizer encoded with (the same
    code serves the optax transform and the wire).

    Examples:
      >>> QuantizedCodec(transforms.Codec("sign", 1)).to_wire()["scheme"]
      'sign'
    """

    codec: transforms.Codec

    schemes = ("none", "uniform", "qsgd", "sign")
    name = "quantized"
    compiles = True
    # "none" sends float32 values, and a product of a code and a finite scale
    # may still overflow a narrower dtype.
    finite_decoded = True
    last_encoded = staticmethod(transforms.last_encoded)

    @classmethod
    def from_wire(cls, codec: dict[str, Any], count: int | None) -> QuantizedCodec:
        del count  # one codec for every leaf
        return cls(_codec_from_dict(codec))

    @classmethod
    def encode(
        cls, codec: Any, encoded: Sequence[Any], likes: Sequence[LikeLeaf]
    ) -> tuple[QuantizedCodec, list[tuple[np.ndarray, np.ndarray]]]:
        wire = codec if isinstance(codec, cls) else cls(codec)
        codec_dict = wire.codec.to_dict()
        pairs = []
        for enc, like in zip(encoded, likes, strict=True):
            if not isinstance(enc, transforms.Encoded):
                raise SpecMismatch("every encoded leaf must be an Encoded")
            codes = as_leaf(enc.codes).reshape(-1)
            scales = as_leaf(enc.scales).reshape(-1)
            if codes.dtype != np.uint8 or scales.dtype != np.float32:
                raise SpecMismatch("Encoded needs uint8 codes and float32 scales")
            want_codes, want_scales = compressed_sizes(like.shape, wire.codec)
            if codes.size != want_codes or scales.size != want_scales:
                raise SpecMismatch(
                    f"Encoded sizes ({codes.size}, {scales.size}) do not match "
                    f"shape {like.shape} under {codec_dict} ({want_codes}, "
                    f"{want_scales})"
                )
            pairs.append((codes, scales))
        return wire, pairs

    def to_wire(self) -> dict[str, Any]:
        return self.codec.to_dict()

    def leaf_nbytes(self, i: int, name: str, shape: Shape) -> tuple[int, int]:
        require_float(i, name, self.name)
        n_codes, n_scales = compressed_sizes(shape, self.codec)
        return n_codes, n_codes + 4 * n_scales

    def leaf_parts(self, i, shape, dtype, code_nbytes, nbytes):
        del i, shape, dtype
        n_scales = (nbytes - code_nbytes) // 4
        return ((code_nbytes,), np.dtype(np.uint8)), ((n_scales,), DTYPES["float32"])

    def check_part(self, pair, part, size, *, finite):
        del finite  # NaN and infinity are looked for once decoded
        # Codes and scales are checked once both are in: "none" sends no
        # scales, other schemes always do.
        if part or self.codec.scheme == "none":
            check_encoded_leaf(pair[0], pair[1], size, self.codec)
        return None

    def decoder(self, specs):
        codec = self.codec

        def decode_leaves(encoded):
            return [
                _host_leaf(enc, codec, shape, dtype)
                for enc, (shape, dtype) in zip(encoded, specs, strict=True)
            ]

        return decode_leaves

    def compile(self, specs):
        codec = self.codec
        args = []
        for shape, _ in specs:
            n_codes, n_scales = compressed_sizes(shape, codec)
            args.append(
                transforms.Encoded(
                    jax.ShapeDtypeStruct((n_codes,), np.uint8),
                    jax.ShapeDtypeStruct((n_scales,), np.float32),
                )
            )

        # A fresh function per codec: JAX's tracing caches hold it weakly, so a
        # decoder the server forgets leaves nothing behind.
        def decode_leaves(encoded):
            return [
                transforms.decode(enc, codec, shape, dtype)
                for enc, (shape, dtype) in zip(encoded, specs, strict=True)
            ]

        compiled = jax.jit(decode_leaves).lower(args).compile()

        def run(encoded):
            return compiled([transforms.Encoded(*enc) for enc in encoded])

        return run
