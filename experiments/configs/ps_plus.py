"""PS+: eager background pulls, push and pull decoupled, staleness-modulated steps.

Workers push gradients asynchronously; each pulls the newest parameters as it
starts a round, independently of its pushes, so the next round starts on the
freshest version that arrived while it computed. A worker scales each update by
``1 / (1 + tau)`` of the staleness the server reported for its previous push
(worker-side step-size modulation).

Launch::

  python -m experiments.run --config=experiments/configs/ps_plus.py:sim8 \\
      --workdir=/tmp/hpsjax/ps_plus

References:
  Jin, Li, Liu, Yang, Yu, Li, "PS+: A Simple yet Effective Framework for Fast
  Training on Parameter Server", IEEE TPDS 33(12), 2022,
  https://doi.org/10.1109/TPDS.2022.3200518
"""

from experiments.configs import common


def get_config(arg=None):
    """PS+ for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ps_plus"
    config.server.policy = "asp"
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"proc4": 0.2, "default": 0.4})
    config.worker.overlap = "eager"
    config.worker.eager_pulls = 3
    config.worker.staleness_lr = "inverse_plus_one"
    return config
