"""A :class:`Dataset` (inputs and targets, split, sharded, batched), the
:class:`BatchStream` of its shuffled batches, and :func:`share_split`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from hpsjax._checks import check_int, check_number


class Batch(NamedTuple):
    """One batch; a pytree that jitted functions take as is.

    Attributes:
      x: inputs, ``(b, *input_shape)``, float32 (int32 for tokens).
      y: targets, as the :class:`Dataset`'s ``y``: labels ``(b,)`` int32, next
        tokens ``(b, L)`` int32 or values ``(b,)``/``(b, k)`` float32.
    """

    x: np.ndarray  # shape=(b, *input_shape), float32 or int32
    y: np.ndarray  # shape=(b,) int32 | (b, L) int32 | (b,) or (b, k) float32


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.view()
    a.flags.writeable = False
    return a


TARGETS = ("labels", "tokens", "values")
"""What a :class:`Dataset`'s ``y`` holds (its ``target``): class labels, next
tokens of token sequences, or real values to regress."""


def _check_target_shape(name: str, target: str, x: np.ndarray, y: np.ndarray):
    if target == "labels" and y.ndim != 1:
        raise ValueError(f"{name}: y must be 1-D, got shape {y.shape}")
    if target == "tokens" and (x.ndim != 2 or y.shape != x.shape):
        raise ValueError(
            f"{name}: tokens x and next tokens y must both be (n, L), got shapes "
            f"{x.shape} and {y.shape}"
        )
    if target == "values" and y.ndim not in (1, 2):
        raise ValueError(f"{name}: values y must be (n,) or (n, k), got {y.shape}")


def _real_inputs(name: str, x: np.ndarray) -> np.ndarray:
    """``x`` as float32 (``uint8`` scaled to ``[0, 1]``), checked finite."""
    real = np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / np.float32(255)
    elif real or x.dtype == np.bool_:
        x = x.astype(np.float32, copy=False)
    else:
        raise ValueError(f"{name}: x must be real numbers, got dtype {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: x holds NaN or infinite values")
    return x


def _integers(name: str, what: str, a: np.ndarray) -> np.ndarray:
    """``a`` as int32, checked to hold non-negative integers."""
    label = what.rsplit(" ", 1)[0]
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or (a != np.round(a)).any():
            raise ValueError(f"{name}: {what} must be integers")
    elif not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name}: {what} must be integers, got dtype {a.dtype}")
    if a.min() < 0:
        raise ValueError(f"{name}: {label} must be non-negative, found {a.min()}")
    return a.astype(np.int32)


class Dataset:
    """Examples and their targets held in memory, exposed read-only.

    ``target`` says what ``y`` holds:

    * ``"labels"`` (the default): integer class labels ``(n,)`` in
      ``[0, num_classes)``; ``x`` is converted to float32 (``uint8`` images
      are scaled to ``[0, 1]``).
    * ``"tokens"``: next-token sequences ``(n, L)`` of the token sequences
      ``x`` ``(n, L)``, both integers in ``[0, num_classes)`` (the
      vocabulary), kept int32.
    * ``"values"``: real regression targets ``(n,)`` or ``(n, k)``, float32;
      ``num_classes`` is the output width (1 or ``k``); ``x`` as for labels.

    Args:
      x: inputs with a leading example axis, at least 2-D. A float32 array is
        kept without a copy, so the caller should not modify it afterwards.
      y: the targets, as ``target`` says.
      num_classes: number of classes or tokens; ``max(y) + 1`` when omitted
        (labels, tokens); the output width for values (given or not).
      name: a label for messages and reports.
      target: ``"labels"``, ``"tokens"`` or ``"values"``.

    Raises:
      ValueError: empty data, lengths or shapes that differ, a non-numeric or
        non-finite ``x`` or ``y``, labels or tokens that are not non-negative
        integers or not below ``num_classes``.
    """

    def __init__(
        self,
        x: Any,
        y: Any,
        *,
        num_classes: int | None = None,
        name: str = "dataset",
        target: str = "labels",
    ):
        if target not in TARGETS:
            raise ValueError(f"{name}: target must be one of {TARGETS}, got {target!r}")
        x = np.asarray(x)
        y = np.asarray(y)
        if x.ndim < 2:
            raise ValueError(
                f"{name}: x must have a leading example axis and at least one "
                f"feature axis, got shape {x.shape}"
            )
        _check_target_shape(name, target, x, y)
        if len(x) != len(y):
            raise ValueError(
                f"{name}: x has {len(x)} examples but y has {len(y)} labels"
            )
        if len(x) == 0:
            raise ValueError(f"{name}: no examples")
        if target == "tokens":
            x = _integers(name, "tokens x", x)
            y = _integers(name, "next tokens y", y)
            top = int(max(x.max(), y.max()))
        else:
            x = _real_inputs(name, x)
        if target == "values":
            if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_):
                raise ValueError(f"{name}: values y must be numbers, got {y.dtype}")
            y = y.astype(np.float32)
            if not np.isfinite(y).all():
                raise ValueError(f"{name}: y holds NaN or infinite values")
            width = 1 if y.ndim == 1 else y.shape[1]
            if num_classes is not None and num_classes != width:
                raise ValueError(
                    f"{name}: num_classes of values is their width {width}, got "
                    f"{num_classes}"
                )
            num_classes = width
        elif target == "labels":
            y = _integers(name, "labels y", y)
            top = int(y.max())
        if target != "values":
            if num_classes is None:
                num_classes = top + 1
            num_classes = check_int("num_classes", num_classes, low=1)
            if top >= num_classes:
                what = "label" if target == "labels" else "token"
                raise ValueError(
                    f"{name}: {what} {top} is not below num_classes={num_classes}"
                )
        self._x = _readonly(x)
        self._y = _readonly(y)
        self._num_classes = num_classes
        self._name = name
        self._target = target

    @property
    def x(self) -> np.ndarray:
        """Inputs, ``(n, *input_shape)``, read-only: float32, or int32 tokens."""
        return self._x

    @property
    def y(self) -> np.ndarray:
        """Targets, read-only: labels ``(n,)`` int32, next tokens ``(n, L)``
        int32, or values ``(n,)`` or ``(n, k)`` float32."""
        return self._y

    @property
    def num_classes(self) -> int:
        """Number of classes, the vocabulary's size, or the values' width."""
        return self._num_classes

    @property
    def target(self) -> str:
        """What ``y`` holds: ``"labels"``, ``"tokens"`` or ``"values"``."""
        return self._target

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example."""
        return tuple(self._x.shape[1:])

    @property
    def name(self) -> str:
        """The dataset's label."""
        return self._name

    def __len__(self) -> int:
        return len(self._y)

    def __repr__(self) -> str:
        target = "" if self._target == "labels" else f", target={self._target!r}"
        return (
            f"Dataset({self._name!r}, n={len(self)}, input_shape={self.input_shape}, "
            f"num_classes={self._num_classes}{target})"
        )

    def _subset(self, index: np.ndarray, name: str) -> Dataset:
        # The parent was validated; a subset skips the checks over its data.
        subset = object.__new__(Dataset)
        subset._x = _readonly(self._x[index])
        subset._y = _readonly(self._y[index])
        subset._num_classes = self._num_classes
        subset._name = name
        subset._target = self._target
        return subset

    def split(
        self, test_fraction: float = 0.2, *, seed: int = 0
    ) -> tuple[Dataset, Dataset]:
        """Splits into a train and a test set after a seeded shuffle.

        Args:
          test_fraction: share of examples in the test set, in ``(0, 1)``; the
            test set gets ``round(n * test_fraction)`` examples, at least one, and
            the train set at least one.
          seed: seed of the shuffle.

        Returns:
          ``(train, test)``, disjoint, together all examples.

        Raises:
          ValueError: a fraction outside ``(0, 1)``, or fewer than two examples.
        """
        test_fraction = check_number(
            "test_fraction",
            test_fraction,
            low=0,
            high=1,
            low_inclusive=False,
            high_inclusive=False,
        )
        seed = check_int("seed", seed, low=0)
        n = len(self)
        if n < 2:
            raise ValueError(f"{self._name}: cannot split {n} example(s)")
        num_test = min(max(round(n * test_fraction), 1), n - 1)
        order = np.random.default_rng(seed).permutation(n)
        return (
            self._subset(np.sort(order[num_test:]), f"{self._name}/train"),
            self._subset(np.sort(order[:num_test]), f"{self._name}/test"),
        )

    def shard(self, num_shards: int, index: int) -> Dataset:
        """The ``index``-th of ``num_shards`` disjoint shards, for one worker.

        Shard ``i`` holds examples ``i, i + num_shards, i + 2 num_shards, ...``:
        the shards are disjoint, together hold every example, differ in size by
        at most one, and each sees every class even when the data are sorted by
        label.

        Args:
          num_shards: number of shards (workers), at most ``len(self)``.
          index: which shard, ``0 <= index < num_shards``.

        Returns:
          The shard as a :class:`Dataset`.

        Raises:
          ValueError: a bad count or index.
        """
        num_shards = check_int("num_shards", num_shards, low=1)
        if num_shards > len(self):
            raise ValueError(
                f"{self._name}: cannot cut {len(self)} examples into {num_shards} "
                "non-empty shards"
            )
        index = check_int("shard index", index, low=0, high=num_shards - 1)
        return self._subset(
            np.arange(int(index), len(self), num_shards),
            f"{self._name}/shard{index}of{num_shards}",
        )

    def shard_by_shares(self, shares: Sequence[float], index: int) -> Dataset:
        """Worker ``index``'s shard when worker ``i`` holds a share ``shares[i]``
        of the examples (ASHL's reference re-partitions the data so); see
        :func:`share_split`.

        Raises:
          ValueError: bad shares, a bad index, or a worker left without examples.
        """
        parts = share_split(len(self), shares)
        index = check_int("shard index", index, low=0, high=len(parts) - 1)
        return self._subset(
            parts[int(index)], f"{self._name}/share{index}of{len(parts)}"
        )

    def batches(
        self, batch_size: int, *, seed: int, epoch: int = 0, offset: int = 0
    ) -> BatchStream:
        """An endless stream of shuffled batches; see :class:`BatchStream`."""
        return BatchStream(self, batch_size, seed=seed, epoch=epoch, offset=offset)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        """All examples in order, in batches of ``batch_size`` (the last may be
        smaller), for evaluation.

        Raises:
          ValueError: a non-positive batch size.
        """
        batch_size = check_int("batch_size", batch_size, low=1)

        def generate() -> Iterator[Batch]:
            for start in range(0, len(self), batch_size):
                stop = start + batch_size
                yield Batch(self._x[start:stop], self._y[start:stop])

        return generate()


def share_split(num_examples: int, shares: Sequence[float]) -> list[np.ndarray]:
    """Example indices ``0 .. num_examples - 1`` cut into disjoint parts, part
    ``i`` holding about ``shares[i]`` of them (the largest-remainder count).

    Deterministic, so that every worker process cuts the same parts. The parts
    are interleaved, not contiguous: part ``i``'s ``c_i`` examples sit at
    evenly spaced positions ``(k + 1/2) / c_i`` of the whole (ties to the lower
    part), so each part sees every class even when the data are sorted by
    label. Equal shares of ``n`` examples give ``i, i + n, i + 2n, ...``, as
    :meth:`Dataset.shard` does when ``n`` divides the count.

    Args:
      num_examples: how many examples, >= 1.
      shares: one share >= 0 per part, summing to 1 (within 1e-6).

    Returns:
      One sorted ``int64`` index array per part.

    Raises:
      ValueError: bad shares, or a part with a positive share left empty.
    """
    num_examples = check_int("num_examples", num_examples, low=1)
    p = np.asarray(shares, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"shares must be finite numbers >= 0, got {shares!r}")
    if abs(float(p.sum()) - 1.0) > 1e-6:
        raise ValueError(f"shares must sum to 1, got {shares!r} (sum {p.sum()})")
    exact = p * num_examples
    counts = np.floor(exact).astype(np.int64)
    left = num_examples - int(counts.sum())
    if left > 0:  # the largest remainders get one more; ties to the lower part
        order = np.lexsort((np.arange(p.size), -(exact - counts)))
        counts[order[:left]] += 1
    empty = [i for i in range(p.size) if p[i] > 0 and counts[i] == 0]
    if empty:
        raise ValueError(
            f"{num_examples} examples leave parts {empty} of shares {list(p)} empty"
        )
    labels = np.repeat(np.arange(p.size), counts)
    ticks = np.concatenate(
        [(np.arange(c) + 0.5) / c for c in counts if c > 0] or [np.zeros(0)]
    )
    owner = labels[np.lexsort((labels, ticks))]
    return [np.flatnonzero(owner == i) for i in range(p.size)]


class BatchStream:
    r"""A deterministic, endless stream of shuffled batches of changing size.

    The stream walks through epoch after epoch; epoch ``e`` visits every example
    once in the order of a permutation drawn from ``(seed, e)``. A batch is the
    next ``batch_size`` positions of that walk, so a batch may run across an
    epoch boundary and the batch size may change at every call (a work plan
    re-sized for a worker) without skipping or repeating an example within an
    epoch. The stream is fully described by ``(seed, epoch, offset)``; saving
    :meth:`position` and passing it back to :meth:`Dataset.batches` resumes it
    exactly.

    Args:
      dataset: the examples.
      batch_size: the default batch size of :meth:`next`.
      seed: seed of the shuffles.
      epoch: epoch to start in.
      offset: position within that epoch, ``0 <= offset < len(dataset)``.

    Raises:
      ValueError: a non-positive batch size, or a negative seed, epoch or offset.

    Examples:
      >>> data = Dataset(np.arange(10.0).reshape(10, 1), np.arange(10) % 2)
      >>> stream = data.batches(4, seed=0)
      >>> [stream.next().y.shape[0] for _ in range(3)], stream.position()
      ([4, 4, 4], {'seed': 0, 'epoch': 1, 'offset': 2})
      >>> stream.batch_size = 7
      >>> stream.next().y.shape
      (7,)
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        seed: int,
        epoch: int = 0,
        offset: int = 0,
    ):
        if not isinstance(dataset, Dataset):
            raise ValueError(f"dataset must be a Dataset, got {type(dataset).__name__}")
        self._dataset = dataset
        self._batch_size = check_int("batch_size", batch_size, low=1)
        self._seed = check_int("seed", seed, low=0)
        epoch = check_int("epoch", epoch, low=0)
        offset = check_int("offset", offset, low=0, high=len(dataset) - 1)
        self._epoch = int(epoch)
        self._offset = int(offset)
        self._order = self._permutation(self._epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self._seed, epoch]).permutation(
            len(self._dataset)
        )

    @property
    def batch_size(self) -> int:
        """The default batch size; assign to change it between rounds."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = check_int("batch_size", value, low=1)

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._epoch

    def position(self) -> dict[str, int]:
        """``{"seed", "epoch", "offset"}``: where the stream stands (msgpack-able)."""
        return {"seed": self._seed, "epoch": self._epoch, "offset": self._offset}

    def next(self, batch_size: int | None = None) -> Batch:
        """The next batch.

        Args:
          batch_size: size of this batch only; the stream's ``batch_size`` when
            omitted.

        Returns:
          A :class:`Batch` of exactly ``batch_size`` examples.
        """
        size = self._batch_size if batch_size is None else batch_size
        size = check_int("batch_size", size, low=1)
        n = len(self._dataset)
        parts = []
        while size > 0:
            take = min(size, n - self._offset)
            parts.append(self._order[self._offset : self._offset + take])
            self._offset += take
            size -= take
            if self._offset == n:
                self._epoch += 1
                self._offset = 0
                self._order = self._permutation(self._epoch)
        index = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return Batch(self._dataset.x[index], self._dataset.y[index])

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Batch:
        return self.next()
