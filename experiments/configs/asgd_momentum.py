"""ASGD with naive server momentum: OrMo's baseline.

Every gradient is applied the moment it arrives (ASP) through heavy-ball
momentum on the server, in the order the gradients arrive: a gradient computed
tau versions ago joins the momentum as if it were the newest (the server
optimizer ``momentum``, beta 0.9). OrMo (``ormo.py``) orders the momentum by
the iterations the gradients were computed at instead; its paper compares it
against this naive momentum ASGD.

Launch::

  python -m experiments.run --config=experiments/configs/asgd_momentum.py:sim8 \\
      --workdir=/tmp/hpsjax/asgd_momentum

References:
  Shi, Yang, Li, "Ordered Momentum for Asynchronous SGD", NeurIPS 2024,
  https://arxiv.org/abs/2407.19234 (its baseline)
"""

from experiments.configs import common


def get_config(arg=None):
    """ASGD with naive momentum for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "asgd_momentum"
    config.server.policy = "asp"
    config.server.optimizer = "momentum"
    # As OrMo: ASP's 0.1 times (1 - beta), the same total step per gradient.
    config.server.learning_rate = common.pick(config, {"default": 0.01})
    config.server.momentum = 0.9
    return config
