"""ASP: every gradient is applied the moment it arrives; nobody waits.

Fast workers push more often; every push is applied with plain SGD, so updates
carry the staleness of however many versions arrived meanwhile.

Launch::

  python -m experiments.run --config=experiments/configs/asp.py:sim8 \\
      --workdir=/tmp/hpsjax/asp
"""

from experiments.configs import common


def get_config(arg=None):
    """ASP for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "asp"
    config.server.policy = "asp"
    config.server.optimizer = "sgd"
    # lm_sim32: tuned at 0.025, 0.05, 0.1, 0.2 on seed 0 (0.1 and 0.2 diverge;
    # 0.025, the grid's edge, was not extended).
    config.server.learning_rate = common.pick(
        config, {"lm_sim8": 0.2, "lm_sim32": 0.025, "default": 0.1}
    )
    return config
