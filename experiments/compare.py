r"""Compare schemes: ``python -m experiments.compare --suite=NAME --workdir=DIR``.

Runs every scheme of a suite (``experiments/configs/suites.py``) in the suite's
setting, one work directory each (``DIR/<scheme>``, see
:mod:`experiments.train`), then writes

* ``DIR/results.md``: a markdown table with, per scheme, the time to the
  target accuracy, the speedup over BSP to that accuracy, the final and best
  test accuracy, the megabytes the workers pushed, the idle fraction of the
  workers' time and the server versions made;
* ``DIR/results.json``: the same figures and each scheme's summary;
* ``DIR/accuracy.png``: test accuracy against time of every scheme;

and prints the table and the plot's path. ``--schemes=bsp,hps`` runs a subset;
``--render_only`` rebuilds the table and plot from the work directories of an
earlier run. Example::

  python -m experiments.compare --suite=quick --workdir=/tmp/hpsjax/quick
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from absl import app, flags, logging

from experiments import plots, registry, train
from experiments.configs.suites import Suite

__all__ = ["format_table", "load_run", "run_suite"]


def _fmt(value: float | None, spec: str, missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def _speedup(base: float | None, ttt: float | None, budget: float) -> str:
    if ttt is None or ttt <= 0:
        return "-"
    if base is None:
        # The baseline never got there within the budget: at least this much.
        return f"> {budget / ttt:.2f}x"
    return f"{base / ttt:.2f}x"


def format_table(summaries: Sequence[dict[str, Any]], *, baseline: str = "bsp") -> str:
    """The markdown comparison table of some runs' summaries.

    Args:
      summaries: :func:`experiments.train.summarize` results, one per scheme.
      baseline: the scheme speedups are measured against (its row reads
        ``1.00x``); without it the speedup column shows ``-``.

    Returns:
      The table, ending with a newline.

    Raises:
      ValueError: no summaries, or runs with different target accuracies.
    """
    if not summaries:
        raise ValueError("format_table needs at least one summary")
    targets = {s["target_accuracy"] for s in summaries}
    if len(targets) != 1:
        raise ValueError(f"the runs have different target accuracies: {targets}")
    target = targets.pop()
    base_row = next((s for s in summaries if s["scheme"] == baseline), None)
    unit = "virtual s" if all(s["backend"] == "sim" for s in summaries) else "s"
    header = (
        f"| scheme | time to {target:g} accuracy ({unit}) | speedup vs "
        f"{baseline.upper()} | final accuracy | best accuracy | MB pushed | "
        "idle fraction | updates |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for s in summaries:
        speedup = "-"
        if base_row is not None:
            speedup = _speedup(
                base_row["time_to_target"], s["time_to_target"], s["end_time"]
            )
        rows.append(
            f"| {s['scheme']} | {_fmt(s['time_to_target'], '.1f')} | {speedup} | "
            f"{s['final_accuracy']:.3f} | {s['best_accuracy']:.3f} | "
            f"{s['bytes_sent'] / 1e6:.1f} | {s['idle_fraction']:.2f} | "
            f"{s['updates']} |"
        )
    return header + "\n".join(rows) + "\n"


def load_run(workdir: str | pathlib.Path) -> tuple[dict[str, Any], list[dict]]:
    """A run's summary and evaluations, read back from its ``metrics.jsonl``.

    Raises:
      FileNotFoundError: no ``metrics.jsonl`` in ``workdir``.
      ValueError: the file holds no summary.
    """
    path = pathlib.Path(workdir) / "metrics.jsonl"
    evals, summary = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if record["event"] == "eval":
                evals.append(record)
            elif record["event"] == "summary":
                summary = record
    if summary is None:
        raise ValueError(f"{path} holds no summary record; did the run finish?")
    summary.pop("event")
    return summary, evals


def run_suite(
    suite: str | Suite,
    workdir: str | pathlib.Path,
    *,
    schemes: Sequence[str] | None = None,
    render_only: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Runs a suite's schemes and writes the comparison.

    Args:
      suite: a name of ``SUITES`` or a :class:`Suite`.
      workdir: the output directory (one subdirectory per scheme).
      schemes: a subset of the suite's schemes, or ``None`` for all.
      render_only: read earlier outputs instead of running.
      progress: show progress bars.

    Returns:
      ``{"table": markdown, "table_path", "plot_path", "summaries"}``.

    Raises:
      ValueError: an unknown suite or scheme (the message lists valid names),
        before anything runs.
    """
    if isinstance(suite, str):
        name = suite
        suite = registry.lookup("suite", suite)
    else:
        name = "custom"
    if not isinstance(suite, Suite):
        raise ValueError(f"suite must be a suite name or a Suite, got {suite!r}")
    chosen = list(suite.schemes if schemes is None else schemes)
    for scheme in chosen:
        registry.lookup("scheme", scheme)
        if scheme not in suite.schemes:
            raise ValueError(
                f"scheme {scheme!r} is not in suite {name!r}; its schemes: "
                f"{', '.join(suite.schemes)}"
            )
    if not chosen:
        raise ValueError("no schemes to run")
    configs = {}
    for scheme in chosen:
        config = registry.load_config(scheme, suite.setting)
        if suite.backend is not None:
            config.backend = suite.backend
        registry.check_config(config)
        configs[scheme] = config
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    summaries, runs = [], {}
    for scheme, config in configs.items():
        if not render_only:
            logging.info("running %s (%s, %s)", scheme, suite.setting, config.backend)
            train.train_and_evaluate(config, workdir / scheme, progress=progress)
        summary, evals = load_run(workdir / scheme)
        summaries.append(summary)
        runs[scheme] = evals

    first = next(iter(configs.values()))
    table = format_table(summaries)
    unit = "virtual s" if first.backend == "sim" else "s"
    plot_path = plots.plot_accuracy(
        runs,
        workdir / "accuracy.png",
        target=float(first.eval.target_accuracy),
        title=f"suite {name}: {suite.setting} ({first.backend})",
        time_unit=unit,
    )
    command = f"python -m experiments.compare --suite={name} --workdir={workdir}"
    text = (
        f"# Suite `{name}`\n\n{suite.description}\n\n"
        f"Setting `{suite.setting}`, backend `{first.backend}`, budget "
        f"{first.budget_seconds:g} {unit} per scheme, target accuracy "
        f"{first.eval.target_accuracy:g}.\n\n{table}\n"
        f"Accuracy against time: `{plot_path.name}`.\n\nCommand: `{command}`\n"
    )
    table_path = workdir / "results.md"
    table_path.write_text(text)
    (workdir / "results.json").write_text(
        json.dumps({"suite": name, "summaries": summaries}, indent=2) + "\n"
    )
    return {
        "table": table,
        "table_path": table_path,
        "plot_path": plot_path,
        "summaries": summaries,
    }


def _define_flags() -> None:
    # Defined only when run as a program, so that importing this module (for
    # run_suite) never clashes with experiments.run's --workdir.
    flags.DEFINE_string("suite", None, "A suite of experiments/configs/suites.py.")
    flags.DEFINE_string("workdir", None, "Directory for all outputs.")
    flags.DEFINE_list(
        "schemes", None, "Run only these schemes of the suite (comma-separated)."
    )
    flags.DEFINE_bool(
        "render_only", False, "Rebuild table and plot from existing outputs."
    )
    flags.mark_flags_as_required(["suite", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.INFO)
    values = flags.FLAGS
    result = run_suite(
        values.suite,
        values.workdir,
        schemes=values.schemes,
        render_only=values.render_only,
    )
    print(result["table"])
    print(f"table: {result['table_path']}")
    print(f"plot: {result['plot_path']}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
