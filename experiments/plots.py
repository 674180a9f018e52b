"""Plots: an evaluation metric against time and updates, and per-worker timelines.

The metric is the run's target metric (:mod:`experiments.target`): a
classifier's test accuracy, a language model's validation loss; the axis names
it (:func:`experiments.target.metric_label`).

Each plot draws on a :class:`matplotlib.figure.Figure` of its own and writes it
with the Agg renderer, so it works without a display and leaves pyplot's state
(and a notebook's inline backend) alone. Figures are laid out by matplotlib's
constrained layout with legends outside the axes, and can be written as PDF and
SVG beside the PNG (``formats=``) for a paper.

What makes them fit for a paper: every scheme shows its readable name
(:data:`SCHEME_NAMES`), every line has a marker as well as a colour, a panel
holds at most :data:`MAX_LINES` lines (more runs are drawn in several rows of
panels, the baseline repeated in each), the updates axis turns logarithmic when
the runs' numbers of updates differ tenfold (so BSP's few versions are not
squashed against the left edge), and a title is wrapped to the figure's width;
a description too long for a title goes to a caption file beside the figure
(``caption=``, written as ``<name>.caption.txt``).

``python -m experiments.plots --results results.json --out accuracy.png``
draws a comparison again from the ``results.json`` that
``experiments.compare`` wrote (its ``curves``), without the work directories.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib import patches
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from experiments import _cli
from experiments.target import Target, metric_label, with_initial_evaluation
from hpsjax._checks import check_int

__all__ = [
    "FORMATS",
    "MARKERS",
    "MAX_LINES",
    "SCHEME_NAMES",
    "TIMELINE_COLORS",
    "check_formats",
    "display_name",
    "line_groups",
    "main",
    "plot_accuracy",
    "plot_comparison",
    "plot_timeline",
    "seed_band",
]

FORMATS = ("png", "pdf", "svg")
"""The file formats a figure for a paper is written in."""

SCHEME_NAMES: Mapping[str, str] = {
    "bsp": "BSP",
    "asp": "ASP",
    "ssp": "SSP",
    "staleness_aware_asp": "staleness-aware ASP",
    "dc_asgd": "DC-ASGD",
    "local_sgd": "Local SGD",
    "saps": "SaPS",
    "hps": "H-PS",
    "adsp": "ADSP",
    "ashl": "ASHL",
    "ps_plus": "PS+",
    "ashl_reference": "ASHL (reference)",
    "diloco": "DiLoCo",
    "async_diloco": "Async DiLoCo",
    "ringmaster": "Ringmaster ASGD",
    "ringmaster_stop": "Ringmaster ASGD, stops",
    "naive_optimal": "naive optimal (m fastest)",
    "ringleader": "Ringleader ASGD",
    "clipped_asgd": "Clipped ASGD",
    "ormo": "OrMo",
    "ormo_da": "OrMo-DA",
    "sparseloco": "SparseLoCo",
    "muloco": "MuLoCo",
    "diloco_ef4": "DiLoCo, 4-bit EF",
    "muloco_f32": "MuLoCo, float32",
    "streaming_diloco": "Streaming DiLoCo",
    "asgd_momentum": "ASGD, naive momentum",
    "streaming_diloco_eager": "Streaming DiLoCo, eager",
    "demo": "DeMo",
    "diloco_delayed": "DiLoCo, delayed outer step",
    "halos": "HALoS",
}
"""The name a figure or table shows for each scheme of ``experiments.registry``."""

MAX_LINES = 8
"""The most lines a panel holds by default; more runs take more rows of panels."""

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
"""The markers of a figure's lines, in order (with the colours, they tell lines
apart in print and for readers who do not see colours)."""

# About this many markers on a line of many evaluations; every evaluation of a
# line of fewer has one (so a single evaluation still shows).
_MARKS_PER_LINE = 10
# The updates axis turns logarithmic when the runs' last versions differ by
# more than this factor.
_LOG_UPDATES_RATIO = 10.0

TIMELINE_COLORS: Mapping[str, str] = {
    "compute": "#2a9d8f",
    "transfer": "#e9c46a",
    "wait": "#e76f51",
    "discarded": "#8d99ae",
    "profile": "#6c5b7b",
    "compile": "#264653",
}
"""Colour of each kind of time in a timeline."""

_LABELS = {
    "compute": "compute",
    "transfer": "transfer (blocked on own messages)",
    "wait": "idle (waiting for the server)",
    "discarded": "discarded compute",
    "profile": "profiling",
    "compile": "compiling",
}
_X_LABELS = {"time": "time ({unit})", "version": "updates (server versions)"}
_BANDS = ("std", "minmax")


def display_name(scheme: str) -> str:
    """The readable name of a scheme (``"staleness-aware ASP"``), else itself."""
    return SCHEME_NAMES.get(scheme, scheme)


def line_groups(
    names: Sequence[str], max_lines: int = MAX_LINES, *, reference: str | None = None
) -> list[list[str]]:
    """Splits runs into groups of at most ``max_lines``, one group per panel row.

    Args:
      names: the runs, in the order they are drawn.
      max_lines: the most lines a group holds (at least 2 with a reference).
      reference: a run drawn in every group (the baseline, as ``"bsp"``), or
        ``None``.

    Returns:
      The groups, in order, each as even in size as the others: one group
      when all fit.

    Raises:
      ValueError: ``max_lines`` below 1 (2 with a reference), or a reference
        that is not one of ``names``.
    """
    names = list(names)
    least = 1 if reference is None else 2
    if not isinstance(max_lines, int) or max_lines < least:
        raise ValueError(f"max_lines must be an int >= {least}, got {max_lines!r}")
    if len(names) <= max_lines:
        return [names]
    if reference is not None and reference not in names:
        raise ValueError(f"reference {reference!r} is not one of the runs {names}")
    rest = [n for n in names if n != reference]
    per = max_lines - (reference is not None)
    count = math.ceil(len(rest) / per)
    size, extra = divmod(len(rest), count)
    groups, start = [], 0
    for i in range(count):
        end = start + size + (i < extra)
        chunk = rest[start:end]
        groups.append(chunk if reference is None else [reference, *chunk])
        start = end
    return groups


def _fit_title(fig: Figure, title: str, *, fontsize: float = 11.0) -> None:
    """The figure's title, wrapped onto as many lines as its width needs."""
    text = fig.suptitle(title, fontsize=fontsize)
    renderer = fig.canvas.get_renderer()
    width = fig.bbox.width * 0.96
    extent = text.get_window_extent(renderer).width
    if extent <= width:
        return
    chars = max(20, int(len(title) * width / extent))
    text.set_text("\n".join(textwrap.wrap(title, chars)))
    while text.get_window_extent(renderer).width > width and chars > 20:
        chars -= 4
        text.set_text("\n".join(textwrap.wrap(title, chars)))


def _write_caption(path: pathlib.Path, caption: str | None) -> None:
    if caption:
        path.with_suffix(".caption.txt").write_text(caption.strip() + "\n")


def check_formats(formats: Sequence[str]) -> None:
    """Raises ValueError unless ``formats`` are one or more of :data:`FORMATS`."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"formats must be some of {FORMATS}, got {list(formats)}")


def _save(
    fig: Figure,
    path: str | pathlib.Path,
    formats: Sequence[str],
    caption: str | None = None,
) -> pathlib.Path:
    path = pathlib.Path(path)
    check_formats(formats)
    for fmt in formats:
        fig.savefig(path.with_suffix(f".{fmt}"))
    _write_caption(path, caption)
    return path.with_suffix(f".{formats[0]}")


def _as_runs(value: Sequence[Any]) -> list[Sequence[Mapping[str, Any]]]:
    # One run (a list of evaluation records) or several (a list of such lists).
    if value and isinstance(value[0], Mapping):
        return [value]
    return list(value)


def _values(run: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """A run's ``key`` over its evaluations, a value that was not finite (in
    a record read back from JSON, ``None``) as NaN: a gap in the line."""
    return np.array(
        [np.nan if e.get(key) is None else e[key] for e in run], dtype=float
    )


def seed_band(
    runs: Sequence[Sequence[Mapping[str, Any]]],
    *,
    x: str = "time",
    band: str = "std",
    points: int = 241,
    metric: str = "accuracy",
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The mean of a metric over several runs, and a band around it, on one grid.

    Each run's ``metric`` is interpolated linearly between its evaluations and
    held at its last value after its end; the grid spans the longest run.

    Args:
      runs: the runs (one per seed), each a list of evaluation records with
        ``metric`` and ``x``.
      x: the record's key to plot against: ``"time"`` or ``"version"``.
      band: ``"std"`` (mean ± one standard deviation) or ``"minmax"``.
      points: the grid's size.
      metric: the record's key to average (``"accuracy"``, ``"loss"``, ...).

    Returns:
      ``(grid, mean, low, high)``.

    Raises:
      ValueError: no runs, a run without evaluations, or an unknown band.
    """
    if band not in _BANDS:
        raise ValueError(f"band must be one of {_BANDS}, got {band!r}")
    if not runs or any(not r for r in runs):
        raise ValueError("seed_band needs runs with evaluations")
    grid = np.linspace(0.0, max(r[-1][x] for r in runs), points)
    curves = np.array(
        [np.interp(grid, _values(r, x), _values(r, metric)) for r in runs]
    )
    mean = curves.mean(axis=0)
    if band == "std":
        std = curves.std(axis=0)
        return grid, mean, mean - std, mean + std
    return grid, mean, curves.min(axis=0), curves.max(axis=0)


def _style(index: int) -> dict[str, Any]:
    """Colour, marker and line style of the ``index``-th run of a figure."""
    # Ten colours, then darker ones drawn dashed; past 26 runs the colours
    # repeat and the marker and line style tell them apart.
    palette = [
        *matplotlib.colormaps["tab10"].colors,
        *matplotlib.colormaps["Dark2"].colors,
        *matplotlib.colormaps["Set1"].colors[:8],
    ]
    return {
        "color": palette[index % len(palette)],
        "marker": MARKERS[index % len(MARKERS)],
        "linestyle": ("-", "--", ":")[min(index // 10, 2)],
    }


def _draw_metric(
    ax,
    runs,
    *,
    x: str,
    band: str,
    target: float | None,
    styles=None,
    metric: str = "accuracy",
) -> list:
    lines = []
    for i, (label, value) in enumerate(runs.items()):
        seeds = _as_runs(value)
        if not seeds or any(not r for r in seeds):
            raise ValueError(f"run {label!r} has no evaluations to plot")
        style = _style(i) if styles is None else styles[label]
        if len(seeds) == 1:
            xs = _values(seeds[0], x)
            ys = _values(seeds[0], metric)
        else:
            xs, ys, low, high = seed_band(seeds, x=x, band=band, metric=metric)
            ax.fill_between(
                xs, low, high, color=style["color"], alpha=0.18, linewidth=0
            )
        # Every point of a short line; else evenly spaced along the drawn line
        # (a share of the axes' diagonal), on a linear axis as on a log one.
        marks = 1 if len(xs) <= _MARKS_PER_LINE else 1.0 / _MARKS_PER_LINE
        (line,) = ax.plot(
            xs,
            ys,
            **style,
            markevery=marks,
            markersize=4.5,
            linewidth=1.4,
            label=display_name(label),
        )
        lines.append(line)
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=0.8)
        ax.annotate(
            f"target {target:g}",
            xy=(0.0, target),
            xycoords=("axes fraction", "data"),
            xytext=(4, -10),
            textcoords="offset points",
            fontsize=8,
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1},
        )
    if metric == "accuracy":
        ax.set_ylim(0.0, 1.0)
    elif metric in _FALLING:
        _leave_divergence_out(ax, lines)
    ax.grid(True, alpha=0.3)
    if x == "version":
        _updates_scale(ax, runs)
    return lines


# Metrics a run starts high on and lowers: a diverged run leaves upwards.
_FALLING = ("loss", "perplexity")


def _leave_divergence_out(ax, lines) -> None:
    """Axes that stop a little above the highest starting value when a run
    went past it (a diverged run's 1e13 would flatten every other curve)."""
    firsts, finite = [], []
    for line in lines:
        ys = np.asarray(line.get_ydata(), dtype=float)
        ys = ys[np.isfinite(ys)]
        if ys.size:
            firsts.append(ys[0])
            finite.append(ys)
    if not finite:
        return
    values = np.concatenate(finite)
    top, low = max(firsts), float(values.min())
    if values.max() > top + 0.05 * (top - low):
        pad = 0.05 * (top - low) or 0.05
        ax.set_ylim(low - pad, top + pad)


def _updates_scale(ax, runs) -> None:
    """A logarithmic updates axis where the runs' versions differ tenfold."""
    last = [
        max(e["version"] for r in _as_runs(value) for e in r) for value in runs.values()
    ]
    if min(last) > 0 and max(last) / min(last) > _LOG_UPDATES_RATIO:
        ax.set_xscale("symlog", linthresh=1.0, linscale=1.0)
        ax.set_xlim(left=0.0)
        ax.set_xlabel(_X_LABELS["version"] + ", log scale")


def _check_runs(runs, what: str) -> None:
    if not runs:
        raise ValueError(f"{what} needs at least one run")
    for label, value in runs.items():
        seeds = _as_runs(value)
        if not seeds or any(not r for r in seeds):
            raise ValueError(f"run {label!r} has no evaluations to plot")


def _reference(runs, reference: str | None) -> str | None:
    if reference is not None:
        return reference
    return "bsp" if "bsp" in runs else None


def plot_accuracy(
    runs: Mapping[str, Sequence[Any]],
    path: str | pathlib.Path,
    *,
    target: float | None = None,
    title: str = "",
    time_unit: str = "s",
    x: str = "time",
    band: str = "std",
    formats: Sequence[str] = ("png",),
    max_lines: int = MAX_LINES,
    caption: str | None = None,
    metric: str = "accuracy",
) -> pathlib.Path:
    """Plots test accuracy (or another metric) against time or updates of one
    or several runs.

    Args:
      runs: label (a scheme name, shown by :func:`display_name`) -> its
        evaluation records (dicts with ``time``, ``version`` and
        ``metric``), or a list of such lists, one per seed: then the mean
        is drawn with a band (see :func:`seed_band`).
      path: the file to write; its suffix is replaced by each format's.
      target: a target value of ``metric`` to draw as a dashed line, or
        ``None``.
      title: the figure title, wrapped to the figure's width.
      time_unit: the unit of ``time`` for the axis label.
      x: ``"time"`` or ``"version"`` (server updates).
      band: ``"std"`` or ``"minmax"`` over seeds.
      formats: some of :data:`FORMATS`; the first is the path returned.
      max_lines: the most lines in one panel; more runs are drawn in several
        panels, one above the other (:func:`line_groups`).
      caption: text written to ``<path>.caption.txt`` beside the figure.
      metric: the records' metric drawn: ``"accuracy"`` (on a 0-1 axis),
        ``"loss"``, ...

    Returns:
      The path written in the first format.

    Raises:
      ValueError: no runs, a run without evaluations, or a bad ``x``,
        ``band``, ``max_lines`` or format.
    """
    _check_runs(runs, "plot_accuracy")
    if x not in _X_LABELS:
        raise ValueError(f"x must be one of {sorted(_X_LABELS)}, got {x!r}")
    check_formats(formats)
    groups = line_groups(list(runs), max_lines)
    styles = {label: _style(i) for i, label in enumerate(runs)}
    fig = Figure(figsize=(7.5, 0.8 + 3.4 * len(groups)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, sharex=True, squeeze=False)[:, 0]
    for ax, group in zip(axes, groups, strict=True):
        _draw_metric(
            ax,
            {k: runs[k] for k in group},
            x=x,
            band=band,
            target=target,
            styles=styles,
            metric=metric,
        )
        ax.set_ylabel(metric_label(metric))
        ax.legend(
            loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False
        )
    if not axes[-1].get_xlabel():
        axes[-1].set_xlabel(_X_LABELS[x].format(unit=time_unit))
    if title:
        _fit_title(fig, title)
    return _save(fig, path, formats, caption)


def plot_comparison(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    path: str | pathlib.Path,
    *,
    target: float | None = None,
    title: str = "",
    time_unit: str = "s",
    band: str = "std",
    formats: Sequence[str] = FORMATS,
    max_lines: int = MAX_LINES,
    reference: str | None = None,
    caption: str | None = None,
    metric: str = "accuracy",
) -> pathlib.Path:
    """One setting's schemes: a metric (test accuracy by default) against time
    and against updates.

    Two panels side by side share the metric's axis and a legend, outside them
    on the right; with several seeds a scheme is its mean and a band. More
    schemes than ``max_lines`` take several rows of such panels, each with the
    reference scheme (BSP where it ran) and an even share of the others; a
    scheme keeps its colour and marker in every row.

    Args:
      runs: scheme -> its runs, one list of evaluation records per seed.
      path: the file to write; its suffix is replaced by each format's.
      target: a target value of ``metric`` to draw as a dashed line, or
        ``None``.
      title: the figure title (the setting), wrapped to the figure's width.
      time_unit: the unit of ``time`` for the axis label.
      band: ``"std"`` or ``"minmax"`` over seeds.
      formats: some of :data:`FORMATS`; the first is the path returned.
      max_lines: the most lines in one panel.
      reference: the scheme drawn in every row; by default ``"bsp"`` where it
        ran.
      caption: text written to ``<path>.caption.txt`` beside the figure (a
        setting's description, too long for a title).
      metric: the records' metric drawn (``"accuracy"``, ``"loss"``, ...).

    Returns:
      The path written in the first format.

    Raises:
      ValueError: no runs, a run without evaluations, or a bad band,
        ``max_lines``, reference or format.
    """
    _check_runs(runs, "plot_comparison")
    check_formats(formats)
    groups = line_groups(list(runs), max_lines, reference=_reference(runs, reference))
    styles = {label: _style(i) for i, label in enumerate(runs)}
    fig = Figure(figsize=(11.0, 0.8 + 3.4 * len(groups)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    panels = fig.subplots(len(groups), 2, sharey=True, squeeze=False)
    seeds = max(len(_as_runs(v)) for v in runs.values())
    for (by_time, by_updates), group in zip(panels, groups, strict=True):
        chosen = {k: runs[k] for k in group}
        drawn = {"band": band, "target": target, "styles": styles, "metric": metric}
        lines = _draw_metric(by_time, chosen, x="time", **drawn)
        _draw_metric(by_updates, chosen, x="version", **drawn)
        by_time.set_ylabel(metric_label(metric))
        by_updates.legend(
            handles=lines,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            fontsize=8,
            frameon=False,
            title=f"mean ± {'std' if band == 'std' else 'min-max'}, {seeds} seeds"
            if seeds > 1
            else None,
            title_fontsize=8,
        )
    panels[-1][0].set_xlabel(_X_LABELS["time"].format(unit=time_unit))
    if not panels[-1][1].get_xlabel():
        panels[-1][1].set_xlabel(_X_LABELS["version"])
    if title:
        _fit_title(fig, title)
    return _save(fig, path, formats, caption)


def _auto_window(
    timelines: Mapping[Any, Sequence[Sequence[Any]]], spans: int = 60
) -> tuple[float, float]:
    """From the end of profiling, enough time for about ``spans`` spans."""
    starts = [
        next((s[0] for s in line if s[2] != "profile"), line[-1][1])
        for line in timelines.values()
        if line
    ]
    start = max(starts, default=0.0)
    end = max((line[-1][1] for line in timelines.values() if line), default=1.0)
    busiest = max(
        ([s[1] for s in line if s[0] >= start] for line in timelines.values()),
        key=len,
    )
    if len(busiest) <= spans:
        return (0.0, end)
    return (start, busiest[spans - 1])


def _draw_bars(ax, timelines, window, used: set[str]) -> None:
    for row, worker in enumerate(timelines):
        bars: dict[str, list[tuple[float, float]]] = {}
        for start, end, kind in timelines[worker]:
            start, end = max(start, window[0]), min(end, window[1])
            if end > start:
                bars.setdefault(kind, []).append((start, end - start))
        for kind, spans in bars.items():
            ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=TIMELINE_COLORS[kind])
            used.add(kind)
    ax.set_yticks(range(len(timelines)))
    ax.set_yticklabels([f"worker {w}" for w in timelines])
    ax.set_ylim(len(timelines) - 0.5, -0.5)
    ax.set_xlim(*window)


def _idle_shares(timelines, edges: np.ndarray) -> np.ndarray:
    """Per worker and bin, the share of the bin's time not spent computing."""
    shares = np.zeros((len(timelines), len(edges) - 1))
    for row, spans in enumerate(timelines.values()):
        for start, end, kind in spans:
            if kind == "compute":
                continue
            overlap = np.minimum(edges[1:], end) - np.maximum(edges[:-1], start)
            shares[row] += np.clip(overlap, 0.0, None)
    return shares / np.diff(edges)


def _mark(ax, marks, window, *, labels: bool) -> None:
    for time, label in marks:
        if window[0] <= time <= window[1]:
            ax.axvline(time, color="black", linestyle="--", linewidth=1.0)
            if labels:
                ax.annotate(
                    label,
                    xy=(time, 0.0),
                    xycoords=("data", "axes fraction"),
                    xytext=(3, 3),
                    textcoords="offset points",
                    fontsize=7,
                    rotation=90,
                    va="bottom",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
                )


def plot_timeline(
    timelines: Mapping[Any, Sequence[Sequence[Any]]],
    path: str | pathlib.Path,
    *,
    title: str = "",
    time_unit: str = "s",
    window: tuple[float, float] | None = None,
    marks: Sequence[tuple[float, str]] = (),
    formats: Sequence[str] = ("png",),
) -> pathlib.Path:
    """Draws each worker's time as bars of compute, transfer, wait and the rest.

    A run too long to read as bars is drawn in two panels: the whole run as
    each worker's idle share per bin (a heat map), with the window shaded, and
    below it the window's bars.

    Args:
      timelines: worker id -> ``(start, end, kind)`` spans (kinds of
        :data:`TIMELINE_COLORS`) in time order.
      path: the file to write; its suffix is replaced by each format's.
      title: the figure title.
      time_unit: unit of the times, for the axis label.
      window: ``(start, end)`` of the time drawn as bars; by default, from the
        end of profiling, about 60 spans of the busiest worker (the whole run
        if it is that short).
      marks: ``(time, label)`` events drawn as vertical lines, such as a
        stage switch or a re-plan.
      formats: some of :data:`FORMATS`; the first is the path returned.

    Returns:
      The path written in the first format.

    Raises:
      ValueError: no workers, a span of unknown kind, or an empty window.
    """
    if not timelines:
        raise ValueError("plot_timeline needs at least one worker")
    kinds = {span[2] for line in timelines.values() for span in line}
    if kinds - set(TIMELINE_COLORS):
        raise ValueError(
            f"unknown timeline kind {sorted(kinds - set(TIMELINE_COLORS))[0]!r}; "
            f"valid: {sorted(TIMELINE_COLORS)}"
        )
    end = max((line[-1][1] for line in timelines.values() if line), default=1.0)
    window = _auto_window(timelines) if window is None else tuple(window)
    if not window[1] > window[0]:
        raise ValueError(f"window must be (start, end) with end > start: {window}")
    whole = window[0] <= 0.0 and window[1] >= end
    height = 0.32 * len(timelines)
    fig = Figure(
        figsize=(9.0, 1.1 + height * (1 if whole else 2)),
        dpi=110,
        layout="constrained",
    )
    FigureCanvasAgg(fig)
    used: set[str] = set()
    if whole:
        detail = fig.subplots()
    else:
        overview, detail = fig.subplots(2, 1)
        # Bins of about an eighth of the window: wide enough to average over
        # several rounds, so the overview reads as a trend, not a barcode.
        bins = int(np.clip(round(8 * end / (window[1] - window[0])), 10, 120))
        edges = np.linspace(0.0, end, bins + 1)
        image = overview.imshow(
            _idle_shares(timelines, edges),
            aspect="auto",
            extent=(0.0, end, len(timelines) - 0.5, -0.5),
            cmap="Reds",
            vmin=0.0,
            vmax=1.0,
            interpolation="nearest",
        )
        overview.axvspan(*window, fill=False, edgecolor="black", linewidth=1.2)
        overview.set_yticks(range(len(timelines)))
        overview.set_yticklabels([f"worker {w}" for w in timelines])
        overview.set_title("whole run: idle share of the time", fontsize=9)
        fig.colorbar(image, ax=overview, label="idle", pad=0.01, aspect=12)
        _mark(overview, marks, (0.0, end), labels=True)
        detail.set_title(
            f"window {window[0]:.3g}-{window[1]:.3g} {time_unit}", fontsize=9
        )
    _draw_bars(detail, timelines, window, used)
    _mark(detail, marks, window, labels=whole)
    detail.set_xlabel(f"time ({time_unit})")
    handles = [
        patches.Patch(color=TIMELINE_COLORS[k], label=_LABELS[k])
        for k in TIMELINE_COLORS
        if k in used
    ]
    fig.legend(
        handles=handles,
        fontsize=8,
        loc="outside lower center",
        ncol=len(handles),
        frameon=False,
    )
    if title:
        fig.suptitle(title)
    return _save(fig, path, formats)


def _runs_of_results(
    results: Mapping[str, Any], source: str = "it"
) -> dict[str, list[list[dict]]]:
    """Scheme -> its runs' evaluation records, from a ``results.json`` (its
    curves hold its ``"metric"``, test accuracy in one written before)."""
    curves = results.get("curves")
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError(
            f"{source} holds no curves (an older results.json, written before "
            "experiments.compare kept them, cannot be drawn again)"
        )
    metric = results.get("metric", "accuracy")
    return {
        scheme: [
            with_initial_evaluation(
                [{"time": t, "version": v, metric: a} for t, v, a in seed]
            )
            for seed in seeds
        ]
        for scheme, seeds in curves.items()
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.plots``: a comparison drawn again from its
    ``results.json``; returns the exit status."""
    p = _cli.Parser(
        "experiments.plots",
        description="Draws a comparison again from the results.json that "
        "experiments.compare wrote: the target's metric against time and updates.",
    )
    p.add_argument("--results", required=True, help="a results.json")
    p.add_argument(
        "--out", required=True, help="the figure's path (PNG, and PDF and SVG)"
    )
    p.add_argument(
        "--title", help="the figure's title (default: the suite and backend)"
    )
    p.add_argument(
        "--caption",
        help="the caption file's text (default: the suite's description)",
    )
    p.add_argument(
        "--schemes", type=_cli.comma_list, help="the schemes to draw, comma-separated"
    )
    p.add_argument(
        "--max_lines", type=int, default=MAX_LINES, help="the most lines drawn"
    )
    p.add_argument(
        "--formats",
        type=_cli.comma_list,
        default=list(FORMATS),
        help=f"the files written, some of {','.join(FORMATS)}",
    )
    args = p.parse_args(argv)
    with _cli.usage_errors("experiments.plots"):
        try:
            check_formats(args.formats)
        except ValueError as e:
            raise ValueError(f"--formats: {e}") from None
        check_int("--max_lines", args.max_lines, low=1)
    try:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        results = json.loads(pathlib.Path(args.results).read_text())
        if not isinstance(results, Mapping):
            raise ValueError(f"{args.results} is not a results object")
        runs = _runs_of_results(results, args.results)
        if args.schemes:
            chosen = args.schemes
            unknown = [s for s in chosen if s not in runs]
            if unknown:
                raise ValueError(f"no scheme {unknown[0]!r}; it has {list(runs)}")
            runs = {s: runs[s] for s in chosen}
        summaries = results.get("summaries") or [{}]
        backend = summaries[0].get("backend", "sim")
        suite = results.get("suite", "")
        description = args.caption
        if description is None:
            from experiments.configs.suites import SUITES

            description = getattr(SUITES.get(suite), "description", "") or None
        first = summaries[0]
        target = Target.of_summary(first) if "target_accuracy" in first else None
        path = plot_comparison(
            runs,
            args.out,
            target=None if target is None else target.value,
            metric=results.get("metric", "accuracy"),
            title=args.title or f"{suite} ({backend})",
            time_unit="virtual s" if backend == "sim" else "s",
            max_lines=args.max_lines,
            caption=description,
            formats=tuple(args.formats),
        )
    except (OSError, ValueError) as e:
        print(f"experiments.plots: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
