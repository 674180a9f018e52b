"""Offline data: generated digit images, a ``.npz`` loader and per-worker batches.

Nothing here downloads. The core dependencies ship no labelled image dataset,
so the default data are **synthetic digits**: the ten digits drawn as strokes, each
example with its own jittered stroke points, slant, scale, shift, stroke width
and pixel noise, rendered anti-aliased at 8x8 (like the UCI digits) or 28x28
(like MNIST). The classes overlap enough that a linear classifier plateaus well
below 100% while a small MLP passes 90% within a few hundred SGD steps. With the
``experiments`` extra, :func:`sklearn_digits` gives the 1,797 real 8x8
handwritten digits bundled with scikit-learn. For bigger benchmarks,
:func:`load_npz` reads the user's own arrays.

:func:`text` gives byte-level language modelling on the English prose every
CPython carries, :func:`synthetic_regression` generated regression data.

A :class:`Dataset` holds inputs ``x`` (float32, ``(n, height, width, channels)``
or ``(n, features)``; int32 tokens ``(n, L)``) and targets ``y``: integer labels,
next tokens or real values (its ``target``). ``split`` makes train/test sets,
``shard`` gives each worker a disjoint part, and ``batches`` returns a
:class:`BatchStream`: an endless, deterministic sequence of shuffled batches whose
batch size may change from one call to the next, as a work plan requires.

Examples:
  >>> train, test = synthetic_digits(1000, seed=0).split(0.2, seed=0)
  >>> len(train), len(test), train.input_shape, train.num_classes
  (800, 200, (8, 8, 1), 10)
  >>> stream = train.shard(4, 0).batches(32, seed=1)
  >>> stream.next().x.shape, stream.next(batch_size=16).x.shape
  ((32, 8, 8, 1), (16, 8, 8, 1))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hpsjax.data._builtin import (
    load_npz,
    sklearn_digits,
    synthetic_digits,
    synthetic_regression,
    text,
)
from hpsjax.data._dataset import TARGETS, Batch, BatchStream, Dataset, share_split

__all__ = [
    "DATASETS",
    "Batch",
    "BatchStream",
    "Dataset",
    "get_dataset",
    "load_npz",
    "TARGETS",
    "share_split",
    "sklearn_digits",
    "synthetic_digits",
    "synthetic_regression",
    "text",
]


DATASETS: dict[str, Callable[..., Dataset]] = {
    "synthetic_digits": synthetic_digits,
    "sklearn_digits": sklearn_digits,
    "npz": load_npz,
    "text": text,
    "synthetic_regression": synthetic_regression,
}
"""The datasets by the name :func:`get_dataset` and ``--dataset`` take."""


_ARGUMENT_HINTS = {"path": ": the .npz file to read"}


def get_dataset(name: str, **kwargs: Any) -> Dataset:
    """Builds a dataset by registry name (for configs).

    Args:
      name: a key of :data:`DATASETS`: ``"synthetic_digits"``,
        ``"sklearn_digits"``, ``"npz"``, ``"text"`` or
        ``"synthetic_regression"``.
      **kwargs: arguments of that loader (e.g. ``image_size=28`` or
        ``path="data.npz"``).

    Returns:
      The dataset.

    Raises:
      ValueError: an unknown name (the message lists the valid ones), an
        argument the loader does not take, or one it needs left out (``"npz"``
        without ``path``); each in one line.
      FileNotFoundError: ``"npz"`` with no file at ``path``.

    Examples:
      >>> get_dataset("npz")
      Traceback (most recent call last):
      ...
      ValueError: dataset 'npz' needs path=...: the .npz file to read
    """
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}"
        )
    loader = DATASETS[name]
    params = inspect.signature(loader).parameters
    valid = [
        n
        for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = [key for key in kwargs if key not in valid]
    if unknown:
        raise ValueError(
            f"dataset {name!r} takes no argument {unknown[0]!r}; valid names: "
            f"{', '.join(valid) or 'none'}"
        )
    missing = [
        n
        for n in valid
        if params[n].default is inspect.Parameter.empty and n not in kwargs
    ]
    if missing:
        what = _ARGUMENT_HINTS.get(missing[0], "")
        raise ValueError(f"dataset {name!r} needs {missing[0]}=...{what}")
    return loader(**kwargs)
