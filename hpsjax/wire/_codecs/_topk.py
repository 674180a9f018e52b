"""Top-k sparsified pushes: each leaf's ``k`` indices, then its ``k`` values
(``{"scheme": "topk", "k": [k per leaf]}``; PROTOCOL.md section 2.5).

Decoded with numpy, by a decoder made for each push (the ``k`` of each leaf
changes with each worker's ratio): the (checked) values scattered into zeros.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from hpsjax import transforms
from hpsjax.wire._codecs._base import (
    LikeLeaf,
    Shape,
    as_leaf,
    per_leaf_ints,
    require_float,
)
from hpsjax.wire._errors import (
    InvalidUpdate,
    MalformedMetadata,
    NonFiniteUpdate,
    SpecMismatch,
)
from hpsjax.wire._frames import DTYPES

__all__ = ["TOPK_SCHEME", "TopKCodec", "check_topk_leaf", "topk_index_dtype"]

TOPK_SCHEME = "topk"
"""The ``scheme`` of the top-k codec (``{"scheme": "topk", "k": [k per leaf]}``)."""


@functools.lru_cache(maxsize=1024)
def topk_index_dtype(size: int) -> np.dtype:
    """The wire dtype of a top-k leaf's indices: ``uint16`` for leaves of at most
    65536 elements, ``uint32`` up to 2**32 (as ``hpsjax.transforms.topk_encode``).

    Raises:
      MalformedMetadata: the leaf has more than 2**32 elements.
    """
    try:
        dtype = transforms.topk_index_dtype(size)
    except ValueError:
        raise MalformedMetadata(
            f"top-k leaves hold at most 2**32 elements, not {size}"
        ) from None
    return np.dtype(dtype).newbyteorder("<")


def check_topk_leaf(
    indices: np.ndarray, values: np.ndarray, size: int, *, finite: bool = True
) -> None:
    """Checks one received top-k leaf before it is decoded.

    Indices must be strictly increasing (so unique) and below ``size``; with
    ``finite`` the values must hold no NaN or infinity.

    Raises:
      InvalidUpdate: a bad index.
      NonFiniteUpdate: a value is NaN or infinite.
    """
    if not indices.size:
        return
    if int(indices[-1]) >= size:
        raise InvalidUpdate(f"top-k index {int(indices[-1])} out of range [0, {size})")
    if indices.size > 1 and not (indices[1:] > indices[:-1]).all():
        raise InvalidUpdate("top-k indices must be strictly increasing")
    if finite and not np.isfinite(values).all():
        raise NonFiniteUpdate("top-k values hold NaN or infinity")


class TopKCodec(NamedTuple):
    """The top-k wire codec: leaf ``i`` sends ``ks[i]`` indices, then as many values.

    Examples:
      >>> TopKCodec((3, 0)).to_wire()
      {'scheme': 'topk', 'k': [3, 0]}
    """

    ks: tuple[int, ...]

    schemes = (TOPK_SCHEME,)
    name = "top-k"
    compiles = False
    # Values are checked as they arrive, and scattering adds nothing to them.
    finite_decoded = False
    last_encoded = staticmethod(transforms.last_topk_encoded)

    @classmethod
    def from_wire(cls, codec: dict[str, Any], count: int | None) -> TopKCodec:
        return cls(per_leaf_ints(codec, "k", cls.name, count))

    @classmethod
    def encode(
        cls, codec: Any, encoded: Sequence[Any], likes: Sequence[LikeLeaf]
    ) -> tuple[TopKCodec, list[tuple[np.ndarray, np.ndarray]]]:
        del codec  # the leaves say their k
        pairs, ks = [], []
        for i, (enc, like) in enumerate(zip(encoded, likes, strict=True)):
            if not (isinstance(enc, tuple) and len(enc) == 2):
                raise SpecMismatch("every top-k leaf must be an (indices, values) pair")
            indices = as_leaf(enc[0]).reshape(-1)
            values = as_leaf(enc[1]).reshape(-1)
            dtype, name, shape = like
            size = math.prod(shape)
            want = topk_index_dtype(size)
            if indices.dtype != want or values.dtype != dtype:
                raise SpecMismatch(
                    f"leaf {i}: top-k of shape {shape} sends {want.name} indices "
                    f"and {dtype.name} values, got {indices.dtype.name} and "
                    f"{values.dtype.name}"
                )
            k = indices.size
            if values.size != k:
                raise SpecMismatch(f"leaf {i}: {k} indices but {values.size} values")
            try:
                require_float(i, name, cls.name)
            except MalformedMetadata as e:
                raise SpecMismatch(e.message) from None
            if k > size:
                raise SpecMismatch(f"leaf {i}: top-k k={k} > {size} elements")
            pairs.append((indices, values))
            ks.append(k)
        return cls(tuple(ks)), pairs

    @classmethod
    def at_ratio(cls, shapes: Sequence[Shape], ratio: float) -> TopKCodec:
        """The codec of ``hpsjax.transforms.top_k(ratio)``'s pushes of leaves
        of ``shapes``."""
        return cls(tuple(transforms.topk_count(math.prod(s), ratio) for s in shapes))

    def to_wire(self) -> dict[str, Any]:
        return {"scheme": TOPK_SCHEME, "k": list(self.ks)}

    def leaf_nbytes(self, i: int, name: str, shape: Shape) -> tuple[int, int]:
        require_float(i, name, self.name)
        size, k = math.prod(shape), self.ks[i]
        if k > size:
            raise MalformedMetadata(f"leaf {i}: top-k k={k} > {size} elements")
        index_nbytes = k * topk_index_dtype(size).itemsize
        return index_nbytes, index_nbytes + k * DTYPES[name].itemsize

    def leaf_parts(self, i, shape, dtype, code_nbytes, nbytes):
        del nbytes
        index_dtype = topk_index_dtype(math.prod(shape))
        k = code_nbytes // index_dtype.itemsize
        return ((k,), index_dtype), ((k,), dtype)

    def check_part(self, pair, part, size, *, finite):
        if part:  # indices and values are in (k = 0 sends neither)
            check_topk_leaf(pair[0], pair[1], size, finite=finite)
        return None

    def decoder(self, specs):
        if len(self.ks) != len(specs):
            raise ValueError(f"{self} does not match the model's leaves")

        def decode_leaves(encoded):
            out = []
            for (indices, values), (shape, dtype) in zip(encoded, specs, strict=True):
                leaf = np.zeros(math.prod(shape), DTYPES[dtype])
                leaf[indices] = values
                out.append(leaf.reshape(shape))
            return out

        return decode_leaves

    def compile(self, specs):
        raise ValueError(f"{self} is not compiled; decoder() gives its decoder")
