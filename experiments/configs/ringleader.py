"""Ringleader ASGD: rounds of n updates over a table of every worker's gradients.

The server keeps, per worker, the sum and the count of its gradients in this
round's table and steps with the average over workers of their average
gradients (``hpsjax.transforms.gradient_table``, the server optimizer
``gradient_table``). The policy (``hpsjax.ps.Ringleader``) decides what each
push does: in phase 1 gradients fill the table without a step until every
worker has one there; in phase 2 the next gradient of each worker not yet
updated this round goes into its slot and steps, one of a worker already
updated goes into the next round's table; after n steps the next round's
table becomes the table. Nobody waits and no gradient is discarded. The step
size is tuned (``experiments.frontier``); the paper's gamma = min(1/(8nL),
eps B/(10 L sigma^2)) needs constants a run does not know.

What was read: the paper's abstract and introduction and a detailed summary of
its method (not its pseudocode). What differs: a worker pulls the current
parameters after every push; every push makes a server version (those without
a step leave the parameters as they were); the n workers are fixed.

Launch::

  python -m experiments.run --config=experiments/configs/ringleader.py:sim8 \\
      --workdir=/tmp/hpsjax/ringleader

References:
  Maranjyan, Richtarik, "Ringleader ASGD: The First Asynchronous SGD with
  Optimal Time Complexity under Data Heterogeneity", 2025,
  https://arxiv.org/abs/2509.22860
"""

from experiments.configs import common


def get_config(arg=None):
    """Ringleader ASGD for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ringleader"
    config.server.policy = "ringleader"
    workers = len(config.workers.slowdowns)
    config.server.policy_kwargs.num_workers = workers
    config.server.optimizer = "gradient_table"
    config.server.optimizer_args = {"num_slots": workers}
    # Each step averages n workers' gradients: ASP's step size to start from
    # (tuned by experiments.frontier).
    config.server.learning_rate = common.pick(
        config, {"lm_sim8": 0.2, "lm_sim32": 0.025, "default": 0.1}
    )
    return config
