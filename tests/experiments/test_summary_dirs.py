"""experiments.summary reads any directory of hpsjax metrics files, by content."""

from __future__ import annotations

import json

import pytest

from experiments import summary


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rounds(worker, n, *, staleness=0):
    return [
        {
            "event": "round",
            "worker": worker,
            "step": i,
            "time": 0.5 * i,
            "round_s": 0.5,
            "wait_s": 0.1,
            "batch_size": 32,
            "staleness": staleness,
            "version": i,
            "loss": 1.0 / (i + 1),
        }
        for i in range(n)
    ]


def _launch_md_run(root):
    # As LAUNCH.md runs it: --metrics w0.jsonl on each worker, the server's file.
    _write(
        root / "w0.jsonl",
        [*_rounds(0, 4), {"event": "eval", "worker": 0, "time": 2.0, "version": 4,
                          "accuracy": 0.8, "loss": 0.5}],
    )  # fmt: skip
    _write(
        root / "w1.jsonl",
        [*_rounds(1, 2, staleness=1), {"event": "eval", "worker": 1, "time": 1.0,
                                       "version": 2, "accuracy": 0.6, "loss": 0.9}],
    )  # fmt: skip
    _write(root / "server.jsonl", [{"event": "server", "step": 6, "version": 6}])
    # Not hpsjax metrics: other JSON lines, and a text file.
    _write(root / "notes.jsonl", [{"comment": "tried lr 0.1"}])
    (root / "log.txt").write_text("hpsjax-worker: joined\n")


def test_metrics_files_are_found_by_content_not_name(tmp_path):
    _launch_md_run(tmp_path)
    names = [p.name for p in summary.metrics_files(tmp_path)]
    assert names == ["server.jsonl", "w0.jsonl", "w1.jsonl"]
    assert not summary.is_metrics_file(tmp_path / "notes.jsonl")
    assert not summary.is_metrics_file(tmp_path / "log.txt")


def test_summary_of_launch_md_files_has_every_worker_and_one_point_evals(tmp_path):
    _launch_md_run(tmp_path)
    result = summary.write_summary(tmp_path)
    table = result["table"]
    assert {w: row["rounds"] for w, row in table.items()} == {"0": 4, "1": 2}
    assert table["1"]["staleness_mean"] == 1.0
    assert result["paths"]["accuracy_plot"].is_file()
    assert result["paths"]["staleness_plot"].is_file()


def test_one_evaluation_per_worker_still_draws_a_visible_point(tmp_path, monkeypatch):
    # Each worker has one evaluation: a line of one point shows only its marker.
    from experiments import plots

    _launch_md_run(tmp_path)
    saved = []
    real = plots.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        saved.append(fig)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(plots.Figure, "savefig", savefig)
    summary.write_summary(tmp_path)
    (ax,) = saved[-1].axes
    lines = [line for line in ax.get_lines() if line.get_label() in
             ("worker 0", "worker 1")]  # fmt: skip
    assert len(lines) == 2
    for line in lines:
        assert len(line.get_xdata()) == 1
        assert line.get_marker() not in (None, "", "None", " ")


def test_workers_subdirectory_and_launcher_names_are_read(tmp_path):
    (tmp_path / "workers").mkdir()
    _write(tmp_path / "workers" / "metrics_0.jsonl", _rounds(0, 3))
    _write(tmp_path / "metrics_1.jsonl", _rounds(1, 5))
    table = summary.write_summary(tmp_path)["table"]
    assert {w: row["rounds"] for w, row in table.items()} == {"0": 3, "1": 5}


def test_an_experiments_metrics_jsonl_is_the_only_file_read(tmp_path):
    _write(tmp_path / "metrics.jsonl", _rounds(0, 2))
    _write(tmp_path / "w9.jsonl", _rounds(9, 2))
    assert summary.metrics_files(tmp_path) == [tmp_path / "metrics.jsonl"]


def test_a_diverged_worker_is_named_with_when(tmp_path, capsys):
    _write(
        tmp_path / "w0.jsonl",
        [*_rounds(0, 3), {"event": "diverged", "worker": 0, "step": 3, "time": 1.5,
                          "version": 3, "loss": None, "action": "stop"}],
    )  # fmt: skip
    assert summary.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "worker 0 diverged at t = 1.5 s (step 3, version 3, loss not finite)" in out


@pytest.mark.parametrize("content", [None, "notes"])
def test_a_directory_without_metrics_fails_in_one_line(tmp_path, capsys, content):
    if content:
        _write(tmp_path / "notes.jsonl", [{"comment": "no event"}])
    assert summary.main(["--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no hpsjax metrics files" in err
    assert summary.main(["--workdir", str(tmp_path / "missing")]) == 2
    assert "no directory" in capsys.readouterr().err
