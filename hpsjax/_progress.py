"""A run's periodic one-line status: a tqdm bar on a terminal, log lines
otherwise.

Workers and the server say where they are between "joined" and "done": the
step or version, its rate, the loss, the staleness and, when the run has a
limit, the time left. On a terminal that is a tqdm bar, redrawn in place; in a
file or a pipe (a launcher, a cluster's job log) it is a log line every
``interval`` seconds, one line whatever the number of rounds.

Examples:
  >>> format_status("worker 0", "step", 120, total=500, rate=8.25,
  ...               loss=0.41234, staleness=0.9, seconds_left=46.2)
  'worker 0: step 120/500, 8.25 steps/s, loss 0.4123, staleness 0.9, 46 s left'
  >>> format_status("server", "version", 1200, rate=85.31,
  ...               notes=("92.1 pushes/s", "4 live workers"))
  'server: version 1200, 85.3 versions/s, 92.1 pushes/s, 4 live workers'
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from hpsjax._checks import check_int, check_positive

__all__ = ["Progress", "format_duration", "format_status"]

DEFAULT_INTERVAL_S = 10.0

# How often a bar is redrawn at most (tqdm's mininterval).
_BAR_REFRESH_S = 0.5


def _number(value: float) -> str:
    """Three significant digits, whole numbers from 100."""
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def format_duration(seconds: float) -> str:
    """``46 s``, ``12 min 5 s``, ``2 h 3 min``.

    Examples:
      >>> format_duration(46.2), format_duration(725), format_duration(7380)
      ('46 s', '12 min 5 s', '2 h 3 min')
    """
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def format_status(
    name: str,
    unit: str,
    count: int,
    *,
    total: int | None = None,
    rate: float | None = None,
    version: int | None = None,
    loss: float | None = None,
    staleness: float | None = None,
    seconds_left: float | None = None,
    notes: Sequence[str] = (),
) -> str:
    """One status line: ``NAME: UNIT COUNT[/TOTAL], RATE UNITs/s, ...``.

    Each part is left out when its value is ``None``; ``notes`` are added as
    they are. See the module's examples.
    """
    parts = [f"{unit} {count}" + ("" if total is None else f"/{total}")]
    parts += _postfix(
        rate=None if rate is None else (rate, unit),
        version=version,
        loss=loss,
        staleness=staleness,
        seconds_left=seconds_left,
        notes=notes,
    )
    return f"{name}: {', '.join(parts)}"


def _postfix(*, rate, version, loss, staleness, seconds_left, notes) -> list[str]:
    parts = []
    if rate is not None:
        parts.append(f"{_number(rate[0])} {rate[1]}s/s")
    if version is not None:
        parts.append(f"version {version}")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    if staleness is not None:
        parts.append(f"staleness {staleness:.2g}")
    parts += list(notes)
    if seconds_left is not None:
        parts.append(f"{format_duration(seconds_left)} left")
    return parts


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


def _tqdm_installed() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Progress:
    """A run's periodic one-line status, on a bar or in the log.

    The driver calls :meth:`update` whenever it has news (a round done, a
    version applied, a timer); this decides what to show and when: a tqdm
    bar redrawn at most every half second when ``stream`` is a terminal (and
    tqdm is installed), else an INFO line on ``logger`` at most every
    ``interval`` seconds. Losses and staleness given between two lines are
    averaged; rates are over the time since the last line.

    Args:
      name: who speaks, e.g. ``"worker 3"`` or ``"server"``.
      unit: what is counted: ``"step"`` or ``"version"``.
      total: the count at which the run stops (e.g. its ``max_steps``), or
        ``None``.
      max_seconds: the run's time limit in seconds, or ``None``.
      until_version: the version at which the run stops, or ``None``.
      interval: seconds between two log lines.
      stream: the terminal of the bar (``sys.stderr`` by default).
      bar: ``True`` for a bar, ``False`` for log lines, ``None`` to choose a
        bar exactly when ``stream`` is a terminal and tqdm is installed.
      logger: where log lines go (``hpsjax.progress`` by default).
      clock: the time in seconds.

    Raises:
      ValueError: a bad ``interval``, ``total``, ``max_seconds`` or
        ``until_version``, or ``bar=True`` without tqdm.

    Examples:
      >>> import io
      >>> t = [0.0]
      >>> p = Progress("worker 0", "step", total=10, interval=5,
      ...              stream=io.StringIO(), clock=lambda: t[0])
      >>> p.bar
      False
      >>> t[0] = 6.0
      >>> p.update(3, loss=0.5)
      'worker 0: step 3/10, 0.5 steps/s, loss 0.5, 14 s left'
    """

    def __init__(
        self,
        name: str,
        unit: str = "step",
        *,
        total: int | None = None,
        max_seconds: float | None = None,
        until_version: int | None = None,
        interval: float = DEFAULT_INTERVAL_S,
        stream: TextIO | None = None,
        bar: bool | None = None,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        check_positive("interval", interval)
        check_int("total", total, low=1, allow_none=True)
        check_int("until_version", until_version, low=1, allow_none=True)
        check_positive("max_seconds", max_seconds, allow_none=True)
        self.name, self.unit = name, unit
        self._total = total
        self._max_seconds = max_seconds
        self._until_version = until_version
        self._interval = float(interval)
        self._logger = logger or logging.getLogger("hpsjax.progress")
        self._clock = clock
        stream = sys.stderr if stream is None else stream
        if bar is None:
            bar = _is_terminal(stream) and _tqdm_installed()
        elif bar and not _tqdm_installed():
            raise ValueError("a progress bar needs tqdm (pip install tqdm)")
        self.bar = bool(bar)
        self._start = self._last = clock()
        self._count = self._last_count = 0
        self._last_version: int | None = None
        # Sums and counts of the losses and staleness observed since the last
        # line, and the means the last line showed.
        self._sums = [0.0, 0, 0.0, 0]
        self._loss: float | None = None
        self._mean_staleness: float | None = None
        self._tqdm = None
        self._redirect = None
        if self.bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # Log lines are written above the bar, not through it.
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()

            self._tqdm = tqdm(
                total=total,
                desc=name,
                unit=f" {unit}s",  # "12 steps [00:03, 4.1 steps/s, ...]"
                file=stream,
                mininterval=_BAR_REFRESH_S,
                dynamic_ncols=True,
                leave=True,
            )

    @property
    def period(self) -> float:
        """How often a driver with a timer should call :meth:`update`."""
        return _BAR_REFRESH_S if self.bar else self._interval

    def observe(
        self, *, loss: float | None = None, staleness: float | None = None
    ) -> None:
        """Notes a loss or a staleness for the next line's mean, and nothing
        else (no clock read: cheap enough for every push)."""
        sums = self._sums
        if loss is not None and math.isfinite(loss):
            sums[0] += loss
            sums[1] += 1
        if staleness is not None:
            sums[2] += staleness
            sums[3] += 1

    def update(
        self,
        count: int,
        *,
        version: int | None = None,
        loss: float | None = None,
        staleness: float | None = None,
        notes: Sequence[str] = (),
    ) -> str | None:
        """Notes the run's progress; shows it if it is time.

        Args:
          count: steps (or versions) done so far.
          version: the model version the run is at, or ``None``.
          loss: a training loss since the last call, or ``None``.
          staleness: a staleness since the last call, or ``None``.
          notes: more parts of the line, e.g. ``("4 live workers",)``.

        Returns:
          The line shown (as logged, or the bar's postfix), or ``None``.
        """
        self.observe(loss=loss, staleness=staleness)
        self._count = count
        now = self._clock()
        if now - self._last < self.period:
            return None
        seconds = max(now - self._last, 1e-9)
        rate = (count - self._last_count) / seconds
        version_rate = (
            None
            if version is None or self._last_version is None
            else (version - self._last_version) / seconds
        )
        loss_sum, losses, staleness_sum, stalenesses = self._sums
        if losses:
            self._loss = loss_sum / losses
        if stalenesses:
            self._mean_staleness = staleness_sum / stalenesses
        self._sums = [0.0, 0, 0.0, 0]
        left = self._seconds_left(now, count, rate, version, version_rate)
        self._last, self._last_count, self._last_version = now, count, version
        if self._tqdm is not None:
            postfix = ", ".join(
                _postfix(
                    rate=None,
                    version=version,
                    loss=self._loss,
                    staleness=self._mean_staleness,
                    # A bar with a total shows its own estimate.
                    seconds_left=None if self._total is not None else left,
                    notes=notes,
                )
            )
            self._tqdm.set_postfix_str(postfix, refresh=False)
            self._tqdm.update(count - self._tqdm.n)
            return postfix
        line = format_status(
            self.name,
            self.unit,
            count,
            total=self._total,
            rate=rate,
            version=version,
            loss=self._loss,
            staleness=self._mean_staleness,
            seconds_left=left,
            notes=notes,
        )
        self._logger.info("%s", line)
        return line

    def _seconds_left(self, now, count, rate, version, version_rate) -> float | None:
        """The least of the times left by each limit set, or ``None``."""
        left = []
        if self._max_seconds is not None:
            left.append(self._max_seconds - (now - self._start))
        if self._total is not None and rate > 0:
            left.append((self._total - count) / rate)
        if (
            self._until_version is not None
            and version is not None
            and version_rate is not None
            and version_rate > 0
        ):
            left.append((self._until_version - version) / version_rate)
        return max(0.0, min(left)) if left else None

    def close(self) -> None:
        """Closes the bar at the last count given (left on the terminal);
        idempotent."""
        bar, self._tqdm = self._tqdm, None
        if bar is not None:
            bar.update(self._count - bar.n)
            bar.close()
        redirect, self._redirect = self._redirect, None
        if redirect is not None:
            redirect.__exit__(None, None, None)
