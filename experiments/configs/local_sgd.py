"""Local SGD: H local steps per worker, then a synchronous average (BSP rounds).

Each worker runs ``local_steps`` SGD steps on its own copy and pushes the
pseudo-gradient ``w_pulled - w_local``; the server averages a round's pushes and
applies them with ``sgd(1.0)`` (the mean of the workers' local deltas).

Launch::

  python -m experiments.run --config=experiments/configs/local_sgd.py:sim8 \\
      --workdir=/tmp/hpsjax/local_sgd

References:
  Stich, "Local SGD Converges Fast and Communicates Little", ICLR 2019,
  https://arxiv.org/abs/1805.09767
"""

from experiments.configs import common


def get_config(arg=None):
    """Local SGD for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "local_sgd"
    config.server.policy = "bsp"
    config.server.optimizer = "sgd"
    config.server.learning_rate = 1.0
    config.worker.local_optimizer = "sgd"
    config.worker.local_learning_rate = common.pick(
        config, {"proc4": 0.2, "default": 0.8}
    )
    config.worker.local_steps = 4
    return config
