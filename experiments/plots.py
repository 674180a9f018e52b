"""Plots: test accuracy against time and updates, and per-worker timelines.

Each plot draws on a :class:`matplotlib.figure.Figure` of its own and writes it
with the Agg renderer, so it works without a display and leaves pyplot's state
(and a notebook's inline backend) alone. Figures are laid out by matplotlib's
constrained layout with legends outside the axes, and can be written as PDF and
SVG beside the PNG (``formats=``) for a paper.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib import patches
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = [
    "FORMATS",
    "SCHEME_NAMES",
    "TIMELINE_COLORS",
    "display_name",
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
}
"""The name a figure shows for each scheme of ``experiments.registry``."""

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


def _save(
    fig: Figure, path: str | pathlib.Path, formats: Sequence[str]
) -> pathlib.Path:
    path = pathlib.Path(path)
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"formats must be some of {FORMATS}, got {list(formats)}")
    for fmt in formats:
        fig.savefig(path.with_suffix(f".{fmt}"))
    return path.with_suffix(f".{formats[0]}")


def _as_runs(value: Sequence[Any]) -> list[Sequence[Mapping[str, Any]]]:
    # One run (a list of evaluation records) or several (a list of such lists).
    if value and isinstance(value[0], Mapping):
        return [value]
    return list(value)


def seed_band(
    runs: Sequence[Sequence[Mapping[str, Any]]],
    *,
    x: str = "time",
    band: str = "std",
    points: int = 241,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The mean accuracy of several runs, and a band around it, on one grid.

    Each run's accuracy is interpolated linearly between its evaluations and
    held at its last value after its end; the grid spans the longest run.

    Args:
      runs: the runs (one per seed), each a list of evaluation records with
        ``accuracy`` and ``x``.
      x: the record's key to plot against: ``"time"`` or ``"version"``.
      band: ``"std"`` (mean ± one standard deviation) or ``"minmax"``.
      points: the grid's size.

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
        [np.interp(grid, [e[x] for e in r], [e["accuracy"] for e in r]) for r in runs]
    )
    mean = curves.mean(axis=0)
    if band == "std":
        std = curves.std(axis=0)
        return grid, mean, mean - std, mean + std
    return grid, mean, curves.min(axis=0), curves.max(axis=0)


def _draw_accuracy(ax, runs, *, x: str, band: str, target: float | None) -> list:
    cmap = matplotlib.colormaps["tab10"]
    lines = []
    for i, (label, value) in enumerate(runs.items()):
        seeds = _as_runs(value)
        if not seeds or any(not r for r in seeds):
            raise ValueError(f"run {label!r} has no evaluations to plot")
        color = cmap(i % 10)
        # Past ten runs the colours repeat; the line style tells them apart.
        style = ("-", "--", ":")[(i // 10) % 3]
        if len(seeds) == 1:
            xs = [e[x] for e in seeds[0]]
            (line,) = ax.plot(xs, [e["accuracy"] for e in seeds[0]], style)
        else:
            grid, mean, low, high = seed_band(seeds, x=x, band=band)
            (line,) = ax.plot(grid, mean, style)
            ax.fill_between(grid, low, high, color=color, alpha=0.18, linewidth=0)
        line.set(color=color, linewidth=1.4, label=display_name(label))
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
        )
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, alpha=0.3)
    return lines


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
) -> pathlib.Path:
    """Plots test accuracy against time (or updates) of one or several runs.

    Args:
      runs: label (a scheme name, shown by :func:`display_name`) -> its
        evaluation records (dicts with ``time``, ``version`` and
        ``accuracy``), or a list of such lists, one per seed: then the mean
        is drawn with a band (see :func:`seed_band`).
      path: the file to write; its suffix is replaced by each format's.
      target: a target accuracy to draw as a dashed line, or ``None``.
      title: the figure title.
      time_unit: the unit of ``time`` for the axis label.
      x: ``"time"`` or ``"version"`` (server updates).
      band: ``"std"`` or ``"minmax"`` over seeds.
      formats: some of :data:`FORMATS`; the first is the path returned.

    Returns:
      The path written in the first format.

    Raises:
      ValueError: no runs, a run without evaluations, or a bad ``x``,
        ``band`` or format.
    """
    if not runs:
        raise ValueError("plot_accuracy needs at least one run")
    if x not in _X_LABELS:
        raise ValueError(f"x must be one of {sorted(_X_LABELS)}, got {x!r}")
    fig = Figure(figsize=(7.5, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    _draw_accuracy(ax, runs, x=x, band=band, target=target)
    ax.set_xlabel(_X_LABELS[x].format(unit=time_unit))
    ax.set_ylabel("test accuracy")
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return _save(fig, path, formats)


def plot_comparison(
    runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    path: str | pathlib.Path,
    *,
    target: float | None = None,
    title: str = "",
    time_unit: str = "s",
    band: str = "std",
    formats: Sequence[str] = FORMATS,
) -> pathlib.Path:
    """One setting's schemes: accuracy against time and against updates.

    Two panels side by side share the accuracy axis and one legend, outside
    them on the right; with several seeds a scheme is its mean and a band.

    Args:
      runs: scheme -> its runs, one list of evaluation records per seed.
      path: the file to write; its suffix is replaced by each format's.
      target: a target accuracy to draw as a dashed line, or ``None``.
      title: the figure title (the setting).
      time_unit: the unit of ``time`` for the axis label.
      band: ``"std"`` or ``"minmax"`` over seeds.
      formats: some of :data:`FORMATS`; the first is the path returned.

    Returns:
      The path written in the first format.

    Raises:
      ValueError: no runs, a run without evaluations, or a bad band or format.
    """
    if not runs:
        raise ValueError("plot_comparison needs at least one scheme")
    fig = Figure(figsize=(11.0, 4.2), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    by_time, by_updates = fig.subplots(1, 2, sharey=True)
    _draw_accuracy(by_time, runs, x="time", band=band, target=target)
    _draw_accuracy(by_updates, runs, x="version", band=band, target=target)
    by_time.set_xlabel(_X_LABELS["time"].format(unit=time_unit))
    by_updates.set_xlabel(_X_LABELS["version"])
    by_time.set_ylabel("test accuracy")
    seeds = max(len(_as_runs(v)) for v in runs.values())
    fig.legend(
        handles=by_time.get_lines()[: len(runs)],
        loc="outside right upper",
        fontsize=8,
        frameon=False,
        title=f"mean ± {'std' if band == 'std' else 'min-max'}, {seeds} seeds"
        if seeds > 1
        else None,
        title_fontsize=8,
    )
    if title:
        fig.suptitle(title)
    return _save(fig, path, formats)


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
