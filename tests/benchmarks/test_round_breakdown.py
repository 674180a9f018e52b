"""Tests of benchmarks/round_breakdown.py: a planned run's time per phase, on
records whose figures are checked by hand."""

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

# Per worker: (plan revision, batch, round seconds) per round: three rounds of
# the even split, two of the new plan still at 32 (its batch compiling), five
# at the new batch.
SCRIPT = {
    0: [(0, 32, 0.3)] * 3 + [(1, 32, 0.4)] * 2 + [(1, 16, 0.1)] * 5,
    1: [(0, 32, 0.3)] * 3 + [(1, 32, 0.4)] * 2 + [(1, 48, 0.1)] * 5,
}


def _workdir(tmp_path: pathlib.Path) -> pathlib.Path:
    records = []
    for worker, rounds in SCRIPT.items():
        t = 0.0
        for step, (revision, batch, seconds) in enumerate(rounds):
            records.append(
                {"event": "round", "worker": worker, "step": step, "time": t,
                 "version": step, "batch_size": batch, "plan_revision": revision,
                 "round_s": seconds, "compute_s": 0.02, "slowdown_s": 0.04,
                 "barrier_s": 0.01, "pull_s": 0.02, "server_s": 0.011,
                 "wait_s": 0.03, "encode_s": 0.0, "decode_s": 0.0}
            )  # fmt: skip
            t += seconds
    records += [
        {"event": "eval", "time": 0.0, "version": 0, "accuracy": 0.1},
        {"event": "eval", "time": 1.0, "version": 3, "accuracy": 0.5},
        {"event": "eval", "time": 2.0, "version": 8, "accuracy": 0.95},
        {"event": "replan", "time": 0.8, "revision": 1, "predicted_round_s": 0.09,
         "workers": [{"worker": 0, "batch_size": 16, "step_time": 0.05,
                      "transfer_seconds": 0.03}]},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records)
    )
    (tmp_path / "summary.json").write_text(json.dumps({"target_value": 0.9}))
    return tmp_path


def test_segments_mark_the_rounds_that_kept_the_last_batch(tmp_path):
    run = rb.read_run(_workdir(tmp_path))
    cut = rb.segments(run["rounds"]["0"])
    assert [(s["revision"], s["batch"], s["compiling"]) for s in cut] == [
        (0, 32, False),
        (1, 32, True),
        (1, 16, False),
    ]
    assert [s["rounds"] for s in cut] == [3, 2, 5]
    # 3 x 0.3 s, then 2 x 0.4 s: the new batch from 1.7 s.
    assert cut[1]["start"] == pytest.approx(0.9)
    assert cut[2]["start"] == pytest.approx(1.7)
    assert rb.pilot_end(run) == pytest.approx(1.7)
    assert len(rb.final_rounds(run["rounds"]["0"])) == 3
    assert rb.target_crossing(run) == (2.0, 8)


def test_the_breakdown_prints_the_pilots_cost_and_the_prediction(tmp_path):
    text = rb.breakdown(rb.read_run(_workdir(tmp_path)))
    # Five versions in 1.7 s before; (9 - 5) versions in (2.1 - 1.7) s after.
    assert "before: 1.70 s for 5 versions (2.9/s); after: 10.0 versions/s" in text
    assert "2 spans, 0.80-0.80 s each" in text
    # Version 8 at 10 a second from 0 s: 0.8 s, reached at 2.0 s.
    assert "at the after rate from the run's start: 0.8 s" in text
    assert "the pilot cost about 1.2 s" in text
    # Predicted 90 ms against the final rounds' 100 ms.
    assert "round: predicted 90 ms, measured mean 100 (median 100): -10%" in text
    # Worker 0's step: compute 20 + slowdown 40 ms; its link 100 - 60 - 10.
    assert "worker 0: batch 16 step predicted 50 ms, measured median 60" in text
    assert "measured round less step and barrier 30" in text


def test_a_workdir_without_rounds_is_a_one_line_error(tmp_path, capsys):
    assert rb.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("round_breakdown: no round records") and err.count("\n") == 1


def test_rounds_without_a_plan_are_one_segment():
    # A scheme without a plan (BSP) writes plan_revision None.
    rounds = [
        {"step": i, "time": 0.2 * i, "version": i, "batch_size": 32,
         "plan_revision": None, "round_s": 0.2}
        for i in range(4)
    ]  # fmt: skip
    (only,) = rb.segments(rounds)
    assert (only["revision"], only["batch"], only["rounds"]) == (0, 32, 4)
    assert only["end"] == pytest.approx(0.8)
