"""OrMo: ASP with the server's momentum ordered by the gradients' iterations.

Every gradient is applied the moment it arrives, with heavy-ball momentum
over iterations of K gradients, K the number of workers as in the paper
(``server.optimizer_args.gradients_per_iteration``): a gradient computed d
iterations ago takes the place its iteration gives it, the part it would
already have moved the parameters by applied at once, the rest joining the
momentum at weight beta^d; the momentum steps once per iteration
(``hpsjax.transforms.ordered_momentum``, the server optimizer
``ordered_momentum``; the staleness comes from the server core). OrMo-DA is
``ormo_da.py``.

Launch::

  python -m experiments.run --config=experiments/configs/ormo.py:sim8 \\
      --workdir=/tmp/hpsjax/ormo

References:
  Shi, Yang, Li, "Ordered Momentum for Asynchronous SGD", NeurIPS 2024,
  https://arxiv.org/abs/2407.19234
"""

from experiments.configs import common


def get_config(arg=None):
    """OrMo for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ormo"
    config.server.policy = "asp"
    config.server.optimizer = "ordered_momentum"
    # ASP's 0.1 times (1 - beta): the same total step per gradient (not tuned).
    config.server.learning_rate = common.pick(config, {"default": 0.01})
    config.server.momentum = 0.9
    config.server.optimizer_args = {
        "gradients_per_iteration": len(config.workers.slowdowns)
    }
    return config
