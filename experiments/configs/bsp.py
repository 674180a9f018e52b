"""BSP: every round waits for all live workers and applies their mean gradient.

Each worker computes one gradient on ``batch_size`` samples per round; the server
averages the round's gradients (a global batch of ``batch_size * num_workers``)
and applies them with SGD with momentum. The slowest worker sets the pace.

Launch::

  python -m experiments.run --config=experiments/configs/bsp.py:sim8 \\
      --workdir=/tmp/hpsjax/bsp
"""

from experiments.configs import common


def get_config(arg=None):
    """BSP for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "bsp"
    config.server.policy = "bsp"
    config.server.optimizer = "momentum"
    config.server.momentum = 0.9
    config.server.learning_rate = common.pick(config, {"proc4": 0.05, "default": 0.2})
    return config
