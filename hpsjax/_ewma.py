"""The moving average behind every speed estimate: the worker core's compute
and pull times, the server core's push intervals and step times, the
re-planner's speed ratios.

Its own module, below all of them, so that none imports another for it.
"""

from __future__ import annotations

__all__ = ["EWMA_ALPHA", "ewma"]

EWMA_ALPHA = 0.3
"""Weight of a new sample in the worker's estimates of compute and pull times."""


def ewma(old: float | None, sample: float, alpha: float = EWMA_ALPHA) -> float:
    """An exponentially weighted moving average: ``sample`` when ``old`` is None."""
    return sample if old is None else old + alpha * (sample - old)
