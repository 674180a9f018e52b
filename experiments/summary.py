r"""Per-worker table and plots of a run's metrics files.

``python -m experiments.summary --workdir W`` reads what a run wrote into ``W``
and prints one row per worker, writing ``W/summary_workers.json``, and the
plots ``W/summary_staleness.png`` (staleness histogram per worker) and, when
the run has evaluations, ``W/summary_<metric>.png`` of its target's metric
(``summary_accuracy.png``, a language model's ``summary_loss.png``; see
:mod:`experiments.target`):

=================  ==========================================================
``rounds``         rounds a worker computed (a simulated worker's pushes)
``idle``           share of its time not computing (waiting for parameters,
                   transfers, barriers)
``staleness``      mean and 90th percentile of its pushes' staleness
``throughput``     examples per second (batch size times local steps, over
                   the time from its first round to its last)
=================  ==========================================================

It reads ``metrics.jsonl`` of an experiment (``python -m experiments.run``,
simulated or real processes: ``"round"`` or ``"push"`` records, ``"worker"``
totals and ``"eval"`` records) where there is one, else every hpsjax metrics
file in the directory and in its ``workers/``, whatever its name: the
workers' ``metrics_<i>.jsonl`` (``hpsjax-launch --workdir``), or the files a
run was given with ``--metrics`` (``w0.jsonl``, ``server.jsonl``, as LAUNCH.md
shows). A file is taken for what it holds, not for its name: JSON lines whose
first record is an object with an ``"event"`` (the schema of
:mod:`hpsjax.metrics`); other ``.jsonl`` files are left alone.

A worker whose run diverged (a ``"diverged"`` record, or an experiment's
``"summary"`` with ``diverged_at``) is named under the table with when.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from experiments import _cli
from experiments.target import Target, metric_label
from hpsjax.metrics import read_jsonl

__all__ = [
    "divergences",
    "evaluated_metric",
    "format_table",
    "is_metrics_file",
    "main",
    "metrics_files",
    "read_run",
    "worker_table",
    "write_summary",
]


def is_metrics_file(path: str | pathlib.Path) -> bool:
    """Whether a file holds hpsjax metrics: JSON lines whose first record is an
    object with an ``"event"`` string (an empty file holds none)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    return isinstance(record, dict) and isinstance(
                        record.get("event"), str
                    )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return False


def metrics_files(workdir: str | pathlib.Path) -> list[pathlib.Path]:
    """The hpsjax metrics files of the run in ``workdir``, in name order.

    An experiment's ``metrics.jsonl`` already holds its workers' rounds, so it
    is the only file when it is there; else every ``.jsonl`` file of
    ``workdir`` and of ``workdir/workers`` that :func:`is_metrics_file`.

    Raises:
      FileNotFoundError: no directory ``workdir``, or no metrics file in it.
    """
    root = pathlib.Path(workdir)
    if not root.is_dir():
        raise FileNotFoundError(f"no directory {str(root)!r}")
    if (root / "metrics.jsonl").is_file():
        return [root / "metrics.jsonl"]
    candidates = sorted(root.glob("*.jsonl")) + sorted(root.glob("workers/*.jsonl"))
    files = [path for path in candidates if is_metrics_file(path)]
    if not files:
        raise FileNotFoundError(
            f"{root} holds no hpsjax metrics files (.jsonl files of records "
            'with an "event", as --metrics writes)'
        )
    return files


def read_run(workdir: str | pathlib.Path) -> list[dict[str, Any]]:
    """Every metrics record of the run in ``workdir`` (see :func:`metrics_files`).

    Raises:
      FileNotFoundError: ``workdir`` holds no metrics files.
      ValueError: a metrics file with a line that is not a JSON object.
    """
    return [record for path in metrics_files(workdir) for record in read_jsonl(path)]


def divergences(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per divergence the records tell of: a worker's ``"diverged"``
    record, or an experiment's ``"summary"`` with ``diverged_at``."""
    lines = []
    for r in records:
        event = r.get("event")
        if event == "diverged":
            at = _number(r.get("time"))
            when = "" if at is None else f" at t = {at:.1f} s"
            loss = r.get("loss")
            lines.append(
                f"worker {r.get('worker')} diverged{when} (step {r.get('step')}, "
                f"version {r.get('version')}, loss "
                f"{'not finite' if loss is None else loss})"
            )
        elif event == "summary" and _number(r.get("diverged_at")) is not None:
            where = (r.get("info") or {}).get("diverged") or {}
            worker = f" (worker {where['worker']})" if "worker" in where else ""
            lines.append(f"the run diverged at t = {r['diverged_at']:.1f} s{worker}")
    return lines


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
      ``{"table": ..., "paths": {name: path}, "diverged": [line, ...]}``.

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
    metric = evaluated_metric(records)
    evals = [
        r
        for r in records
        if r.get("event") == "eval" and _number(r.get(metric)) is not None
    ]
    if evals:
        path = paths[f"{metric}_plot"] = root / f"summary_{metric}.png"
        runs: dict[str, list] = {}
        for record in evals:
            worker = record.get("worker")
            name = "run" if worker is None else f"worker {worker}"
            runs.setdefault(name, []).append(record)
        plots.plot_accuracy(
            runs,
            path,
            metric=metric,
            title=f"{root.name}: {metric_label(metric)} per worker",
        )
    return {"table": table, "paths": paths, "diverged": divergences(records)}


def evaluated_metric(records: Sequence[Mapping[str, Any]]) -> str:
    """The metric a run's evaluations are plotted by: its summary's target
    metric, else ``accuracy`` where evaluations hold one, else ``loss``."""
    for r in records:
        if r.get("event") == "summary" and (
            r.get("target_metric") or r.get("target_accuracy") is not None
        ):
            return Target.of_summary(r).metric
    evals = [r for r in records if r.get("event") == "eval"]
    return "accuracy" if any("accuracy" in r for r in evals) else "loss"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m experiments.summary``; returns the exit status."""
    p = _cli.Parser(
        "experiments.summary",
        description="Per-worker table (rounds, idle, staleness, throughput) and "
        "plots of a run's metrics files.",
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
        print(f"experiments.summary: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result["table"]))
    for line in result["diverged"]:
        print(line)
    for path in result["paths"].values():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
