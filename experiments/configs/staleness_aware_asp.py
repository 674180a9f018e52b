"""Staleness-aware ASP: ASP whose server damps a push of staleness tau by 1/tau.

The server optimizer is ``optax.chain(hpsjax.scale_by_staleness("inverse"),
sgd)``: an update computed ``tau`` versions ago is scaled by ``1 / max(tau, 1)``
before the step, so the base learning rate can be larger than plain ASP's.

Launch::

  python -m experiments.run \\
      --config=experiments/configs/staleness_aware_asp.py:sim8 \\
      --workdir=/tmp/hpsjax/staleness_aware_asp

References:
  Zhang, Gupta, Lian, Liu, "Staleness-aware Async-SGD for Distributed Deep
  Learning", IJCAI 2016, https://arxiv.org/abs/1511.05950
"""

from experiments.configs import common


def get_config(arg=None):
    """Staleness-aware ASP for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "staleness_aware_asp"
    config.server.policy = "asp"
    config.server.staleness_lr = "inverse"
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"proc4": 0.2, "default": 0.4})
    return config
