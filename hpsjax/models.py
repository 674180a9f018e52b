r"""Flax NNX models and the functional bridge the parameter server trades in.

Which models train. The registry :data:`MODELS` (``--model NAME``) holds an
:class:`MLP`, a :class:`SmallCNN` and a :class:`SmallResNet` (with BatchNorm)
for classification or regression, and a decoder-only :class:`Transformer`
language model (``transformer``, and the presets ``transformer_1m`` and
``transformer_30m``). Any other flax NNX module comes from a factory
``"package.module:make_model"`` (:func:`resolve_model`), on two conditions:
its state is ``nnx.Param`` (plus ``nnx.BatchStat``, which stays on each
worker: :func:`split_with_batch_stats`; random-number streams or other
variables are refused), and its outputs on a batch ``(b, *input_shape)`` are
what the run's task takes (:mod:`hpsjax.tasks`): logits ``(b, classes)`` for
classification, ``(b, L, vocab)`` for a language model, values ``(b, k)`` for
regression, or whatever a user's task's loss reads. The loss, not the model,
is the task's: every path (``hpsjax-worker --task``, the simulator,
``experiments``' ``config.task``) trains ``task.loss`` of the model's outputs.

The parameter server and the wire move plain pytrees: a nested ``dict`` of
arrays with ``str`` keys. :func:`split_model` turns an ``nnx.Module`` into its
static ``graphdef`` and such a dict; :func:`merge_model` rebuilds the module.
:func:`loss_fn`, :func:`per_example_loss` and :func:`accuracy` are the
classification task's pure functions of ``(params, graphdef, batch)`` (kept
for callers of earlier versions; :func:`hpsjax.tasks.per_example_loss` takes
any task), and :func:`make_train_functions` returns their jitted forms for one
model.

The classification objective is the mean softmax cross-entropy over a batch
of ``n`` examples with logits :math:`z_i = f_\theta(x_i)` and labels
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

import functools
import itertools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hpsjax._checks import check_int
from hpsjax._factory import import_factory
from hpsjax._npz import PARAMS_MARKER, nest_named_arrays, open_npz, params_marker

__all__ = [
    "MODELS",
    "MLP",
    "ResolvedModel",
    "SmallCNN",
    "SmallResNet",
    "StatefulTrainFunctions",
    "TRANSFORMER_PRESETS",
    "TrainFunctions",
    "Transformer",
    "accuracy",
    "get_model",
    "load_params_npz",
    "loss_fn",
    "make_stateful_train_functions",
    "make_train_functions",
    "merge_model",
    "per_example_loss",
    "per_example_loss_with_stats",
    "resolve_model",
    "save_params_npz",
    "split_model",
    "split_trainable",
    "split_with_batch_stats",
]

Params = dict[str, Any]


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
        in_features = check_int("in_features", in_features, low=1)
        num_classes = check_int("num_classes", num_classes, low=1)
        if isinstance(hidden, int):
            raise ValueError(f"hidden must be a sequence of widths, got {hidden!r}")
        widths = [check_int("hidden width", h, low=1) for h in hidden]
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
        num_classes = check_int("num_classes", num_classes, low=1)
        in_channels = check_int("in_channels", in_channels, low=1)
        if isinstance(image_size, int):
            image_size = (image_size, image_size)
        height, width = (check_int("image_size", s, low=1) for s in image_size)
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


class _ResidualBlock(nnx.Module):
    """Two 3x3 convolutions with BatchNorm and a shortcut (projected when the
    shape changes)."""

    def __init__(self, in_channels: int, channels: int, stride: int, *, rngs):
        conv = functools.partial(nnx.Conv, use_bias=False, rngs=rngs)
        self.conv1 = conv(in_channels, channels, (3, 3), strides=stride)
        self.bn1 = nnx.BatchNorm(channels, rngs=rngs)
        self.conv2 = conv(channels, channels, (3, 3))
        self.bn2 = nnx.BatchNorm(channels, rngs=rngs)
        projection = []
        if stride != 1 or in_channels != channels:
            projection = [
                conv(in_channels, channels, (1, 1), strides=stride),
                nnx.BatchNorm(channels, rngs=rngs),
            ]
        self.projection = nnx.List(projection)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = nnx.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        shortcut = x
        for layer in self.projection:
            shortcut = layer(shortcut)
        return nnx.relu(y + shortcut)


class SmallResNet(nnx.Module):
    """A small residual network with BatchNorm for small images.

    A 3x3 convolution with BatchNorm, then one residual block per entry of
    ``widths`` (the first at full resolution, each later one halving it),
    global average pooling and the output layer. Its BatchNorm statistics are
    ``nnx.BatchStat`` state: split it with :func:`split_with_batch_stats` and
    train it with :func:`make_stateful_train_functions`.

    References:
      He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition",
      CVPR 2016, https://arxiv.org/abs/1512.03385. Ioffe, Szegedy, "Batch
      Normalization", ICML 2015, https://arxiv.org/abs/1502.03167.

    Args:
      num_classes: number of output logits.
      in_channels: channels of the input images.
      image_size: input height and width, an int or a pair.
      widths: channels of the residual blocks.
      rngs: random streams for the initial weights.

    Examples:
      >>> import jax.numpy as jnp
      >>> model = SmallResNet(10, in_channels=1, image_size=8, rngs=nnx.Rngs(0))
      >>> model(jnp.ones((2, 8, 8, 1))).shape
      (2, 10)
    """

    def __init__(
        self,
        num_classes: int = 10,
        *,
        in_channels: int = 1,
        image_size: int | tuple[int, int] = 8,
        widths: Sequence[int] = (16, 32),
        rngs: nnx.Rngs,
    ):
        num_classes = check_int("num_classes", num_classes, low=1)
        in_channels = check_int("in_channels", in_channels, low=1)
        if isinstance(image_size, int):
            image_size = (image_size, image_size)
        height, width = (check_int("image_size", s, low=1) for s in image_size)
        if isinstance(widths, int) or not widths:
            raise ValueError(f"widths must be a non-empty sequence, got {widths!r}")
        widths = [check_int("width", w, low=1) for w in widths]
        self.image_shape = (height, width, in_channels)
        self.stem = nnx.Conv(in_channels, widths[0], (3, 3), use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(widths[0], rngs=rngs)
        self.blocks = nnx.List(
            [
                _ResidualBlock(a, b, 1 if i == 0 else 2, rngs=rngs)
                for i, (a, b) in enumerate(itertools.pairwise([widths[0], *widths]))
            ]
        )
        self.head = nnx.Linear(widths[-1], num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3 and self.image_shape[2] == 1:
            x = x[..., None]
        if tuple(x.shape[1:]) != self.image_shape:
            raise ValueError(
                f"SmallResNet expects images of shape {self.image_shape}, got "
                f"{tuple(x.shape[1:])}"
            )
        x = nnx.relu(self.stem_bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(jnp.mean(x, axis=(1, 2)))


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary position embedding of ``x``, ``(b, length, heads, head_dim)``:
    each pair of features ``(i, i + head_dim / 2)`` of position ``p`` turned by
    the angle ``p * 10000 ** (-2 i / head_dim)``."""
    half = x.shape[-1] // 2
    frequencies = 10000.0 ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * frequencies
    sin = jnp.sin(angles)[None, :, None, :].astype(x.dtype)
    cos = jnp.cos(angles)[None, :, None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class _CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention with rotary positions on queries and
    keys."""

    def __init__(self, d_model: int, num_heads: int, *, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, length, d = x.shape
        head_dim = d // self.num_heads
        qkv = self.qkv(x).reshape(b, length, 3, self.num_heads, head_dim)
        q, k, v = _rotary(qkv[:, :, 0]), _rotary(qkv[:, :, 1]), qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((length, length), bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, length, d)
        return self.out(y)


class _DecoderBlock(nnx.Module):
    """Pre-norm block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, rngs):
        self.norm1 = nnx.RMSNorm(d_model, rngs=rngs)
        self.attention = _CausalSelfAttention(d_model, num_heads, rngs=rngs)
        self.norm2 = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, rngs=rngs)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    r"""A decoder-only transformer language model.

    Tokens are embedded, pass ``num_layers`` pre-norm blocks (RMSNorm, causal
    multi-head self-attention with rotary positions, a GELU MLP of
    ``mlp_ratio * d_model`` units, each with a residual connection) and a final
    RMSNorm; the logits are the products with the token embeddings (tied input
    and output embeddings). Position ``t``'s logits see tokens ``0 .. t`` only.

    The parameters number about :math:`V d + L (4 + 2 r) d^2` for vocabulary
    :math:`V`, ``d_model`` :math:`d`, ``num_layers`` :math:`L` and
    ``mlp_ratio`` :math:`r`: :data:`TRANSFORMER_PRESETS` gives about 1M and
    30M (``--model transformer_1m`` or ``transformer_30m``).

    References:
      Vaswani et al., "Attention Is All You Need", NeurIPS 2017,
      https://arxiv.org/abs/1706.03762. Su et al., "RoFormer: Enhanced
      Transformer with Rotary Position Embedding", 2021,
      https://arxiv.org/abs/2104.09864. Press, Wolf, "Using the Output
      Embedding to Improve Language Models", EACL 2017,
      https://arxiv.org/abs/1608.05859.

    Args:
      vocab_size: number of token values (256 for bytes).
      seq_len: the longest sequence it takes.
      d_model: width of the residual stream, a multiple of ``num_heads``
        whose per-head width is even.
      num_layers: number of blocks.
      num_heads: attention heads.
      mlp_ratio: MLP width over ``d_model``.
      rngs: random streams for the initial weights.

    Examples:
      >>> import jax.numpy as jnp
      >>> model = Transformer(256, seq_len=16, d_model=32, num_layers=1,
      ...                     num_heads=2, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)
    """

    def __init__(
        self,
        vocab_size: int = 256,
        *,
        seq_len: int = 64,
        d_model: int = 128,
        num_layers: int = 5,
        num_heads: int = 4,
        mlp_ratio: int = 4,
        rngs: nnx.Rngs,
    ):
        vocab_size = check_int("vocab_size", vocab_size, low=1)
        self.seq_len = check_int("seq_len", seq_len, low=1)
        d_model = check_int("d_model", d_model, low=1)
        num_layers = check_int("num_layers", num_layers, low=1)
        num_heads = check_int("num_heads", num_heads, low=1)
        mlp_ratio = check_int("mlp_ratio", mlp_ratio, low=1)
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(
                f"d_model must be num_heads times an even head width, got "
                f"d_model={d_model}, num_heads={num_heads}"
            )
        self.embed = nnx.Embed(
            vocab_size,
            d_model,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.blocks = nnx.List(
            [
                _DecoderBlock(d_model, num_heads, mlp_ratio, rngs=rngs)
                for _ in range(num_layers)
            ]
        )
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Logits ``(b, length, vocab_size)`` of tokens ``x``, ``(b, length)``
        (integers, or floats holding integers: they are cast)."""
        if x.ndim != 2 or not 0 < x.shape[1] <= self.seq_len:
            raise ValueError(
                f"Transformer expects tokens (batch, length <= {self.seq_len}), got "
                f"shape {tuple(x.shape)}"
            )
        h = self.embed(x.astype(jnp.int32))
        for block in self.blocks:
            h = block(h)
        return self.embed.attend(self.norm(h))


TRANSFORMER_PRESETS: dict[str, dict[str, int]] = {
    "transformer_1m": {"d_model": 128, "num_layers": 5, "num_heads": 4},
    "transformer_30m": {"d_model": 512, "num_layers": 10, "num_heads": 8},
}
"""The :class:`Transformer` sizes of the registry's ``transformer_1m`` (about
1.0M parameters with 256 byte tokens) and ``transformer_30m`` (about 31.6M,
126 MB in float32); other keyword arguments replace the preset's."""


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
    stats = _stringify_keys(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
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
        stats = _stringify_keys(nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))
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
        raise ValueError(f"unknown model {name!r}; valid names: {sorted(MODELS)}")
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
                f"unknown model {spec!r}; valid names: {sorted(MODELS)} or "
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
