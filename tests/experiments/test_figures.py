"""Figures fit for a paper: readable names, markers, at most eight lines a panel,
titles inside the figure, an updates axis that does not squash BSP, t = 0."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.colors import to_hex

from experiments import plots, registry, train

LONG_TITLE = (
    "suite sim32: 32 simulated workers, 8 each at slowdowns 1, 2.06, 2.63, 6.73 "
    "(the ResNet-50 training throughputs of A100 AMP, V100 AMP, A100 TF32 and "
    "V100 FP32 in NVIDIA's DeepLearningExamples), sim8's data (sim)"
)


def _run(scheme_index: int, updates_per_s: float, points: int = 41) -> list[dict]:
    return [
        {
            "time": float(t),
            "version": int(updates_per_s * t),
            "accuracy": min(0.95, 0.1 + 0.02 * t * (1 + scheme_index / 10)),
        }
        for t in range(points)
    ]


def _every_scheme() -> dict[str, list[list[dict]]]:
    # BSP makes few updates, the asynchronous schemes many: as in sim8.
    return {
        s: [_run(i, 3.0 if s == "bsp" else 90.0), _run(i, 3.0 if s == "bsp" else 88.0)]
        for i, s in enumerate(registry.SCHEMES)
    }


@pytest.fixture
def saved(monkeypatch):
    figures = []
    real = plots.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        figures.append(fig)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(plots.Figure, "savefig", savefig)
    return figures


def _scheme_lines(ax):
    # The runs' lines (the target is a line without a label of its own).
    return [line for line in ax.get_lines() if not line.get_label().startswith("_")]


def _legend_labels(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    return [t.get_text() for lg in legends if lg for t in lg.get_texts()]


def test_every_scheme_has_a_readable_name():
    for scheme in registry.SCHEMES:
        assert scheme in plots.SCHEME_NAMES, scheme
    assert plots.display_name("ashl_reference") == "ASHL (reference)"
    assert plots.display_name("diloco") == "DiLoCo"
    assert plots.display_name("async_diloco") == "Async DiLoCo"


def test_comparison_of_every_scheme_has_at_most_eight_marked_lines_a_panel(
    tmp_path, saved
):
    runs = _every_scheme()
    plots.plot_comparison(runs, tmp_path / "all.png", target=0.9, formats=("png",))
    fig = saved[-1]
    rows = plots.line_groups(list(runs), reference="bsp")
    assert len(rows) >= 2 and len(fig.axes) == 2 * len(rows)  # (time, updates)
    drawn = set()
    colors: dict[str, set] = {}
    for ax in fig.axes:
        lines = _scheme_lines(ax)
        assert 2 <= len(lines) <= plots.MAX_LINES
        labels = [line.get_label() for line in lines]
        assert labels[0] == "BSP"  # the baseline in every row
        for line in lines:
            assert line.get_marker() not in (None, "", "None", " ")
            colors.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
        drawn.update(labels)
    names = {plots.display_name(s) for s in runs}
    assert drawn == names
    assert all(len(c) == 1 for c in colors.values())  # one colour per scheme
    assert set(_legend_labels(fig)) == names
    assert not any(label in registry.SCHEMES for label in _legend_labels(fig))


def test_markers_tell_apart_lines_that_share_a_colour(tmp_path, saved):
    runs = {f"s{i}": [_run(i, 10.0)] for i in range(12)}
    plots.plot_accuracy(runs, tmp_path / "a.png", max_lines=12)
    styles = {(to_hex(line.get_color()), line.get_marker(), line.get_linestyle())
              for line in _scheme_lines(saved[-1].axes[0])}  # fmt: skip
    assert len(styles) == 12


def test_a_long_title_is_wrapped_inside_the_figure(tmp_path, saved):
    plots.plot_comparison(
        {"bsp": [_run(0, 3.0)], "asp": [_run(1, 90.0)]},
        tmp_path / "t.png",
        title=LONG_TITLE,
        formats=("png",),
    )
    fig = saved[-1]
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle
    box = title.get_window_extent(renderer)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    assert box.y1 <= fig.bbox.height
    assert title.get_text().replace("\n", " ") == LONG_TITLE
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))
    for legend in (ax.get_legend() for ax in fig.axes):
        if legend:
            assert not box.overlaps(legend.get_window_extent(renderer))


def test_a_caption_goes_beside_the_figure(tmp_path):
    path = plots.plot_comparison(
        {"bsp": [_run(0, 3.0)]},
        tmp_path / "c.png",
        title="sim32 (sim)",
        caption=LONG_TITLE,
        formats=("png",),
    )
    assert (tmp_path / "c.caption.txt").read_text() == LONG_TITLE + "\n"
    assert path.is_file()


def test_updates_axis_does_not_squash_bsp_against_the_left_edge(tmp_path, saved):
    plots.plot_comparison(
        {"bsp": [_run(0, 3.0)], "asp": [_run(1, 90.0)]},
        tmp_path / "u.png",
        formats=("png",),
    )
    by_updates = saved[-1].axes[1]
    assert by_updates.get_xscale() == "symlog"
    assert "log scale" in by_updates.get_xlabel()
    bsp = _scheme_lines(by_updates)[0]
    last = bsp.get_xdata()[-1]
    # Where BSP's last update sits, as a share of the axis' width.
    x, _ = by_updates.transLimits.transform(
        (by_updates.xaxis.get_transform().transform(last), 0.5)
    )
    assert x > 0.4
    # Runs of like numbers of updates keep a linear axis.
    plots.plot_comparison(
        {"bsp": [_run(0, 3.0)], "ssp": [_run(1, 6.0)]},
        tmp_path / "v.png",
        formats=("png",),
    )
    assert saved[-1].axes[1].get_xscale() == "linear"


def test_line_groups():
    names = [f"s{i}" for i in range(14)]
    assert plots.line_groups(names[:8]) == [names[:8]]
    groups = plots.line_groups(names, 8, reference="s0")
    assert [len(g) for g in groups] == [8, 7]
    assert all(g[0] == "s0" for g in groups)
    assert sorted(n for g in groups for n in g[1:]) == sorted(names[1:])
    assert [len(g) for g in plots.line_groups(names, 5)] == [5, 5, 4]
    with pytest.raises(ValueError, match="max_lines"):
        plots.line_groups(names, 1, reference="s0")
    with pytest.raises(ValueError, match="reference"):
        plots.line_groups(names, 4, reference="bsp")


def test_an_evaluation_at_time_zero_is_added_after_profiling():
    evals = [
        {"time": 1.25, "version": 0, "accuracy": 0.1},
        {"time": 1.75, "version": 3, "accuracy": 0.2},
    ]
    out = train.with_initial_evaluation(evals)
    assert out[0] == {"time": 0.0, "version": 0, "accuracy": 0.1}
    assert out[1:] == evals
    assert train.with_initial_evaluation(out) == out
    later = [{"time": 2.0, "version": 5, "accuracy": 0.3}]
    assert train.with_initial_evaluation(later) == later


def test_a_comparison_is_drawn_again_from_its_results_json(tmp_path, saved, capsys):
    runs = _every_scheme()
    results = {
        "suite": "sim8",
        "seeds": [1, 2],
        "summaries": [{"backend": "sim", "target_accuracy": 0.9}],
        "curves": {
            s: [[[e["time"] + 1.0 * (s == "hps"), e["version"], e["accuracy"]]
                 for e in seed] for seed in seeds]
            for s, seeds in runs.items()
        },
    }  # fmt: skip
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = tmp_path / "again.png"
    assert plots.main(["--results", str(tmp_path / "results.json"),
                       "--out", str(out), "--schemes", "bsp,hps,asp"]) == 0  # fmt: skip
    assert out.is_file() and (tmp_path / "again.svg").is_file()
    assert (tmp_path / "again.caption.txt").read_text().startswith("8 simulated")
    fig = saved[-1]
    hps = next(x for x in _scheme_lines(fig.axes[0]) if x.get_label() == "H-PS")
    assert np.min(hps.get_xdata()) == 0.0  # its t = 0 evaluation, added
    (tmp_path / "old.json").write_text(json.dumps({"suite": "sim8", "summaries": []}))
    assert plots.main(["--results", str(tmp_path / "old.json"),
                       "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no curves" in err
