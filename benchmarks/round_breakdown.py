"""Where a planned (piloted) run's time went, from its round records.

Reads one run's workdir (``metrics.jsonl``: the workers' ``"round"`` records,
the server's ``"eval"`` and ``"replan"`` records, as ``experiments.run`` and
``experiments.compare`` write them; or ``workers/metrics_<i>.jsonl``) and
prints, per worker, its segments of rounds (a plan revision, its rounds still
at the last batch while the new one's step compiled beside them, then its
rounds at the new batch), the time and versions spent before every worker ran
the final plan's batch against after, the rounds that compiled in the round,
where each worker's rounds at the final batch went (the barrier's wait by
worker), the plan's predicted round (and, where the replan records carry
them, each worker's predicted step and round) against the measured ones, and
what the pilot cost: the target's version reached at the after-pilot rate
from the first round, against when it was reached, and each segment's
seconds over the after-pilot round (and the first push's wait). A server ``--metrics``
file (``"version"`` records) adds the server's apply and serve seconds::

    .venv/bin/python benchmarks/round_breakdown.py WORKDIR [--server_metrics PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from hpsjax import telemetry

# Rounds at a batch left out of its steady figures: the first execution of
# its step, and the slowdown's median settling (as the pilot leaves them out).
_SETTLING = 2


def read_run(workdir: str | pathlib.Path) -> dict[str, Any]:
    """A run's records: ``rounds`` per worker (in order), ``evals``,
    ``replans``, ``compiles`` and ``target`` (the summary's target value or
    ``None``).

    Raises:
      ValueError: ``workdir`` holds no round records.
    """
    root = pathlib.Path(workdir)
    records = []
    if (root / "metrics.jsonl").exists():
        records = telemetry.read_records(root / "metrics.jsonl")
    if not any(r.get("event") == "round" for r in records):
        records += telemetry.read_records(sorted(root.glob("workers/metrics_*.jsonl")))
    rounds: dict[str, list[dict]] = {}
    for r in records:
        if r.get("event") == "round" and "round_s" in r:
            rounds.setdefault(str(r.get("worker")), []).append(r)
    if not rounds:
        raise ValueError(f"no round records in {root}")
    for rs in rounds.values():
        rs.sort(key=lambda r: r["step"])
    target = None
    if (root / "summary.json").exists():
        target = json.loads((root / "summary.json").read_text()).get("target_value")
    return {
        "rounds": dict(sorted(rounds.items())),
        "evals": [r for r in records if r.get("event") == "eval"],
        "replans": [r for r in records if r.get("event") == "replan"],
        "compiles": [r for r in records if r.get("event") == "compile"],
        "target": target,
    }


def segments(rounds: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A worker's rounds cut where the plan revision or the batch changes.

    Each segment: ``revision``, ``batch``, ``compiling`` (true for rounds of a
    revision before its new batch came: the same revision at another batch
    follows, and its step compiled beside them), ``start`` and ``end`` (the
    worker's clock: the first round's start, the last round's end),
    ``rounds``, ``first_version`` and ``last_version``, and the records
    themselves (``records``).
    """
    cut: list[dict[str, Any]] = []
    for r in rounds:
        key = (r.get("plan_revision") or 0, r["batch_size"])
        if not cut or cut[-1]["key"] != key:
            cut.append({"key": key, "revision": key[0], "batch": key[1], "records": []})
        cut[-1]["records"].append(r)
    for s, after in itertools.zip_longest(cut, cut[1:]):
        # A revision's rounds before its new batch came (the same revision at
        # another batch next) computed at the last batch while it compiled.
        s["compiling"] = after is not None and after["revision"] == s["revision"]
        rs = s.pop("records")
        s.pop("key")
        s.update(
            start=rs[0]["time"],
            end=rs[-1]["time"] + rs[-1]["round_s"],
            rounds=len(rs),
            first_version=rs[0].get("version", 0),
            last_version=rs[-1].get("version", 0),
            records=rs,
        )
    return cut


def _mean_ms(rs: Sequence[Mapping[str, Any]], field: str) -> float:
    return 1e3 * statistics.fmean(float(r.get(field, 0.0)) for r in rs) if rs else 0.0


def final_rounds(rounds: Sequence[Mapping[str, Any]]) -> list[dict]:
    """A worker's rounds at its last batch of its last plan revision, past the
    first :data:`_SETTLING` there."""
    last = segments(rounds)[-1]
    return last["records"][_SETTLING:]


def pilot_end(run: Mapping[str, Any]) -> float:
    """When the last worker began its last segment (the final plan's batch):
    the worker clock's seconds."""
    return max(segments(rs)[-1]["start"] for rs in run["rounds"].values())


def target_crossing(run: Mapping[str, Any]) -> tuple[float, int] | None:
    """The first evaluation at or past the target: its time and version."""
    target = run["target"]
    if target is None:
        return None
    for e in run["evals"]:
        value = e.get("accuracy", e.get("metric"))
        if value is not None and value >= target:
            return float(e["time"]), int(e["version"])
    return None


def _worker_lines(worker: str, rs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for s in segments(rs):
        g = s["records"]
        lines.append(
            f"  {worker:>3} rev {s['revision']:>2} b={s['batch']:>4}"
            f"{' compiling' if s['compiling'] else '          '}"
            f" {s['start']:6.2f}-{s['end']:6.2f} s {s['rounds']:>4} rounds"
            f" v{s['first_version']:>4}-{s['last_version']:<4}"
            f" round {_mean_ms(g, 'round_s'):5.0f}"
            f" compute {_mean_ms(g, 'compute_s'):4.0f}"
            f" slowdown {_mean_ms(g, 'slowdown_s'):4.0f}"
            f" barrier {_mean_ms(g, 'barrier_s'):4.0f} ms"
        )
    return lines


def _after_lines(run: Mapping[str, Any]) -> list[str]:
    lines = [
        "  after the final plan (each worker's rounds at its last batch, "
        f"the first {_SETTLING} left out):",
        "  worker batch rounds  round   busy  wire+server  barrier  other  "
        "busy share  barrier share",
    ]
    for w, rs in run["rounds"].items():
        kept = [telemetry.from_record(r) for r in final_rounds(rs)]
        if not kept:
            continue
        total = sum(r.round_s for r in kept)
        busy = sum(r.busy_s for r in kept)
        barrier = sum(r.barrier_s for r in kept)
        wire = sum(r.wire_s + r.server_own_s for r in kept)
        other = sum(r.other_s for r in kept)
        n = len(kept)
        lines.append(
            f"  {w:>6} {kept[-1].batch_size:>5} {n:>6} {1e3 * total / n:6.0f}"
            f" {1e3 * busy / n:6.0f} {1e3 * wire / n:12.0f} {1e3 * barrier / n:8.0f}"
            f" {1e3 * other / n:6.0f} {busy / total:11.0%} {barrier / total:14.0%}"
        )
    return lines


def _prediction_lines(run: Mapping[str, Any]) -> list[str]:
    if not run["replans"]:
        return ["  no plan revisions recorded"]
    last = run["replans"][-1]
    measured = [
        float(r["round_s"]) for rs in run["rounds"].values() for r in final_rounds(rs)
    ]
    lines = []
    if measured:
        mean = statistics.fmean(measured)
        predicted = float(last["predicted_round_s"])
        lines.append(
            f"  round: predicted {1e3 * predicted:.0f} ms, measured mean "
            f"{1e3 * mean:.0f} (median {1e3 * statistics.median(measured):.0f}): "
            f"{predicted / mean - 1:+.0%}"
        )
    for p in last.get("workers", ()):
        rs = run["rounds"].get(str(p["worker"]), [])
        kept = final_rounds(rs)
        if not kept:
            continue
        step = [float(r["compute_s"]) + float(r.get("slowdown_s", 0)) for r in kept]
        link = [
            float(r["round_s"]) - s - float(r.get("barrier_s", 0))
            for r, s in zip(kept, step, strict=True)
        ]
        lines.append(
            f"  worker {p['worker']}: batch {p['batch_size']} step predicted "
            f"{1e3 * p['step_time']:.0f} ms, measured median "
            f"{1e3 * statistics.median(step):.0f}"
            f" (mean {1e3 * statistics.fmean(step):.0f});"
            f" link predicted {1e3 * p['transfer_seconds']:.0f}, measured round less"
            f" step and barrier {1e3 * statistics.median(link):.0f}"
        )
    return lines


def _cost_lines(run: Mapping[str, Any]) -> list[str]:
    """The pilot's seconds: before against after the final plan, and the
    target's version at the after-pilot rate."""
    start = min(rs[0]["time"] for rs in run["rounds"].values())
    end = pilot_end(run)
    first = run["rounds"][next(iter(run["rounds"]))]
    version_at_end = next((r["version"] for r in first if r["time"] >= end), None)
    after = [r for rs in run["rounds"].values() for r in final_rounds(rs)]
    lines = [
        f"  first round {start:.2f} s, every worker on its final batch {end:.2f} s"
    ]
    if version_at_end is None or not after:
        return lines
    last = first[-1]
    rate = (last["version"] - version_at_end) / max(last["time"] - end, 1e-9)
    before = version_at_end / max(end - start, 1e-9)
    lines.append(
        f"  before: {end - start:.2f} s for {version_at_end} versions "
        f"({before:.1f}/s); after: {rate:.1f} versions/s"
    )
    compiling = [
        s["end"] - s["start"]
        for rs in run["rounds"].values()
        for s in segments(rs)
        if s["compiling"]
    ]
    if compiling:
        lines.append(
            f"  rounds while a new batch compiled beside them: {len(compiling)} spans, "
            f"{min(compiling):.2f}-{max(compiling):.2f} s each (per worker)"
        )
    crossing = target_crossing(run)
    if crossing is not None and rate > 0:
        t, version = crossing
        # The evaluations' clock starts when every worker has joined, at
        # the first round (the workers' clocks count their start-up too).
        ideal = version / rate
        lines.append(
            f"  target {run['target']} at {t:.1f} s (version {version}); at the after "
            f"rate from the run's start: {ideal:.1f} s, so the pilot cost about "
            f"{t - ideal:.1f} s (the evaluations are {_eval_step(run):.1f} s apart)"
        )
    return lines


def revision_costs(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What each segment of the first worker's rounds before its last cost:
    per segment (a plan revision at a batch), ``revision``, ``batch``,
    ``rounds``, ``seconds`` and ``extra`` (its seconds less as many rounds at
    the mean round after the final plan, :func:`final_rounds`'s); empty
    without rounds after it. Under a barrier every worker's rounds are the
    same rounds, so the first worker's say what the run spent."""
    first = next(iter(run["rounds"].values()))
    after = [float(r["round_s"]) for r in final_rounds(first)]
    if not after:
        return []
    mean = statistics.fmean(after)
    costs = []
    for s in segments(first)[:-1]:
        seconds = sum(float(r["round_s"]) for r in s["records"])
        costs.append(
            {
                "revision": s["revision"],
                "batch": s["batch"],
                "rounds": s["rounds"],
                "seconds": seconds,
                "extra": seconds - s["rounds"] * mean,
            }
        )
    return costs


def first_push_waits(run: Mapping[str, Any]) -> list[float]:
    """Per worker, the seconds from its first round's compute end to its
    first push going out (its encoding, and what the encoder waited for),
    where the records say both."""
    waits = []
    for rs in run["rounds"].values():
        r = rs[0]
        if r.get("compute_end") is not None and r.get("pull_start") is not None:
            waits.append(float(r["pull_start"]) - float(r["compute_end"]))
    return waits


def _revision_lines(run: Mapping[str, Any]) -> list[str]:
    lines = [
        f"  rev {c['revision']:>2} b={c['batch']:>4}: {c['rounds']:>3} rounds "
        f"{c['seconds']:5.2f} s, {c['extra']:+.2f} s over the after-plan round"
        for c in revision_costs(run)
    ]
    first = next(iter(run["rounds"].values()))
    if len(first) >= 2:
        two = float(first[0]["round_s"]) + float(first[1]["round_s"])
        lines.append(f"  its first two rounds: {two:.2f} s")
    waits = first_push_waits(run)
    if waits:
        lines.append(
            f"  first round's compute end to first push: {min(waits):.2f}-"
            f"{max(waits):.2f} s (per worker)"
        )
    return lines


def _eval_step(run: Mapping[str, Any]) -> float:
    times = [float(e["time"]) for e in run["evals"]]
    if len(times) < 2:
        return 0.0
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def breakdown(run: Mapping[str, Any], server_versions: Sequence[Any] = ()) -> str:
    """The printed breakdown of :func:`read_run`'s ``run``."""
    lines = ["segments per worker (worker clock, seconds; means in ms):"]
    for w, rs in run["rounds"].items():
        lines += _worker_lines(w, rs)
    in_round = [c for c in run["compiles"] if c.get("compile_s", 0) > 0]
    lines.append(
        f"compiles in a round: {len(in_round)}"
        + "".join(
            f", worker {c['worker']} b={c['batch_size']} {c['compile_s']:.2f} s"
            for c in in_round
        )
    )
    lines.append("the pilot's time against after:")
    lines += _cost_lines(run)
    lines.append("before the final plan, by segment (the first worker's rounds):")
    lines += _revision_lines(run)
    lines += _after_lines(run)
    lines.append("plan against measured (the last revision):")
    lines += _prediction_lines(run)
    if server_versions:
        apply_s = sum(v.apply_s for v in server_versions)
        serve_s = sum(v.serve_s for v in server_versions)
        lines.append(
            f"server: {len(server_versions)} versions, apply {apply_s:.2f} s, "
            f"serve {serve_s:.2f} s"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", help="a run's workdir (its metrics.jsonl)")
    parser.add_argument("--server_metrics", help="the server's --metrics file")
    args = parser.parse_args(argv)
    try:
        run = read_run(args.workdir)
        versions = (
            telemetry.read_versions(args.server_metrics) if args.server_metrics else ()
        )
    except (OSError, ValueError) as error:
        print(f"round_breakdown: {error}", file=sys.stderr)
        return 2
    print(breakdown(run, versions))
    return 0


if __name__ == "__main__":
    sys.exit(main())
