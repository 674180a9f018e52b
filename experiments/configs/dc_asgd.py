"""DC-ASGD: ASP with the server compensating each gradient for its delay.

The server keeps the parameters each worker computed on (``keep_stale_params``)
and applies ``optax.chain(hpsjax.transforms.delay_compensation(lam), sgd)``:
``g + lam * g * g * (w - w_bak)``, a first-order correction for the steps taken
while the gradient was in flight.

Launch::

  python -m experiments.run --config=experiments/configs/dc_asgd.py:sim8 \\
      --workdir=/tmp/hpsjax/dc_asgd

References:
  Zheng, Meng, Wang, Chen, Yu, Ma, Liu, "Asynchronous Stochastic Gradient
  Descent with Delay Compensation", ICML 2017, https://arxiv.org/abs/1609.08326
"""

from experiments.configs import common


def get_config(arg=None):
    """DC-ASGD for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "dc_asgd"
    config.server.policy = "asp"
    config.server.dc_lambda = 0.04
    config.server.dc_adaptive = False
    config.server.optimizer = "sgd"
    config.server.learning_rate = common.pick(config, {"default": 0.1})
    return config
