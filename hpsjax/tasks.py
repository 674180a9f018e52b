r"""What is learned: a task's loss, its evaluation metrics and its target.

A :class:`Task` is a small bundle of pure functions, as optax's
``GradientTransformation`` is: the loss of each example of a batch, the
metrics an evaluation reports, and which of them a run's target is set on
and in which direction. Every path that trains or evaluates (``hpsjax-worker
--task``, ``hpsjax-launch --task``, the simulator, ``experiments``'
``config.task``) takes one, by the name :func:`get_task` takes:

* ``"classification"`` (the default): softmax cross-entropy on integer
  labels; reports ``loss`` and ``accuracy``, the target is accuracy, up.
* ``"lm"``: next-token language modelling; the loss of a sequence is its mean
  token cross-entropy (nats per token); reports ``loss``, next-token
  ``accuracy`` and ``perplexity`` :math:`e^{\text{loss}}`; the target is the
  validation loss, down.
* ``"regression"``: the mean squared error of each example over its outputs;
  reports ``loss``; the target is the loss, down.
* a user's ``"package.module:make_task"``: a function of no arguments that
  returns a :class:`Task`.

The model's outputs are ``model(batch[0])``: logits ``(b, classes)``, logits
``(b, L, vocab)``, or values ``(b, k)`` (or ``(b,)``). :func:`per_example_loss`
and :func:`evaluate` merge an ``nnx`` model from its ``(params, graphdef)``
and apply the task.

Examples:
  >>> import jax.numpy as jnp
  >>> task = get_task("lm")
  >>> task.target_metric, task.higher_is_better
  ('loss', False)
  >>> logits = jnp.zeros((2, 4, 256))
  >>> batch = (jnp.zeros((2, 4), jnp.int32), jnp.ones((2, 4), jnp.int32))
  >>> task.loss(logits, batch).shape
  (2,)
  >>> means = {k: float(v) for k, v in task.metrics(logits, batch).items()}
  >>> round(task.summarize(means)["perplexity"])
  256
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from hpsjax._factory import import_factory
from hpsjax.models import Params, batch_stats_of, merge_model

__all__ = [
    "TASKS",
    "Task",
    "check_target",
    "classification",
    "evaluate",
    "get_task",
    "higher_is_better",
    "language_model",
    "per_example_loss",
    "per_example_loss_with_stats",
    "regression",
    "reported_metrics",
]


class Task(NamedTuple):
    """What is learned: the loss, the evaluation metrics, the target.

    Attributes:
      name: ``"classification"``, ``"lm"``, ``"regression"``, or the user's.
      loss: ``loss(outputs, batch) -> (b,)`` float32 losses, one per example;
        ``outputs = model(batch[0])``. Training minimises their mean.
      metrics: ``metrics(outputs, batch) -> {name: scalar}``, the batch's
        means, always with ``"loss"``.
      summarize: from the metrics averaged over evaluation batches (weighted
        by examples) to what is reported, e.g. adding ``"perplexity"``.
      target_metric: the reported metric a run's target is set on.
      higher_is_better: the target's direction.
      tokens_per_example: from a :class:`hpsjax.data.Dataset` to the tokens
        one example counts (the sequence length for a language model, else
        1), for tokens per second.
      metric_names: the keys ``metrics`` returns (``summarize`` may add
        more); empty for a user's task means ``"loss"`` and
        ``target_metric``.
    """

    name: str
    loss: Callable[[jax.Array, Any], jax.Array]
    metrics: Callable[[jax.Array, Any], dict[str, jax.Array]]
    summarize: Callable[[Mapping[str, float]], dict[str, float]]
    target_metric: str
    higher_is_better: bool
    tokens_per_example: Callable[[Any], int]
    metric_names: tuple[str, ...] = ()


def _as_dict(means: Mapping[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in means.items()}


def _one_token(dataset: Any) -> int:
    del dataset
    return 1


def _classification_loss(outputs: jax.Array, batch: Any) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(
        outputs.astype(jnp.float32), batch[1]
    )


def _hits(outputs: jax.Array, batch: Any) -> jax.Array:
    return (jnp.argmax(outputs, axis=-1) == batch[1]).astype(jnp.float32)


def _softmax_task(name, loss, summarize, target, higher, tokens) -> Task:
    """A task of softmax outputs that reports its loss and the accuracy of
    its top output."""

    def metrics(outputs, batch):
        return {
            "loss": jnp.mean(loss(outputs, batch)),
            "accuracy": jnp.mean(_hits(outputs, batch)),
        }

    return Task(
        name, loss, metrics, summarize, target, higher, tokens, ("loss", "accuracy")
    )


def classification() -> Task:
    """Softmax cross-entropy on integer labels ``(b,)``; the target is the
    test accuracy, up."""
    return _softmax_task(
        "classification", _classification_loss, _as_dict, "accuracy", True, _one_token
    )


def _sequence_loss(outputs: jax.Array, batch: Any) -> jax.Array:
    losses = optax.softmax_cross_entropy_with_integer_labels(
        outputs.astype(jnp.float32), batch[1]
    )
    return jnp.mean(losses, axis=-1)


def _with_perplexity(means: Mapping[str, float]) -> dict[str, float]:
    out = _as_dict(means)
    out["perplexity"] = math.exp(min(out["loss"], 700.0))
    return out


def _sequence_length(dataset: Any) -> int:
    return int(dataset.input_shape[0])


def language_model() -> Task:
    """Next-token prediction: logits ``(b, L, vocab)``, next tokens ``(b, L)``;
    an example's loss is its mean token cross-entropy; reports ``loss``,
    ``accuracy`` (next token) and ``perplexity``; the target is the
    validation loss, down."""
    return _softmax_task(
        "lm", _sequence_loss, _with_perplexity, "loss", False, _sequence_length
    )


def _squared_error(outputs: jax.Array, batch: Any) -> jax.Array:
    b = outputs.shape[0]
    predicted = jnp.reshape(outputs.astype(jnp.float32), (b, -1))
    target = jnp.reshape(batch[1].astype(jnp.float32), (b, -1))
    if predicted.shape != target.shape:
        raise ValueError(
            f"regression outputs {predicted.shape[1]} values per example, the "
            f"targets {target.shape[1]}"
        )
    return jnp.mean(jnp.square(predicted - target), axis=-1)


def regression() -> Task:
    """Mean squared error of each example over its outputs (values ``(b,)``
    or ``(b, k)``, outputs ``(b, k)``); the target is the loss, down."""

    def metrics(outputs, batch):
        return {"loss": jnp.mean(_squared_error(outputs, batch))}

    return Task(
        "regression",
        _squared_error,
        metrics,
        _as_dict,
        "loss",
        False,
        _one_token,
        ("loss",),
    )


TASKS: dict[str, Callable[[], Task]] = {
    "classification": classification,
    "lm": language_model,
    "regression": regression,
}
"""The built-in tasks by the name :func:`get_task` and ``--task`` take."""


def _check_task(task: Any, source: str) -> Task:
    if not isinstance(task, Task):
        raise ValueError(
            f"{source} must return an hpsjax.tasks.Task, got {type(task).__name__}"
        )
    for field in ("loss", "metrics", "summarize", "tokens_per_example"):
        if not callable(getattr(task, field)):
            raise ValueError(f"{source}'s Task.{field} is not callable")
    if not isinstance(task.name, str) or not task.name:
        raise ValueError(f"{source}'s Task.name must be a non-empty string")
    if not isinstance(task.target_metric, str) or not task.target_metric:
        raise ValueError(f"{source}'s Task.target_metric must be a non-empty string")
    if not isinstance(task.higher_is_better, bool):
        raise ValueError(f"{source}'s Task.higher_is_better must be a bool")
    return task


def get_task(spec: str) -> Task:
    """The task of a built-in name or of a user's factory.

    Args:
      spec: a key of :data:`TASKS` (``"classification"``, ``"lm"``,
        ``"regression"``), or ``"package.module:make_task"``, a function of no
        arguments returning a :class:`Task` (importable from the working
        directory or ``PYTHONPATH``).

    Returns:
      The :class:`Task`.

    Raises:
      ValueError: an unknown name (the message lists the valid ones), a
        module that does not import, a missing function, a factory that
        fails or returns something else than a :class:`Task` (one line each).

    Examples:
      >>> get_task("regression").target_metric
      'loss'
      >>> get_task("ranking")  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: unknown task 'ranking'; valid names: classification, lm, ...
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"task must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec not in TASKS:
            raise ValueError(
                f"unknown task {spec!r}; valid names: {', '.join(sorted(TASKS))} "
                "or 'package.module:make_task'"
            )
        return TASKS[spec]()
    factory = import_factory(spec, "task", "make_task")
    try:
        task = factory()
    except TypeError as e:
        raise ValueError(f"task factory {spec!r} refused to be called: {e}") from e
    return _check_task(task, f"task factory {spec!r}")


def reported_metrics(task: Task) -> tuple[str, ...]:
    """The metrics an evaluation of ``task`` reports: its ``metric_names``
    (``"loss"`` and its target's for a task that names none) and what its
    ``summarize`` adds, sorted."""
    names = set(task.metric_names) or {"loss", task.target_metric}
    return tuple(sorted(task.summarize(dict.fromkeys(names, 1.0))))


def check_target(task: Task, metric: str) -> None:
    """Checks that ``task`` reports ``metric``, the metric of a run's target.

    Raises:
      ValueError: one line naming the metrics the task reports.

    Examples:
      >>> check_target(get_task("lm"), "perplexity")
      >>> check_target(get_task("regression"), "accuracy")
      Traceback (most recent call last):
      ...
      ValueError: task 'regression' reports no metric 'accuracy'; its metrics: loss
    """
    reported = reported_metrics(task)
    if metric not in reported:
        raise ValueError(
            f"task {task.name!r} reports no metric {metric!r}; its metrics: "
            f"{', '.join(reported)}"
        )


_DIRECTIONS = {"accuracy": True, "loss": False, "perplexity": False}


def higher_is_better(task: Task, metric: str) -> bool:
    """Whether a higher ``metric`` is better: the task's own direction for its
    target metric, else the known one of ``accuracy`` (up), ``loss`` and
    ``perplexity`` (down).

    Raises:
      ValueError: a metric the task does not report, or one of a user's task
        whose direction is not known (one line each).

    Examples:
      >>> higher_is_better(get_task("lm"), "perplexity")
      False
    """
    check_target(task, metric)
    if metric == task.target_metric:
        return task.higher_is_better
    if metric not in _DIRECTIONS:
        raise ValueError(
            f"the direction of task {task.name!r}'s metric {metric!r} is not "
            f"known; set the target on {task.target_metric!r}"
        )
    return _DIRECTIONS[metric]


def per_example_loss(
    task: Task, params: Params, graphdef: nnx.GraphDef, batch: Any
) -> jax.Array:
    """``task.loss`` of the model ``(params, graphdef)`` on ``batch = (x, y)``.

    Returns:
      Losses of shape ``(b,)``, float32.
    """
    return task.loss(merge_model(graphdef, params)(batch[0]), batch)


def per_example_loss_with_stats(
    task: Task, params: Params, batch_stats: Params, graphdef: nnx.GraphDef, batch: Any
) -> tuple[jax.Array, Params]:
    """Training-mode ``task.loss`` of a model with batch statistics.

    BatchNorm normalises with the batch's own statistics and folds them into
    its running ones (see :func:`hpsjax.models.split_with_batch_stats`).

    Returns:
      ``(losses, batch_stats)``: losses ``(b,)`` and the new running
      statistics.
    """
    model = merge_model(graphdef, params, batch_stats=batch_stats)
    model.train()
    outputs = model(batch[0])
    stats = batch_stats_of(model)
    return task.loss(outputs, batch), stats


def evaluate(
    task: Task,
    params: Params,
    graphdef: nnx.GraphDef,
    batch: Any,
    *,
    batch_stats: Params | None = None,
) -> dict[str, jax.Array]:
    """``task.metrics`` of the model on ``batch`` (evaluation mode: BatchNorm
    with the running ``batch_stats``, for a model that has them).

    Returns:
      The batch's mean metrics, ``"loss"`` among them.
    """
    model = merge_model(graphdef, params, batch_stats=batch_stats)
    if batch_stats is not None:
        model.eval()
    return task.metrics(model(batch[0]), batch)
