"""The functional bridge: a module as its graph and a dict of parameters, the
classification task's pure loss and accuracy, their jitted forms, and the
parameter ``.npz`` files the server starts from."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hpsjax._npz import PARAMS_MARKER, nest_named_arrays, open_npz, params_marker

Params = dict[str, Any]


def _stringify_keys(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _stringify_keys(v) for k, v in tree.items()}
    return tree


def batch_stats_of(model: nnx.Module) -> Params:
    """A model's running batch statistics (its ``nnx.BatchStat`` state) as a
    plain dict with ``str`` keys, as :func:`split_with_batch_stats` gives
    them (empty for a model without)."""
    return _stringify_keys(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, Params]:
    """Splits a model into its static graph and a plain dict of parameters.

    The parameters are the model's ``nnx.Param`` variables as a nested ``dict``
    of arrays whose keys are all ``str`` (list indices become ``"0"``,
    ``"1"``, ...), the form the parameter server, the wire and checkpoints take.

    Args:
      model: an ``nnx.Module`` whose state is all ``nnx.Param`` (no batch
        statistics or random-number state, which a parameter server would not
        average).

    Returns:
      ``(graphdef, params)``; ``merge_model(graphdef, params)`` rebuilds it.

    Raises:
      ValueError: the model holds state other than ``nnx.Param``.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    others = nnx.to_flat_state(rest)
    if len(others):
        names = sorted({type(v).__name__ for _, v in others})
        hint = (
            "; split it with split_with_batch_stats" if names == ["BatchStat"] else ""
        )
        raise ValueError(
            f"split_model takes models whose state is all nnx.Param; this one also "
            f"holds {names}{hint}"
        )
    return graphdef, _stringify_keys(nnx.to_pure_dict(params))


def split_with_batch_stats(
    model: nnx.Module,
) -> tuple[nnx.GraphDef, Params, Params]:
    """Splits a model with BatchNorm into its graph, parameters and statistics.

    Only the parameters trade through the parameter server; each worker keeps
    its own batch statistics (the running means and variances of BatchNorm),
    updates them as it trains, and evaluates with them. This is FedBN's choice
    (statistics stay local while the weights are shared), which keeps BatchNorm
    from mixing statistics of differently distributed shards and asks nothing
    of the server: statistics have no gradient, so the server's optimizer could
    not apply them as it applies updates. Averaging them as FedAvg averages
    all model state is the alternative it was measured against.

    References:
      Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on Non-IID
      Features via Local Batch Normalization", ICLR 2021,
      https://arxiv.org/abs/2102.07623. McMahan et al., "Communication-Efficient
      Learning of Deep Networks from Decentralized Data", AISTATS 2017,
      https://arxiv.org/abs/1602.05629.

    Args:
      model: an ``nnx.Module`` whose state is ``nnx.Param`` and
        ``nnx.BatchStat`` (a stateless model gives empty statistics).

    Returns:
      ``(graphdef, params, batch_stats)``, both dicts with ``str`` keys as
      :func:`split_model` gives; ``merge_model(graphdef, params,
      batch_stats=batch_stats)`` rebuilds the model.

    Raises:
      ValueError: the model holds other state (e.g. random-number streams).
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    graphdef, params, stats, rest = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    others = nnx.to_flat_state(rest)
    if len(others):
        names = sorted({type(v).__name__ for _, v in others})
        raise ValueError(
            f"split_with_batch_stats takes models whose state is nnx.Param and "
            f"nnx.BatchStat; this one also holds {names}"
        )
    return (
        graphdef,
        _stringify_keys(nnx.to_pure_dict(params)),
        _stringify_keys(nnx.to_pure_dict(stats)),
    )


def split_trainable(
    model: nnx.Module,
) -> tuple[nnx.GraphDef, Params, Params | None]:
    """Splits any supported model: ``(graphdef, params, batch_stats)``.

    A model with ``nnx.BatchStat`` state is split as
    :func:`split_with_batch_stats` does; any other as :func:`split_model` does,
    with ``batch_stats`` ``None``. Only ``params`` go through the parameter
    server either way.

    Raises:
      ValueError: the model holds state other than ``nnx.Param`` and
        ``nnx.BatchStat``.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(f"model must be an nnx.Module, got {type(model).__name__}")
    if len(nnx.to_flat_state(nnx.state(model, nnx.BatchStat))):
        return split_with_batch_stats(model)
    graphdef, params = split_model(model)
    return graphdef, params, None


def _key_paths(tree: Any) -> list[str]:
    return [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def _check_fits(model: nnx.Module, kind: Any, given: Params, what: str) -> None:
    expected = _key_paths(_stringify_keys(nnx.to_pure_dict(nnx.state(model, kind))))
    given_paths = _key_paths(_stringify_keys(given))
    if expected != given_paths:
        first = next(
            (
                f"{e} != {g}"
                for e, g in zip(expected, given_paths, strict=False)
                if e != g
            ),
            f"{len(expected)} leaves expected, {len(given_paths)} given",
        )
        raise ValueError(f"{what} do not fit the model's graphdef: {first}")


def merge_model(
    graphdef: nnx.GraphDef, params: Params, *, batch_stats: Params | None = None
) -> nnx.Module:
    """Rebuilds the model of ``graphdef`` with the parameters ``params``.

    Works on traced values too, so it runs inside ``jax.jit`` and ``jax.grad``.
    The keys of ``params`` are checked against the model's (``nnx.merge``
    alone places leaves by position and would accept misnamed keys); shapes are
    not known to a graphdef and show up when the model runs.

    Args:
      graphdef: from :func:`split_model` or :func:`split_with_batch_stats`.
      params: a dict of the structure :func:`split_model` returned.
      batch_stats: the batch statistics, for a graphdef from
        :func:`split_with_batch_stats`.

    Returns:
      The module, in the mode it was split in (``model.train()`` and
      ``model.eval()`` switch BatchNorm between batch and running statistics).

    Raises:
      ValueError: ``params`` or ``batch_stats`` does not have the model's
        structure (the message names the first differing key path).
    """
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    if batch_stats is not None and not isinstance(batch_stats, dict):
        raise ValueError(
            f"batch_stats must be a dict, got {type(batch_stats).__name__}"
        )
    states = (params,) if batch_stats is None else (params, batch_stats)
    try:
        model = nnx.merge(graphdef, *states)
    except (KeyError, TypeError, ValueError) as e:
        what = "params" if batch_stats is None else "params or batch_stats"
        raise ValueError(f"{what} do not fit the model's graphdef: {e}") from e
    _check_fits(model, nnx.Param, params, "params")
    if batch_stats is not None:
        _check_fits(model, nnx.BatchStat, batch_stats, "batch_stats")
    return model


def _logits(params: Params, graphdef: nnx.GraphDef, x: jax.Array) -> jax.Array:
    return merge_model(graphdef, params)(x).astype(jnp.float32)


def per_example_loss(params: Params, graphdef: nnx.GraphDef, batch: Any) -> jax.Array:
    """Softmax cross-entropy of every example; ``batch`` is ``(x, y)``.

    Returns:
      Losses of shape ``(b,)``, float32.
    """
    x, y = batch[0], batch[1]
    return optax.softmax_cross_entropy_with_integer_labels(
        _logits(params, graphdef, x), y
    )


def per_example_loss_with_stats(
    params: Params, batch_stats: Params, graphdef: nnx.GraphDef, batch: Any
) -> tuple[jax.Array, Params]:
    """Training-mode per-example losses of a model with batch statistics.

    BatchNorm normalises with the batch's own statistics and folds them into
    its running ones, which come back updated.

    Returns:
      ``(losses, batch_stats)``: losses of shape ``(b,)`` and the new running
      statistics, a dict of the structure ``batch_stats`` has.
    """
    x, y = batch[0], batch[1]
    model = merge_model(graphdef, params, batch_stats=batch_stats)
    model.train()
    logits = model(x).astype(jnp.float32)
    stats = batch_stats_of(model)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y), stats


def loss_fn(params: Params, graphdef: nnx.GraphDef, batch: Any) -> jax.Array:
    """Mean softmax cross-entropy of a batch ``(x, y)`` (see the module maths).

    Args:
      params: model parameters from :func:`split_model`.
      graphdef: the model's graph from :func:`split_model`.
      batch: ``(x, y)`` (e.g. a :class:`hpsjax.data.Batch`), integer labels.

    Returns:
      A float32 scalar.
    """
    return jnp.mean(per_example_loss(params, graphdef, batch))


def accuracy(params: Params, graphdef: nnx.GraphDef, batch: Any) -> jax.Array:
    """Share of examples of ``batch = (x, y)`` whose top logit is the label.

    Returns:
      A float32 scalar in ``[0, 1]``.
    """
    x, y = batch[0], batch[1]
    predicted = jnp.argmax(_logits(params, graphdef, x), axis=-1)
    return jnp.mean((predicted == y).astype(jnp.float32))


class TrainFunctions(NamedTuple):
    """Jitted pure functions of one model (unpacks as a pair).

    Attributes:
      loss_and_grad: ``(params, batch) -> (loss, grads)``, grads shaped like
        params.
      evaluate: ``(params, batch) -> {"loss": ..., "accuracy": ...}``.
    """

    loss_and_grad: Callable[[Params, Any], tuple[jax.Array, Params]]
    evaluate: Callable[[Params, Any], dict[str, jax.Array]]


def make_train_functions(graphdef: nnx.GraphDef) -> TrainFunctions:
    """Jitted ``loss_and_grad`` and ``evaluate`` for the model of ``graphdef``.

    Each distinct batch shape compiles once; a worker whose batch size changes
    between rounds pays one compile per new size.

    Args:
      graphdef: the model's graph from :func:`split_model`.

    Returns:
      :class:`TrainFunctions` ``(loss_and_grad, evaluate)``.
    """
    if not isinstance(graphdef, nnx.GraphDef):
        raise ValueError(
            f"graphdef must be an nnx.GraphDef, got {type(graphdef).__name__}"
        )

    @jax.jit
    def loss_and_grad(params: Params, batch: Any) -> tuple[jax.Array, Params]:
        return jax.value_and_grad(loss_fn)(params, graphdef, batch)

    @jax.jit
    def evaluate(params: Params, batch: Any) -> dict[str, jax.Array]:
        return {
            "loss": loss_fn(params, graphdef, batch),
            "accuracy": accuracy(params, graphdef, batch),
        }

    return TrainFunctions(loss_and_grad, evaluate)


class StatefulTrainFunctions(NamedTuple):
    """Jitted pure functions of a model with batch statistics.

    Attributes:
      loss_and_grad: ``(params, batch_stats, batch) -> (loss, grads,
        batch_stats)``: BatchNorm normalises with the batch's statistics and
        the returned running statistics include it.
      evaluate: ``(params, batch_stats, batch) -> {"loss": ..., "accuracy":
        ...}`` with the running statistics.
    """

    loss_and_grad: Callable[[Params, Params, Any], tuple[jax.Array, Params, Params]]
    evaluate: Callable[[Params, Params, Any], dict[str, jax.Array]]


def make_stateful_train_functions(graphdef: nnx.GraphDef) -> StatefulTrainFunctions:
    """Jitted training and evaluation for a model of :func:`split_with_batch_stats`.

    A worker trades ``params`` and the gradients through the server and keeps
    ``batch_stats`` to itself (see :func:`split_with_batch_stats`).

    Args:
      graphdef: the model's graph from :func:`split_with_batch_stats`.

    Returns:
      :class:`StatefulTrainFunctions` ``(loss_and_grad, evaluate)``.
    """
    if not isinstance(graphdef, nnx.GraphDef):
        raise ValueError(
            f"graphdef must be an nnx.GraphDef, got {type(graphdef).__name__}"
        )

    def forward(params, batch_stats, x, *, train: bool):
        model = merge_model(graphdef, params, batch_stats=batch_stats)
        if train:
            model.train()
        else:
            model.eval()
        logits = model(x).astype(jnp.float32)
        stats = batch_stats_of(model)
        return logits, stats

    def train_loss(params, batch_stats, batch):
        logits, stats = forward(params, batch_stats, batch[0], train=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1])
        return jnp.mean(loss), stats

    @jax.jit
    def loss_and_grad(params, batch_stats, batch):
        grad_fn = jax.value_and_grad(train_loss, has_aux=True)
        (loss, stats), grads = grad_fn(params, batch_stats, batch)
        return loss, grads, stats

    @jax.jit
    def evaluate(params, batch_stats, batch):
        logits, _ = forward(params, batch_stats, batch[0], train=False)
        y = batch[1]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        hits = jnp.argmax(logits, axis=-1) == y
        return {"loss": jnp.mean(loss), "accuracy": jnp.mean(hits.astype(jnp.float32))}

    return StatefulTrainFunctions(loss_and_grad, evaluate)


def save_params_npz(path: str | os.PathLike, params: Params) -> None:
    """Writes parameters as the ``.npz`` file ``hpsjax-server --init`` reads.

    The format: one array per leaf, named by its key path joined with ``/``
    (``{"conv": {"w": ...}}`` is stored as ``"conv/w"``); float64 arrays are
    stored as float32, the dtype training runs in; other dtypes as they are;
    and the format marker ``__hpsjax_params__`` (:mod:`hpsjax._npz`), without
    which ``hpsjax-server --init`` refuses a file.

    Args:
      path: the file to write (``.npz`` is not appended).
      params: a nested dict with ``str`` keys (as :func:`split_model` gives)
        whose leaves are arrays.

    Raises:
      ValueError: an empty tree, a key that is empty, holds ``/`` or is the
        marker's name, or a leaf that is not an array of numbers.
    """
    if not isinstance(params, dict) or not params:
        raise ValueError("params must be a non-empty dict")
    flat: dict[str, Any] = {}

    def visit(node: Any, prefix: str) -> None:
        for key, value in node.items():
            name = f"{prefix}/{key}" if prefix else key
            if (
                not isinstance(key, str)
                or not key
                or "/" in key
                or name == PARAMS_MARKER
            ):
                raise ValueError(f"bad parameter key {key!r} under {prefix!r}")
            if isinstance(value, dict):
                visit(value, name)
                continue
            array = np.asarray(value)
            if array.dtype.kind not in "biuf":
                raise ValueError(f"parameter {name!r} is not numeric: {array.dtype}")
            flat[name] = (
                array.astype(np.float32) if array.dtype == np.float64 else array
            )

    visit(params, "")
    with open(path, "wb") as f:
        np.savez(f, **flat, **{PARAMS_MARKER: params_marker()})


def load_params_npz(path: str | os.PathLike) -> Params:
    """Reads an ``.npz`` file of :func:`save_params_npz`'s format as a nested dict.

    Names split on ``/`` into nested dicts; arrays keep their stored dtype;
    the format marker is left out. Object arrays are refused (nothing is
    unpickled).

    Raises:
      FileNotFoundError: no file at ``path``.
      ValueError: not an ``.npz`` archive, no arrays, a name with an empty part
        (``a//b``), or two names that clash (``a`` and ``a/b``).
    """
    path = os.fspath(path)
    archive = open_npz(path)
    with archive:
        named = {}
        for name in archive.files:
            try:
                named[name] = archive[name]
            except ValueError as e:
                raise ValueError(f"cannot read {name!r} from {path!r}: {e}") from e
    return nest_named_arrays(named, repr(path))
