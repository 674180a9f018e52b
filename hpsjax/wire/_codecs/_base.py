"""What every wire codec provides (:class:`WireCodec`), and the helpers they share."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import numpy as np

from hpsjax._checks import is_int
from hpsjax.wire._errors import MalformedMetadata

__all__ = ["FLOAT_NAMES", "LikeLeaf", "WireCodec", "as_leaf", "per_leaf_ints"]

FLOAT_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""Wire dtype names a compressed leaf may decode to."""

Shape = tuple[int, ...]
Pair = tuple[np.ndarray, np.ndarray]


class LikeLeaf(NamedTuple):
    """A decoded leaf as the encoder sees it: dtype, wire dtype name and shape."""

    dtype: np.dtype
    name: str
    shape: Shape


class WireCodec(Protocol):
    """One compressor's bytes on the wire (PROTOCOL.md, section 2.4).

    A codec object is the parsed ``codec`` map of a frame: hashable (it keys
    the server's decoders) and immutable. Every compressed leaf travels as two
    arrays, one after the other in its buffer (the first one's bytes are the
    leaf's ``code_nbytes``); the class says how many bytes they take, builds
    them from what the compressing transform kept, checks them as they arrive
    and decodes them.

    Adding a compressor is a module of ``hpsjax/wire/_codecs`` with a class
    following this protocol, and its line in ``hpsjax.wire._codecs.CODECS``.

    Attributes:
      schemes: the ``scheme`` values of the codec maps the class reads.
      name: the compressor's name in error messages.
      compiles: whether a model's decoder is worth compiling once and keeping
        (one program per codec object); otherwise :meth:`decoder` is made for
        each push.
      finite_decoded: whether a decoded push is checked for NaN and infinity
        (the received parts cannot say it alone).
    """

    schemes: ClassVar[tuple[str, ...]]
    name: ClassVar[str]
    compiles: ClassVar[bool]
    finite_decoded: ClassVar[bool]

    @classmethod
    def from_wire(cls, codec: dict[str, Any], count: int | None) -> WireCodec:
        """The codec of a received ``codec`` map of a tree of ``count`` leaves
        (``None``: a map already checked).

        Raises:
          MalformedMetadata: the map is invalid.
        """
        ...

    @classmethod
    def encode(
        cls, codec: Any, encoded: Sequence[Any], likes: Sequence[LikeLeaf]
    ) -> tuple[WireCodec, list[Pair]]:
        """The codec and each leaf's two arrays of an encoded tree.

        Args:
          codec: what the caller named the codec with (an object, a scheme).
          encoded: per leaf, what the transform kept (as ``last_encoded``
            returns it).
          likes: per leaf, the decoded leaf.

        Raises:
          SpecMismatch: ``encoded`` does not fit ``likes``.
        """
        ...

    @staticmethod
    def last_encoded(opt_state: Any) -> list[Any]:
        """What the compressing transform kept of its last update, per leaf."""
        ...

    def to_wire(self) -> dict[str, Any]:
        """The codec as frame metadata."""
        ...

    def leaf_nbytes(self, i: int, name: str, shape: Shape) -> tuple[int, int]:
        """``(code_nbytes, nbytes)`` of leaf ``i`` (dtype ``name``, ``shape``).

        Raises:
          MalformedMetadata: the leaf cannot be sent with this codec.
        """
        ...

    def leaf_parts(
        self, i: int, shape: Shape, dtype: np.dtype, code_nbytes: int, nbytes: int
    ) -> tuple[tuple[Shape, np.dtype], tuple[Shape, np.dtype]]:
        """``(shape, dtype)`` of the two arrays leaf ``i``'s buffer holds."""
        ...

    def check_part(
        self, pair: Pair, part: int, size: int, *, finite: bool
    ) -> np.ndarray | None:
        """Checks part ``part`` (0 or 1) of a received leaf once it is in.

        Args:
          pair: the leaf's two arrays (the other one may not be in yet).
          part: which one has just arrived.
          size: elements of the decoded leaf.
          finite: whether NaN and infinity are refused.

        Returns:
          An array the caller checks for NaN and infinity (naming the leaf), or
          ``None``.

        Raises:
          InvalidUpdate: the values are invalid.
        """
        ...

    def decoder(
        self, specs: tuple[tuple[Shape, str], ...]
    ) -> Callable[[list[Pair]], list[Any]]:
        """A numpy decoder of a model's received pairs into its leaves.

        Args:
          specs: per model leaf, ``(shape, dtype name)`` of the decoded leaf.

        Raises:
          ValueError: the codec does not fit ``specs``.
        """
        ...

    def compile(
        self, specs: tuple[tuple[Shape, str], ...]
    ) -> Callable[[list[Pair]], list[Any]]:
        """A compiled decoder (only where ``compiles``), the values of
        :meth:`decoder`'s."""
        ...


def as_leaf(x: Any) -> np.ndarray:
    """``x`` as a C-contiguous little-endian numpy array (no copy if it is one)."""
    array = np.asarray(x)
    if array.dtype.byteorder == ">" or (
        array.dtype.byteorder == "=" and sys.byteorder == "big"
    ):
        array = array.astype(array.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return array if array.flags.c_contiguous else array.copy(order="C")


def per_leaf_ints(
    codec: dict[str, Any], key: str, what: str, count: int | None
) -> tuple[int, ...]:
    """The ``count`` ints >= 0 a codec map sends under ``key`` (and nothing else).

    ``count`` ``None`` takes a checked map's list as it is.

    Raises:
      MalformedMetadata: naming the codec by ``what``.
    """
    if set(codec) != {"scheme", key}:
        keys = sorted(map(str, codec))[:8]
        raise MalformedMetadata(
            f"a {what} codec has only 'scheme' and {key!r}, not {keys}"
        )
    values = codec[key]
    if count is None:
        return tuple(values)
    if (
        not isinstance(values, list)
        or len(values) != count
        or not all(is_int(v) and v >= 0 for v in values)
    ):
        raise MalformedMetadata(f"{what} {key!r} must list {count} ints >= 0"[:200])
    return tuple(int(v) for v in values)


def require_float(i: int, name: str, what: str) -> None:
    """Refuses a compressed leaf ``i`` that does not decode to floating point.

    Raises:
      MalformedMetadata: one fault, one code, whatever the codec.
    """
    if name not in FLOAT_NAMES:
        raise MalformedMetadata(f"leaf {i}: {what} leaves must be floating, not {name}")
