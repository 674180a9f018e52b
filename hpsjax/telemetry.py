r"""A run's own measurements: where each worker's round went, and the server's.

Every worker writes one ``"round"`` record per round to its metrics sink
(:class:`hpsjax.worker.Worker`, ``--metrics``); the server's
:class:`hpsjax.metrics.ServerMetrics` writes one ``"version"`` record per model
version. This module reads them back as typed records, the one source of the
figures a plan, a re-planner, an advisor or an experiment takes from a run:

* :class:`RoundTelemetry`: a worker's round. Its compute is waited for
  (``block_until_ready``); encode, decode, push and pull are timed where they
  happen; ``server_s`` is what the server said it held the round's requests
  (a pull at a barrier, a push decoded and applied), and ``barrier_s`` the
  part of that hold before the push that released the barrier arrived (the
  wait for the other workers: idle, not the server's work).
* :class:`VersionTelemetry`: the server's seconds applying and serving a
  version.

A round's seconds, measured on the worker (``round_s`` from the start of its
compute until the next round could start):

.. math::

  \text{round} = \underbrace{\text{decode} + \text{compute} + \text{slowdown}
  + \ldots}_{\text{until compute ends}} + \text{wait},

``wait_s`` the seconds idle after computing until the next parameters were
there. ``push_s`` and ``pull_s`` run from a request's hand-off to its answer
(the wire both ways plus ``server_s``; a push-pull's whole trip is ``pull_s``);
with a pipelined transfer they overlap the compute. The idle seconds that are
neither compute, nor the wire, nor the server's own work
(:attr:`RoundTelemetry.other_s`) are

.. math::

  \text{other} = \max(0,\ \text{round} - \text{compute} - \text{slowdown}
  - \text{decode} - \min(\text{wait},\ \text{encode} + \text{push} +
  \text{pull} - \text{barrier})),

exact without overlap and a lower bound with it (a transfer counts as exposed
up to the wait only): a barrier's wait for the other workers is idle time, the
server's decode, apply and serve (``server_s - barrier_s``) is not.

Examples:
  >>> r = RoundTelemetry(worker="w0", round=3, version=2, time=1.0,
  ...     batch_size=32, samples=64, local_steps=2, compute_s=0.08,
  ...     encode_s=0.001, decode_s=0.001, push_s=0.004, pull_s=0.01,
  ...     server_s=0.006, wait_s=0.015, round_s=0.1, tokens_per_s=640.0,
  ...     barrier_s=0.005)
  >>> round(r.wire_s, 3), round(r.server_own_s, 3), round(r.other_s, 3)
  (0.008, 0.001, 0.009)
  >>> from_record(r.to_record()) == r
  True
  >>> summary = round_summary([r])
  >>> round(summary["w0"]["compute"], 3), summary["w0"]["wait_s"]
  (0.8, 0.015)
  >>> print(format_summary(summary).splitlines()[0])
  where each worker's round went (mean milliseconds, share of the round):
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from hpsjax.metrics import read_jsonl

__all__ = [
    "PARTS",
    "RoundTelemetry",
    "VersionTelemetry",
    "format_summary",
    "from_record",
    "from_simulation",
    "idle_fraction",
    "read_records",
    "read_rounds",
    "read_versions",
    "round_summary",
    "rounds",
    "versions",
]


class RoundTelemetry(NamedTuple):
    """One round of one worker, as its ``"round"`` metrics record gives it.

    Seconds are wall-clock seconds on the worker; ``None`` never appears (a
    part not measured is 0).

    Attributes:
      worker: the worker's id.
      round: the round index (the record's ``step``).
      version: the version of the parameters the round computed on.
      time: seconds from the worker's start to the round's start.
      batch_size: samples per local step.
      samples: samples computed in the round (batch size times local steps).
      local_steps: local steps taken.
      compute_s: seconds of compute, every result waited for.
      encode_s: seconds preparing the round's push for the wire (scaling,
        compressing, copying to the host).
      decode_s: seconds putting the pulled parameters on the device.
      push_s: seconds from a push's hand-off to its acknowledgement.
      pull_s: seconds from a pull's request to its parameters (a push-pull's
        whole trip).
      server_s: of ``push_s + pull_s``, seconds the server held the answers
        (a pull at a barrier; a push decoded and applied), as it said.
      wait_s: seconds idle after computing until the next parameters were there.
      round_s: seconds from the round's start until the next could start.
      tokens_per_s: ``samples * tokens_per_example / round_s``.
      slowdown_s: seconds slept to inject a slowdown (counts as compute).
      compile_s: seconds compiling a step in the round.
      discarded: whether the server had the round's work thrown away.
      barrier_s: of ``server_s``, seconds a pull waited at a barrier for the
        other workers' pushes (before the push that released it arrived).
    """

    worker: Any
    round: int
    version: int
    time: float
    batch_size: int
    samples: int
    local_steps: int
    compute_s: float
    encode_s: float
    decode_s: float
    push_s: float
    pull_s: float
    server_s: float
    wait_s: float
    round_s: float
    tokens_per_s: float
    slowdown_s: float = 0.0
    compile_s: float = 0.0
    discarded: bool = False
    barrier_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """Seconds computing: compute plus the injected slowdown."""
        return self.compute_s + self.slowdown_s

    @property
    def wire_s(self) -> float:
        """Seconds on the wire: the push and pull trips less the server's hold."""
        return max(self.push_s + self.pull_s - self.server_s, 0.0)

    @property
    def server_own_s(self) -> float:
        """Seconds the server worked on the round's requests: its hold less
        the barrier's wait."""
        return max(self.server_s - self.barrier_s, 0.0)

    @property
    def other_s(self) -> float:
        """Idle seconds that are neither compute, nor the wire, nor the
        server's own work: a barrier's wait is idle (see the module
        docstring)."""
        comm = self.encode_s + self.push_s + self.pull_s - self.barrier_s
        exposed = min(self.wait_s, max(comm, 0.0))
        return max(self.round_s - self.busy_s - self.decode_s - exposed, 0.0)

    def to_record(self) -> dict[str, Any]:
        """The metrics record (``event: "round"``) with these fields."""
        record = {"event": "round", **self._asdict()}
        record["step"] = record.pop("round")
        return record


class VersionTelemetry(NamedTuple):
    """The server's seconds on one model version (its ``"version"`` record).

    Attributes:
      version: the model version.
      time: seconds from the server's start to when the version was made.
      apply_s: seconds applying the update that made it.
      serve_s: seconds answering pulls with it (preparing the frames and
        handing them to the connections).
      pulls: pulls answered with it.
    """

    version: int
    time: float
    apply_s: float
    serve_s: float
    pulls: int

    def to_record(self) -> dict[str, Any]:
        """The metrics record (``event: "version"``) with these fields."""
        return {"event": "version", **self._asdict()}


# The parts a round is summarised by: (column, what it sums).
PARTS = (
    ("compute", "busy_s"),
    ("encode", "encode_s"),
    ("decode", "decode_s"),
    ("push", "push_s"),
    ("pull", "pull_s"),
    ("server", "server_own_s"),
    ("barrier", "barrier_s"),
    ("wait", "wait_s"),
    ("other", "other_s"),
)


def _number(record: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    value = float(value)
    return value if math.isfinite(value) else default


def from_record(record: Mapping[str, Any]) -> RoundTelemetry | None:
    """The :class:`RoundTelemetry` of a worker's ``"round"`` record, or ``None``
    for another record (or a round record without its timings).

    Records written before a part was measured read it as 0.
    """
    if record.get("event") != "round" or "round_s" not in record:
        return None
    step = record.get("step", record.get("round"))
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    batch_size = int(_number(record, "batch_size"))
    local_steps = int(_number(record, "local_steps"))
    samples = int(_number(record, "samples", batch_size * max(local_steps, 1)))
    round_s = _number(record, "round_s")
    return RoundTelemetry(
        worker=record.get("worker"),
        round=step,
        version=int(_number(record, "version")),
        time=_number(record, "time"),
        batch_size=batch_size,
        samples=samples,
        local_steps=local_steps,
        compute_s=_number(record, "compute_s"),
        encode_s=_number(record, "encode_s"),
        decode_s=_number(record, "decode_s"),
        push_s=_number(record, "push_s"),
        pull_s=_number(record, "pull_s"),
        server_s=_number(record, "server_s"),
        wait_s=_number(record, "wait_s"),
        round_s=round_s,
        tokens_per_s=_number(
            record, "tokens_per_s", samples / round_s if round_s > 0 else 0.0
        ),
        slowdown_s=_number(record, "slowdown_s"),
        compile_s=_number(record, "compile_s"),
        discarded=bool(record.get("discarded", False)),
        barrier_s=_number(record, "barrier_s"),
    )


def _seconds(spans: Iterable[Any], start: float, stop: float, kind: str) -> float:
    """Seconds of the ``kind`` spans that start in ``[start, stop)``."""
    return sum(
        s.end - s.start for s in spans if s.kind == kind and start <= s.start < stop
    )


def from_simulation(
    result: Any, *, tokens_per_example: int = 1
) -> list[RoundTelemetry]:
    """The rounds of a simulated run (:func:`hpsjax.sim.simulate`'s result) as
    the real workers report theirs, so that one reader serves both.

    A worker's round starts with each of its compute spans (``"discarded"``
    ones are discarded rounds) and runs to the next. Its kept rounds take, in
    order, the batch size, local steps and version of its pushes. The
    simulator has no encode or decode: those are 0; ``push_s`` and ``pull_s``
    are its link's push and pull seconds that start in the round, ``pull_s``
    with the server's waits (``server_s``, all of it a barrier's: ``barrier_s``)
    as a real pull holds them;
    ``wait_s`` is what its timeline has blocked after the compute. A round
    whose compute the run's end cut short is left out.

    Args:
      result: a ``SimResult`` (``timelines``, ``transfers``, ``pushes``).
      tokens_per_example: as :class:`hpsjax.worker.Worker`'s.
    """
    found = []
    for worker, timeline in result.timelines.items():
        pushes = iter([p for p in result.pushes if p.worker_id == worker])
        links = result.transfers.get(worker, ())
        starts = [iv for iv in timeline if iv.kind in ("compute", "discarded")]
        ends = [iv.start for iv in starts[1:]] + [timeline[-1].end if timeline else 0]
        last = None
        for index, (span, end) in enumerate(zip(starts, ends, strict=True)):
            if span.end >= result.end_time:
                break  # cut short by the end of the run
            discarded = span.kind == "discarded"
            if not discarded:
                last = next(pushes, last)
            batch, steps = (
                (0, 0) if last is None else (last.batch_size, last.local_steps)
            )
            server = _seconds(timeline, span.start, end, "wait")
            blocked = server + _seconds(timeline, span.start, end, "transfer")
            round_s = end - span.start
            found.append(
                RoundTelemetry(
                    worker=worker,
                    round=index,
                    version=0 if last is None else last.version,
                    time=span.start,
                    batch_size=batch,
                    samples=batch * steps,
                    local_steps=steps,
                    compute_s=span.end - span.start,
                    encode_s=0.0,
                    decode_s=0.0,
                    push_s=_seconds(links, span.start, end, "push"),
                    pull_s=_seconds(links, span.start, end, "pull") + server,
                    server_s=server,
                    barrier_s=server,
                    wait_s=blocked,
                    round_s=round_s,
                    tokens_per_s=(
                        batch * steps * tokens_per_example / round_s
                        if round_s > 0
                        else 0.0
                    ),
                    discarded=discarded,
                )
            )
    return found


def rounds(records: Iterable[Mapping[str, Any]]) -> list[RoundTelemetry]:
    """The workers' rounds among ``records``, in the records' order."""
    return [r for r in map(from_record, records) if r is not None]


def versions(records: Iterable[Mapping[str, Any]]) -> list[VersionTelemetry]:
    """The server's versions among ``records``, in the records' order."""
    found = []
    for record in records:
        if record.get("event") != "version" or "apply_s" not in record:
            continue
        found.append(
            VersionTelemetry(
                version=int(_number(record, "version")),
                time=_number(record, "time"),
                apply_s=_number(record, "apply_s"),
                serve_s=_number(record, "serve_s"),
                pulls=int(_number(record, "pulls")),
            )
        )
    return found


def _files(path: str | os.PathLike) -> list[pathlib.Path]:
    path = pathlib.Path(path)
    if path.is_dir():
        return sorted(path.rglob("*.jsonl"))
    if path.exists():
        return [path]
    raise ValueError(f"no metrics file or directory at {str(path)!r}")


def read_records(paths: str | os.PathLike | Sequence) -> list[dict[str, Any]]:
    """Every record of the metrics files at ``paths``.

    Args:
      paths: a JSON-lines file, a directory (its ``*.jsonl`` files, searched
        recursively: a run's workdir), or a list of either.

    Raises:
      ValueError: a path that does not exist, or a line that is not a JSON
        object.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    records = []
    for path in paths:
        for file in _files(path):
            records.extend(read_jsonl(file))
    return records


def read_rounds(paths: str | os.PathLike | Sequence) -> list[RoundTelemetry]:
    """The workers' rounds in the metrics files at ``paths`` (see
    :func:`read_records`)."""
    return rounds(read_records(paths))


def read_versions(paths: str | os.PathLike | Sequence) -> list[VersionTelemetry]:
    """The server's versions in the metrics files at ``paths`` (see
    :func:`read_records`)."""
    return versions(read_records(paths))


# Rounds as the summaries take them: a metrics file or workdir, or records.
Rounds = str | os.PathLike | Iterable[RoundTelemetry | Mapping[str, Any]]


def _by_worker(records: Rounds) -> dict[str, list[RoundTelemetry]]:
    if isinstance(records, str | os.PathLike):
        records = read_rounds(records)
    grouped: dict[str, list[RoundTelemetry]] = {}
    for r in records:
        if not isinstance(r, RoundTelemetry):
            r = from_record(r)
            if r is None:
                continue
        grouped.setdefault(str(r.worker), []).append(r)
    return dict(sorted(grouped.items()))


def round_summary(records: Rounds) -> dict[str, dict[str, float]]:
    """Where each worker's round went: means and shares of its round.

    Args:
      records: :class:`RoundTelemetry` s or metrics records (others skipped),
        or a metrics file or a run's workdir (read by :func:`read_rounds`).

    Returns:
      Per worker (its id as a string): ``rounds``, ``round_s`` (the mean
      round), ``tokens_per_s`` (samples or tokens over all its rounds' time),
      and for each part of :data:`PARTS` its mean seconds ``<part>_s`` and its
      share of the rounds' time ``<part>``. ``push`` and ``pull`` hold
      ``server`` and may overlap ``compute``: the shares need not add up to 1.
    """
    table = {}
    for worker, rs in _by_worker(records).items():
        total = sum(r.round_s for r in rs)
        row = {
            "rounds": float(len(rs)),
            "round_s": total / len(rs),
            "tokens_per_s": (
                sum(r.tokens_per_s * r.round_s for r in rs) / total if total else 0.0
            ),
        }
        for part, attribute in PARTS:
            seconds = sum(getattr(r, attribute) for r in rs)
            row[f"{part}_s"] = seconds / len(rs)
            row[part] = seconds / total if total > 0 else 0.0
        table[worker] = row
    return table


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """The table of :func:`round_summary`, one line per worker."""
    head = f"{'worker':>8} {'rounds':>6} {'round':>8}" + "".join(
        f" {part:>12}" for part, _ in PARTS
    )
    lines = [
        "where each worker's round went (mean milliseconds, share of the round):",
        head + f" {'tokens/s':>9}",
    ]
    for worker, row in summary.items():
        cells = "".join(
            f" {1e3 * row[f'{part}_s']:7.1f} {row[part]:4.0%}" for part, _ in PARTS
        )
        lines.append(
            f"{worker:>8} {int(row['rounds']):>6} {1e3 * row['round_s']:8.1f}"
            f"{cells} {row['tokens_per_s']:9.0f}"
        )
    return "\n".join(lines)


def idle_fraction(records: Rounds) -> dict[str, float]:
    """Each worker's share of its rounds' time idle for something other than
    the wire or the server's own work (a barrier's wait is idle):
    :attr:`RoundTelemetry.other_s` over ``round_s``.

    Args:
      records: as :func:`round_summary`'s.

    Returns:
      Per worker (its id as a string), a fraction in ``[0, 1]``.
    """
    return {worker: row["other"] for worker, row in round_summary(records).items()}
