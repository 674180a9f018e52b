"""Batch sizes on a geometric grid: a few shapes a worker compiles ahead.

Every batch size new to a worker is a compile of its step (seconds beside its
rounds on a busy machine). A plan whose batches are restricted to a grid of
sizes, :math:`\\operatorname{round}(2^{k/n})` up to the global batch, has at
most a few dozen shapes, which a worker compiles before it joins (and a
persistent compilation cache keeps): a pilot's or re-planner's new batch then
needs no compile. :func:`on_grid` puts a planned batch on the grid at or below
it, so that no worker's step grows past its plan's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from hpsjax._checks import check_int

__all__ = ["batch_grid", "on_grid"]


def batch_grid(high: int, per_doubling: int = 4, low: int = 1) -> tuple[int, ...]:
    """The sizes ``round(low * 2 ** (k / per_doubling))`` from ``low`` to
    ``high`` (both included), ascending, without repeats.

    Raises:
      ValueError: ``low`` < 1, ``high`` < ``low`` or ``per_doubling`` < 1.

    Examples:
      >>> batch_grid(32)
      (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 23, 27, 32)
      >>> batch_grid(20, per_doubling=1, low=3)
      (3, 6, 12, 20)
    """
    low = check_int("low", low, low=1)
    high = check_int("high", high, low=low)
    per_doubling = check_int("per_doubling", per_doubling, low=1)
    sizes = {low, high}
    k = 0
    while (size := round(low * 2 ** (k / per_doubling))) < high:
        sizes.add(size)
        k += 1
    return tuple(sorted(sizes))


def on_grid(batch: int, grid: Sequence[int]) -> int:
    """The largest size of ``grid`` (ascending) at or below ``batch``, or its
    smallest when ``batch`` is below every size.

    Examples:
      >>> on_grid(12, (8, 10, 13, 16)), on_grid(13, (8, 10, 13)), on_grid(2, (8, 10))
      (10, 13, 8)
    """
    i = bisect.bisect_right(grid, batch)
    return int(grid[max(i - 1, 0)])
