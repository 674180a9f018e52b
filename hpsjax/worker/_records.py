"""What a worker's run leaves: its summary, its metrics records, their totals.

:class:`WorkerSummary` is what :meth:`hpsjax.worker.Worker.run` returns,
:class:`JsonLinesSink` writes the round records (their fields are listed in
the docs' worker notes) one JSON line each, and :func:`summarize` reads the
idle fraction and the transfer overlap back from them.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from hpsjax.telemetry import rounds as telemetry_rounds

__all__ = ["JsonLinesSink", "WorkerSummary", "summarize"]

# Rounds a worker keeps in memory for its summary (about 25 MB at most).
_TELEMETRY_KEPT = 100_000


# A round's transfer seconds by part (see hpsjax.telemetry.RoundTelemetry).
_TRANSFER_PARTS = ("encode_s", "push_s", "pull_s", "server_s", "barrier_s")


def _finite_or_none(value: float | None) -> float | None:
    """``value``, or ``None`` where it is NaN or infinite (JSON has neither)."""
    return value if value is None or math.isfinite(value) else None


class WorkerSummary(NamedTuple):
    """What a worker did, returned by :meth:`Worker.run`.

    Attributes:
      worker_id: the worker.
      steps: rounds computed.
      pushes: updates pushed.
      local_steps: local steps taken in all.
      version: the newest server version the worker heard of: the version its
        last push was acknowledged at, or its last pull brought. The server's
        last checkpoint may be newer: a push still buffered under BSP when
        the worker left is applied with the others' (see the log's last line).
      loss: the mean training loss of its last round, or ``None``.
      elapsed: seconds the run took.
      compute_s: seconds of real compute.
      slowdown_s: seconds slept to inject slowness.
      wait_s: seconds idle, waiting for parameters.
      transfer_s: seconds of transfers, overlapped or not.
      bytes_sent: bytes written to the server.
      bytes_received: bytes read from it.
      discarded: rounds whose update was discarded on the server's request.
      rejoins: times the worker was dropped by the server and joined again.
      ended_by: why it stopped: ``"max_steps"``, ``"max_seconds"``,
        ``"until_version"``, ``"stopped"``, ``"server"`` (the server went away
        for longer than ``reconnect_timeout``) or ``"diverged"`` (a round's
        loss or update was not finite).
      reconnects: times the worker lost the server and joined it again.
    """

    worker_id: str | int
    steps: int
    pushes: int
    local_steps: int
    version: int
    loss: float | None
    elapsed: float
    compute_s: float
    slowdown_s: float
    wait_s: float
    transfer_s: float
    bytes_sent: int
    bytes_received: int
    discarded: int
    rejoins: int
    ended_by: str
    reconnects: int = 0


class JsonLinesSink:
    """A metrics sink writing one JSON object per line, flushed at once.

    Args:
      target: a path (the file is created, or appended to), or a text file
        object (not closed by :meth:`close`).

    Examples:
      >>> import io
      >>> out = io.StringIO()
      >>> sink = JsonLinesSink(out)
      >>> sink({"step": 0, "loss": 2.3})
      >>> out.getvalue()
      '{"step": 0, "loss": 2.3}\\n'
    """

    def __init__(self, target: str | os.PathLike | io.TextIOBase):
        if isinstance(target, str | os.PathLike):
            self._file = open(target, "a", encoding="utf-8")  # noqa: SIM115
            self._owned = True
        elif hasattr(target, "write"):
            self._file = target
            self._owned = False
        else:
            raise ValueError(
                f"target must be a path or a text file, got {type(target).__name__}"
            )

    def __call__(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file if this sink opened it; idempotent."""
        if self._owned and not self._file.closed:
            self._file.close()

    def __enter__(self) -> JsonLinesSink:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    r"""Idle fraction and transfer overlap of a worker's (or workers') rounds.

    .. math::

      \text{idle} = \frac{\sum_r \text{wait}_r}{\sum_r \text{round}_r}, \qquad
      \text{overlap} = 1 - \frac{\sum_r \text{wait}_r}{\sum_r \text{transfer}_r},

    the overlap being the share of transfer time hidden behind compute (clipped to
    ``[0, 1]``; meaningful without barrier waits, which also count as transfer),
    and ``other_idle_fraction`` the share of the rounds' time idle for neither
    the wire nor the server (:attr:`hpsjax.telemetry.RoundTelemetry.other_s`).

    Args:
      records: metrics records of :class:`Worker` (``"round"`` events are used).

    Returns:
      ``{"rounds", "idle_fraction", "other_idle_fraction", "overlap",
      "compute_s", "slowdown_s", "wait_s", "transfer_s", "round_s"}``.

    Raises:
      ValueError: no round records.
    """
    rounds = [r for r in records if r.get("event") == "round"]
    if not rounds:
        raise ValueError("no round records to summarize")
    total = {
        k: float(sum(r[k] for r in rounds))
        for k in ("compute_s", "slowdown_s", "wait_s", "transfer_s", "round_s")
    }
    idle = total["wait_s"] / total["round_s"] if total["round_s"] > 0 else 0.0
    overlap = (
        min(max(1.0 - total["wait_s"] / total["transfer_s"], 0.0), 1.0)
        if total["transfer_s"] > 0
        else 1.0
    )
    other = sum(r.other_s for r in telemetry_rounds(rounds))
    return {
        "rounds": float(len(rounds)),
        "idle_fraction": idle,
        "other_idle_fraction": other / total["round_s"]
        if total["round_s"] > 0
        else 0.0,
        "overlap": overlap,
        **total,
    }
