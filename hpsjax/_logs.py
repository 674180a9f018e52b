"""Logging shared by the command-line tools: what a person reads.

hpsjax's own lines (joins, leaves and why, plans, refused updates, progress,
shutdown) are the log; the libraries under it (orbax-checkpoint and absl,
which log every checkpoint's handler registry and options at INFO, JAX,
tensorstore) speak only of warnings and errors unless the level is DEBUG.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = [
    "LOG_LEVELS",
    "Every",
    "check_log_level",
    "quiet_backend_probe",
    "setup_logging",
]

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# Libraries whose INFO lines are about their own workings, not the run.
THIRD_PARTY_LOGGERS = ("absl", "orbax", "jax", "tensorstore", "etils")

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_PROBE_LOGGER = "jax._src.xla_bridge"
_PROBE_MESSAGE = "Unable to initialize backend 'tpu'"


def _not_the_tpu_probe(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_PROBE_MESSAGE)


def quiet_backend_probe() -> None:
    """Drops JAX's "Unable to initialize backend 'tpu'" line, and only it.

    JAX logs it at INFO on every machine without a TPU when it looks for
    backends; the platform JAX picks is unchanged. Idempotent.
    """
    logger = logging.getLogger(_PROBE_LOGGER)
    if _not_the_tpu_probe not in logger.filters:
        logger.addFilter(_not_the_tpu_probe)


def check_log_level(level: str) -> str:
    """``level`` upper-cased, one of :data:`LOG_LEVELS`.

    Raises:
      ValueError: another name (one line, listing the valid ones).
    """
    name = str(level).strip().upper()
    if name not in LOG_LEVELS:
        raise ValueError(
            f"unknown log level {level!r}; choose from {', '.join(LOG_LEVELS)}"
        )
    return name


def setup_logging(level: str = "INFO") -> None:
    """Configures a command's logging: hpsjax at ``level``, the libraries under
    it at WARNING unless ``level`` is DEBUG.

    Lines go to stderr as ``TIME LEVEL LOGGER: MESSAGE``. Idempotent.

    Args:
      level: one of :data:`LOG_LEVELS` (any case).

    Raises:
      ValueError: an unknown level (nothing is changed).

    Examples:
      >>> setup_logging("info")
      >>> logging.getLogger("absl").level == logging.WARNING
      True
      >>> setup_logging("debug")
      >>> logging.getLogger("absl").level == logging.NOTSET
      True
    """
    name = check_log_level(level)
    logging.basicConfig(level=name, format=_FORMAT)
    logging.getLogger().setLevel(name)
    quiet = name != "DEBUG"
    for library in THIRD_PARTY_LOGGERS:
        logging.getLogger(library).setLevel(
            logging.WARNING if quiet else logging.NOTSET
        )
    quiet_backend_probe()


class Every:
    """Lets a repeated log line through at most once per ``seconds``.

    The lines held back are counted, so the next one can say how many it
    stands for. One thread.

    Args:
      seconds: least seconds between two lines let through.
      clock: the time in seconds (``time.monotonic`` by default).

    Examples:
      >>> t = [0.0]
      >>> every = Every(60, clock=lambda: t[0])
      >>> every.ready(), every.ready()
      ((True, 0), (False, 0))
      >>> t[0] = 61.0
      >>> every.ready()
      (True, 1)
    """

    def __init__(self, seconds: float, *, clock: Callable[[], float] = time.monotonic):
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self._seconds = float(seconds)
        self._clock = clock
        self._last: float | None = None
        self._held = 0

    def ready(self) -> tuple[bool, int]:
        """``(let through, lines held back since the last one let through)``."""
        now = self._clock()
        if self._last is not None and now - self._last < self._seconds:
            self._held += 1
            return False, 0
        held, self._held, self._last = self._held, 0, now
        return True, held
