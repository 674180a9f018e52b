r"""Flax NNX models and the functional bridge the parameter server trades in.

The parameter server and the wire move plain pytrees: a nested ``dict`` of
arrays with ``str`` keys. :func:`split_model` turns an ``nnx.Module`` into its
static ``graphdef`` and such a dict; :func:`merge_model` rebuilds the module.
:func:`loss_fn`, :func:`per_example_loss` and :func:`accuracy` are pure
functions of ``(params, graphdef, batch)``, and :func:`make_train_functions`
returns their jitted forms for one model.

The training objective is the mean softmax cross-entropy over a batch of
``n`` examples with logits :math:`z_i = f_\theta(x_i)` and labels
:math:`y_i`:

.. math::

  \mathcal{L}(\theta) = \frac{1}{n} \sum_{i=1}^{n}
    \Big( \log \sum_{c} e^{z_{i,c}} - z_{i, y_i} \Big).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> model = MLP(64, (32,), 10, rngs=nnx.Rngs(0))
  >>> graphdef, params = split_model(model)
  >>> sorted(params), sorted(params["layers"])
  (['layers'], ['0', '1'])
  >>> train = make_train_functions(graphdef)
  >>> batch = (jnp.zeros((4, 8, 8, 1)), jnp.zeros((4,), jnp.int32))
  >>> loss, grads = train.loss_and_grad(params, batch)
  >>> jax.tree.structure(grads) == jax.tree.structure(params)
  True
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = [
    "MODELS",
    "MLP",
    "SmallCNN",
    "TrainFunctions",
    "accuracy",
    "get_model",
    "loss_fn",
    "make_train_functions",
    "merge_model",
    "per_example_loss",
    "split_model",
]

Params = dict[str, Any]


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


class MLP(nnx.Module):
    """A multilayer perceptron classifier with ReLU hidden layers.

    Inputs of any shape ``(b, ...)`` are flattened to ``(b, in_features)``.

    Args:
      in_features: number of input features after flattening (64 for 8x8
        images, 784 for 28x28).
      hidden: widths of the hidden layers, possibly empty (a linear softmax
        classifier).
      num_classes: number of output logits.
      rngs: random streams for the initial weights.

    Examples:
      >>> import jax.numpy as jnp
      >>> model = MLP(64, (128, 64), 10, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((2, 8, 8, 1))).shape
      (2, 10)
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (64, 64),
        num_classes: int = 10,
        *,
        rngs: nnx.Rngs,
    ):
        in_features = _check_positive_int("in_features", in_features)
        num_classes = _check_positive_int("num_classes", num_classes)
        if isinstance(hidden, int):
            raise ValueError(f"hidden must be a sequence of widths, got {hidden!r}")
        widths = [_check_positive_int("hidden width", h) for h in hidden]
        sizes = [in_features, *widths, num_classes]
        self.in_features = in_features
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.reshape(x, (x.shape[0], -1))
        if x.shape[1] != self.in_features:
            raise ValueError(
                f"MLP expects {self.in_features} features per example, got {x.shape[1]}"
            )
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


class SmallCNN(nnx.Module):
    """A small convolutional classifier for 8x8 or 28x28 grayscale images.

    Two 3x3 convolutions (16 and 32 channels), each followed by ReLU and 2x2
    max pooling, then a 64-unit ReLU layer and the output layer. Inputs are
    ``(b, height, width, in_channels)``, or ``(b, height, width)`` when
    ``in_channels`` is 1.

    Args:
      num_classes: number of output logits.
      in_channels: channels of the input images.
      image_size: input height and width, an int or a pair; at least 4.
      rngs: random streams for the initial weights.

    Examples:
      >>> import jax.numpy as jnp
      >>> model = SmallCNN(10, in_channels=1, image_size=28, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((2, 28, 28, 1))).shape
      (2, 10)
    """

    def __init__(
        self,
        num_classes: int = 10,
        *,
        in_channels: int = 1,
        image_size: int | tuple[int, int] = 28,
        rngs: nnx.Rngs,
    ):
        num_classes = _check_positive_int("num_classes", num_classes)
        in_channels = _check_positive_int("in_channels", in_channels)
        if isinstance(image_size, int):
            image_size = (image_size, image_size)
        height, width = (_check_positive_int("image_size", s) for s in image_size)
        if min(height, width) < 4:
            raise ValueError(f"image_size must be at least 4, got {image_size}")
        self.image_shape = (height, width, in_channels)
        self.conv1 = nnx.Conv(in_channels, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, (3, 3), rngs=rngs)
        flat = 32 * (height // 4) * (width // 4)
        self.dense = nnx.Linear(flat, 64, rngs=rngs)
        self.head = nnx.Linear(64, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3 and self.image_shape[2] == 1:
            x = x[..., None]
        if tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(
                f"SmallCNN expects images of shape {self.image_shape}, got "
                f"{tuple(x.shape[1:])}"
            )
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), strides=(2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), strides=(2, 2))
        x = jnp.reshape(x, (x.shape[0], -1))
        return self.head(nnx.relu(self.dense(x)))


def _stringify_keys(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _stringify_keys(v) for k, v in tree.items()}
    return tree


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
        raise ValueError(
            f"split_model takes models whose state is all nnx.Param; this one also "
            f"holds {names}"
        )
    return graphdef, _stringify_keys(nnx.to_pure_dict(params))


def _key_paths(tree: Any) -> list[str]:
    return [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(tree)
    ]


def merge_model(graphdef: nnx.GraphDef, params: Params) -> nnx.Module:
    """Rebuilds the model of ``graphdef`` with the parameters ``params``.

    Works on traced values too, so it runs inside ``jax.jit`` and ``jax.grad``.
    The keys of ``params`` are checked against the model's (``nnx.merge``
    alone places leaves by position and would accept misnamed keys); shapes are
    not known to a graphdef and show up when the model runs.

    Args:
      graphdef: from :func:`split_model`.
      params: a dict of the structure :func:`split_model` returned.

    Returns:
      The module.

    Raises:
      ValueError: ``params`` does not have the model's structure (the message
        names the first differing key path).
    """
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict, got {type(params).__name__}")
    try:
        model = nnx.merge(graphdef, params)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"params do not fit the model's graphdef: {e}") from e
    _, state, _ = nnx.split(model, nnx.Param, ...)
    expected = _key_paths(_stringify_keys(nnx.to_pure_dict(state)))
    given = _key_paths(_stringify_keys(params))
    if expected != given:
        first = next(
            (f"{e} != {g}" for e, g in zip(expected, given, strict=False) if e != g),
            f"{len(expected)} leaves expected, {len(given)} given",
        )
        raise ValueError(f"params do not fit the model's graphdef: {first}")
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


def _make_mlp(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> MLP:
    return MLP(math.prod(input_shape), num_classes=num_classes, rngs=rngs, **kwargs)


def _make_cnn(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> SmallCNN:
    if len(input_shape) == 2:
        input_shape = (*input_shape, 1)
    if len(input_shape) != 3:
        raise ValueError(
            f"cnn takes images (height, width[, channels]), got input shape "
            f"{tuple(input_shape)}"
        )
    height, width, channels = input_shape
    return SmallCNN(
        num_classes,
        in_channels=channels,
        image_size=(height, width),
        rngs=rngs,
        **kwargs,
    )


MODELS: dict[str, Callable[..., nnx.Module]] = {"mlp": _make_mlp, "cnn": _make_cnn}


def get_model(
    name: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int = 0,
    **kwargs: Any,
) -> nnx.Module:
    """Builds a model by registry name (for configs).

    Args:
      name: a key of :data:`MODELS`: ``"mlp"`` or ``"cnn"``.
      input_shape: shape of one example, e.g. ``dataset.input_shape``.
      num_classes: number of classes.
      seed: seed of the initial weights.
      **kwargs: further arguments of the model (e.g. ``hidden=(128,)``).

    Returns:
      The initialised module.

    Raises:
      ValueError: an unknown name (the message lists the valid ones) or bad
        arguments.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {sorted(MODELS)}")
    return MODELS[name](tuple(input_shape), num_classes, rngs=nnx.Rngs(seed), **kwargs)
