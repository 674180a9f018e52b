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

Codecs whose parameters change from worker to worker (a count or a rank per
leaf: their class's ``compiles`` is false) need no compiled program: their numpy
decoder is made on demand and never stored. Each codec's decoders are its
class's (:mod:`hpsjax.wire._codecs`); this cache only keeps the compiled ones.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any

from hpsjax.wire._codecs import as_wire_codec

__all__ = ["COMPILE_MIN_ELEMENTS", "DecoderCache"]

COMPILE_MIN_ELEMENTS = 1 << 18
"""Models of fewer elements decode their quantized pushes with numpy only."""


class DecoderCache:
    """The compiled decoders of the codecs used last, at most ``size`` of them.

    Args:
      specs: per model leaf, ``(shape, dtype name)`` of the decoded leaf.
      size: decoders kept; the least recently used one is forgotten first.
      compile_min: a model of fewer elements is only ever decoded with numpy
        (:meth:`worth_compiling` is false); None for
        :data:`COMPILE_MIN_ELEMENTS` at construction.

    Examples:
      >>> import numpy as np
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

        ``codec`` is a wire codec object (:mod:`hpsjax.wire._codecs`) or a
        quantization ``Codec``. One that is not compiled (``compiles`` false)
        always has one if it fits the model's leaves, and it is not kept.
        """
        codec = as_wire_codec(codec)
        if not codec.compiles:
            try:
                return codec.decoder(self._specs)
            except ValueError:
                return None
        decoder = self._compiled.get(codec)
        if decoder is not None:
            self._compiled.move_to_end(codec)
        return decoder

    def decoder(self, codec: Any) -> Callable:
        """A decoder of ``codec``: the compiled one if kept, else numpy's.

        Never compiles: the numpy decoder gives the compiled one's values.
        """
        codec = as_wire_codec(codec)
        decoder = self.get(codec) if codec.compiles else None
        return decoder or codec.decoder(self._specs)

    def worth_compiling(self, codec: Any) -> bool:
        """Whether to compile ``codec``'s decoder (the model is big, none kept)."""
        codec = as_wire_codec(codec)
        return self._worth_compiling and codec.compiles and codec not in self._compiled

    def compile(self, codec: Any) -> Callable:
        """Compiles the decoder of ``codec``; thread-safe, stores nothing."""
        return as_wire_codec(codec).compile(self._specs)

    def put(self, codec: Any, decoder: Callable) -> None:
        """Keeps ``decoder`` for ``codec``, forgetting the least recently used."""
        codec = as_wire_codec(codec)
        self._compiled[codec] = decoder
        self._compiled.move_to_end(codec)
        while len(self._compiled) > self._size:
            self._compiled.popitem(last=False)
