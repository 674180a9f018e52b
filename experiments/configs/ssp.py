"""SSP: asynchronous, but no worker runs more than ``s`` clocks ahead of the slowest.

Pushes are applied at once (as ASP); a worker whose clock is more than
``staleness_bound`` rounds ahead of the slowest live worker waits at its pull.

Launch::

  python -m experiments.run --config=experiments/configs/ssp.py:sim8 \\
      --workdir=/tmp/hpsjax/ssp

References:
  Ho, Cipar, Cui, Lee, Kim, Gibbons, Gibson, Ganger, Xing, "More Effective
  Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS 2013,
  https://papers.nips.cc/paper/4894
"""

from experiments.configs import common


def get_config(arg=None):
    """SSP for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ssp"
    config.server.policy = "ssp"
    config.server.policy_kwargs.staleness_bound = 8
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"proc4": 0.025, "default": 0.05})
    return config
