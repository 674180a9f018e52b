"""SaPS: asynchronous; stragglers are found by the version they computed on.

A push whose staleness exceeds the threshold comes from a straggler: the server
damps it by ``(1 + theta) / (1 + tau)`` and makes the worker pull fresh
parameters, so no worker works far behind; fast workers never wait.

Launch::

  python -m experiments.run --config=experiments/configs/saps.py:sim8 \\
      --workdir=/tmp/hpsjax/saps

References:
  Yu, Chen, Xu, Wang, Li, "Accelerating Distributed Training in Heterogeneous
  Clusters via a Straggler-Aware Parameter Server", IEEE HPCC 2019,
  https://doi.org/10.1109/HPCC/SmartCity/DSS.2019.00042
"""

from experiments.configs import common


def get_config(arg=None):
    """SaPS for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "saps"
    config.server.policy = "saps"
    # theta = 8 was chosen on sim8 from {4, 8, None}; None means 2 (n - 1),
    # about twice the staleness of a steady ASP push, which never fired there.
    config.server.policy_kwargs.threshold = 8
    config.server.policy_kwargs.on_straggler = "damp"
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"proc4": 0.05, "default": 0.1})
    return config
