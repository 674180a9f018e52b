"""PowerSGD low-rank pushes: each leaf's factor ``p`` then its factor ``q``, or
its values whole (``{"scheme": "powersgd", "rank": [rank per leaf]}``;
PROTOCOL.md section 2.6).

Decoded with numpy, by a decoder made for each push: each leaf's (checked)
factors multiplied, ``p q^T``, in the order PROTOCOL.md specifies
(:func:`powersgd_product`).
"""

from __future__ import annotations

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
from hpsjax.wire._errors import MalformedMetadata, SpecMismatch
from hpsjax.wire._frames import DTYPES

__all__ = ["POWERSGD_SCHEME", "PowerSGDCodec", "powersgd_product"]

POWERSGD_SCHEME = "powersgd"
"""The ``scheme`` of the PowerSGD codec (``{"scheme": "powersgd", "rank": [rank
per leaf]}``)."""

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


def _factor_shapes(i: int, shape: Shape, rank: int) -> tuple[Shape, Shape]:
    """The shapes of PowerSGD leaf ``i``'s factors ``p`` and ``q`` at ``rank``.

    Rank 0 sends the leaf whole: ``p`` holds its values, ``q`` none. A rank
    ``r >= 1`` sends ``p`` (``n x r``) and ``q`` (``m x r``) of the matrix
    ``hpsjax.transforms.powersgd_matrix_shape`` reads the leaf as.

    Raises:
      MalformedMetadata: rank-``r`` factors would be no smaller than the leaf.
    """
    if rank == 0:
        return (math.prod(shape),), (0,)
    matrix = transforms.powersgd_matrix_shape(shape, rank)
    if matrix is None:
        raise MalformedMetadata(
            f"leaf {i}: rank-{rank} factors are no smaller than shape "
            f"{list(shape)} (send it whole: rank 0)"
        )
    return (matrix[0], rank), (matrix[1], rank)


class PowerSGDCodec(NamedTuple):
    """The PowerSGD wire codec: leaf ``i`` sends its rank-``ranks[i]`` factors
    ``p`` then ``q``, or its values whole where ``ranks[i]`` is 0.

    One rank per leaf, as top-k's one ``k`` per leaf: the encoded leaves alone
    say it (a leaf too thin to gain from its factors is sent whole by
    ``hpsjax.transforms.power_sgd``).

    Examples:
      >>> PowerSGDCodec((0, 4)).to_wire()
      {'scheme': 'powersgd', 'rank': [0, 4]}
    """

    ranks: tuple[int, ...]

    schemes = (POWERSGD_SCHEME,)
    name = "PowerSGD"
    compiles = False
    # Finite factors may still overflow (in the product, or in the cast to a
    # narrower dtype).
    finite_decoded = True
    last_encoded = staticmethod(transforms.last_powersgd_encoded)

    @classmethod
    def from_wire(cls, codec: dict[str, Any], count: int | None) -> PowerSGDCodec:
        return cls(per_leaf_ints(codec, "rank", cls.name, count))

    @classmethod
    def encode(
        cls, codec: Any, encoded: Sequence[Any], likes: Sequence[LikeLeaf]
    ) -> tuple[PowerSGDCodec, list[tuple[np.ndarray, np.ndarray]]]:
        del codec  # the factors say their rank
        pairs, ranks = [], []
        for i, (enc, like) in enumerate(zip(encoded, likes, strict=True)):
            if not (isinstance(enc, tuple) and len(enc) == 2):
                raise SpecMismatch("every PowerSGD leaf must be a (p, q) pair")
            p, q = as_leaf(enc[0]), as_leaf(enc[1])
            dtype, name, shape = like
            if p.dtype != dtype or q.dtype != dtype:
                raise SpecMismatch(
                    f"leaf {i}: PowerSGD factors of a {dtype.name} leaf are "
                    f"{dtype.name}, got {p.dtype.name} and {q.dtype.name}"
                )
            rank = p.shape[1] if p.ndim == 2 else 0
            try:
                require_float(i, name, cls.name)
                want = _factor_shapes(i, shape, rank)
            except MalformedMetadata as e:
                raise SpecMismatch(e.message) from None
            if (p.shape, q.shape) != want:
                raise SpecMismatch(
                    f"leaf {i}: factors {p.shape} and {q.shape} do not fit shape "
                    f"{shape} (rank {rank}: {want[0]} and {want[1]})"
                )
            pairs.append((p, q))
            ranks.append(rank)
        return cls(tuple(ranks)), pairs

    @classmethod
    def at_rank(cls, shapes: Sequence[Shape], rank: int) -> PowerSGDCodec:
        """The codec of ``hpsjax.transforms.power_sgd(rank)``'s pushes of
        leaves of ``shapes`` (rank 0 for a leaf it sends whole)."""
        return cls(
            tuple(
                0 if transforms.powersgd_matrix_shape(s, rank) is None else rank
                for s in shapes
            )
        )

    def to_wire(self) -> dict[str, Any]:
        return {"scheme": POWERSGD_SCHEME, "rank": list(self.ranks)}

    def leaf_nbytes(self, i: int, name: str, shape: Shape) -> tuple[int, int]:
        require_float(i, name, self.name)
        p_shape, q_shape = _factor_shapes(i, shape, self.ranks[i])
        itemsize = DTYPES[name].itemsize
        p_nbytes = math.prod(p_shape) * itemsize
        return p_nbytes, p_nbytes + math.prod(q_shape) * itemsize

    def leaf_parts(self, i, shape, dtype, code_nbytes, nbytes):
        del code_nbytes, nbytes
        p_shape, q_shape = _factor_shapes(i, shape, self.ranks[i])
        return (p_shape, dtype), (q_shape, dtype)

    def check_part(self, pair, part, size, *, finite):
        del size
        # p or q (a leaf sent whole has no q): the caller refuses NaN in it.
        return pair[part] if finite else None

    def decoder(self, specs):
        """PowerSGD leaves decoded as PROTOCOL.md specifies: :func:`powersgd_product`
        then the cast (the leaf itself where ``p`` holds it whole).

        :func:`~hpsjax.transforms.powersgd_decode` (a JAX matmul, which a worker
        uses for its error feedback) computes the same product up to the last
        bits.
        """
        if len(self.ranks) != len(specs):
            raise ValueError(f"{self} does not match the model's leaves")

        def decode_leaves(encoded):
            out = []
            # Finite factors may still overflow (in the product, or in the cast
            # to a narrower dtype): the server refuses such a decoded leaf.
            with np.errstate(over="ignore", invalid="ignore"):
                for (p, q), (shape, dtype) in zip(encoded, specs, strict=True):
                    if p.ndim == 2:
                        p = powersgd_product(p, q)
                    out.append(p.astype(DTYPES[dtype], copy=False).reshape(shape))
            return out

        return decode_leaves

    def compile(self, specs):
        raise ValueError(f"{self} is not compiled; decoder() gives its decoder")
