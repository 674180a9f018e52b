"""Ringmaster ASGD: ASP that ignores gradients delayed R versions or more.

Every gradient is applied the moment it arrives with plain SGD, as in ASP,
unless its delay (staleness) reaches R: the server then drops it unapplied and
makes its worker pull, so that its next gradient is computed at the current
point (``hpsjax.ps.Ringmaster``). R defaults to the number of live workers:
a steady ASP push is about n - 1 versions stale, so only the slower workers'
gradients are cut. The paper's optimal R = max(1, ceil(sigma^2 / epsilon))
needs the gradient noise and the target, which a run does not know, so
``experiments.frontier`` tunes R (``server.policy_kwargs.delay_threshold``,
from n/2, n and 2n, extended off the grid's edges) with the step size; R =
infinity is ASP. The paper's second form (Ringmaster ASGD with calculation
stops) is the knob ``server.policy_kwargs.stop_stale`` (``ringmaster_stop.py``
sets it): every new version also stops the workers still computing on a
version R or more behind, which start again on the new one instead of
finishing a gradient that could only be ignored.

Launch::

  python -m experiments.run --config=experiments/configs/ringmaster.py:sim8 \\
      --workdir=/tmp/hpsjax/ringmaster

References:
  Maranjyan, Tyurin, Richtarik, "Ringmaster ASGD: The First Asynchronous SGD
  with Optimal Time Complexity", ICML 2025, https://arxiv.org/abs/2501.16168
"""

from experiments.configs import common


def get_config(arg=None):
    """Ringmaster ASGD for setting ``arg`` (see ``common.SETTINGS``)."""
    config = common.get_config(arg)
    config.scheme = "ringmaster"
    config.server.policy = "ringmaster"
    # None: R = the number of live workers (experiments.frontier tunes it).
    config.server.policy_kwargs.delay_threshold = None
    # The paper's first form: a late gradient is computed, then ignored.
    config.server.policy_kwargs.stop_stale = False
    config.server.optimizer = "sgd"
    # ASP's step sizes (experiments.frontier tunes it with R).
    config.server.learning_rate = common.pick(config, {"default": 0.1})
    return config
