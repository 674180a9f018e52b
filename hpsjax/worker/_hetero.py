r"""Heterogeneity injection: make one machine stand for a mixed cluster.

Real heterogeneous clusters have slow devices and slow links. To study them on
one machine, each worker is given

* a **slowdown factor** :math:`k \ge 1`: after every local step that computed
  for :math:`c` seconds, the worker sleeps :math:`(k - 1)\,\bar c` seconds, where
  :math:`\bar c` is the median of its last steps of the same shape (this one
  included), so its typical step takes :math:`k \bar c`: a device :math:`k`
  times slower, whose step varies as much as this machine's does, not :math:`k`
  times as much (a step slowed by a busy core would otherwise have that delay
  multiplied by :math:`k - 1`). The first execution of a shape (where XLA
  finishes compiling and allocating: several times a steady step) is not
  slowed and not in the median: slower hardware runs its steps slower, not the
  compiler;
* a **bandwidth cap** :math:`B` (bytes per second) and a **latency**
  :math:`\ell` (seconds): every message of :math:`n` bytes it sends or receives
  is held back by :math:`\ell + n / B`, as a link of that speed would take;

and both may change over time, following a piecewise-constant schedule
:math:`[(t_0, v_0), (t_1, v_1), \ldots]`: value :math:`v_j` holds from
:math:`t_j` seconds after the worker started until :math:`t_{j+1}`. A worker that
becomes four times slower after a minute is ``slowdown=[(0, 1), (60, 4)]``.

:class:`Heterogeneity` is the description (pure, JSON-serialisable, parsed from
command-line strings such as ``"4"`` or ``"0:1,60:4"``); :class:`Injector`
carries it out against a clock and keeps totals of the delays it injected.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Heterogeneity", "Injector", "parse_schedule"]

Schedule = tuple[tuple[float, float | None], ...]
"""Piecewise-constant schedule: ``((t_0, v_0), (t_1, v_1), ...)``, ``t_0 == 0``."""


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value


def _schedule(
    name: str,
    value: Any,
    check: Callable[[str, Any], float | None],
) -> Schedule:
    """Normalises a constant or a list of ``(time, value)`` pairs to a Schedule."""
    if value is None or isinstance(value, int | float | str):
        if isinstance(value, str):
            return parse_schedule(value, name=name, check=check)
        return ((0.0, check(name, value)),)
    if isinstance(value, Mapping) or not isinstance(value, Sequence):
        raise ValueError(
            f"{name} must be a number, None or a list of (time, value) pairs, "
            f"got {type(value).__name__}"
        )
    points = []
    for i, point in enumerate(value):
        if (
            isinstance(point, str | bytes)
            or not isinstance(point, Sequence)
            or len(point) != 2
        ):
            raise ValueError(f"{name}[{i}] must be a (time, value) pair, got {point!r}")
        t = _number(f"{name}[{i}] time", point[0])
        if not (math.isfinite(t) and t >= 0):
            raise ValueError(f"{name}[{i}] time must be finite and >= 0, got {t}")
        points.append((t, check(f"{name}[{i}] value", point[1])))
    if not points:
        raise ValueError(f"{name} schedule is empty")
    times = [t for t, _ in points]
    if any(b <= a for a, b in itertools.pairwise(times)):
        raise ValueError(f"{name} schedule times must increase, got {times}")
    if times[0] != 0.0:
        raise ValueError(
            f"{name} schedule must start at time 0 (got {times[0]}): the value "
            "before the first point would be undefined"
        )
    return tuple(points)


def _slowdown(name: str, value: Any) -> float:
    if value is None:
        raise ValueError(f"{name} must be a number >= 1, got None")
    value = _number(name, value)
    if not (math.isfinite(value) and value >= 1.0):
        raise ValueError(
            f"{name} must be a finite number >= 1 (a step takes that many times "
            f"as long), got {value}"
        )
    return value


def _bandwidth(name: str, value: Any) -> float | None:
    if value is None:
        return None
    value = _number(name, value)
    if value == math.inf:
        return None
    if not value > 0:
        raise ValueError(
            f"{name} must be > 0 bytes/s (or None for no cap), got {value}"
        )
    return value


def parse_schedule(
    text: str,
    *,
    name: str = "schedule",
    check: Callable[[str, Any], float | None] | None = None,
) -> Schedule:
    """Parses ``"v"`` or ``"t0:v0,t1:v1,..."`` into a schedule.

    Values may be written ``inf`` or ``none`` (no cap, for bandwidths).

    Args:
      text: a constant (``"4"``) or comma-separated ``time:value`` pairs
        (``"0:1,30:4"``), times in seconds from the worker's start.
      name: what is parsed, for error messages.
      check: validates and converts each value; the default accepts any number.

    Returns:
      The schedule, a tuple of ``(time, value)`` pairs starting at time 0.

    Raises:
      ValueError: unreadable text, times that do not increase or do not start
        at 0, or a value ``check`` refuses.

    Examples:
      >>> parse_schedule("0:1,30:4")
      ((0.0, 1.0), (30.0, 4.0))
      >>> parse_schedule("2.5")
      ((0.0, 2.5),)
    """
    check = check or (lambda n, v: None if v is None else _number(n, v))
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{name}: expected 'value' or 'time:value,...', got {text!r}")

    def value_of(raw: str) -> float | None:
        raw = raw.strip().lower()
        if raw in ("none", "inf", "infinity"):
            return None if raw == "none" else math.inf
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}: {raw!r} is not a number") from None

    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1 and ":" not in parts[0]:
        return _schedule(name, [(0.0, value_of(parts[0]))], check)
    pairs = []
    for part in parts:
        t, sep, v = part.partition(":")
        if not sep:
            raise ValueError(f"{name}: expected 'time:value', got {part!r} in {text!r}")
        try:
            time_value = float(t)
        except ValueError:
            raise ValueError(f"{name}: time {t!r} is not a number") from None
        pairs.append((time_value, value_of(v)))
    return _schedule(name, pairs, check)


def _at(schedule: Schedule, t: float) -> float | None:
    value = schedule[0][1]
    for start, v in schedule:
        if start <= t:
            value = v
        else:
            break
    return value


@dataclasses.dataclass(frozen=True)
class Heterogeneity:
    r"""How much slower one worker computes and communicates, over time.

    A local step that computed for :math:`c` seconds at time :math:`t` is followed
    by a sleep of :math:`(k(t) - 1)\,c`; a message of :math:`n` bytes is held back
    by :math:`\ell + n / B(t)` (no cap: :math:`\ell` only).

    Args:
      slowdown: :math:`k`, a number >= 1 or a schedule of ``(seconds, k)`` pairs
        (or its text form, ``"0:1,60:4"``).
      bandwidth: :math:`B` in bytes per second, ``None`` for no cap, or a
        schedule of ``(seconds, B or None)`` pairs (``"0:inf,30:1e6"``).
      latency: :math:`\ell`, seconds added to every message, >= 0.

    Raises:
      ValueError: a slowdown below 1, a bandwidth <= 0, a negative latency, or a
        schedule whose times do not start at 0 and increase.

    Examples:
      >>> het = Heterogeneity(slowdown="0:1,60:4", bandwidth=1e6)
      >>> het.slowdown_at(10.0), het.slowdown_at(90.0)
      (1.0, 4.0)
      >>> het.compute_delay(0.5, now=90.0)
      1.5
      >>> het.transfer_delay(250_000, now=0.0)
      0.25

    References:
      Xian, Li, Liu, Guo, Du, "H-PS: A Heterogeneous-Aware Parameter Server With
      Distributed Neural Network Training", IEEE Access, 2021,
      https://doi.org/10.1109/ACCESS.2021.3060154
    """

    slowdown: Any = 1.0
    bandwidth: Any = None
    latency: float = 0.0

    def __post_init__(self):
        object.__setattr__(
            self, "slowdown", _schedule("slowdown", self.slowdown, _slowdown)
        )
        object.__setattr__(
            self, "bandwidth", _schedule("bandwidth", self.bandwidth, _bandwidth)
        )
        latency = _number("latency", self.latency)
        if not (math.isfinite(latency) and latency >= 0):
            raise ValueError(f"latency must be finite and >= 0, got {latency}")
        object.__setattr__(self, "latency", latency)

    @property
    def is_identity(self) -> bool:
        """Whether nothing is injected at any time."""
        return (
            all(k == 1.0 for _, k in self.slowdown)
            and all(b is None for _, b in self.bandwidth)
            and self.latency == 0.0
        )

    def slowdown_at(self, now: float) -> float:
        """The slowdown factor :math:`k` in force ``now`` seconds after the start."""
        return _at(self.slowdown, now)

    def bandwidth_at(self, now: float) -> float | None:
        """The bandwidth cap (bytes/s) in force at ``now``, ``None`` for none."""
        return _at(self.bandwidth, now)

    def compute_delay(self, compute_seconds: float, *, now: float) -> float:
        """Seconds to sleep after a step that computed for ``compute_seconds``."""
        if not compute_seconds >= 0:
            raise ValueError(f"compute_seconds must be >= 0, got {compute_seconds}")
        return (self.slowdown_at(now) - 1.0) * compute_seconds

    def transfer_delay(self, nbytes: int, *, now: float) -> float:
        """Seconds to hold back a message of ``nbytes`` bytes sent or received."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        bandwidth = self.bandwidth_at(now)
        return self.latency + (0.0 if bandwidth is None else nbytes / bandwidth)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable form (see :meth:`from_dict`)."""
        return {
            "slowdown": [list(p) for p in self.slowdown],
            "bandwidth": [list(p) for p in self.bandwidth],
            "latency": self.latency,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Heterogeneity:
        """Reads :meth:`to_dict`'s form; missing keys take their defaults.

        Raises:
          ValueError: unknown keys or bad values.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a mapping, got {type(data).__name__}")
        unknown = set(data) - {"slowdown", "bandwidth", "latency"}
        if unknown:
            raise ValueError(f"unknown heterogeneity keys: {sorted(unknown)}")
        return cls(**dict(data))


class Injector:
    """Carries out a :class:`Heterogeneity` against a clock, and counts it.

    The clock starts at :meth:`start` (or at the first use); schedule times are
    seconds since then. :meth:`after_compute` blocks (call it from the thread
    that computes, so the event loop keeps moving bytes); :meth:`transfer` is
    awaited on the event loop. Both are safe to use from two threads at once.

    Args:
      heterogeneity: what to inject.
      clock: a monotonic clock in seconds.
      sleep: the blocking sleep used by :meth:`after_compute`.

    Examples:
      >>> injector = Injector(Heterogeneity(slowdown=3.0))
      >>> injector.after_compute(2.0, key=32)    # the shape's first execution
      0.0
      >>> injector.after_compute(0.25, key=32)   # sleeps 0.5 s
      0.5
      >>> injector.after_compute(0.75, key=32)   # (3 - 1) * median(0.25, 0.75)
      1.0
      >>> injector.first_executions
      1
    """

    window = 8
    """Steps of one shape whose median compute time the slowdown multiplies."""

    def __init__(
        self,
        heterogeneity: Heterogeneity | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if heterogeneity is None:
            heterogeneity = Heterogeneity()
        if not isinstance(heterogeneity, Heterogeneity):
            raise ValueError(
                f"heterogeneity must be a Heterogeneity, got "
                f"{type(heterogeneity).__name__}"
            )
        self._het = heterogeneity
        self._clock = clock
        self._sleep = sleep
        self._start: float | None = None
        self._lock = threading.Lock()
        self._compute_delay = 0.0
        self._transfer_delay = 0.0
        self._recent: dict[Any, collections.deque[float]] = {}
        self._first_executions = 0

    @property
    def heterogeneity(self) -> Heterogeneity:
        """What is injected."""
        return self._het

    def start(self) -> None:
        """Starts the schedule clock now (idempotent)."""
        with self._lock:
            if self._start is None:
                self._start = self._clock()

    def elapsed(self) -> float:
        """Seconds since :meth:`start` (starting the clock if needed)."""
        self.start()
        return self._clock() - self._start

    def slowdown(self) -> float:
        """The slowdown factor in force now."""
        return self._het.slowdown_at(self.elapsed())

    def after_compute(self, compute_seconds: float, *, key: Any = None) -> float:
        """Sleeps after a step; returns the seconds slept.

        Args:
          compute_seconds: what the step computed for.
          key: the step's shape (e.g. its batch sizes): the sleep is
            :math:`(k - 1)` times the median of the last :attr:`window` steps
            with this key, this one included (the profile's statistic too);
            the first step with a key is its first execution, not slowed (0
            returned) and not in the median. ``None``: :math:`(k - 1)` times
            this step's own time.
        """
        if not compute_seconds >= 0:
            raise ValueError(f"compute_seconds must be >= 0, got {compute_seconds}")
        if key is not None:
            with self._lock:
                recent = self._recent.get(key)
                if recent is None:
                    self._recent[key] = collections.deque(maxlen=self.window)
                    self._first_executions += 1
                    return 0.0
                recent.append(float(compute_seconds))
                compute_seconds = statistics.median(recent)
        delay = self._het.compute_delay(compute_seconds, now=self.elapsed())
        if delay > 0:
            self._sleep(delay)
            with self._lock:
                self._compute_delay += delay
        return delay

    async def transfer(self, nbytes: int) -> float:
        """Holds back a message of ``nbytes`` bytes; returns the seconds waited.

        Cancelling is safe (the wait just ends early).
        """
        delay = self._het.transfer_delay(nbytes, now=self.elapsed())
        if delay > 0:
            await asyncio.sleep(delay)
            with self._lock:
                self._transfer_delay += delay
        return delay

    @property
    def first_executions(self) -> int:
        """Steps not slowed as the first execution of their shape."""
        return self._first_executions

    @property
    def total_compute_delay(self) -> float:
        """Seconds slept after compute so far."""
        return self._compute_delay

    @property
    def total_transfer_delay(self) -> float:
        """Seconds messages were held back so far."""
        return self._transfer_delay
