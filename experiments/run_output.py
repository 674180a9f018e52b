"""What both backends share: the run's output and the pieces both drivers use.

:class:`RunOutput` is what a backend reports; the helpers evaluate the model,
build the push compression, the re-planner and the pilot's batch grid, and
derive the worker-side settings of a work plan, for the simulator
(:mod:`experiments.sim_backend`) and the real processes
(:mod:`experiments.process_backend`) alike.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax

from experiments import build, registry
from experiments.configs.schema import ExperimentConfig

__all__ = ["TIMELINE_KINDS", "RunOutput"]


TIMELINE_KINDS = ("profile", "compile", "compute", "transfer", "wait", "discarded")
"""Kinds of time in a worker's timeline (everything but compute is idle)."""


class RunOutput(NamedTuple):
    """What a backend reports.

    Attributes:
      evals: one dict per evaluation, in time order: ``time`` (seconds since
        the start, profiling included), ``version``, the task's metrics on
        the test set (``loss``, and ``accuracy``, ``perplexity``, ... as the
        task reports them), and where known ``train_loss`` and ``gradients``.
      workers: per worker id, totals: ``compute_s``, ``transfer_s``,
        ``wait_s``, ``discarded_s``, ``idle_fraction``, ``bytes_sent``,
        ``bytes_received``, ``pushes``, ``local_steps``.
      timelines: per worker id, ``(start, end, kind)`` spans in time order,
        ``kind`` one of :data:`TIMELINE_KINDS`.
      records: raw per-push (sim) or per-round (processes) records.
      info: anything else worth keeping (plans, wall seconds, errors, ...).
    """

    evals: list[dict[str, Any]]
    workers: dict[Any, dict[str, Any]]
    timelines: dict[Any, list[tuple[float, float, str]]]
    records: list[dict[str, Any]]
    info: dict[str, Any]


def _evaluate(setup: build.Setup, params: Any, batch_size: int) -> dict[str, float]:
    """The task's metrics of ``params`` on the test set, averaged over examples
    and summarized (:meth:`experiments.build.Setup.summarize`)."""
    totals: dict[str, float] = {}
    count = 0
    for batch in setup.test.eval_batches(batch_size):
        values = jax.device_get(setup.eval_fn(params, batch))
        n = len(batch.y)
        for key, value in values.items():
            totals[key] = totals.get(key, 0.0) + float(value) * n
        count += n
    return setup.summarize({key: value / count for key, value in totals.items()})


def _replanner(
    config: ExperimentConfig,
    work_plan: Any,
    on_revision: Callable[[float, Any], None],
) -> Any:
    """The run's :class:`~hpsjax.profiling.Replanner` (``config.plan.replan_*``),
    or with ``work_plan=None`` its :class:`~hpsjax.profiling.Pilot`
    (``config.plan.pilot``), telling ``on_revision(now, plan)`` of every
    revision it makes."""
    from hpsjax.profiling import Pilot, Replanner

    base = Replanner if work_plan is not None else Pilot

    # A pilot without plan.replan plans once, from its fit, and keeps it.
    keep = work_plan is None and not config.plan.replan

    class Recorded(base):
        def observe(self, worker_id, batch_size, step_time, now):
            if keep and self.done:
                return None
            revised = super().observe(worker_id, batch_size, step_time, now)
            if revised is not None:
                on_revision(now, revised)
            return revised

    settings = {
        "threshold": float(config.plan.replan_threshold),
        "window": int(config.plan.replan_window),
        "cooldown": float(config.plan.replan_cooldown),
    }
    if work_plan is not None:
        return Recorded(work_plan, **settings)
    n = len(config.workers.slowdowns)
    # The pilot's plans scale the step size as build.work_plan's plan does.
    options = {
        "lr_scaling": registry.lookup("lr scaling", config.plan.lr_scaling),
        "local_steps": int(config.plan.local_steps),
        "max_local_steps": int(config.plan.max_local_steps),
    }
    return Recorded(
        range(n),
        int(config.batch_size) * n,
        str(config.plan.scheme),
        tolerance=float(config.plan.pilot_tolerance),
        max_rounds=int(config.plan.pilot_rounds),
        batch_sizes=_pilot_grid(config),
        balance_rounds=int(config.plan.pilot_balance),
        plan_options=options,
        **settings,
    )


def _pilot_grid(config: ExperimentConfig) -> tuple[int, ...] | None:
    """The batch sizes a pilot plans on and its workers compile before
    joining (``plan.pilot_grid`` a doubling, up to the global batch), or
    ``None`` without a pilot or a grid."""
    from hpsjax.planning import batch_grid

    per_doubling = int(config.plan.pilot_grid)
    if not config.plan.pilot or per_doubling <= 0:
        return None
    return batch_grid(
        int(config.batch_size) * len(config.workers.slowdowns), per_doubling
    )


# What the simulator records beside the evaluation's metrics.
_SIM_COLUMNS = ("time", "version", "gradients", "train_loss")


def _eval_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The task's metrics of a simulator's evaluation record (its columns
    ``time``, ``version``, ``gradients`` and ``train_loss`` left out)."""
    return {k: float(v) for k, v in record.items() if k not in _SIM_COLUMNS}


def _overlap(config: ExperimentConfig, work_plan: Any) -> str:
    """The workers' overlap: ``worker.overlap``, or where
    ``plan.overlap_link_share`` is set and there is a plan, the plan's choice
    (:func:`hpsjax.profiling.choose_overlap`)."""
    from hpsjax.profiling import choose_overlap

    share = config.plan.overlap_link_share
    if share is None or work_plan is None:
        return registry.lookup("overlap", config.worker.overlap)
    return choose_overlap(work_plan, float(share))


def _with_startup(config: ExperimentConfig, specs: list[Any]) -> list[Any]:
    """``specs`` with ``config.workers.startup_times`` as their start-up times
    (after the profiling pass, which measures warm workers)."""
    times = tuple(config.workers.startup_times or ())
    if not times:
        return specs
    if len(times) != len(specs):
        raise ValueError(
            f"workers.startup_times has {len(times)} entries for {len(specs)} "
            "workers; give one per worker or ()"
        )
    return [
        dataclasses.replace(spec, startup_time=float(t))
        for spec, t in zip(specs, times, strict=True)
    ]


def _worker_side(config: ExperimentConfig, work_plan: Any) -> dict[str, Any]:
    """The :class:`~hpsjax.worker.WorkerOptions` fields that ``config`` sets on
    every worker, simulated or real: the overlap, eager pulls, PS+'s staleness
    step rule and, with a plan to give the ratios, top-k from a stage on."""
    worker = config.worker
    side: dict[str, Any] = {"overlap": _overlap(config, work_plan)}
    if worker.staleness_lr is not None:
        registry.lookup("staleness policy", worker.staleness_lr)
        side["staleness_lr"] = worker.staleness_lr
    if side["overlap"] == "eager":
        side["eager_pulls"] = int(worker.eager_pulls)
    if work_plan is not None:
        value = config.stages.compress_from_stage
        side["compress_from_stage"] = None if value is None else int(value)
    return side


def _progress_bar(enabled: bool, total: float, unit: str) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit=unit,
        bar_format="{l_bar}{bar}| {n:.1f}/{total:.1f} {unit} [{elapsed}{postfix}]",
        file=sys.stderr,
    )


def _advance(bar: Any, value: float) -> None:
    """Moves ``bar`` to ``value`` (at most its total: rounded sums of the
    steps could pass it, which tqdm warns of)."""
    bar.n = min(float(bar.total), float(value))
    bar.refresh()


def _streaming_bits(worker: ExperimentConfig) -> int | str | None:
    """``worker.streaming_bits``: an int, ``"e2m1"`` (4-bit floats) or None."""
    bits = worker.streaming_bits
    return bits if bits is None or isinstance(bits, str) else int(bits)
