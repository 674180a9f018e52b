"""The model registry (:data:`MODELS`, ``--model NAME``) and the resolution of a
name or a ``package.module:factory`` string into a module."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from flax import nnx

from hpsjax._factory import import_factory
from hpsjax.models._modules import (
    MLP,
    TRANSFORMER_PRESETS,
    SmallCNN,
    SmallResNet,
    Transformer,
)


def _image_shape(name: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    if len(input_shape) == 2:
        input_shape = (*input_shape, 1)
    if len(input_shape) != 3:
        raise ValueError(
            f"{name} takes images (height, width[, channels]), got input shape "
            f"{tuple(input_shape)}"
        )
    return tuple(input_shape)


def _make_mlp(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> MLP:
    return MLP(math.prod(input_shape), num_classes=num_classes, rngs=rngs, **kwargs)


def _make_cnn(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> SmallCNN:
    height, width, channels = _image_shape("cnn", input_shape)
    return SmallCNN(
        num_classes,
        in_channels=channels,
        image_size=(height, width),
        rngs=rngs,
        **kwargs,
    )


def _make_resnet(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> SmallResNet:
    height, width, channels = _image_shape("resnet", input_shape)
    return SmallResNet(
        num_classes,
        in_channels=channels,
        image_size=(height, width),
        rngs=rngs,
        **kwargs,
    )


def _make_transformer(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> Transformer:
    if len(input_shape) != 1:
        raise ValueError(
            f"transformer takes token sequences (seq_len,), got input shape "
            f"{tuple(input_shape)}"
        )
    return Transformer(num_classes, seq_len=input_shape[0], rngs=rngs, **kwargs)


def _make_transformer_1m(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> Transformer:
    preset = TRANSFORMER_PRESETS["transformer_1m"]
    return _make_transformer(input_shape, num_classes, rngs=rngs, **preset | kwargs)


def _make_transformer_30m(
    input_shape: Sequence[int], num_classes: int, *, rngs: nnx.Rngs, **kwargs: Any
) -> Transformer:
    preset = TRANSFORMER_PRESETS["transformer_30m"]
    return _make_transformer(input_shape, num_classes, rngs=rngs, **preset | kwargs)


MODELS: dict[str, Callable[..., nnx.Module]] = {
    "mlp": _make_mlp,
    "cnn": _make_cnn,
    "resnet": _make_resnet,
    "transformer": _make_transformer,
    "transformer_1m": _make_transformer_1m,
    "transformer_30m": _make_transformer_30m,
}
"""The models by the name :func:`get_model` and ``--model`` take: each builds
its module from ``(input_shape, num_classes, *, rngs, **kwargs)``."""


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
      name: a key of :data:`MODELS`: ``"mlp"``, ``"cnn"``, ``"resnet"``
        (a :class:`SmallResNet`, split with :func:`split_with_batch_stats`),
        ``"transformer"``, ``"transformer_1m"`` or ``"transformer_30m"``
        (a :class:`Transformer`; its ``seq_len`` is ``input_shape[0]``).
      input_shape: shape of one example, e.g. ``dataset.input_shape``.
      num_classes: number of classes, the vocabulary's size (a
        transformer's), or the number of values to regress (an MLP's
        outputs): ``dataset.num_classes``.
      seed: seed of the initial weights.
      **kwargs: further arguments of the model (e.g. ``hidden=(128,)``).

    Returns:
      The initialised module.

    Raises:
      ValueError: an unknown name (the message lists the valid ones) or bad
        arguments.
    """
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}"
        )
    return MODELS[name](tuple(input_shape), num_classes, rngs=nnx.Rngs(seed), **kwargs)


class ResolvedModel(NamedTuple):
    """A model built by :func:`resolve_model`.

    Attributes:
      model: the initialised ``nnx.Module``.
      input_shape: the shape of one example it takes, without the batch axis.
    """

    model: nnx.Module
    input_shape: tuple[int, ...]


def _input_shape(spec: Any, source: str) -> tuple[int, ...]:
    shape = getattr(spec, "shape", spec)
    if isinstance(shape, list | tuple) and all(
        isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape
    ):
        return tuple(shape)
    raise ValueError(
        f"{source} must return (module, input_shape) with input_shape a tuple of "
        f"positive ints or a jax.ShapeDtypeStruct, got {spec!r}"
    )


def resolve_model(
    spec: str,
    *,
    input_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    seed: int = 0,
    **kwargs: Any,
) -> ResolvedModel:
    """Builds a model from a registry name or a ``"module:factory"`` path.

    A built-in name (a key of :data:`MODELS`) is built for ``input_shape`` and
    ``num_classes``, as :func:`get_model` does. Any other flax model comes from
    a factory, named ``"my_pkg.my_module:make_model"`` (importable from the
    working directory or ``PYTHONPATH``), under this contract:

    .. code-block:: python

      def make_model(*, rngs: nnx.Rngs, **kwargs) -> tuple[nnx.Module, Any]:
          model = MyModel(..., rngs=rngs)
          return model, (28, 28, 1)  # or jax.ShapeDtypeStruct((28, 28, 1), ...)

    It is called with ``rngs=nnx.Rngs(seed)`` and the user's ``kwargs`` (not
    ``input_shape`` or ``num_classes``: the factory knows its model) and
    returns the initialised module, whose state is ``nnx.Param`` (and
    ``nnx.BatchStat``, see :func:`split_with_batch_stats`), and the shape of one
    example it takes, without the batch axis. The model maps a batch
    ``(b, *input_shape)`` to the outputs the run's task takes
    (:mod:`hpsjax.tasks`): logits ``(b, num_classes)`` for classification,
    ``(b, L, vocab)`` for a language model, values ``(b, k)`` for
    regression.

    Args:
      spec: a key of :data:`MODELS`, or ``"package.module:factory"``.
      input_shape: shape of one example, required for a built-in name; for a
        factory, checked against the shape it returns when given.
      num_classes: number of classes, required for a built-in name.
      seed: seed of the initial weights.
      **kwargs: further arguments of the model or factory.

    Returns:
      :class:`ResolvedModel` ``(model, input_shape)``.

    Raises:
      ValueError: an unknown name, a module that does not import, a missing
        attribute, a factory that refuses its arguments or returns something
        else than ``(nnx.Module, input_shape)``, or an input shape that differs
        from ``input_shape``.

    Examples:
      >>> resolve_model("mlp", input_shape=(8, 8, 1), num_classes=10).input_shape
      (8, 8, 1)
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a non-empty string, got {spec!r}")
    if ":" not in spec:
        if spec not in MODELS:
            raise ValueError(
                f"unknown model {spec!r}; valid names: {', '.join(sorted(MODELS))} or "
                "'package.module:factory'"
            )
        if input_shape is None or num_classes is None:
            raise ValueError(f"model {spec!r} needs input_shape and num_classes")
        model = get_model(
            spec, input_shape=input_shape, num_classes=num_classes, seed=seed, **kwargs
        )
        return ResolvedModel(model, tuple(input_shape))
    factory = import_factory(spec, "model")
    try:
        result = factory(rngs=nnx.Rngs(seed), **kwargs)
    except TypeError as e:
        raise ValueError(f"model factory {spec!r} refused its arguments: {e}") from e
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError(
            f"{spec!r} must return (module, input_shape), got {type(result).__name__}"
        )
    model, shape = result
    if not isinstance(model, nnx.Module):
        raise ValueError(
            f"{spec!r} must return an nnx.Module first, got {type(model).__name__}"
        )
    shape = _input_shape(shape, repr(spec))
    if input_shape is not None and tuple(input_shape) != shape:
        raise ValueError(
            f"{spec!r} takes inputs of shape {shape}, the data have "
            f"{tuple(input_shape)}"
        )
    return ResolvedModel(model, shape)
