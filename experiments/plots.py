"""Plots: test accuracy against time, and per-worker timelines.

Both draw on a :class:`matplotlib.figure.Figure` of their own and write a PNG
with the Agg renderer, so they work without a display and leave pyplot's state
(and a notebook's inline backend) alone.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib
from matplotlib import patches
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["TIMELINE_COLORS", "plot_accuracy", "plot_timeline"]

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


def plot_accuracy(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | pathlib.Path,
    *,
    target: float | None = None,
    title: str = "",
    time_unit: str = "s",
) -> pathlib.Path:
    """Plots test accuracy against time for one or several runs.

    Args:
      runs: label -> evaluation records (dicts with ``time`` and ``accuracy``).
      path: the PNG to write.
      target: a target accuracy to draw as a dashed line, or ``None``.
      title: the figure title.
      time_unit: the unit of ``time`` for the axis label.

    Returns:
      The path written.

    Raises:
      ValueError: no runs, or a run without evaluations.
    """
    if not runs:
        raise ValueError("plot_accuracy needs at least one run")
    fig = Figure(figsize=(7.5, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    cmap = matplotlib.colormaps["tab10"]
    for i, (label, evals) in enumerate(runs.items()):
        if not evals:
            raise ValueError(f"run {label!r} has no evaluations to plot")
        ax.plot(
            [e["time"] for e in evals],
            [e["accuracy"] for e in evals],
            label=label,
            color=cmap(i % 10),
            # Past ten runs the colours repeat; the line style tells them apart.
            linestyle=("-", "--", ":")[(i // 10) % 3],
            linewidth=1.5,
        )
    if target is not None:
        ax.axhline(target, color="black", linestyle="--", linewidth=0.9)
        ax.annotate(
            f"target {target:g}",
            xy=(1.0, target),
            xycoords=("axes fraction", "data"),
            xytext=(-4, 3),
            textcoords="offset points",
            ha="right",
            fontsize=8,
        )
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.0, 1.0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, ncol=2 if len(runs) > 6 else 1, loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path)
    return path


def plot_timeline(
    timelines: Mapping[Any, Sequence[Sequence[Any]]],
    path: str | pathlib.Path,
    *,
    title: str = "",
    time_unit: str = "s",
    window: tuple[float, float] | None = None,
) -> pathlib.Path:
    """Draws each worker's time as bars of compute, transfer, wait and the rest.

    Args:
      timelines: worker id -> ``(start, end, kind)`` spans (kinds of
        :data:`TIMELINE_COLORS`).
      path: the PNG to write.
      title: the figure title.
      time_unit: unit of the times, for the axis label.
      window: ``(start, end)`` of the time shown; the whole run by default.

    Returns:
      The path written.

    Raises:
      ValueError: no workers, or a span of unknown kind.
    """
    if not timelines:
        raise ValueError("plot_timeline needs at least one worker")
    workers = list(timelines)
    fig = Figure(figsize=(9.0, 1.2 + 0.45 * len(workers)), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    used = set()
    for row, worker in enumerate(workers):
        bars: dict[str, list[tuple[float, float]]] = {}
        for start, end, kind in timelines[worker]:
            if kind not in TIMELINE_COLORS:
                raise ValueError(
                    f"unknown timeline kind {kind!r}; valid: {sorted(TIMELINE_COLORS)}"
                )
            if window is not None:
                start, end = max(start, window[0]), min(end, window[1])
            if end > start:
                bars.setdefault(kind, []).append((start, end - start))
        for kind, spans in bars.items():
            ax.broken_barh(spans, (row - 0.38, 0.76), facecolors=TIMELINE_COLORS[kind])
            used.add(kind)
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels([f"worker {w}" for w in workers])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    if window is not None:
        ax.set_xlim(*window)
    handles = [
        patches.Patch(color=TIMELINE_COLORS[k], label=_LABELS[k])
        for k in TIMELINE_COLORS
        if k in used
    ]
    ax.legend(
        handles=handles,
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if len(workers) > 3 else -0.45),
        ncol=len(handles),
        frameon=False,
    )
    if title:
        ax.set_title(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, bbox_inches="tight")
    return path
