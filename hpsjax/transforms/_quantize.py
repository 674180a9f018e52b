"""Quantized communication: a wire codec and the optax transform built on it.

One quantizer serves both the optax transform and the wire: :func:`encode` turns
an array into an :class:`Encoded` pair of byte codes and float32 scales, which is
exactly what travels on the wire, and :func:`decode` turns it back. The transform
:func:`quantize` outputs ``decode(encode(p))`` and keeps the :class:`Encoded`
leaves in its state (see :func:`last_encoded`), so a worker sends the very bytes
its optimizer applied, and error feedback is applied exactly once.

Schemes, for an array (or a block of it) ``x`` of ``d`` elements, each with one
float32 scale, the step ``Δ``:

* ``uniform`` (``b`` bits): ``Δ = max|x| / L`` with ``L = 2^(b-1) - 1``; code
  ``round(x_i / Δ) + L`` in ``[0, 2L]``.
* ``qsgd`` (``s`` levels): ``Δ = ||x||_2 / s``; code ``round(x_i / Δ) + s`` in
  ``[0, 2s]``, i.e. ``L = s``.
* ``sign`` (1 bit): nearest, ``Δ = ||x||_1 / d`` and code 1 iff ``x_i >= 0``;
  stochastic, ``Δ = max|x|`` and code 1 with probability ``(1 + x_i / Δ) / 2``.
* ``none`` (32 bits): no scale; the float32 bits of ``x_i``.

``round`` is to the nearest integer (ties to even) or, with ``stochastic=True``,
unbiased stochastic rounding: up with probability ``y - floor(y)``. Decoding is
``(code - L) Δ`` (``sign``: ``(2 code - 1) Δ``), so every scheme but nearest
``sign`` is unbiased with stochastic rounding, and nearest rounding is off by at
most ``Δ / 2``. A step below the smallest normal float32 (about ``1.2e-38``) is
sent as 0, so such a block, and an all-zero one, decodes to exact zeros on every
platform, whether or not it flushes subnormal numbers to zero.

Wire layout of ``Encoded.codes`` (a 1-D ``uint8`` array, codes in element order of
the row-major flattened array):

* 16-bit codes: two bytes per element, little-endian.
* 8-bit codes: one byte per element.
* 4-, 2- and 1-bit codes: ``8 / b`` elements per byte, the first element in the
  least significant bits (byte ``j`` holds elements ``j * 8/b`` to
  ``j * 8/b + 8/b - 1``); the unused high bits of the last byte are zero.
* ``none``: the float32 value of each element, 4 bytes little-endian.

``Encoded.scales`` is a 1-D ``float32`` array holding the step of each block in
order (one per leaf when ``block_size`` is None; ``ceil(d / block_size)`` blocks
otherwise, the last one possibly partial), and empty for ``none``. Its size and
the size of the codes follow from the shape and the :class:`Codec` alone
(:func:`encoded_nbytes`), which travels as :meth:`Codec.to_dict`.

Random bits for stochastic rounding come from a counter-based hash of the element
index, seeded from the key once per array, so that the rounding fuses into a
single XLA kernel with the scaling and the packing; see :func:`encode`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from hpsjax._checks import check_float_dtype, is_int
from hpsjax.transforms._common import (
    check_seed,
    decode_leaves,
    error_feedback_step,
    find_one_state,
    initial_error,
)

__all__ = [
    "Codec",
    "Encoded",
    "QuantizeState",
    "decode",
    "decode_tree",
    "encode",
    "encode_tree",
    "encoded_nbytes",
    "last_encoded",
    "quantize",
]

SCHEMES = ("none", "uniform", "qsgd", "sign")
CODE_BITS = (2, 4, 8, 16)
MAX_LEVELS = 2**15 - 1

_F32 = jnp.float32
# Largest finite float32: caps 1 / step so that a subnormal scale cannot turn a
# zero element into 0 * inf = NaN.
_F32_MAX = float(np.finfo(np.float32).max)
# Smallest normal float32: a smaller step is sent as 0. XLA flushes subnormal
# results to zero on CPUs and keeps them on GPUs, so without it a block of
# subnormal values, and the zeros sharing its scale (which the sign code sends
# as +step), decoded to 0 on one platform and to about 3e-40 on the other.
_F32_TINY = float(np.finfo(np.float32).tiny)


def _min_bits_for_levels(levels: int) -> int:
    for bits in CODE_BITS:
        if 2 ** (bits - 1) - 1 >= levels:
            return bits
    raise ValueError(f"levels must be at most {MAX_LEVELS}, got {levels}")


@dataclasses.dataclass(frozen=True)
class Codec:
    """A compression scheme: what :func:`encode` does and how to read its bytes.

    Fields left as None take the scheme's default, so the stored fields are always
    concrete after construction (``Codec("qsgd", levels=7).bits == 4``).

    Attributes:
      scheme: one of ``"none"``, ``"uniform"``, ``"qsgd"``, ``"sign"``.
      bits: bits per code. ``uniform``: one of 2, 4, 8, 16 (default 8), codes
        ``-(2^(b-1)-1) .. 2^(b-1)-1``. ``qsgd``: the smallest of 2, 4, 8, 16 that
        holds ``levels`` (or any larger one of them). ``sign``: 1. ``none``: 32.
      block_size: None for one scale per array, else one scale per block of that
        many consecutive elements. Must be None for ``none``.
      stochastic: unbiased stochastic rounding (True) or nearest rounding (False).
        Default True for ``uniform`` and ``qsgd``, False for ``sign`` and
        ``none`` (which has no rounding and accepts only False).
      levels: QSGD's number of levels ``s`` (1 to 32767); default
        ``2^(bits-1)-1``, i.e. 127 for 8 bits. None for the other schemes.

    Examples:
      >>> from hpsjax.transforms import Codec
      >>> Codec("qsgd", levels=7)
      Codec(scheme='qsgd', bits=4, block_size=None, stochastic=True, levels=7)
      >>> Codec.from_dict(Codec("uniform", 4, block_size=256).to_dict()).bits
      4
    """

    scheme: str = "uniform"
    bits: int | None = None
    block_size: int | None = None
    stochastic: bool | None = None
    levels: int | None = None

    def __post_init__(self):
        scheme, bits, levels = self.scheme, self.bits, self.levels
        if not isinstance(scheme, str) or scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        if bits is not None and not is_int(bits):
            raise ValueError(f"bits must be an int or None, got {bits!r}")
        if levels is not None and not is_int(levels):
            raise ValueError(f"levels must be an int or None, got {levels!r}")
        if self.block_size is not None and (
            not is_int(self.block_size) or self.block_size < 1
        ):
            raise ValueError(
                f"block_size must be a positive int or None, got {self.block_size!r}"
            )
        if self.stochastic is not None and not isinstance(self.stochastic, bool):
            raise ValueError(
                f"stochastic must be a bool or None, got {self.stochastic!r}"
            )
        if scheme != "qsgd" and levels is not None:
            raise ValueError(
                f"levels applies to scheme 'qsgd' only, got levels={levels!r} "
                f"with scheme {scheme!r}"
            )

        stochastic = self.stochastic
        if scheme == "uniform":
            bits = 8 if bits is None else bits
            if bits not in CODE_BITS:
                raise ValueError(
                    f"bits for scheme 'uniform' must be one of {CODE_BITS}, got {bits}"
                )
            stochastic = True if stochastic is None else stochastic
        elif scheme == "qsgd":
            if levels is None:
                bits = 8 if bits is None else bits
                if bits not in CODE_BITS:
                    raise ValueError(
                        f"bits for scheme 'qsgd' must be one of {CODE_BITS}, got {bits}"
                    )
                levels = 2 ** (bits - 1) - 1
            else:
                if not 1 <= levels <= MAX_LEVELS:
                    raise ValueError(
                        f"levels must be in [1, {MAX_LEVELS}], got {levels}"
                    )
                least = _min_bits_for_levels(levels)
                valid = tuple(b for b in CODE_BITS if b >= least)
                bits = least if bits is None else bits
                if bits not in valid:
                    raise ValueError(
                        f"bits for qsgd with {levels} levels must be one of {valid} "
                        f"(sign + level), got {bits}"
                    )
            stochastic = True if stochastic is None else stochastic
        elif scheme == "sign":
            bits = 1 if bits is None else bits
            if bits != 1:
                raise ValueError(f"bits for scheme 'sign' must be 1, got {bits}")
            stochastic = False if stochastic is None else stochastic
        else:
            bits = 32 if bits is None else bits
            if bits != 32:
                raise ValueError(f"bits for scheme 'none' must be 32, got {bits}")
            if stochastic:
                raise ValueError("scheme 'none' does not round: stochastic=True")
            if self.block_size is not None:
                raise ValueError("scheme 'none' has no scales: block_size must be None")
            stochastic = False
        object.__setattr__(self, "bits", int(bits))
        object.__setattr__(self, "levels", None if levels is None else int(levels))
        object.__setattr__(
            self,
            "block_size",
            None if self.block_size is None else int(self.block_size),
        )
        object.__setattr__(self, "stochastic", stochastic)

    @property
    def half_range(self) -> int:
        """The largest code magnitude L: codes span [-L, L] before the offset
        (``sign`` and ``none`` have no offset and do not use it)."""
        if self.scheme == "qsgd":
            return self.levels
        return 2 ** (self.bits - 1) - 1

    def to_dict(self) -> dict[str, Any]:
        """Returns the codec as a plain dict (str, int, bool, None values).

        The dict is JSON- and msgpack-serialisable; :meth:`from_dict` inverts it.
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Codec:
        """Builds a codec from :meth:`to_dict`'s output, validating every value.

        Args:
          d: a mapping with keys among ``scheme``, ``bits``, ``block_size``,
            ``stochastic``, ``levels``; missing keys take their defaults.

        Returns:
          The :class:`Codec`.

        Raises:
          ValueError: ``d`` is not a mapping, has an unknown key, or a bad value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"codec must be a mapping, got {type(d).__name__}")
        names = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(repr(k) for k in d if k not in names)
        if unknown:
            raise ValueError(
                f"unknown codec keys {', '.join(unknown)}; valid keys are {names}"
            )
        return cls(**d)


class Encoded(NamedTuple):
    """One array as it travels on the wire (layout in the module docstring).

    The shape and dtype of the original array are not stored: the receiver knows
    them (from the model, or from the message's metadata).
    """

    codes: jax.Array  # shape=(ceil(size * bits / 8),), uint8
    scales: jax.Array  # shape=(number of blocks,), float32


class QuantizeState(NamedTuple):
    """State of :func:`quantize`."""

    count: jax.Array  # shape=(), int32: number of updates so far
    key: jax.Array  # shape=(2,), uint32: raw PRNG key data, split every update
    # Error-feedback residual e, a float32 tree like the updates, or
    # optax.EmptyState() when error feedback is off.
    error: Any
    # The Encoded of each leaf of the last output, in leaf order: the bytes that
    # decode to exactly that output.
    encoded: list[Encoded]


def _counts(size: int, codec: Codec) -> tuple[int, int]:
    """Returns (number of code bytes, number of scales) for `size` elements."""
    n_codes = -(-size * codec.bits // 8)
    if codec.scheme == "none":
        return n_codes, 0
    if codec.block_size is None:
        return n_codes, 1
    return n_codes, -(-size // codec.block_size)


def _check_shape(shape: Any) -> tuple[int, ...]:
    try:
        dims = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be a sequence of ints, got {shape!r}") from None
    if not all(is_int(d) and d >= 0 for d in dims):
        raise ValueError(f"shape must hold non-negative ints, got {shape!r}")
    return tuple(int(d) for d in dims)


def _check_codec(codec: Any) -> Codec:
    if not isinstance(codec, Codec):
        raise ValueError(f"codec must be a Codec, got {type(codec).__name__}")
    return codec


def encoded_nbytes(shape: Sequence[int], codec: Codec) -> int:
    """Returns the exact size in bytes of :func:`encode`'s output.

    .. math::

      \\lceil d \\cdot b / 8 \\rceil + 4 n_s,

    with ``d`` the number of elements, ``b`` = ``codec.bits`` and ``n_s`` the
    number of scales: 0 for ``none``, 1 per array, or ``ceil(d / block_size)``.

    Args:
      shape: shape of the original array.
      codec: the :class:`Codec`.

    Returns:
      ``codes.nbytes + scales.nbytes`` of the :class:`Encoded`.

    Examples:
      >>> from hpsjax.transforms import Codec, encoded_nbytes
      >>> encoded_nbytes((1000, 1000), Codec("uniform", 8))  # 1 MB + one scale
      1000004
      >>> encoded_nbytes((1000, 1000), Codec("sign", block_size=4096))
      125980
    """
    size = math.prod(_check_shape(shape))
    n_codes, n_scales = _counts(size, _check_codec(codec))
    return n_codes + 4 * n_scales


def _mix32(h: jax.Array) -> jax.Array:
    """A bijective avalanche mix of uint32 values (the 'lowbias32' constants).

    Each output bit depends on every input bit, so consecutive counters give
    rounding decisions that look independent.
    """
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def _random_bits(index: jax.Array, seeds: jax.Array, bits: int) -> jax.Array:
    """``bits`` (at most 31) random bits per uint32 element index, as int32.

    ``seeds[1]`` is uniform over all 2^32 values and the map index -> hash is a
    bijection, so every element's draw is exactly uniform over its 2^bits values
    whatever the hash's quality; the odd multiplier ``seeds[0]`` decorrelates the
    streams of successive keys.
    """
    h = _mix32(index * seeds[0] + seeds[1])
    return lax.convert_element_type(h >> (32 - bits), jnp.int32)


def _seeds(key: jax.Array) -> jax.Array:
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    seeds = jax.random.bits(key, (2,), jnp.uint32)
    return seeds.at[0].set(seeds[0] | jnp.uint32(1))


def _index(shape: tuple[int, int], offset: int) -> jax.Array:
    rows, cols = shape
    index = lax.broadcasted_iota(jnp.uint32, shape, 1) + jnp.uint32(offset)
    if rows > 1:
        index = index + lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(cols)
    return index


def _block_stats(flat: jax.Array, codec: Codec) -> jax.Array:
    """Returns the float32 step of each block (or of the whole array)."""
    size = flat.shape[0]
    scheme, levels = codec.scheme, codec.half_range
    stat = {
        "uniform": "max",
        "qsgd": "l2",
        "sign": "max" if codec.stochastic else "l1",
    }[scheme]

    def full(x):
        if stat == "max":
            return jnp.max(jnp.abs(x))
        if stat == "l2":
            return jnp.sqrt(jnp.sum(x * x))
        return jnp.sum(jnp.abs(x)) * _F32(1 / x.shape[0])

    def rows(x):
        if stat == "max":
            # The bare row max and min vectorise; a row max of |x| compiles to a
            # sequential loop several times slower on CPU.
            return jnp.maximum(jnp.max(x, axis=1), -jnp.min(x, axis=1))
        if stat == "l2":
            return jnp.sqrt(jnp.sum(x * x, axis=1))
        return jnp.sum(jnp.abs(x), axis=1) * _F32(1 / x.shape[1])

    if codec.block_size is None:
        if size == 0:
            return jnp.zeros((1,), _F32)
        stats = full(flat)[None]
    else:
        block = codec.block_size
        n_full, rest = divmod(size, block)
        parts = []
        if n_full:
            parts.append(rows(flat[: n_full * block].reshape(n_full, block)))
        if rest:
            parts.append(full(flat[n_full * block :])[None])
        if not parts:
            return jnp.zeros((0,), _F32)
        stats = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    if scheme != "sign":
        # A multiply, not a division by a constant: XLA rewrites the latter into
        # a multiply under jit but not op by op, and the step must not depend on
        # that.
        stats = stats * _F32(1 / levels)
    # NaN and infinity compare false and stay, for the checks downstream.
    return jnp.where(jnp.abs(stats) < _F32_TINY, _F32(0), stats)


def _block_codes(
    x: jax.Array,
    step: jax.Array,
    codec: Codec,
    seeds: jax.Array | None,
    offset: int,
) -> jax.Array:
    """Codes in [0, 2^bits) of a 2-D piece of the array, int32.

    ``x`` has shape (rows, cols) and ``step`` broadcasts against it; ``offset`` is
    the flat index of ``x[0, 0]`` in the whole array, so that every element draws
    its own random bits wherever the block boundaries fall.
    """
    if codec.scheme == "sign" and not codec.stochastic:
        return (x >= 0).astype(jnp.int32)
    sign = codec.scheme == "sign"
    # Stochastic rounding works on y in fixed point with `frac` fractional bits,
    # Y = round(y 2^frac), as (Y + r) >> frac with r uniform on [0, 2^frac): it
    # rounds up with probability exactly (Y mod 2^frac) / 2^frac. Integer
    # arithmetic after one multiply and one round leaves XLA no float rewrite
    # (contraction into fused multiply-adds) that could change a code between
    # compilations. (levels + 1) 2^frac must fit in int32.
    frac = min(24, 32 - codec.bits) if codec.stochastic else 0
    # The stochastic sign's y is (x / max|x|) 2^(frac - 1), in [-top, top].
    top = 2 ** (frac - 1) if sign else codec.half_range * 2**frac
    scale = top if sign else 2**frac
    inv = jnp.minimum(jnp.where(step > 0, _F32(scale) / step, 0), _F32_MAX)
    y = jnp.clip(jnp.round(x * inv), -top, top)
    if not codec.stochastic:
        return (y + top).astype(jnp.int32)
    r = _random_bits(_index(x.shape, offset), seeds, frac)
    y = y.astype(jnp.int32)
    if sign:
        # P(code = 1) = (top + y) / 2^frac = (1 + x / max|x|) / 2, so that
        # E[(2 code - 1) max|x|] = x.
        return (r < y + top).astype(jnp.int32)
    return ((y + r) >> frac) + codec.half_range


def _codes(flat, steps, codec, seeds):
    size = flat.shape[0]
    if codec.block_size is None:
        return _block_codes(flat[None], steps[0], codec, seeds, 0).reshape(size)
    block = codec.block_size
    n_full, rest = divmod(size, block)
    parts = []
    if n_full:
        main = flat[: n_full * block].reshape(n_full, block)
        parts.append(
            _block_codes(main, steps[:n_full, None], codec, seeds, 0).reshape(-1)
        )
    if rest:
        tail = flat[n_full * block :][None]
        parts.append(
            _block_codes(tail, steps[n_full], codec, seeds, n_full * block).reshape(-1)
        )
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _pack(q: jax.Array, bits: int) -> jax.Array:
    """Packs int32 codes in [0, 2^bits) into bytes (layout in the module doc)."""
    if bits == 16:
        return _little_endian_bytes(q.astype(jnp.uint16))
    q = q.astype(jnp.uint8)
    if bits == 8:
        return q
    per_byte = 8 // bits
    pad = (-q.shape[0]) % per_byte
    if pad:
        q = jnp.pad(q, (0, pad))
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    # The codes occupy disjoint bits, so the sum is their bitwise or.
    return jnp.sum(q.reshape(-1, per_byte) << shifts, axis=1, dtype=jnp.uint8)


def _unpack(codes: jax.Array, bits: int, size: int) -> jax.Array:
    """Inverse of :func:`_pack`: int32 codes of the first `size` elements."""
    if bits == 16:
        pairs = codes.reshape(-1, 2).astype(jnp.int32)
        return pairs[:, 0] | (pairs[:, 1] << 8)
    if bits == 8:
        return codes.astype(jnp.int32)
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * jnp.uint8(bits)
    q = (codes[:, None] >> shifts) & jnp.uint8(2**bits - 1)
    return q.reshape(-1)[:size].astype(jnp.int32)


def _little_endian_bytes(words: jax.Array) -> jax.Array:
    """The bytes of 1-D uint16 or uint32 words, least significant first."""
    if sys.byteorder == "little" and jax.default_backend() == "cpu":
        # On the CPU a bitcast splits words in the host's byte order, and packs
        # blocks about twice as fast as the shifts below, which are portable:
        # StableHLO leaves the byte order of a narrowing bitcast to the backend.
        return lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    width = words.dtype.itemsize
    parts = [(words >> (8 * i)).astype(jnp.uint8) for i in range(width)]
    return jnp.stack(parts, axis=-1).reshape(-1)


def _float_bytes(flat: jax.Array) -> jax.Array:
    return _little_endian_bytes(lax.bitcast_convert_type(flat, jnp.uint32))


def _bytes_float(codes: jax.Array) -> jax.Array:
    b = codes.reshape(-1, 4).astype(jnp.uint32)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    return lax.bitcast_convert_type(word, _F32)


def encode(x: jax.Array, codec: Codec, key: jax.Array | None = None) -> Encoded:
    """Quantizes one array into wire bytes: codes and float32 scales.

    Per block (or the whole array) with step ``Δ`` and ``L`` as in the module
    table, ``y = x / Δ`` and the code is ``r(y) + L``, ``r(y)`` in ``[-L, L]``:

    .. math::

      r(y) = \\left\\lfloor \\frac{Y + R}{2^k} \\right\\rfloor,\\
      Y = \\mathrm{round}(2^k y),\\ R \\sim U\\{0, \\dots, 2^k - 1\\}
      \\quad\\text{(stochastic)},\\qquad
      r(y) = \\mathrm{round}(y) \\quad\\text{(nearest)},

    with ``k = min(24, 32 - bits)`` fractional bits, so ``E[r(y)] = Y / 2^k``:
    unbiased up to the float32 rounding of ``y`` (at most about
    ``2^-24 max|x|`` per element). The stochastic ``sign`` sends 1 with
    probability ``(1 + x / max|x|) / 2`` in the same fixed point. ``R`` comes from
    a counter-based hash of the element index (the ``lowbias32`` avalanche mix of
    ``index * m + s``, with an odd ``m`` and a uniform ``s`` drawn once from
    ``key``): each element's ``R`` is exactly uniform, and no full-size array of
    random numbers is ever built, so scaling, rounding and packing fuse into one
    XLA kernel. After one float multiply and one rounding the arithmetic is on
    integers, so given the scales the codes are the same however XLA compiles the
    call (jitted or not, fused into a larger program or not); max-abs scales are
    exact too, while the sums behind ``qsgd`` and nearest ``sign`` scales may round
    differently in different programs. Arrays are computed in float32.

    Args:
      x: a floating array of any shape (float32, bfloat16, float16, ...).
      codec: the :class:`Codec`; hashable, so pass it as a static argument under
        ``jax.jit``.
      key: a PRNG key (typed or raw ``uint32[2]``), required when
        ``codec.stochastic``; ignored otherwise.

    Returns:
      The :class:`Encoded` codes and scales (:func:`encoded_nbytes` bytes).

    Raises:
      ValueError: ``x`` is not floating, ``key`` is missing for stochastic
        rounding, or ``x`` has 2^32 elements or more with stochastic rounding.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from hpsjax.transforms import Codec, encode, decode
      >>> codec = Codec("uniform", bits=4, stochastic=False)
      >>> enc = encode(jnp.array([0.0, 0.65, -1.4]), codec)  # step 1.4 / 7
      >>> enc.codes  # codes 7, 10 in the first byte, 0 in the second
      Array([167,   0], dtype=uint8)
      >>> decode(enc, codec, (3,), jnp.float32)
      Array([ 0. ,  0.6, -1.4], dtype=float32)

    References:
      Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD
      via Gradient Quantization and Encoding", NeurIPS 2017,
      https://arxiv.org/abs/1610.02132

      Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
      Application to Data-Parallel Distributed Training of Speech DNNs",
      Interspeech 2014.

      Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
      Gradient Compression Schemes", ICML 2019, https://arxiv.org/abs/1901.09847
    """
    codec = _check_codec(codec)
    x = _check_input(x, codec)
    seeds = None
    if codec.stochastic:
        if key is None:
            raise ValueError("stochastic rounding needs a PRNG key, got key=None")
        seeds = _seeds(jnp.asarray(key))
    return _encode(x, codec, seeds)


def _check_input(x: Any, codec: Codec) -> jax.Array:
    x = jnp.asarray(x)
    check_float_dtype("encode's input dtype", x.dtype)
    if codec.stochastic and x.size >= 2**32:
        raise ValueError(
            f"stochastic rounding counts elements in 32 bits; split arrays of "
            f"{x.size} >= 2**32 elements"
        )
    return x


def _encode(x: jax.Array, codec: Codec, seeds: jax.Array | None) -> Encoded:
    size = x.size
    flat = x.reshape(size).astype(_F32)
    if codec.scheme == "none":
        return Encoded(_float_bytes(flat), jnp.zeros((0,), _F32))
    steps = _block_stats(flat, codec)
    if size == 0:
        return Encoded(jnp.zeros((0,), jnp.uint8), steps)
    return Encoded(_pack(_codes(flat, steps, codec, seeds), codec.bits), steps)


def decode(
    encoded: Encoded,
    codec: Codec,
    shape: Sequence[int],
    dtype: Any = jnp.float32,
) -> jax.Array:
    """Rebuilds an array from :func:`encode`'s codes and scales.

    .. math::

      \\hat x_i = (c_i - L)\\,\\Delta_{B(i)}
      \\quad(\\text{sign: } (2 c_i - 1)\\,\\Delta_{B(i)}),

    with ``Δ_B(i)`` the step of element ``i``'s block, computed in float32 and cast
    to ``dtype``.

    Args:
      encoded: the :class:`Encoded` (codes ``uint8``, scales ``float32``).
      codec: the :class:`Codec` it was encoded with.
      shape: shape of the original array.
      dtype: floating dtype of the result.

    Returns:
      The decoded array of ``shape`` and ``dtype``.

    Raises:
      ValueError: the codes or scales do not have the sizes and dtypes that
        ``shape`` and ``codec`` imply, or ``dtype`` is not floating.

    Examples:
      >>> import jax.numpy as jnp
      >>> from hpsjax.transforms import Codec, Encoded, decode
      >>> enc = Encoded(jnp.array([0b101], jnp.uint8), jnp.array([0.5], jnp.float32))
      >>> decode(enc, Codec("sign"), (3,))
      Array([ 0.5, -0.5,  0.5], dtype=float32)
    """
    codec = _check_codec(codec)
    shape = _check_shape(shape)
    dtype = check_float_dtype("decode's dtype", dtype)
    if not isinstance(encoded, Encoded):
        raise ValueError(f"expected an Encoded, got {type(encoded).__name__}")
    codes, scales = jnp.asarray(encoded.codes), jnp.asarray(encoded.scales)
    size = math.prod(shape)
    n_codes, n_scales = _counts(size, codec)
    if codes.dtype != jnp.uint8 or codes.shape != (n_codes,):
        raise ValueError(
            f"codes for shape {shape} with {codec} must be uint8[{n_codes}], got "
            f"{codes.dtype}{list(codes.shape)}"
        )
    if scales.dtype != _F32 or scales.shape != (n_scales,):
        raise ValueError(
            f"scales for shape {shape} with {codec} must be float32[{n_scales}], "
            f"got {scales.dtype}{list(scales.shape)}"
        )
    if size == 0:
        return jnp.zeros(shape, dtype)
    if codec.scheme == "none":
        return _bytes_float(codes).astype(dtype).reshape(shape)
    q = _unpack(codes, codec.bits, size)

    def values(q, step):
        if codec.scheme == "sign":
            return (2 * q - 1).astype(_F32) * step
        return (q - codec.half_range).astype(_F32) * step

    if codec.block_size is None:
        flat = values(q, scales[0])
    else:
        block = codec.block_size
        n_full, rest = divmod(size, block)
        parts = []
        if n_full:
            main = q[: n_full * block].reshape(n_full, block)
            parts.append(values(main, scales[:n_full, None]).reshape(-1))
        if rest:
            parts.append(values(q[n_full * block :], scales[n_full]))
        flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    return flat.astype(dtype).reshape(shape)


def encode_tree(tree: Any, codec: Codec, key: jax.Array | None = None) -> list[Encoded]:
    """Encodes every leaf of a pytree, one key per leaf.

    Leaf ``i`` (in ``jax.tree.leaves`` order) is encoded with
    ``jax.random.fold_in(key, i)``.

    Args:
      tree: a pytree of floating arrays.
      codec: the :class:`Codec`.
      key: a PRNG key, required when ``codec.stochastic``.

    Returns:
      A list with the :class:`Encoded` of each leaf, in leaf order.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from hpsjax.transforms import Codec, encode_tree, decode_tree
      >>> tree = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
      >>> enc = encode_tree(tree, Codec("uniform", 8), jax.random.key(0))
      >>> [e.codes.shape for e in enc]
      [(3,), (6,)]
      >>> decode_tree(enc, Codec("uniform", 8), tree)["w"]
      Array([[1., 1., 1.],
             [1., 1., 1.]], dtype=float32)
    """
    codec = _check_codec(codec)
    leaves = [_check_input(leaf, codec) for leaf in jax.tree.leaves(tree)]
    if not codec.stochastic or not leaves:
        return [_encode(leaf, codec, None) for leaf in leaves]
    if key is None:
        raise ValueError("stochastic rounding needs a PRNG key, got key=None")
    # The same keys as fold_in(key, i) leaf by leaf, derived in two batched
    # hash calls rather than two per leaf: much less to compile for big trees.
    index = jnp.arange(len(leaves), dtype=jnp.uint32)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jnp.asarray(key), index)
    seeds = jax.vmap(_seeds)(keys)
    return [_encode(leaf, codec, seeds[i]) for i, leaf in enumerate(leaves)]


def decode_tree(encoded_leaves: Sequence[Encoded], codec: Codec, like_tree: Any) -> Any:
    """Decodes :func:`encode_tree`'s output into a tree shaped like ``like_tree``.

    Args:
      encoded_leaves: the :class:`Encoded` of each leaf, in leaf order.
      codec: the :class:`Codec`.
      like_tree: a pytree whose leaves (arrays or ``jax.ShapeDtypeStruct``) give
        the structure, shapes and dtypes of the result.

    Returns:
      The decoded pytree.

    Raises:
      ValueError: the number of encoded leaves differs from ``like_tree``'s, or
        one of them does not match its leaf (see :func:`decode`).
    """
    return decode_leaves(
        encoded_leaves,
        like_tree,
        lambda enc, leaf: decode(enc, codec, leaf.shape, leaf.dtype),
    )


def _static_int(name: str, value: Any) -> None:
    if value is None or is_int(value):
        return
    if isinstance(value, (jax.Array, np.ndarray)):
        raise ValueError(
            f"quantize's {name} fixes the shapes of the packed codes and must be a "
            f"Python int, got an array; under optax.inject_hyperparams pass "
            f"static_args=('bits', 'block_size', 'levels')"
        )
    raise ValueError(f"{name} must be an int or None, got {value!r}")


def quantize(
    bits: int | None = None,
    *,
    scheme: str = "uniform",
    stochastic: bool | None = None,
    error_feedback: bool = False,
    block_size: int | None = None,
    levels: int | None = None,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """Quantizes updates as they would be sent, optionally with error feedback.

    Without error feedback the output is ``C(g) = decode(encode(g))``. With error
    feedback (a residual ``e_0 = 0`` kept in float32):

    .. math::

      p_t = g_t + e_t, \\qquad \\text{output } C(p_t), \\qquad
      e_{t+1} = p_t - C(p_t),

    so everything not yet sent is carried over and ``sum_t C(p_t) + e_T`` equals
    ``sum_t g_t``. The analysis of Karimireddy et al. bounds the residual for
    contractive compressors, ``E||C(p) - p||^2 <= (1 - δ) ||p||^2``, such as the
    scaled sign; with coarse stochastic ones (the stochastic sign, QSGD with few
    levels on long vectors) the residual can grow.

    The state keeps the :class:`Encoded` leaves of the output
    (:func:`last_encoded`), which the wire sends as they are. The key is split at
    every update; leaf ``i`` is encoded with ``fold_in(step_key, i)`` as in
    :func:`encode_tree`.

    Every hyperparameter changes array shapes or the program, so under
    ``optax.inject_hyperparams`` the int-valued ones must be static:
    ``inject_hyperparams`` turns every int argument (but not bools, strings or
    None) into an array, which this factory rejects with a ValueError. Use
    ``optax.inject_hyperparams(quantize, static_args=("bits", "block_size",
    "levels"))``; ``seed`` may stay injected (it is read only by ``init``).

    Args:
      bits: bits per code (see :class:`Codec`); None takes the scheme's default:
        8 for ``uniform``, the smallest width holding ``levels`` for ``qsgd``, 1
        for ``sign``.
      scheme: ``"uniform"``, ``"qsgd"``, ``"sign"`` or ``"none"``.
      stochastic: unbiased stochastic (True) or nearest (False) rounding; None
        takes the scheme's default (True, but False for ``sign``, which then is
        the scaled sign of Karimireddy et al.).
      error_feedback: carry the compression error over to the next update.
      block_size: None for one scale per leaf, else one scale per block of this
        many elements.
      levels: QSGD's number of levels ``s``.
      seed: seed of the PRNG key kept in the state.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; its state is a
      :class:`QuantizeState`.

    Raises:
      ValueError: a hyperparameter is invalid (see :class:`Codec`).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import quantize, last_encoded
      >>> opt = optax.chain(quantize(4, error_feedback=True), optax.sgd(0.1))
      >>> params = {"w": jnp.ones(5)}
      >>> state = opt.init(params)
      >>> updates, state = opt.update({"w": jnp.arange(5.0)}, state)
      >>> last_encoded(state)[0].codes.shape  # 5 elements, two per byte
      (3,)

    References:
      Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
      Gradient Compression Schemes", ICML 2019, https://arxiv.org/abs/1901.09847

      Alistarh, Grubic, Li, Tomioka, Vojnovic, "QSGD: Communication-Efficient SGD
      via Gradient Quantization and Encoding", NeurIPS 2017,
      https://arxiv.org/abs/1610.02132

      Seide, Fu, Droppo, Li, Yu, "1-Bit Stochastic Gradient Descent and its
      Application to Data-Parallel Distributed Training of Speech DNNs",
      Interspeech 2014.
    """
    _static_int("bits", bits)
    _static_int("block_size", block_size)
    _static_int("levels", levels)
    codec = Codec(
        scheme=scheme,
        bits=bits,
        block_size=block_size,
        stochastic=stochastic,
        levels=levels,
    )
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be a bool, got {error_feedback!r}")
    check_seed(seed)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        encoded = []
        for leaf in leaves:
            n_codes, n_scales = _counts(math.prod(leaf.shape), codec)
            encoded.append(
                Encoded(jnp.zeros((n_codes,), jnp.uint8), jnp.zeros((n_scales,), _F32))
            )
        return QuantizeState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            error=initial_error(params, error_feedback),
            encoded=encoded,
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        key, step_key = jax.random.split(state.key)

        def compress(sent):
            encoded = encode_tree(sent, codec, step_key)
            return encoded, decode_tree(encoded, codec, updates)

        out, error, encoded = error_feedback_step(
            updates, state.error, error_feedback, compress
        )
        return out, QuantizeState(
            count=optax.safe_increment(state.count),
            key=key,
            error=error,
            encoded=encoded,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def last_encoded(state: Any) -> list[Encoded]:
    """Returns the :class:`Encoded` leaves of :func:`quantize`'s last output.

    Finds the one :class:`QuantizeState` anywhere inside an optax state (chains,
    named chains, ``inject_hyperparams``, ``MultiSteps``, ...).

    Args:
      state: an optax state holding exactly one :class:`QuantizeState`.

    Returns:
      Its ``encoded`` list, one :class:`Encoded` per update leaf.

    Raises:
      ValueError: ``state`` holds no :class:`QuantizeState`, or more than one.

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from hpsjax.transforms import quantize, last_encoded
      >>> opt = optax.MultiSteps(optax.chain(quantize(8), optax.adam(1e-3)), 2)
      >>> len(last_encoded(opt.init({"a": jnp.ones(3), "b": jnp.ones(2)})))
      2
    """
    return find_one_state(state, QuantizeState, "no quantize").encoded
