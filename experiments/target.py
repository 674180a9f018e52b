"""A run's target: which evaluation metric, which value, and which way is better.

The target of an experiment follows its task (``config.task``, see
:mod:`hpsjax.tasks`): a classifier's test accuracy up to ``0.9``, a language
model's validation loss down to ``2.1``. It is set in the config's ``eval``
group:

* ``eval.target_metric``: the metric (``None``: the task's own,
  ``task.target_metric``);
* ``eval.target_value``: the value to reach; ``None`` with an accuracy target
  takes ``eval.target_accuracy``, the field every classification config and
  result of earlier versions holds;
and the direction is the task's (:func:`hpsjax.tasks.higher_is_better`: its
own for its target metric, the known one of ``accuracy``, ``loss`` and
``perplexity`` otherwise).

Every comparison with a target (time to target, the best value of a run, the
tables' and plots' labels) goes through :class:`Target`.

Examples:
  >>> t = Target("loss", 2.1, higher_is_better=False)
  >>> t.reached(2.05), t.reached(2.2), t.label
  (True, False, 'val loss 2.1')
  >>> Target("accuracy", 0.9, higher_is_better=True).label
  '0.9 accuracy'
  >>> t.time_to([{"time": 0.0, "loss": 5.0}, {"time": 3.0, "loss": 2.0}])
  3.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from experiments.configs.schema import ExperimentConfig

__all__ = [
    "Target",
    "metric_label",
    "target",
    "task_of",
    "with_initial_evaluation",
]


def metric_label(metric: str) -> str:
    """How a figure's axis names an evaluation metric: the held-out set's."""
    return "test accuracy" if metric == "accuracy" else f"validation {metric}"


class Target(NamedTuple):
    """The value of an evaluation metric a run is timed to.

    Attributes:
      metric: the evaluation metric (a key of the evaluations' records).
      value: the value to reach.
      higher_is_better: ``True`` for a metric to raise (accuracy), ``False``
        for one to lower (loss, perplexity).
    """

    metric: str
    value: float
    higher_is_better: bool

    @property
    def label(self) -> str:
        """The target in a table's words: ``0.9 accuracy``, ``val loss 2.1``."""
        if self.metric == "accuracy":
            return f"{self.value:g} accuracy"
        return f"val {self.metric} {self.value:g}"

    def reached(self, value: float | None) -> bool:
        """Whether ``value`` of the metric is at the target or beyond it."""
        if value is None or not math.isfinite(value):
            return False
        if self.higher_is_better:
            return value >= self.value
        return value <= self.value

    def best(self, values: Sequence[float]) -> float | None:
        """The best of ``values`` (non-finite ones left out), or ``None``."""
        finite = [float(v) for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return None
        return max(finite) if self.higher_is_better else min(finite)

    def sort_key(self, value: float | None) -> float:
        """A key that sorts better values first (``None`` last)."""
        if value is None or not math.isfinite(value):
            return math.inf
        return -value if self.higher_is_better else value

    def time_to(self, evals: Sequence[Mapping[str, Any]]) -> float | None:
        """The first evaluation time at which the metric reached the target.

        Returns:
          Seconds, or ``None`` when the run never reached it.
        """
        for record in evals:
            if self.reached(record.get(self.metric)):
                return float(record["time"])
        return None

    def fields(self) -> dict[str, Any]:
        """The target as a summary's fields (``target_accuracy`` kept for
        accuracy targets, ``None`` otherwise, as readers of earlier results
        expect)."""
        return {
            "target_metric": self.metric,
            "target_value": self.value,
            "higher_is_better": self.higher_is_better,
            "target_accuracy": self.value if self.metric == "accuracy" else None,
        }

    @classmethod
    def of_summary(cls, summary: Mapping[str, Any]) -> Target:
        """The target a run's summary was timed to; a summary written before
        targets had a metric holds ``target_accuracy`` only."""
        metric = summary.get("target_metric")
        if metric is None:
            return cls("accuracy", float(summary["target_accuracy"]), True)
        return cls(
            str(metric),
            float(summary["target_value"]),
            bool(summary["higher_is_better"]),
        )

    @classmethod
    def of_config(cls, config: ExperimentConfig, task: Any) -> Target:
        """The target of ``config.eval`` for ``task`` (a :class:`hpsjax.tasks.Task`).

        Raises:
          ValueError: a metric the task does not report or whose direction is
            not known, or no value (one line each).
        """
        from hpsjax.tasks import higher_is_better

        ev = config.eval
        metric = ev.target_metric or task.target_metric
        if not isinstance(metric, str):
            raise ValueError(
                f"eval.target_metric must be a metric name, got {metric!r}"
            )
        higher = higher_is_better(task, metric)
        value = ev.target_value
        if value is None and metric == "accuracy":
            value = ev.target_accuracy
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"eval.target_value must be a number for the target on "
                f"{metric!r} of task {task.name!r}, got {value!r}"
            )
        if not math.isfinite(value):
            raise ValueError(f"eval.target_value must be finite, got {value!r}")
        if metric == "accuracy" and higher and not 0 < value <= 1:
            raise ValueError(f"an accuracy target must be in (0, 1], got {value!r}")
        return cls(metric, float(value), bool(higher))


@functools.lru_cache(maxsize=16)
def task_of(spec: str) -> Any:
    """The :class:`hpsjax.tasks.Task` of ``config.task``, one object per spec
    (so that the loss and evaluation built from it, and their compiled
    programs, are shared by every run of a process).

    Raises:
      ValueError: an unknown task, or a factory that is missing or returns
        something else than a task (one line each).
    """
    from hpsjax.tasks import get_task

    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"config.task must be a task name or 'module:function', got {spec!r}"
        )
    return get_task(spec)


def target(config: ExperimentConfig) -> Target:
    """The run's target for its task (:meth:`Target.of_config`).

    Raises:
      ValueError: an unknown task, or a target the task cannot have.
    """
    return Target.of_config(config, task_of(config.task))


def with_initial_evaluation(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``evals`` with an evaluation at time 0 where the first came later.

    A scheme that profiles its workers first evaluates when profiling ends;
    until then the server held the initial parameters (version 0), so their
    evaluation holds from time 0 as well: it is repeated there. Evaluations
    that start at time 0, or of a later version, are returned as they are.
    """
    evals = list(evals)
    if evals and evals[0]["time"] > 0 and evals[0]["version"] == 0:
        evals.insert(0, {**evals[0], "time": 0.0})
    return evals
