"""``hpsjax-worker``'s flags: :func:`parse_args` and the eval target.

The flags are made from the fields of :class:`~hpsjax.worker.WorkerCommand`
and :class:`~hpsjax.worker.WorkerConfig`; the launcher, the run
configuration and the in-place profile read a worker's command line with
:func:`parse_args` (:func:`hpsjax.worker.parse_worker_args`), so a flag means
the same to each. The command itself, which runs the worker or its profile,
is :mod:`hpsjax.cli.worker`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NamedTuple

from hpsjax import tasks
from hpsjax._config_flags import add_flags
from hpsjax._flags import ArgumentParser, HelpFormatter
from hpsjax.worker._command import WorkerCommand
from hpsjax.worker._config import WorkerConfig

__all__ = ["Target", "parse_args", "worker_target"]


# The --dataset and --model of each built-in task when the flags name none.
_TASK_DEFAULTS = {
    "classification": ("synthetic_digits", "mlp"),
    "lm": ("text", "transformer"),
    "regression": ("synthetic_regression", "mlp"),
}

_GROUPS = {
    "server": "server",
    "data": "model and data",
    "work": "work",
    "faults": "heterogeneity and faults",
    "outputs": "outputs",
}


def parse_args(
    argv: Sequence[str] | None = None, *, prog: str = "hpsjax-worker"
) -> argparse.Namespace:
    """Parses ``hpsjax-worker``'s command line (see :mod:`hpsjax.cli.worker`);
    ``prog`` is the command's name in its help and messages.

    The flags are made from the fields of :class:`~hpsjax.worker.WorkerConfig`
    (``--local_steps``, ``--overlap``, ``--no_follow_hints``, ...) and of
    :class:`WorkerCommand` (the command's own: ``--port``, ``--model``, ...),
    by :mod:`hpsjax._config_flags`.
    """
    p = ArgumentParser(
        prog=prog,
        description="Run an hpsjax training worker.",
        formatter_class=HelpFormatter,
    )
    groups = {key: p.add_argument_group(title) for key, title in _GROUPS.items()}
    add_flags(p, WorkerCommand, groups)
    add_flags(p, WorkerConfig, groups)
    args = p.parse_args(argv)
    dataset, model = _TASK_DEFAULTS.get(args.task, _TASK_DEFAULTS["classification"])
    args.dataset = dataset if args.dataset is None else args.dataset
    args.model = model if args.model is None else args.model
    if args.worker_id is None and args.profile_out is not None:
        args.worker_id = 0  # no server assigns a profile's id: worker 0's
    return args


class Target(NamedTuple):
    """The eval value at which ``--target_value`` stops the worker.

    Attributes:
      metric: the eval metric (``--target_metric``, or the task's).
      value: the value to reach.
      higher_is_better: the direction (the task's, see
        :func:`hpsjax.tasks.higher_is_better`).
    """

    metric: str
    value: float
    higher_is_better: bool

    def reached(self, result: dict[str, float]) -> bool:
        """Whether an eval ``result`` reached the target."""
        got = result[self.metric]
        return got >= self.value if self.higher_is_better else got <= self.value


def worker_target(args: argparse.Namespace, task: tasks.Task) -> Target | None:
    """The target of ``--target_metric``/``--target_value``, or ``None``.

    Raises:
      ValueError: a metric the task does not report, or the flags without
        the ones they need (one line each).
    """
    metric = args.target_metric or task.target_metric
    higher = tasks.higher_is_better(task, metric)
    if args.target_value is None:
        if args.target_metric is not None:
            raise ValueError("--target_metric needs --target_value")
        return None
    if args.eval_every is None:
        raise ValueError("--target_value needs --eval_every (the evals it checks)")
    return Target(metric, float(args.target_value), higher)
