"""One metrics schema for workers, server, simulator and experiments.

A **record** is a flat JSON object, one per event, as the workers
(``hpsjax.worker``), the simulator and ``experiments`` have always written to
their ``.jsonl`` files:

=============  ===============================================================
``event``      what happened: ``"round"`` and ``"final"`` (a worker),
               ``"push"`` (a simulated push), ``"eval"`` (test accuracy),
               ``"worker"`` (per-worker totals), ``"summary"``, ...
``worker``     the worker's id, when the record is about one worker
``step``       the worker's step; ``version`` the server's model version
``time``       seconds since the run started (virtual seconds in the simulator)
others         numbers (``loss``, ``staleness``, ``batch_size``, ...), strings,
               lists; ``null`` where a number is not finite
=============  ===============================================================

:class:`MetricsWriter` writes such records to a JSON-lines file, byte for byte
as before, and to TensorBoard event files, and :func:`read_jsonl` and
:func:`read_tensorboard` read both back. TensorBoard events are written with
tensorboardX: it needs only numpy and protobuf (no TensorFlow, no PyTorch), is
maintained, and its files are the ones TensorBoard itself reads.

:class:`ServerMetrics` exports a parameter server's counters to Prometheus
(prometheus-client) and, given a ``tensorboard_dir``, to TensorBoard as
scalars written every few seconds. Events are counted in plain Python numbers,
a few nanoseconds per push, and turned into metric families only when
``/metrics`` is scraped; the server's gauges (version, live workers) are read
from a callable at scrape time.

Examples:
  >>> import os, tempfile
  >>> with tempfile.TemporaryDirectory() as d:
  ...     with MetricsWriter(os.path.join(d, "m.jsonl"), tensorboard_dir=d) as w:
  ...         w({"event": "round", "worker": 0, "step": 3, "loss": 0.5})
  ...     records = read_jsonl(os.path.join(d, "m.jsonl"))
  ...     scalars = read_tensorboard(d)
  >>> records
  [{'event': 'round', 'worker': 0, 'step': 3, 'loss': 0.5}]
  >>> scalars["worker0"]["round/loss"]
  [(3, 0.5)]
"""

from __future__ import annotations

import bisect
import json
import math
import os
import pathlib
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hpsjax._checks import check_int, check_number, check_positive

__all__ = [
    "LEAVE_REASONS",
    "ROUND_PARTS",
    "MetricsWriter",
    "RoundMetrics",
    "ServerMetrics",
    "jsonable",
    "read_jsonl",
    "read_tensorboard",
]


def jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and numpy scalars as Python
    numbers, so that ``json.dumps(..., allow_nan=False)`` takes it."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return jsonable(value.item())
    return value


# Fields that identify a record rather than measure something.
_NOT_SCALARS = frozenset({"event", "worker", "step"})


def _event(values: list[tuple[str, float]], step: int) -> Any:
    """A TensorBoard event of scalars, one value per tag."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values])
    return Event(wall_time=time.time(), step=int(step), summary=summary)


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsWriter:
    """Writes metrics records to a JSON-lines file and TensorBoard event files.

    A callable sink: pass it wherever a ``metrics`` callable is taken (e.g.
    ``hpsjax.worker.Worker(..., metrics=MetricsWriter(...))``).

    Every record is appended to ``jsonl`` as one line, flushed at once, exactly
    as ``json.dumps(record)`` writes it (non-finite numbers become ``null``).
    Its numeric fields go to TensorBoard as scalars tagged ``"<event>/<field>"``
    (``"<field>"`` without an event). Records of one worker go to the run
    ``<tensorboard_dir>/worker<id>``, so TensorBoard overlays the workers of a
    run; the others to ``<tensorboard_dir>`` itself. A scalar's step is the
    record's ``step``, else its ``version``, else the number of earlier records
    of that event in that run.

    Args:
      jsonl: path of the JSON-lines file (created, or appended to), or None.
      tensorboard_dir: directory of the event files (created), or None.
      flush_secs: how often the event files are flushed, in seconds.
      prometheus: a :class:`RoundMetrics` (any callable) also handed every
        record, e.g. to serve a worker's rounds to Prometheus; or None.

    Raises:
      ValueError: no output given, or a bad ``flush_secs`` or ``prometheus``.
    """

    def __init__(
        self,
        jsonl: str | os.PathLike | None = None,
        *,
        tensorboard_dir: str | os.PathLike | None = None,
        flush_secs: float = 10.0,
        prometheus: Callable[[Mapping[str, Any]], None] | None = None,
    ):
        if jsonl is None and tensorboard_dir is None and prometheus is None:
            raise ValueError(
                "MetricsWriter needs a jsonl path or a tensorboard_dir (or prometheus)"
            )
        if prometheus is not None and not callable(prometheus):
            raise ValueError("prometheus must be a RoundMetrics (callable) or None")
        self._prometheus = prometheus
        check_positive("flush_secs", flush_secs)
        self._file = None
        if jsonl is not None:
            self._file = open(jsonl, "a", encoding="utf-8")  # noqa: SIM115
        self._tb_dir = (
            None if tensorboard_dir is None else pathlib.Path(tensorboard_dir)
        )
        self._flush_secs = flush_secs
        self._flushed = time.monotonic()
        self._writers: dict[str, Any] = {}
        self._counts: dict[tuple[str, str], int] = {}

    def _writer(self, run: str):
        writer = self._writers.get(run)
        if writer is None:
            # tensorboardX's events writer, written to in this thread: its
            # SummaryWriter hands every event to a process queue and a thread,
            # so a flush returned before the last events were written.
            from tensorboardX.event_file_writer import EventsWriter

            assert self._tb_dir is not None
            logdir = self._tb_dir / run if run else self._tb_dir
            logdir.mkdir(parents=True, exist_ok=True)
            # Files are named by the second they are opened in: the suffix keeps
            # two writers of one directory apart.
            writer = EventsWriter(str(logdir / "events"), f".{os.getpid()}.{id(self)}")
            self._writers[run] = writer
        return writer

    def __call__(self, record: Mapping[str, Any]) -> None:
        """Writes one record.

        Raises:
          ValueError: ``record`` is not a mapping, or the writer is closed.
        """
        if not isinstance(record, Mapping):
            raise ValueError(f"a record must be a mapping, got {type(record).__name__}")
        if self._writers is None:
            raise ValueError("MetricsWriter is closed")
        record = jsonable(record)
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
        if self._tb_dir is not None:
            self._write_scalars(record)
        if self._prometheus is not None:
            self._prometheus(record)

    def _write_scalars(self, record: dict[str, Any]) -> None:
        event = record.get("event")
        prefix = f"{event}/" if isinstance(event, str) and event else ""
        worker = record.get("worker")
        run = (
            ""
            if worker is None or isinstance(worker, dict | list)
            else f"worker{worker}"
        )
        key = (run, prefix)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        step = record.get("step", record.get("version"))
        if isinstance(step, bool) or not isinstance(step, int):
            step = count
        # One event per record, holding all of its scalars (TensorBoard reads
        # each value under its own tag), written in this thread: 0.1 ms a
        # record of 24 scalars against 1.5 ms for an event per scalar through
        # SummaryWriter (benchmarks/bench_metrics.py), which a simulation's
        # thousands of push records add up.
        values = []
        for field, value in record.items():
            value = None if field in _NOT_SCALARS else _scalar(value)
            if value is not None:
                values.append((prefix + field, value))
        if values:
            self._writer(run).write_event(_event(values, step))
            if time.monotonic() - self._flushed >= self._flush_secs:
                self.flush()

    def flush(self) -> None:
        """Flushes the event files (the JSON lines are flushed per record)."""
        self._flushed = time.monotonic()
        for writer in (self._writers or {}).values():
            writer.flush()

    def close(self) -> None:
        """Flushes and closes every file; idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
        for writer in (self._writers or {}).values():
            writer.close()
        self._writers = None

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Reads a JSON-lines metrics file; blank lines are skipped.

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: a line that is not a JSON object (the message gives its number).
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON: {e}") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            records.append(record)
    return records


def _read_events(path: pathlib.Path) -> Iterable[Any]:
    """The events of one event file; a truncated last record (a writer killed
    mid-write) ends the file. Record framing: length (u64), its masked CRC32C
    (u32), the data, the data's masked CRC32C (u32), little-endian."""
    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    data = path.read_bytes()
    offset = 0
    while offset + 12 <= len(data):
        header = data[offset : offset + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[offset + 8 : offset + 12])
        if header_crc != masked_crc32c(header):
            raise ValueError(f"{path}: corrupt record header at byte {offset}")
        end = offset + 12 + length + 4
        if end > len(data):
            return
        yield event_pb2.Event.FromString(data[offset + 12 : end - 4])
        offset = end


def read_tensorboard(
    logdir: str | os.PathLike,
) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Reads back the scalars of the TensorBoard event files under ``logdir``.

    Args:
      logdir: a directory as given to :class:`MetricsWriter` (or any
        TensorBoard log directory of scalar summaries).

    Returns:
      ``{run: {tag: [(step, value), ...]}}``, runs named by their directory
      relative to ``logdir`` (``""`` for ``logdir`` itself), points in the order
      written.

    Raises:
      FileNotFoundError: ``logdir`` is not a directory.
      ValueError: a corrupt event file.
    """
    root = pathlib.Path(logdir)
    if not root.is_dir():
        raise FileNotFoundError(f"no directory {str(root)!r}")
    runs: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for path in sorted(root.rglob("events.out.tfevents.*")):
        run = path.parent.relative_to(root).as_posix()
        tags = runs.setdefault("" if run == "." else run, {})
        for event in _read_events(path):
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    point = (int(event.step), float(value.simple_value))
                    tags.setdefault(value.tag, []).append(point)
    return runs


# ---------------------------------------------------------------------------
# Prometheus.
# ---------------------------------------------------------------------------

_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


def _check_buckets(name: str, buckets: Iterable[float]) -> tuple[float, ...]:
    buckets = tuple(buckets)
    if not buckets:
        raise ValueError(f"{name} must be finite numbers, got {buckets!r}")
    buckets = tuple(check_number(name, b) for b in buckets)
    if list(buckets) != sorted(set(buckets)):
        raise ValueError(f"{name} must be strictly increasing, got {buckets!r}")
    return tuple(float(b) for b in buckets)


class _Histogram:
    """Bucket counts kept as plain numbers; one writer thread."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """The cumulative counts, as prometheus-client takes them."""
        cumulative, total = [], 0
        counts = list(self.counts)
        for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
            total += count
            cumulative.append(("+Inf" if bound == math.inf else repr(bound), total))
        return cumulative

    def family(self, name: str, documentation: str):
        from prometheus_client.core import HistogramMetricFamily

        return HistogramMetricFamily(
            name, documentation, buckets=self.buckets(), sum_value=self.sum
        )


class _Exporter:
    """Serves a collector's families on ``/metrics`` (prometheus-client)."""

    def _init_exporter(self) -> None:
        from prometheus_client import CollectorRegistry

        self._http = None
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def exposition(self) -> bytes:
        """The text ``/metrics`` serves."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serves ``/metrics`` over HTTP from a daemon thread.

        Args:
          port: TCP port; 0 picks a free one.
          host: address to bind, loopback by default.

        Returns:
          The bound port.

        Raises:
          ValueError: a bad port, or already serving.
          OSError: the address cannot be bound.
        """
        from prometheus_client import start_http_server

        check_int("port", port, low=0, high=65535)
        with self._lock:
            if self._http is not None:
                raise ValueError(f"{type(self).__name__} is already serving")
            server, thread = start_http_server(port, addr=host, registry=self.registry)
            self._http = (server, thread)
        return server.server_port

    def stop(self) -> None:
        """Stops serving and joins the thread; idempotent."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            server, thread = http
            server.shutdown()
            server.server_close()
            thread.join()


# The parts of a worker's round that RoundMetrics exports: the seconds fields
# of its "round" record (hpsjax.telemetry.RoundTelemetry).
ROUND_PARTS = (
    "compute",
    "slowdown",
    "encode",
    "decode",
    "push",
    "pull",
    "server",
    "barrier",
    "wait",
    "round",
)


class RoundMetrics(_Exporter):
    """A worker's rounds, served to Prometheus on ``/metrics``.

    A callable sink of metrics records (pass it as
    ``MetricsWriter(..., prometheus=RoundMetrics())``): each ``"round"``
    record adds its seconds by part to a histogram; other records are
    ignored. Exported (prefix ``hpsjax_worker_``), labelled by ``worker``:

    ==============================  ===========================================
    ``round_part_seconds``          histogram, by ``part`` (one of
                                    :data:`ROUND_PARTS`): the round's seconds
                                    of compute, injected slowdown, encode,
                                    decode, push, pull, server hold, idle wait
                                    and the whole round
    ``rounds_total``                counter: rounds
    ``samples_total``               counter: samples computed
    ``tokens_per_second``           gauge: the last round's tokens (samples)
                                    per second
    ==============================  ===========================================

    Args:
      seconds_buckets: upper bounds of the histograms.

    Examples:
      >>> m = RoundMetrics()
      >>> m({"event": "round", "worker": "w0", "compute_s": 0.02, "round_s": 0.03,
      ...    "samples": 32, "tokens_per_s": 1066.7})
      >>> b'hpsjax_worker_rounds_total{worker="w0"} 1.0' in m.exposition()
      True
    """

    def __init__(self, *, seconds_buckets: Iterable[float] = _SECONDS_BUCKETS):
        self._bounds = _check_buckets("seconds_buckets", seconds_buckets)
        # Per worker: its histograms by part, rounds, samples, tokens/s.
        self._workers: dict[str, tuple[dict[str, _Histogram], list[float]]] = {}
        self._init_exporter()

    def __call__(self, record: Mapping[str, Any]) -> None:
        """Adds a ``"round"`` record (others are ignored)."""
        if record.get("event") != "round":
            return
        worker = str(record.get("worker"))
        entry = self._workers.get(worker)
        if entry is None:
            parts = {part: _Histogram(self._bounds) for part in ROUND_PARTS}
            entry = self._workers[worker] = (parts, [0, 0, 0.0])
        parts, counts = entry
        for part, histogram in parts.items():
            value = _scalar(record.get(f"{part}_s"))
            if value is not None:
                histogram.observe(value)
        counts[0] += 1
        counts[1] += int(_scalar(record.get("samples")) or 0)
        counts[2] = _scalar(record.get("tokens_per_s")) or 0.0

    def collect(self):
        """The metric families, built now (the prometheus-client collector API)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        p = "hpsjax_worker_"
        seconds = HistogramMetricFamily(
            p + "round_part_seconds",
            "A round's seconds by part.",
            labels=["worker", "part"],
        )
        rounds = CounterMetricFamily(p + "rounds", "Rounds.", labels=["worker"])
        samples = CounterMetricFamily(
            p + "samples", "Samples computed.", labels=["worker"]
        )
        tokens = GaugeMetricFamily(
            p + "tokens_per_second",
            "The last round's tokens (samples) per second.",
            labels=["worker"],
        )
        for worker, (parts, counts) in list(self._workers.items()):
            for part, histogram in parts.items():
                seconds.add_metric(
                    [worker, part], histogram.buckets(), sum_value=histogram.sum
                )
            rounds.add_metric([worker], float(counts[0]))
            samples.add_metric([worker], float(counts[1]))
            tokens.add_metric([worker], float(counts[2]))
        yield from (seconds, rounds, samples, tokens)


# Why a worker left (ServerMetrics.worker_left): it said goodbye, its
# connection ended without one, the server dropped it (a missed deadline), or
# it connected again.
LEAVE_REASONS = ("done", "crashed", "dropped", "replaced")
# The reasons that count as dropped workers: those that did not mean to go.
_DROPPED = frozenset({"crashed", "dropped"})


class ServerMetrics(_Exporter):
    """A parameter server's metrics, served to Prometheus on ``/metrics`` and
    written to TensorBoard.

    The server calls the event methods (:meth:`push`, :meth:`pull`,
    :meth:`barrier_wait`, :meth:`apply`, :meth:`served`, :meth:`worker_left`,
    :meth:`nonfinite_update`, :meth:`checkpoint_saved`) from its event loop,
    one thread; each adds to a few Python numbers. Gauges of the server's state
    come from ``state``, called at each scrape from the HTTP thread. Exported
    (prefix ``hpsjax_server_``):

    ==============================  ===========================================
    ``version``                     gauge: the model version
    ``live_workers``                gauge: workers joined and not gone
    ``dropped_workers_total``       counter: workers that went without meaning
                                    to (crashed, or dropped at a deadline);
                                    a worker that ends its run is not one
    ``worker_leaves_total``         counter, by ``reason``: ``done`` (said
                                    goodbye), ``crashed``, ``dropped``,
                                    ``replaced`` (connected again)
    ``nonfinite_updates_total``     counter: updates refused for holding NaN
                                    or infinity (a diverging run)
    ``pushes_total``                counter: pushes received (``rate()`` gives
                                    pushes per second)
    ``pulls_total``                 counter: pulls served
    ``received_bytes_total``        counter: bytes in
    ``sent_bytes_total``            counter: bytes out
    ``staleness``                   histogram: staleness of each push
    ``barrier_wait_seconds``        histogram: time a worker waited at a barrier
    ``apply_seconds``               histogram: time to apply an update
    ``serve_seconds``               histogram: time to answer a pull (prepare
                                    and hand over the parameters' frame)
    ``checkpoint_age_seconds``      gauge: seconds since the last checkpoint
                                    (absent before the first)
    ==============================  ===========================================

    With a ``tensorboard_dir``, each :meth:`write_scalars` (the server calls
    it with its status lines, and once when it closes) adds one point to each
    of the scalars ``server/version``, ``server/live_workers``,
    ``server/pushes_per_s``, ``server/versions_per_s``, ``server/staleness``
    (the mean since the last point), ``server/barrier_wait_s`` (likewise),
    ``server/dropped_workers`` and ``server/nonfinite_updates`` (totals),
    ``server/apply_s`` and ``server/serve_s`` (the mean apply and the mean
    answer to a pull since the last point), at the model version as its step
    (the number of points written without a ``state``).

    **Per version.** Given the version with :meth:`apply` and :meth:`served`,
    it keeps the server's seconds on each version, and with a ``jsonl`` file
    writes one record per version when the next is made (or it closes):
    ``{"event": "version", "version", "time", "apply_s", "serve_s",
    "pulls"}`` (:class:`hpsjax.telemetry.VersionTelemetry`), to the file and
    to TensorBoard (``version/apply_s``, ...).

    Args:
      state: a callable returning a mapping with ``"version"`` and
        ``"live_workers"`` (either may be missing), or None.
      staleness_buckets: upper bounds of the staleness histogram.
      seconds_buckets: upper bounds of the wait and apply histograms.
      tensorboard_dir: directory of the TensorBoard event files (created), or
        None.
      jsonl: a JSON-lines file (created, or appended to) of the per-version
        records and the TensorBoard points' records, or None.

    Examples:
      >>> m = ServerMetrics(state=lambda: {"version": 7, "live_workers": 2})
      >>> m.push(staleness=1, received_bytes=4096)
      >>> b"hpsjax_server_pushes_total 1.0" in m.exposition()
      True
    """

    def __init__(
        self,
        state: Callable[[], Mapping[str, Any]] | None = None,
        *,
        staleness_buckets: Iterable[float] = _STALENESS_BUCKETS,
        seconds_buckets: Iterable[float] = _SECONDS_BUCKETS,
        tensorboard_dir: str | os.PathLike | None = None,
        jsonl: str | os.PathLike | None = None,
    ):
        if state is not None and not callable(state):
            raise ValueError("state must be callable or None")
        self._state = state
        self._staleness = _Histogram(
            _check_buckets("staleness_buckets", staleness_buckets)
        )
        seconds = _check_buckets("seconds_buckets", seconds_buckets)
        self._barrier_wait = _Histogram(seconds)
        self._apply = _Histogram(seconds)
        self._serve = _Histogram(seconds)
        self._pushes = self._pulls = self._nonfinite = 0
        self._leaves = dict.fromkeys(LEAVE_REASONS, 0)
        self._received = self._sent = 0
        self._writer = (
            None
            if tensorboard_dir is None and jsonl is None
            else MetricsWriter(jsonl, tensorboard_dir=tensorboard_dir)
        )
        self._version_records = jsonl is not None
        self._t0 = time.monotonic()
        # The version being served: [version, time, apply_s, serve_s, pulls].
        self._version: list | None = None
        self._points = 0
        # What the last TensorBoard point saw: (time, version, pushes, and the
        # count and sum of staleness, barrier wait, apply and serve).
        self._last_point = (time.monotonic(), None, 0, 0, 0.0, 0, 0.0, 0, 0.0, 0, 0.0)
        self._checkpoint_time: float | None = None
        self._init_exporter()

    # -- events (the server's event loop) ------------------------------------

    def push(self, *, staleness: int, received_bytes: int = 0) -> None:
        """Counts one push of ``staleness`` and ``received_bytes`` bytes in."""
        self._pushes += 1
        self._staleness.observe(staleness)
        self._received += received_bytes

    def pull(self, *, sent_bytes: int = 0) -> None:
        """Counts one pull of ``sent_bytes`` bytes out."""
        self._pulls += 1
        self._sent += sent_bytes

    def transfer(self, *, received_bytes: int = 0, sent_bytes: int = 0) -> None:
        """Counts bytes of other messages (joins, plans, errors)."""
        self._received += received_bytes
        self._sent += sent_bytes

    def barrier_wait(self, seconds: float) -> None:
        """Records how long one worker waited at a barrier."""
        self._barrier_wait.observe(seconds)

    def apply(self, seconds: float, *, version: int | None = None) -> None:
        """Records how long applying one update took; ``version``, the one it
        made, starts that version's record."""
        self._apply.observe(seconds)
        if version is not None:
            self._at_version(version)[2] += seconds

    def served(self, seconds: float, *, version: int, pull: bool = True) -> None:
        """Records how long sending the parameters of ``version`` took, for a
        pull (or, ``pull=False``, to a subscriber)."""
        if pull:
            self._serve.observe(seconds)
        entry = self._at_version(version)
        entry[3] += seconds
        entry[4] += int(pull)

    def _at_version(self, version: int) -> list:
        """The record of ``version``, the last one's written when it is new."""
        entry = self._version
        if entry is None or entry[0] != version:
            self._write_version()
            entry = self._version = [version, time.monotonic() - self._t0, 0.0, 0.0, 0]
        return entry

    def _write_version(self) -> None:
        entry, self._version = self._version, None
        if entry is None or not self._version_records or self._writer is None:
            return
        version, t, apply_s, serve_s, pulls = entry
        self._writer(
            {
                "event": "version",
                "version": version,
                "time": t,
                "apply_s": apply_s,
                "serve_s": serve_s,
                "pulls": pulls,
            }
        )

    def worker_left(self, reason: str) -> None:
        """Counts a worker leaving for ``reason``, one of :data:`LEAVE_REASONS`.

        Raises:
          ValueError: another reason.
        """
        if reason not in self._leaves:
            raise ValueError(f"reason must be one of {LEAVE_REASONS}, got {reason!r}")
        self._leaves[reason] += 1

    def nonfinite_update(self) -> None:
        """Counts an update refused for holding NaN or infinity."""
        self._nonfinite += 1

    @property
    def dropped_workers(self) -> int:
        """Workers that went without meaning to (crashed or dropped)."""
        return sum(self._leaves[r] for r in _DROPPED)

    def checkpoint_saved(self, timestamp: float | None = None) -> None:
        """Notes a checkpoint written at ``timestamp`` (``time.time()``; now
        when omitted), e.g. the one resumed from."""
        self._checkpoint_time = time.time() if timestamp is None else timestamp

    # -- scrape (the HTTP thread) --------------------------------------------

    def collect(self):
        """The metric families, built now (the prometheus-client collector API)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        p = "hpsjax_server_"
        state = dict(self._state()) if self._state is not None else {}
        for key, doc in (
            ("version", "The model version."),
            ("live_workers", "Workers joined and not gone."),
        ):
            if state.get(key) is not None:
                yield GaugeMetricFamily(p + key, doc, value=float(state[key]))
        leaves = CounterMetricFamily(
            p + "worker_leaves", "Workers that left, by reason.", labels=["reason"]
        )
        for reason, count in self._leaves.items():
            leaves.add_metric([reason], float(count))
        yield leaves
        for name, doc, value in (
            ("dropped_workers", "Workers crashed or dropped.", self.dropped_workers),
            ("nonfinite_updates", "Non-finite updates refused.", self._nonfinite),
            ("pushes", "Pushes received.", self._pushes),
            ("pulls", "Pulls served.", self._pulls),
            ("received_bytes", "Bytes received.", self._received),
            ("sent_bytes", "Bytes sent.", self._sent),
        ):
            yield CounterMetricFamily(p + name, doc, value=float(value))
        yield self._staleness.family(p + "staleness", "Staleness of each push.")
        yield self._barrier_wait.family(
            p + "barrier_wait_seconds", "Time a worker waited at a barrier."
        )
        yield self._apply.family(p + "apply_seconds", "Time to apply an update.")
        yield self._serve.family(p + "serve_seconds", "Time to answer a pull.")
        if self._checkpoint_time is not None:
            yield GaugeMetricFamily(
                p + "checkpoint_age_seconds",
                "Seconds since the last checkpoint.",
                value=max(0.0, time.time() - self._checkpoint_time),
            )

    # -- TensorBoard (the server's event loop) -------------------------------

    def write_scalars(self, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Adds a point to each TensorBoard scalar (see the class docstring).

        Args:
          state: the server's ``"version"`` and ``"live_workers"``; ``None``
            to ask the ``state`` callable.

        Returns:
          The point's record (``{"event": "server", "step": ..., ...}``),
          written or not (without a ``tensorboard_dir``).
        """
        now = time.monotonic()
        if state is None:
            state = dict(self._state()) if self._state is not None else {}
        version = state.get("version")
        t, version0, pushes, s_count, s_sum, w_count, w_sum, *last = self._last_point
        a_count, a_sum, v_count, v_sum = last
        seconds = max(now - t, 1e-9)
        stale_count = self._staleness.count() - s_count
        waits = self._barrier_wait.count() - w_count
        applies = self._apply.count() - a_count
        serves = self._serve.count() - v_count
        self._points += 1
        record = {
            "event": "server",
            "step": self._points - 1 if version is None else int(version),
            "version": version,
            "live_workers": state.get("live_workers"),
            "pushes_per_s": (self._pushes - pushes) / seconds,
            "versions_per_s": (
                None
                if version is None or version0 is None
                else (version - version0) / seconds
            ),
            "staleness": (
                (self._staleness.sum - s_sum) / stale_count if stale_count else None
            ),
            "barrier_wait_s": (
                (self._barrier_wait.sum - w_sum) / waits if waits else None
            ),
            "dropped_workers": self.dropped_workers,
            "nonfinite_updates": self._nonfinite,
            "apply_s": (self._apply.sum - a_sum) / applies if applies else None,
            "serve_s": (self._serve.sum - v_sum) / serves if serves else None,
        }
        self._last_point = (
            now,
            version,
            self._pushes,
            *(
                value
                for h in (self._staleness, self._barrier_wait, self._apply, self._serve)
                for value in (h.count(), h.sum)
            ),
        )
        if self._writer is not None:
            self._writer(record)
            self._writer.flush()
        return record

    def close(self) -> None:
        """Stops serving (:meth:`stop`), writes the last version's record and
        closes the files; idempotent."""
        self.stop()
        self._write_version()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
