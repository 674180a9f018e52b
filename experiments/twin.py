"""The cluster an advice is about, fitted from what its workers measured.

From the workers' profiles (:func:`load_profiles`: each worker's step times
and, where it reached a server, its push and pull) or from a short pilot run's
telemetry (:func:`twin_from_telemetry`: the workers' round records and the
server's version records, fitted to a :class:`Twin`: per-worker compute, one
link, the server's seconds per push, start-ups); the link of a profile or of
``--link=MB_PER_S[,LATENCY_MS]`` (:func:`link_of`, :func:`parse_link`).
:mod:`experiments.advise` simulates every scheme on the result.
"""

import dataclasses
import glob
import math
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = [
    "Twin",
    "fit_wire",
    "link_of",
    "load_profiles",
    "parse_link",
    "twin_from_telemetry",
]


def load_profiles(pattern: str | Sequence[str]) -> list[Any]:
    """The profiles that ``pattern`` (a glob, or several) matches, by worker id.

    Raises:
      ValueError: no file matches, a file is not a profile (the message names
        it), or two profiles have the same worker id.
    """
    from hpsjax.profiling import WorkerProfile

    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    paths = sorted({p for pat in patterns for p in glob.glob(pat)})
    if not paths:
        raise ValueError(f"no profile files match {' '.join(patterns)!r}")
    profiles = []
    for path in paths:
        try:
            text = pathlib.Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        try:
            profiles.append(WorkerProfile.from_json(text))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    ids = [str(p.worker_id) for p in profiles]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ValueError(f"several profiles of worker {', '.join(dup)}")

    def order(p):
        w = p.worker_id
        return (0, int(w), "") if isinstance(w, int) else (1, 0, str(w))

    return sorted(profiles, key=order)


def _link(transfer: Any) -> tuple[float, float] | None:
    """``(latency, bandwidth)`` of one worker's measured push and pull."""
    if transfer is None:
        return None
    points = [
        (transfer.push_bytes, transfer.push_seconds),
        (transfer.pull_bytes, transfer.pull_seconds),
    ]
    points = [(n, s) for n, s in points if s is not None and n > 0]
    if not points:
        # Only a round trip, without its bytes: all of it latency.
        return transfer.round_trip_seconds / 2, math.inf
    (n1, s1), (n2, s2) = points[0], points[-1]
    if n1 != n2:
        slope = (s2 - s1) / (n2 - n1)
        if slope > 0:
            latency = max(s1 - slope * n1, 0.0)
            return latency, 1.0 / slope
    seconds = (s1 + s2) / 2
    nbytes = (n1 + n2) / 2
    return 0.0, (nbytes / seconds if seconds > 0 else math.inf)


def parse_link(text: str) -> tuple[float, float]:
    """``--link``'s value, ``MB_PER_S[,LATENCY_MS]``, as ``(latency_s, bytes_per_s)``.

    Raises:
      ValueError: anything else, or a bandwidth that is not a finite number
        > 0 or a latency that is not a finite number >= 0 (one line).

    Examples:
      >>> parse_link("50,1")
      (0.001, 50000000.0)
      >>> parse_link("4.5")
      (0.0, 4500000.0)
    """
    parts = str(text).split(",")
    try:
        if len(parts) > 2:
            raise ValueError
        mbps = float(parts[0])
        latency_ms = float(parts[1]) if len(parts) == 2 else 0.0
    except ValueError:
        mbps = latency_ms = math.nan
    if not (math.isfinite(mbps) and mbps > 0):
        raise ValueError(
            f"--link: expected MB_PER_S[,LATENCY_MS] with MB_PER_S > 0, got {text!r}"
        )
    if not (math.isfinite(latency_ms) and latency_ms >= 0):
        raise ValueError(f"--link: the latency must be >= 0 ms, got {text!r}")
    return latency_ms / 1e3, mbps * 1e6


def link_of(
    profiles: Sequence[Any], link: tuple[float, float] | None = None
) -> tuple[float, float, str]:
    """One link for the simulator: the workers' median latency and bandwidth,
    or ``link`` (``(latency, bandwidth)``, :func:`parse_link`) in their place.

    Returns:
      ``(latency, bandwidth, note)``: bandwidth ``inf`` for no link; the note
      says where the workers' links differ by more than 2x, or that ``link``
      replaced them, else ``""``.
    """
    if link is not None:
        return link[0], link[1], "the link given by --link replaces the profiled ones"
    links = [link for link in map(_link, (p.transfer for p in profiles)) if link]
    if not links:
        return 0.0, math.inf, "no profile measured a link: transfers cost nothing"
    latency = statistics.median(lat for lat, _ in links)
    bandwidth = statistics.median(b for _, b in links)
    finite = [b for _, b in links if math.isfinite(b)]
    note = ""
    if finite and max(finite) > 2 * min(finite):
        note = (
            f"the workers' links differ ({min(finite) / 1e6:.3g} to "
            f"{max(finite) / 1e6:.3g} MB/s): simulated with their median"
        )
    if len(links) < len(profiles):
        note = (note + "; " if note else "") + (
            f"{len(profiles) - len(links)} profile(s) without a link take the median"
        )
    return latency, bandwidth, note


def _step_fit(profile: Any, batch_size: int) -> tuple[float, float]:
    """``(intercept, slope)`` of the worker's step time in its whole batch."""
    devices = profile.devices
    share = batch_size / len(devices)
    slowest = max(devices, key=lambda d: d.step_time(share))
    fit = slowest.time_fit
    # The devices split the batch: per sample of the worker's batch, the
    # slowest device's slope over the devices.
    return float(fit.intercept), float(fit.slope) / len(devices)


@dataclasses.dataclass(frozen=True)
class Twin:
    """A cluster fitted from its own run's telemetry (:func:`twin_from_telemetry`).

    Attributes:
      workers: the workers' ids, in the simulated workers' order.
      fits: per worker (by position), its seconds per local step
        (:class:`experiments.calibrate.ComputeFit`), encode, decode and the
        gap between rounds included in the fixed part.
      link: the link's time per message (:class:`experiments.calibrate.LinkFit`).
      service_s: the server's seconds per push.
      startup: per worker (by position), seconds its first round computed
        beyond its fit.
      notes: what the telemetry could not tell, one line each.
      source: where the telemetry came from.
    """

    workers: tuple[str, ...]
    fits: dict[int, Any]
    link: Any
    service_s: float
    startup: dict[int, float]
    notes: tuple[str, ...]
    source: str


def _worker_order(worker: str) -> tuple[int, int, str]:
    return (0, int(worker), "") if worker.isdigit() else (1, 0, worker)


def _telemetry_records(paths: str | Sequence[str]) -> list[dict[str, Any]]:
    """The round and version records of the metrics files at ``paths``, each once.

    A directory is searched for ``*.jsonl`` files (a run's workdir), leaving
    out ``warmup`` folders (the experiments' warm-up rounds against a
    throwaway server); a round in two files (an experiments workdir copies
    the workers' rounds into its ``metrics.jsonl``) counts once.
    """
    from hpsjax import telemetry

    paths = [paths] if isinstance(paths, str | pathlib.Path) else list(paths)
    files = []
    for path in map(pathlib.Path, paths):
        if path.is_dir():
            files += [
                f
                for f in sorted(path.rglob("*.jsonl"))
                if "warmup" not in f.relative_to(path).parts
            ]
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(
                f"--telemetry: no metrics file or directory at {str(path)!r}"
            )
    try:
        records = telemetry.read_records(files)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--telemetry: {e}".splitlines()[0]) from None
    seen, found = set(), []
    for r in records:
        event = r.get("event")
        if event == "round":
            key = (event, str(r.get("worker")), r.get("step"), r.get("time"))
        elif event == "version":
            key = (event, r.get("version"), r.get("time"))
        else:
            continue
        if key not in seen:
            seen.add(key)
            found.append(r)
    return found


def _pushed(r: dict[str, Any]) -> bool:
    return r.get("status") is not None or float(r.get("push_s") or 0.0) > 0


def fit_wire(records: Sequence[dict[str, Any]]) -> Any:
    """The link, ``latency + bytes / bandwidth`` per message, fitted to the
    rounds' wire seconds (:attr:`hpsjax.telemetry.RoundTelemetry.wire_s`: push
    and pull less the server's hold) against their messages and bytes.

    Where every message moves about the same bytes the two terms cannot be
    told apart and the whole wire time is charged by the byte (latency 0), as
    a profile's push and pull of one size are.

    Returns:
      A :class:`experiments.calibrate.LinkFit` (``method`` ``"wire fitted"``,
      ``"wire by the byte"``, ``"wire latency only"`` (no bytes on record) or
      ``"none"`` (no round moved anything)).
    """
    import numpy as np

    from experiments.calibrate import LinkFit
    from hpsjax import telemetry

    rows = []
    for r in records:
        t = telemetry.from_record(r)
        if t is None:
            continue
        pulls = r.get("pulls")
        pulls = int(pulls) if isinstance(pulls, int) else int(t.pull_s > 0)
        messages = int(_pushed(r)) + pulls
        nbytes = int(r.get("bytes_sent") or 0) + int(r.get("bytes_received") or 0)
        if messages and t.wire_s > 0:
            rows.append((messages, nbytes, t.wire_s))
    if not rows:
        return LinkFit(0.0, math.inf, "none", 0)
    n, nbytes, wire = (np.array(c, dtype=float) for c in zip(*rows, strict=True))
    if nbytes.sum() == 0:
        return LinkFit(
            float(wire.sum() / n.sum()), math.inf, "wire latency only", len(rows)
        )
    per_message = nbytes / n
    if np.std(per_message) >= 0.1 * np.mean(per_message):
        design = np.stack([n, nbytes], axis=1)
        (latency, per_byte), *_ = np.linalg.lstsq(design, wire, rcond=None)
        if latency >= 0 and per_byte > 0:
            return LinkFit(
                float(latency), float(1 / per_byte), "wire fitted", len(rows)
            )
    return LinkFit(0.0, float(nbytes.sum() / wire.sum()), "wire by the byte", len(rows))


def _service(
    steady: dict[str, list[dict[str, Any]]], records: Sequence[dict[str, Any]]
) -> tuple[float, str]:
    """The server's seconds per push and how they were found."""
    import numpy as np

    from hpsjax import telemetry

    versions = telemetry.versions(records)
    pushes = sum(_pushed(r) for r in records if r.get("event") == "round")
    if versions and pushes:
        busy = sum(v.apply_s + v.serve_s for v in versions)
        return busy / pushes, "the server's version records (apply and serve)"
    # A barrier holds every pull but the last one's: the server says which
    # part of a hold was the barrier's (barrier_s); what is left is its
    # decode and apply, least for the worker held least (its median round).
    held = [
        float(np.median([t.server_own_s for t in telemetry.rounds(rs)]))
        for rs in steady.values()
    ]
    return min(held), (
        "no server version records: the server's share per push is the least "
        "of the workers' median holds less their barrier waits (server_s - "
        "barrier_s)"
    )


def twin_from_telemetry(paths: str | Sequence[str], *, skip_rounds: int = 1) -> Twin:
    """The cluster a run's telemetry saw, for :func:`cluster_config`.

    Args:
      paths: metrics files or directories (a run's workdir): the workers'
        ``"round"`` records (:class:`hpsjax.telemetry.RoundTelemetry`), and
        the server's ``"version"`` records where there are any.
      skip_rounds: each worker's first rounds left out of the fits (its first
        round's extra compute is its start-up).

    Returns:
      A :class:`Twin`: per worker, its step time ``a + c b`` at its batch sizes
      (:func:`experiments.calibrate.fit_compute`; with one batch size all of
      it per sample, as noted) with its encode, decode and the gap between
      rounds added to ``a``, and its start-up; the link from the wire
      seconds (:func:`fit_wire`); the server's seconds per push.

    Raises:
      ValueError: no such file, a file that is not JSON lines, no worker's
        rounds, or a worker without a round to fit (one line each).
    """
    import numpy as np

    from experiments.calibrate import fit_compute, fit_startup, round_gap
    from hpsjax import telemetry

    records = _telemetry_records(paths)
    source = ", ".join(map(str, [paths] if isinstance(paths, str) else paths))
    by_worker: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["event"] == "round" and telemetry.from_record(r) is not None:
            by_worker.setdefault(str(r.get("worker")), []).append(r)
    if not by_worker:
        raise ValueError(f"--telemetry: no workers' round records in {source}")
    ids = sorted(by_worker, key=_worker_order)
    fits, startup, steady, notes = {}, {}, {}, []
    for i, w in enumerate(ids):
        rs = sorted(by_worker[w], key=lambda r: float(r.get("time") or 0.0))
        kept = [
            r for r in rs if int(r["step"]) >= skip_rounds and not r.get("discarded")
        ]
        try:
            fit = fit_compute(kept)
        except ValueError:
            raise ValueError(
                f"--telemetry: worker {w} has no round to fit after its first "
                f"{skip_rounds} in {source}"
            ) from None
        typed = telemetry.rounds(kept)
        extra = float(np.mean([t.encode_s + t.decode_s for t in typed])) + round_gap(
            kept
        )
        steps = float(np.mean([max(t.local_steps, 1) for t in typed]))
        fits[i] = dataclasses.replace(fit, intercept=fit.intercept + extra / steps)
        startup[i] = fit_startup(rs, fit)
        steady[w] = kept
    one = [w for i, w in enumerate(ids) if fits[i].method != "batches"]
    if one:
        notes.append(
            f"worker(s) {', '.join(one)} ran one batch size: the step is charged "
            "per sample (no fixed cost); a pilot at two batch sizes fits both"
        )
    link = fit_wire([r for rs in steady.values() for r in rs])
    if link.method == "wire by the byte":
        notes.append(
            "every message moved about the same bytes: the link's latency is "
            "charged by the byte"
        )
    service, how = _service(steady, records)
    if how.startswith("no server"):
        notes.append(how)
    return Twin(tuple(ids), fits, link, service, startup, tuple(notes), source)
