r"""Per-worker table and plots of a run's metrics files.

``python -m experiments.summary --workdir W`` reads what a run wrote into ``W``
and prints one row per worker, writing ``W/summary_workers.json``, and the
plots ``W/summary_staleness.png`` (staleness histogram per worker) and, when
the run has evaluations, ``W/summary_accuracy.png``:

=================  ==========================================================
``rounds``         rounds a worker computed (a simulated worker's pushes)
``idle``           share of its time not computing (waiting for parameters,
                   transfers, barriers)
``staleness``      mean and 90th percentile of its pushes' staleness
``throughput``     examples per second (batch size times local steps, over
                   the time from its first round to its last)
=================  ==========================================================

It reads, whichever are there: ``metrics.jsonl`` of an experiment
(``python -m experiments.run``, simulated or real processes: ``"round"`` or
``"push"`` records, ``"worker"`` totals and ``"eval"`` records), the workers'
own files ``metrics_<i>.jsonl`` (``hpsjax-launch --workdir``) and
``workers/metrics_<i>.jsonl`` (an experiment's processes). Records are the
schema of :mod:`hpsjax.metrics`.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hpsjax.metrics import read_jsonl

__all__ = ["format_table", "main", "read_run", "worker_table", "write_summary"]


def read_run(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every metrics record of the run in ``workdir``.

    An experiment's ``metrics.jsonl`` already holds its workers' rounds, so the
    workers' own files are read only when it is absent.

    Raises:
      FileNotFoundError: ``workdir`` holds no metrics files.
      ValueError: a file that is not JSON lines.
    """
    root = pathlib.Path(workdir)
    if not root.is_dir():
        raise FileNotFoundError(f"no directory {str(root)!r}")
    if (root / "metrics.jsonl").is_file():
        return read_jsonl(root / "metrics.jsonl")
    files = sorted(root.glob("metrics_*.jsonl")) + sorted(
        root.glob("workers/metrics_*.jsonl")
    )
    if not files:
        raise FileNotFoundError(
            f"{root} holds no metrics.jsonl or metrics_<i>.jsonl files"
        )
    return [record for path in files for record in read_jsonl(path)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _sum(records: Iterable[Mapping[str, Any]], field: str) -> float:
    return sum(_number(r.get(field)) or 0.0 for r in records)


def worker_table(records: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker (its id as a string): rounds, idle, staleness, throughput.

    Returns:
      ``{worker: {"rounds", "idle_fraction", "staleness_mean",
      "staleness_p90", "throughput", "staleness"}}`` (``staleness`` the
      list of its pushes' staleness); a value that the records do not give is
      ``None``.
    """
    by_worker: dict[str, dict[str, list]] = {}
    for record in records:
        worker = record.get("worker")
        if worker is None or record.get("event") not in ("round", "push", "worker"):
            continue
        kinds = by_worker.setdefault(
            str(worker), {"round": [], "push": [], "worker": []}
        )
        kinds[record["event"]].append(record)
    table = {}
    for worker, kinds in sorted(by_worker.items()):
        rounds = kinds["round"] or kinds["push"]
        staleness = [
            s for s in (_number(r.get("staleness")) for r in rounds) if s is not None
        ]
        totals = kinds["worker"][-1] if kinds["worker"] else {}
        idle = _number(totals.get("idle_fraction"))
        if idle is None and kinds["round"]:
            busy = _sum(kinds["round"], "round_s")
            waited = _sum(kinds["round"], "wait_s")
            idle = None if busy <= 0 else min(max(waited / busy, 0.0), 1.0)
        examples = sum(
            (_number(r.get("batch_size")) or 0.0)
            * max(_number(r.get("local_steps")) or 1.0, 1.0)
            for r in rounds
        )
        times = [t for t in (_number(r.get("time")) for r in rounds) if t is not None]
        span = 0.0
        if times:
            span = max(times) - min(times)
            if kinds["round"]:  # a round's time is its start: count the last one
                span += _number(kinds["round"][-1].get("round_s")) or 0.0
        table[worker] = {
            "rounds": len(rounds),
            "idle_fraction": idle,
            "staleness_mean": float(np.mean(staleness)) if staleness else None,
            "staleness_p90": float(np.percentile(staleness, 90)) if staleness else None,
            "throughput": examples / span if span > 0 and examples else None,
            "staleness": staleness,
        }
    return table


def format_table(table: Mapping[str, Mapping[str, Any]]) -> str:
    """The table as aligned text, one line per worker."""

    def cell(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        f"{'worker':>8} {'rounds':>7} {'idle':>6} {'stale':>6} {'p90':>5} "
        f"{'examples/s':>11}"
    ]
    for worker, row in table.items():
        lines.append(
            f"{worker:>8} {row['rounds']:>7d} {cell(row['idle_fraction'], '6.1%')} "
            f"{cell(row['staleness_mean'], '6.2f')} "
            f"{cell(row['staleness_p90'], '5.1f')} "
            f"{cell(row['throughput'], '11.1f')}"
        )
    return "\n".join(lines)


def _plot_staleness(table: Mapping[str, Mapping[str, Any]], path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    top = max((max(r["staleness"], default=0) for r in table.values()), default=0)
    bins = np.arange(int(top) + 2) - 0.5
    for worker, row in table.items():
        if row["staleness"]:
            ax.hist(
                row["staleness"], bins=bins, histtype="step", label=f"worker {worker}"
            )
    ax.set_xlabel("staleness of a push")
    ax.set_ylabel("pushes")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_summary(workdir: str | pathlib.Path) -> dict[str, Any]:
    """Reads the run in ``workdir``, writes the table (JSON) and the plots.

    Returns:
      ``{"table": ..., "paths": {name: path}}``.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_run`, or no worker records.
    """
    from experiments import plots

    root = pathlib.Path(workdir)
    records = read_run(root)
    table = worker_table(records)
    if not table:
        raise ValueError(f"the metrics files in {root} hold no worker records")
    paths = {"table": root / "summary_workers.json"}
    paths["table"].write_text(
        json.dumps(
            {
                w: {k: v for k, v in row.items() if k != "staleness"}
                for w, row in table.items()
            },
            indent=2,
        )
        + "\n"
    )
    if any(row["staleness"] for row in table.values()):
        paths["staleness_plot"] = root / "summary_staleness.png"
        _plot_staleness(table, paths["staleness_plot"])
    evals = [
        r
        for r in records
        if r.get("event") == "eval" and _number(r.get("accuracy")) is not None
    ]
    if evals:
        paths["accuracy_plot"] = root / "summary_accuracy.png"
        runs: dict[str, list] = {}
        for record in evals:
            worker = record.get("worker")
            name = "run" if worker is None else f"worker {worker}"
            runs.setdefault(name, []).append(record)
        plots.plot_accuracy(runs, paths["accuracy_plot"], title=str(root.name))
    return {"table": table, "paths": paths}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.summary``; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m experiments.summary",
        description="Per-worker table (rounds, idle, staleness, throughput) and "
        "plots of a run's metrics files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--workdir",
        required=True,
        help="the run's directory (experiments.run's workdir or hpsjax-launch's)",
    )
    args = p.parse_args(argv)
    try:
        result = write_summary(args.workdir)
    except (FileNotFoundError, ValueError) as e:
        print(f"experiments.summary: {e}", file=sys.stderr)
        return 2
    print(format_table(result["table"]))
    for path in result["paths"].values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
