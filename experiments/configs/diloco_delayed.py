"""Asynchronous DiLoCo with one-step-delayed outer updates, as PCCL runs it.

Each round every worker takes ``worker.local_steps`` = H inner Adam steps from
the global parameters it last received and pushes the pseudo-gradient
``theta_pulled - theta_local``; the server waits for all of them (BSP) and
takes the outer step on their mean. Unlike ``diloco.py`` the outer step's
communication overlaps the next round (``worker.overlap='pipeline'``): at the
end of round t a worker sends round t's pseudo-gradient and at once starts
round t + 1 from theta_t, the parameters made from round t - 1's average
while round t computed; the server's step that ends round t + 1 applies round
t's average to them, one step stale:

  theta_{t+1} = theta_t - lr * mean_i(theta_{t-1} - theta_{i,t}),

theta_{i,t} the local parameters after round t's inner steps from
theta_{t-1}. Round 0 bootstraps: round 1 starts from the initial parameters
again, and its pseudo-gradient is applied to theta_1. The push and the pull
travel while the next round computes, so a link faster than a round is
hidden; a worker waits only where the barrier or the link is slower than its
compute.

Read: PCCL's documentation of async DiLoCo (``docs/md/07-DiLoCo -
Distributed Low-Communication/03-AsyncDiloco.md``: the all-reduce of round t
overlaps the inner steps of round t + 1; pseudo code) and its example
``python/examples/nanogpt_diloco/async_diloco.py`` (the join of the previous
all-reduce after the inner steps, the outer step with the previous
pseudo-gradients, the copy of the outer parameters into the local model,
and the bootstrap reset to the initial parameters after round 0; its
``async_config_gpu0.json``: outer learning rate 0.7, H = 8 inner steps,
AdamW inside) and the technical report (arXiv 2505.14065: "one-step delayed
parameter updates" hide the communication). PCCL applies no correction to
the stale pseudo-gradient beyond that bootstrap. What differs: PCCL's peers
all-reduce (each holds the outer parameters); here a server averages, the
same arithmetic; the example's outer optimizer is plain SGD
(``torch.optim.SGD`` without momentum), kept here (``OUTER_MOMENTUM = 0``;
a value > 0 takes DiLoCo's Nesterov); the inner optimizer is Adam without
weight decay or schedule, as in ``diloco.py``; the late joiner's
"eavesdrop" synchronisation is not needed (no worker joins late here).

Launch::

  python -m experiments.run --config=experiments/configs/diloco_delayed.py:sim8 \\
      --workdir=/tmp/hpsjax/diloco_delayed

References:
  Keiblinger, Sieg, Ong, Jaghouar, Hagemann, "Prime Collective Communications
  Library - Technical Report", 2025, https://arxiv.org/abs/2505.14065
"""

from experiments.configs import common

OUTER_MOMENTUM = 0.0  # PCCL's example: plain SGD; > 0: Nesterov momentum


def get_config(arg=None):
    """Delayed-outer-step DiLoCo for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "diloco_delayed"
    config.server.policy = "bsp"
    config.server.optimizer = "nesterov" if OUTER_MOMENTUM else "sgd"
    config.server.learning_rate = common.pick(config, {"default": 0.7})
    config.server.momentum = OUTER_MOMENTUM
    config.worker.local_optimizer = "adam"
    config.worker.local_learning_rate = common.pick(
        config, {"lm_sim8": 0.02, "default": 0.01}
    )
    config.worker.local_steps = common.pick(config, {"default": 8})
    config.worker.overlap = "pipeline"
    return config
