"""The built-in flax NNX models: :class:`MLP`, :class:`SmallCNN`, :class:`SmallResNet`
and the decoder-only :class:`Transformer` (with its presets)."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from hpsjax._checks import check_int


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
