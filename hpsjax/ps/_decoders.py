"""Compiled decoders of compressed pushes, kept in a bounded cache.

A compressed push is decoded by one compiled program per codec (the model's
shapes and dtypes are fixed). Compiling takes tens of milliseconds and holds
about two MiB, so the server compiles off its event loop
(:meth:`DecoderCache.compile` runs in a worker thread) and keeps only the
``size`` codecs used last: whatever codecs clients send, memory stays bounded.

Top-k pushes (:class:`~hpsjax.ps._treecodec.TopKCodec`, a ``k`` per leaf that
changes with each worker's ratio) need no compiled program: their decoder
scatters the (checked) values into zeros with numpy, is made on demand and
is never stored.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from hpsjax.ps._frames import DTYPES
from hpsjax.ps._treecodec import TopKCodec, compressed_sizes
from hpsjax.transforms import _quantize as q

__all__ = ["DecoderCache"]


def _leaf_decoder(codec: Any, specs: tuple[tuple[tuple[int, ...], str], ...]):
    # A fresh function per codec: JAX's tracing caches hold it weakly, so a
    # decoder the cache forgets leaves nothing behind.
    def decode_leaves(encoded):
        return [
            q.decode(enc, codec, shape, dtype)
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


class DecoderCache:
    """The compiled decoders of the codecs used last, at most ``size`` of them.

    Args:
      specs: per model leaf, ``(shape, dtype name)`` of the decoded leaf.
      size: decoders kept; the least recently used one is forgotten first.

    Examples:
      >>> from hpsjax.transforms._quantize import Codec, encode
      >>> cache = DecoderCache([((4,), "float32")], size=2)
      >>> codec = Codec("uniform", bits=8, stochastic=False)
      >>> cache.get(codec) is None
      True
      >>> cache.put(codec, cache.compile(codec))
      >>> x = np.array([127.0, -127.0, 64.0, 0.0], np.float32)  # scale 1: exact
      >>> enc = encode(x, codec)
      >>> [float(v) for v in cache.get(codec)([enc])[0]]
      [127.0, -127.0, 64.0, 0.0]
    """

    def __init__(self, specs: Sequence[tuple[Sequence[int], str]], size: int = 8):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._specs = tuple((tuple(shape), str(dtype)) for shape, dtype in specs)
        self._size = size
        self._compiled: collections.OrderedDict[Any, Callable] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._compiled)

    def get(self, codec: Any) -> Callable | None:
        """The decoder of ``codec`` (``encoded leaves -> leaves``), or ``None``.

        A :class:`TopKCodec` always has one (``(indices, values)`` pairs, checked
        by ``check_topk_leaf``, to leaves), and it is not kept.
        """
        if isinstance(codec, TopKCodec):
            if len(codec.ks) != len(self._specs):
                return None
            return _topk_decoder(self._specs)
        decoder = self._compiled.get(codec)
        if decoder is not None:
            self._compiled.move_to_end(codec)
        return decoder

    def compile(self, codec: Any) -> Callable:
        """Compiles the decoder of ``codec``; thread-safe, stores nothing."""
        if isinstance(codec, TopKCodec):
            raise ValueError("top-k decoders are not compiled; get() gives them")
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
