"""Decoders of compressed pushes: numpy at once, compiled for big models.

A quantized push is decoded on the host with numpy (:meth:`DecoderCache.decoder`):
no compile, and results equal to the compiled program's bit for bit (one
float32 product per element, then the cast). For a model of at least
``compile_min`` elements, where one compiled program per codec decodes faster,
the server also compiles that program off its event loop
(:meth:`DecoderCache.compile` runs in a worker thread; tens of milliseconds
idle, seconds on a loaded machine) and meanwhile keeps decoding with numpy,
so no push ever waits for a compile. Only the ``size`` compiled codecs used
last are kept (about two MiB each): whatever codecs clients send, memory
stays bounded.

Top-k and PowerSGD pushes (:class:`~hpsjax.ps._treecodec.TopKCodec`, a ``k``
per leaf that changes with each worker's ratio, and
:class:`~hpsjax.ps._treecodec.PowerSGDCodec`, a rank per leaf) need no
compiled program: top-k's decoder scatters the (checked) values into zeros,
PowerSGD's multiplies each leaf's (checked) factors, ``p q^T``, with numpy in
the order PROTOCOL.md specifies (:func:`powersgd_product`); it is made on
demand and is never stored.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hpsjax.ps._frames import DTYPES
from hpsjax.ps._treecodec import PowerSGDCodec, TopKCodec, compressed_sizes
from hpsjax.transforms import _quantize as q

__all__ = ["COMPILE_MIN_ELEMENTS", "DecoderCache", "powersgd_product"]

COMPILE_MIN_ELEMENTS = 1 << 18
"""Models of fewer elements decode their quantized pushes with numpy only."""


def _leaf_decoder(codec: Any, specs: tuple[tuple[tuple[int, ...], str], ...]):
    # A fresh function per codec: JAX's tracing caches hold it weakly, so a
    # decoder the cache forgets leaves nothing behind.
    def decode_leaves(encoded):
        return [
            q.decode(enc, codec, shape, dtype)
            for enc, (shape, dtype) in zip(encoded, specs, strict=True)
        ]

    return decode_leaves


def _host_codes(codes: np.ndarray, bits: int, size: int) -> np.ndarray:
    """:func:`~hpsjax.transforms._quantize._unpack` in numpy (int32 codes)."""
    if bits == 8:
        return codes.astype(np.int32)
    if bits == 16:
        return codes[: size * 2].view("<u2").astype(np.int32)
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    q = (codes[:, None] >> shifts) & np.uint8(2**bits - 1)
    return q.reshape(-1)[:size].astype(np.int32)


def _host_leaf(enc: Any, codec: Any, shape: tuple[int, ...], dtype: str):
    """:func:`~hpsjax.transforms._quantize.decode` in numpy, bit for bit.

    The codes and scales have the sizes the codec implies (the wire layout
    was checked against the model before the payload was read).
    """
    size = math.prod(shape)
    out_dtype = DTYPES[dtype]
    codes = np.asarray(enc.codes)
    if size == 0:
        return np.zeros(shape, out_dtype)
    if codec.scheme == "none":
        flat = codes.view("<f4")
        return flat.astype(out_dtype).reshape(shape)
    q_ = _host_codes(codes, codec.bits, size)
    if codec.scheme == "sign":
        q_ = 2 * q_ - 1
    else:
        q_ -= q._half_range(codec)
    values = q_.astype(np.float32)
    scales = np.asarray(enc.scales, np.float32)
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


def _host_decoder(codec: Any, specs: tuple[tuple[tuple[int, ...], str], ...]):
    def decode_leaves(encoded):
        return [
            _host_leaf(enc, codec, shape, dtype)
            for enc, (shape, dtype) in zip(encoded, specs, strict=True)
        ]

    return decode_leaves


def _topk_decoder(specs: tuple[tuple[tuple[int, ...], str], ...]):
    def decode_leaves(encoded):
        out = []
        for (indices, values), (shape, dtype) in zip(encoded, specs, strict=True):
            leaf = np.zeros(math.prod(shape), DTYPES[dtype])
            leaf[indices] = values
            out.append(leaf.reshape(shape))
        return out

    return decode_leaves


# Elements of the row blocks powersgd_product works on (1 MiB of float32): a
# block and its scratch stay in cache while the rank's terms are added (larger
# blocks fall out of it, smaller ones cost more calls).
_PRODUCT_BLOCK_ELEMENTS = 1 << 18


def powersgd_product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p q^T`` in float32, in the order PROTOCOL.md (section 2.6) specifies.

    ``M[a, b] = (...((p[a, 0] q[b, 0] + p[a, 1] q[b, 1]) + p[a, 2] q[b, 2]) ...)
    + p[a, r-1] q[b, r-1]``: the ``r`` terms added in order of ``j``, every
    product and every sum rounded to float32 (round to nearest even, no fused
    multiply-add), so any decoder following the document gets the same bits.
    A BLAS product does not say how it orders or fuses its sums (it varies
    with the machine and the library), so it is not used.

    Args:
      p: ``n x r`` factor (any floating dtype; converted to float32 exactly).
      q: ``m x r`` factor.

    Returns:
      The float32 ``n x m`` product.

    Examples:
      >>> p = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
      >>> q = np.array([[1.0, 1.0], [0.5, -1.0]], np.float32)
      >>> powersgd_product(p, q).tolist()
      [[3.0, -1.5], [7.0, -2.5]]
    """
    p = np.asarray(p, np.float32)
    qt = np.ascontiguousarray(np.asarray(q, np.float32).T)  # r x m
    (n, rank), m = p.shape, qt.shape[1]
    out = np.empty((n, m), np.float32)
    rows = max(1, _PRODUCT_BLOCK_ELEMENTS // max(m, 1))
    term = np.empty((min(rows, n), m), np.float32)
    for start in range(0, n, rows):
        block = out[start : start + rows]
        scratch = term[: len(block)]
        np.multiply(p[start : start + rows, 0:1], qt[0], out=block)
        for j in range(1, rank):
            np.multiply(p[start : start + rows, j : j + 1], qt[j], out=scratch)
            np.add(block, scratch, out=block)
    return out


def _powersgd_decoder(specs: tuple[tuple[tuple[int, ...], str], ...]):
    """PowerSGD leaves decoded as PROTOCOL.md specifies: :func:`powersgd_product`
    then the cast (the leaf itself where ``p`` holds it whole).

    :func:`~hpsjax.transforms.powersgd_decode` (a JAX matmul, which a worker
    uses for its error feedback) computes the same product up to the last bits.
    """

    def decode_leaves(encoded):
        out = []
        # Finite factors may still overflow (in the product, or in the cast to
        # a narrower dtype): the server refuses such a decoded leaf itself.
        with np.errstate(over="ignore", invalid="ignore"):
            for (p, q_), (shape, dtype) in zip(encoded, specs, strict=True):
                if p.ndim == 2:
                    p = powersgd_product(p, q_)
                out.append(p.astype(DTYPES[dtype], copy=False).reshape(shape))
        return out

    return decode_leaves


# Codecs decoded with numpy only, by a decoder made for each push: their k or
# rank per leaf changes from worker to worker.
_HOST_ONLY = {TopKCodec: _topk_decoder, PowerSGDCodec: _powersgd_decoder}


class DecoderCache:
    """The compiled decoders of the codecs used last, at most ``size`` of them.

    Args:
      specs: per model leaf, ``(shape, dtype name)`` of the decoded leaf.
      size: decoders kept; the least recently used one is forgotten first.
      compile_min: a model of fewer elements is only ever decoded with numpy
        (:meth:`worth_compiling` is false); None for
        :data:`COMPILE_MIN_ELEMENTS` at construction.

    Examples:
      >>> from hpsjax.transforms._quantize import Codec, encode
      >>> cache = DecoderCache([((4,), "float32")], size=2)
      >>> codec = Codec("uniform", bits=8, stochastic=False)
      >>> cache.get(codec) is None
      True
      >>> [float(v) for v in cache.decoder(codec)([encode(np.ones(4), codec)])[0]]
      [1.0, 1.0, 1.0, 1.0]
      >>> cache.put(codec, cache.compile(codec))
      >>> x = np.array([127.0, -127.0, 64.0, 0.0], np.float32)  # scale 1: exact
      >>> enc = encode(x, codec)
      >>> [float(v) for v in cache.get(codec)([enc])[0]]
      [127.0, -127.0, 64.0, 0.0]
    """

    def __init__(
        self,
        specs: Sequence[tuple[Sequence[int], str]],
        size: int = 8,
        compile_min: int | None = None,
    ):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if compile_min is None:
            compile_min = COMPILE_MIN_ELEMENTS
        if compile_min < 0:
            raise ValueError(f"compile_min must be >= 0, got {compile_min}")
        self._specs = tuple((tuple(shape), str(dtype)) for shape, dtype in specs)
        self._size = size
        self._worth_compiling = (
            sum(math.prod(shape) for shape, _ in self._specs) >= compile_min
        )
        self._compiled: collections.OrderedDict[Any, Callable] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, codec: Any) -> Callable | None:
        """The decoder of ``codec`` (``encoded leaves -> leaves``), or ``None``.

        A :class:`TopKCodec` (``(indices, values)`` pairs, checked by
        ``check_topk_leaf``) or :class:`PowerSGDCodec` (``(p, q)`` pairs) of
        the model's leaf count always has one, and it is not kept.
        """
        make = _HOST_ONLY.get(type(codec))
        if make is not None:
            (per_leaf,) = codec  # its k or rank of each leaf
            return make(self._specs) if len(per_leaf) == len(self._specs) else None
        decoder = self._compiled.get(codec)
        if decoder is not None:
            self._compiled.move_to_end(codec)
        return decoder

    def decoder(self, codec: Any) -> Callable:
        """A decoder of ``codec``: the compiled one if kept, else numpy's.

        Never compiles: the numpy decoder gives the compiled one's values.
        """
        decoder = self.get(codec)
        if decoder is not None:
            return decoder
        if type(codec) in _HOST_ONLY:
            raise ValueError(f"{codec} does not match the model's leaves")
        return _host_decoder(codec, self._specs)

    def worth_compiling(self, codec: Any) -> bool:
        """Whether to compile ``codec``'s decoder (the model is big, none kept)."""
        return (
            self._worth_compiling
            and isinstance(codec, q.Codec)
            and codec not in self._compiled
        )

    def compile(self, codec: Any) -> Callable:
        """Compiles the decoder of ``codec``; thread-safe, stores nothing."""
        if type(codec) in _HOST_ONLY:
            raise ValueError(f"{codec} is not compiled; get() gives its decoder")
        args = []
        for shape, _ in self._specs:
            n_codes, n_scales = compressed_sizes(shape, codec)
            args.append(
                q.Encoded(
                    jax.ShapeDtypeStruct((n_codes,), np.uint8),
                    jax.ShapeDtypeStruct((n_scales,), np.float32),
                )
            )
        decode_leaves = _leaf_decoder(codec, self._specs)
        return jax.jit(decode_leaves).lower(args).compile()

    def put(self, codec: Any, decoder: Callable) -> None:
        """Keeps ``decoder`` for ``codec``, forgetting the least recently used."""
        self._compiled[codec] = decoder
        self._compiled.move_to_end(codec)
        while len(self._compiled) > self._size:
            self._compiled.popitem(last=False)
