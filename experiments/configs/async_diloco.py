"""Asynchronous local SGD with Delayed Nesterov (DN) and Dynamic Local Updates.

Each worker takes inner Adam steps from the parameters it pulled and pushes the
pseudo-gradient ``w_pulled - w_local``; the server applies every push as it
arrives (ASP) with Delayed Nesterov (``hpsjax.transforms.delayed_nesterov``):
a plain step of ``lr / N`` per push, and the outer momentum updated from the
buffered pseudo-gradients once every ``N`` pushes, ``N`` the number of workers.
Dynamic Local Updates (plan scheme ``dylu``) give each worker local steps in
proportion to its speed, the fastest taking ``plan.local_steps``, so that all
finish a round at about the same time; the simulator re-plans as measured
speeds drift.

Launch::

  python -m experiments.run --config=experiments/configs/async_diloco.py:sim8 \\
      --workdir=/tmp/hpsjax/async_diloco

References:
  Liu, Chhaparia, Douillard, Kale, Rusu, Shen, Szlam, Ranzato, "Asynchronous
  Local-SGD Training for Language Modeling", 2024,
  https://arxiv.org/abs/2401.09135
"""

from experiments.configs import common


def get_config(arg=None):
    """Async local SGD with DN and DyLU for setting ``arg``."""
    config = common.get_config(arg)
    config.scheme = "async_diloco"
    config.server.policy = "asp"
    config.server.optimizer = "delayed_nesterov"
    # Tuned on sim8 seed 0 from {0.1, 0.3, 0.7}: the paper's 0.7 (DiLoCo's)
    # diverges here when pushes are applied one by one.
    config.server.learning_rate = common.pick(config, {"default": 0.1})
    config.server.momentum = 0.9
    config.server.outer_delay = None  # the number of workers
    config.worker.local_optimizer = "adam"
    config.worker.local_learning_rate = common.pick(config, {"default": 0.01})
    config.plan.scheme = "dylu"
    config.plan.lr_scaling = "none"
    # The fastest worker's local steps; a 6x slower one takes 1/6 of them.
    config.plan.local_steps = common.pick(config, {"default": 8})
    config.plan.max_local_steps = 64
    config.plan.replan = True
    return config
