"""Clipped ASGD: ASP whose server clips every arriving gradient.

Each push (one gradient, as in ASP) is clipped to the global norm c before the
server's SGD step: ``x <- x - lr * g * min(1, c / ||g||)``
(``optax.clip_by_global_norm`` ahead of the optimizer, ``server.clip_norm``).
The clipping sits on the server rather than on the workers: a push is one
gradient, so clipping it on arrival is the same update, it holds for every
worker whatever it runs (a process, the simulator, a worker of someone else's),
and the one server optimizer chain keeps it in one place for both backends.

What was read: the abstract and the start of the introduction of arXiv
2606.13287v1 (its HTML version) and three summaries of it (ClippedASGD clips
each arriving stochastic gradient at a threshold and takes a constant step;
under sub-Weibull noise its bounds, in expectation and with high
probability, depend on the average delay, not the maximum). The theorem
that fixes the threshold and the step (in terms of the smoothness, the
noise's sub-Weibull parameters, the delays and the number of workers) was
not in what could be read, so no rule of the paper is built: the rule here
is the clipped ASGD step above, and ``experiments.frontier`` tunes the clip
norm and the step size together, from 0.5, 1 and 2 times the values below,
extended off the grid's edges, under the same budget as ASP's step. What
differs from the paper: those two constants are tuned, not derived.

Launch::

  python -m experiments.run --config=experiments/configs/clipped_asgd.py:sim8 \\
      --workdir=/tmp/hpsjax/clipped_asgd

References:
  Erickson, Johansson, "Clipping Makes Distributed and Federated Asynchronous
  SGD Robust to Stragglers", 2026, https://arxiv.org/abs/2606.13287
"""

from experiments.configs import common


def get_config(arg=None):
    """Clipped ASGD for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "clipped_asgd"
    config.server.policy = "asp"
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"default": 0.1})
    # About the median norm of a batch gradient at the start of training on
    # synthetic_digits, the start of experiments.frontier's grid: later
    # gradients are mostly below it, the large early and stale ones are cut.
    config.server.clip_norm = common.pick(config, {"default": 1.0})
    return config
