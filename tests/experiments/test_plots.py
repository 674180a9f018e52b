"""The figures of ``experiments.plots``: files, bands over seeds, legends, windows."""

from __future__ import annotations

import pytest
from matplotlib.collections import PolyCollection

from experiments import plots


def _run(offset: float, points: int = 6) -> list[dict]:
    return [
        {"time": float(t), "version": 3 * t, "accuracy": min(1.0, 0.1 * t + offset)}
        for t in range(points)
    ]


def _figure_of(monkeypatch):
    """Calls to Figure.savefig, recorded: the figure and the path."""
    saved = []
    real = plots.Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        saved.append((fig, path))
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(plots.Figure, "savefig", savefig)
    return saved


def _legends(fig):
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def test_comparison_writes_png_pdf_and_svg(tmp_path):
    path = plots.plot_comparison(
        {"bsp": [_run(0.0), _run(0.1)]}, tmp_path / "cmp.png", target=0.5
    )
    assert path == tmp_path / "cmp.png"
    assert path.read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "cmp.pdf").read_bytes().startswith(b"%PDF")
    assert b"<svg" in (tmp_path / "cmp.svg").read_bytes()[:1000]


def test_comparison_draws_a_band_per_scheme_of_several_seeds(tmp_path, monkeypatch):
    saved = _figure_of(monkeypatch)
    plots.plot_comparison(
        {"bsp": [_run(0.0), _run(0.2)], "hps": [_run(0.1)]},
        tmp_path / "cmp.png",
        formats=("png",),
    )
    fig = saved[-1][0]
    by_time, by_updates = fig.axes
    for ax in (by_time, by_updates):
        bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
        assert len(bands) == 1  # bsp has two seeds, hps one: no band for hps
    # Against updates the x axis runs over the versions, against time over time.
    assert by_updates.get_xlim()[1] > by_time.get_xlim()[1]


def test_legend_is_outside_the_axes_and_names_are_readable(tmp_path, monkeypatch):
    saved = _figure_of(monkeypatch)
    plots.plot_comparison(
        {"staleness_aware_asp": [_run(0.0)], "ps_plus": [_run(0.1)]},
        tmp_path / "cmp.png",
        formats=("png",),
    )
    fig = saved[-1][0]
    renderer = fig.canvas.get_renderer()
    (legend,) = _legends(fig)
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer))
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["staleness-aware ASP", "PS+"]


def test_band_is_std_or_min_max():
    runs = [
        [{"time": 0.0, "accuracy": 0.0}, {"time": 2.0, "accuracy": 1.0}],
        [{"time": 0.0, "accuracy": 0.2}, {"time": 2.0, "accuracy": 0.6}],
    ]
    grid, mean, low, high = plots.seed_band(runs, band="minmax", points=3)
    assert list(grid) == [0.0, 1.0, 2.0]
    assert list(mean) == pytest.approx([0.1, 0.45, 0.8])
    assert list(low) == pytest.approx([0.0, 0.4, 0.6])
    assert list(high) == pytest.approx([0.2, 0.5, 1.0])
    _, mean, low, high = plots.seed_band(runs, band="std", points=3)
    assert list(high - mean) == pytest.approx([0.1, 0.05, 0.2])
    with pytest.raises(ValueError, match="band must be one of"):
        plots.seed_band(runs, band="iqr")
    with pytest.raises(ValueError, match="runs with evaluations"):
        plots.seed_band([[]])


def test_bad_formats_are_refused(tmp_path):
    with pytest.raises(ValueError, match="formats must be some of"):
        plots.plot_accuracy({"a": _run(0.0)}, tmp_path / "a.png", formats=("jpg",))
    assert not any(tmp_path.iterdir())


def _rounds(workers: int, rounds: int, step: float = 0.1) -> dict:
    timelines = {}
    for w in range(workers):
        spans = [(0.0, 1.0, "profile")]
        for r in range(rounds):
            start = 1.0 + r * step
            spans.append((start, start + step / (w + 1), "compute"))
            spans.append((start + step / (w + 1), start + step, "wait"))
        timelines[w] = spans
    return timelines


def test_long_timeline_is_windowed_with_an_overview_and_marks(tmp_path, monkeypatch):
    saved = _figure_of(monkeypatch)
    plots.plot_timeline(
        _rounds(3, 400),
        tmp_path / "tl.png",
        marks=[(5.0, "re-plan 1"), (30.0, "stage 2")],
    )
    fig = saved[-1][0]
    overview, detail = fig.axes[:2]
    assert overview.get_xlim() == pytest.approx((0.0, 41.0))
    start, end = detail.get_xlim()
    # From the end of profiling, about 60 spans (30 rounds) of a worker.
    assert start == pytest.approx(1.0) and end == pytest.approx(4.0)
    marked = [line.get_xdata()[0] for line in overview.lines]
    assert marked == [5.0, 30.0]
    texts = [t.get_text() for t in overview.texts]
    assert texts == ["re-plan 1", "stage 2"]
    # The legend sits right under the bars, not far below them.
    renderer = fig.canvas.get_renderer()
    gap = detail.get_tightbbox(renderer).y0 - fig.legends[0].get_window_extent().y1
    assert 0 <= gap < 20


def test_short_timeline_is_one_panel_and_window_is_honoured(tmp_path, monkeypatch):
    saved = _figure_of(monkeypatch)
    plots.plot_timeline(_rounds(2, 10), tmp_path / "tl.png")
    assert len(saved[-1][0].axes) == 1
    plots.plot_timeline(_rounds(2, 400), tmp_path / "tl.png", window=(10.0, 12.0))
    assert saved[-1][0].axes[1].get_xlim() == (10.0, 12.0)
    with pytest.raises(ValueError, match="end > start"):
        plots.plot_timeline(_rounds(2, 10), tmp_path / "tl.png", window=(3.0, 3.0))
    with pytest.raises(ValueError, match="unknown timeline kind 'nap'"):
        plots.plot_timeline({0: [(0.0, 1.0, "nap")]}, tmp_path / "tl.png")


def _loss_run(losses) -> list[dict]:
    return [
        {"time": float(t), "version": 3 * t, "loss": v} for t, v in enumerate(losses)
    ]


def test_a_diverged_loss_leaves_the_scale_to_the_others(tmp_path, monkeypatch):
    saved = _figure_of(monkeypatch)
    plots.plot_comparison(
        {
            "bsp": [_loss_run([5.5, 4.0, 3.2, 2.9, 2.7])],
            "ssp": [_loss_run([5.5, 4.5, 9.0, 2.5e13, float("nan")])],
        },
        tmp_path / "cmp.png",
        formats=("png",),
        metric="loss",
        target=3.0,
    )
    by_time, _ = saved[-1][0].axes
    low, high = by_time.get_ylim()
    # Up to a little above the start (5.5), down to the lowest loss (2.7).
    assert 5.5 < high < 6.0 and 2.5 < low < 2.7
    # Without a diverged run, matplotlib's own scale is kept.
    plots.plot_comparison(
        {"bsp": [_loss_run([5.5, 4.0, 3.2, 2.9, 2.7])]},
        tmp_path / "one.png",
        formats=("png",),
        metric="loss",
    )
    assert saved[-1][0].axes[0].get_ylim()[1] < 6.0
