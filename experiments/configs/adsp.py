"""ADSP: every worker commits about equally often, with no waiting.

Workers run local SGD steps and commit (push their accumulated update) at a rate
the ``adsp`` policy sets: in each check period of ``check_period`` seconds all
workers commit about ``C`` times, so a worker 4x faster takes 4x the local steps
per commit (at most ``max_local_steps``); ``C`` is searched online from the
loss. Commits are applied as they come with ``sgd(0.25)``.

Launch::

  python -m experiments.run --config=experiments/configs/adsp.py:sim8 \\
      --workdir=/tmp/hpsjax/adsp

References:
  Hu, Wang, Wu, "Distributed Machine Learning through Heterogeneous Edge
  Systems", AAAI 2020, https://arxiv.org/abs/1911.06949
"""

from experiments.configs import common


def get_config(arg=None):
    """ADSP for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "adsp"
    config.server.policy = "adsp"
    config.server.policy_kwargs.check_period = common.pick(
        config, {"quick": 1.0, "default": 3.0}
    )
    config.server.policy_kwargs.search = True
    config.server.policy_kwargs.max_local_steps = 2
    config.server.optimizer = "sgd"
    # Commits are applied one at a time, as they come, so each moves the server
    # by a quarter of the worker's local progress.
    config.server.learning_rate = 0.25
    config.worker.local_optimizer = "sgd"
    config.worker.local_learning_rate = common.pick(config, {"default": 0.4})
    return config
