"""round_breakdown's cost of each segment before the final plan, and the
first push's wait, on records whose figures are checked by hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "round_breakdown", REPO / "benchmarks" / "round_breakdown.py"
)
rb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rb)


def _workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    # Per worker: two rounds of the even split (the first 1.0 s), three of a
    # pilot phase at 0.2 s, six of the final plan at 0.1 s.
    rounds = [(0, 32, 1.0), (0, 32, 0.3)] + [(1, 16, 0.2)] * 3 + [(2, 8, 0.1)] * 6
    records = []
    for worker in (0, 1):
        t = 0.0
        for step, (revision, batch, seconds) in enumerate(rounds):
            record = {"event": "round", "worker": worker, "step": step, "time": t,
                      "version": step, "batch_size": batch,
                      "plan_revision": revision, "round_s": seconds,
                      "compute_s": 0.02, "slowdown_s": 0.04}  # fmt: skip
            if step == 0:
                # Its first push went out 0.5 s (worker 1: 0.25 s) after its
                # compute ended.
                record.update(compute_end=0.1, pull_start=0.6 - 0.25 * worker)
            records.append(record)
            t += seconds
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    return tmp_path


def test_each_segment_before_the_final_plan_against_the_rounds_after(tmp_path):
    run = rb.read_run(_workdir(tmp_path))
    costs = rb.revision_costs(run)
    # The rounds after the final plan: 0.1 s (the first two there left out).
    assert [(c["revision"], c["batch"], c["rounds"]) for c in costs] == [
        (0, 32, 2),
        (1, 16, 3),
    ]
    assert costs[0]["seconds"] == pytest.approx(1.3)
    assert costs[0]["extra"] == pytest.approx(1.3 - 0.2)
    assert costs[1]["extra"] == pytest.approx(0.6 - 0.3)
    assert rb.first_push_waits(run) == pytest.approx([0.5, 0.25])
    text = rb.breakdown(run)
    assert (
        "rev  0 b=  32:   2 rounds  1.30 s, +1.10 s over the after-plan round" in text
    )
    assert "its first two rounds: 1.30 s" in text
    assert "first round's compute end to first push: 0.25-0.50 s" in text
