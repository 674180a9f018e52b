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

from hpsjax.models._functional import (
    Params,  # noqa: F401  (hpsjax.models.Params, a type alias)
    StatefulTrainFunctions,
    TrainFunctions,
    accuracy,
    batch_stats_of,
    load_params_npz,
    loss_fn,
    make_stateful_train_functions,
    make_train_functions,
    merge_model,
    per_example_loss,
    per_example_loss_with_stats,
    save_params_npz,
    split_model,
    split_trainable,
    split_with_batch_stats,
)
from hpsjax.models._modules import (
    MLP,
    TRANSFORMER_PRESETS,
    SmallCNN,
    SmallResNet,
    Transformer,
)
from hpsjax.models._registry import MODELS, ResolvedModel, get_model, resolve_model

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
    "batch_stats_of",
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
