"""Naive optimal: minibatch SGD over only the m fastest workers.

The baseline of the delay papers: each round waits for one gradient from each
of the m fastest workers and applies their average with SGD; the slower
workers are never sent parameters (``hpsjax.ps.NaiveOptimal``). m minimises
the time complexity tau_(m) (1 + S / m) of the workers' measured times per
gradient (every worker computes once at the start to be measured), with
S = sigma^2 / epsilon unknown to a run: ``server.policy_kwargs.noise_ratio``
(the number of workers here, as Ringmaster's default R), tuned with the step
size by ``experiments.frontier``; ``server.policy_kwargs.workers`` fixes
m instead, and ``server.policy_kwargs.asynchronous`` runs asynchronous SGD
over them (Ringmaster's Naive Optimal ASGD).

What was read: the Ringmaster ASGD paper's introduction (Naive Optimal ASGD
uses only the fastest m* workers and is optimal when the times are fixed and
known) and the abstract and introduction of "Do We Need Asynchronous SGD?"
(arXiv 2602.03802: synchronous SGD over the fastest workers is near-optimal
in many heterogeneous settings). What differs: m comes from measured times
and a tuned S, not from known times and sigma^2 / epsilon.

Launch::

  python -m experiments.run --config=experiments/configs/naive_optimal.py:sim8 \\
      --workdir=/tmp/hpsjax/naive_optimal

References:
  Maranjyan, Tyurin, Richtarik, "Ringmaster ASGD: The First Asynchronous SGD
  with Optimal Time Complexity", ICML 2025, https://arxiv.org/abs/2501.16168;
  "Do We Need Asynchronous SGD? On the Near-Optimality of Synchronous
  Methods", 2026, https://arxiv.org/abs/2602.03802
"""

from experiments.configs import common


def get_config(arg=None):
    """Naive optimal (SGD over the m fastest workers) for setting ``arg``."""
    config = common.get_config(arg)
    config.scheme = "naive_optimal"
    config.server.policy = "naive_optimal"
    # S = the number of workers (the policy's default; a value, so that
    # experiments.frontier can start its grid from it).
    config.server.policy_kwargs.noise_ratio = float(len(config.workers.slowdowns))
    config.server.policy_kwargs.workers = None
    config.server.policy_kwargs.asynchronous = False
    config.server.optimizer = "sgd"
    # ASP's step size on an average of m gradients (tuned by experiments.frontier).
    config.server.learning_rate = common.pick(config, {"default": 0.1})
    return config
